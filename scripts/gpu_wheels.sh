#!/usr/bin/env bash
# Here, with the network, in the repository's root: the wheels that a lent GPU machine's image
# (Python 3.12, jax 0.11.2 with CUDA 13, no network) lacks for scripts/gpu_session.sh, into .whl/
# (ignored by git; the device call carries it). ../shared/gpu/wheels.sh maxtext fetches jaxtron's
# and most of MaxText's; the rest below is what MaxText 0.2.5's train step imports beyond those and
# the image (jaxtron/bench/peers.py, MAXTEXT_PACKAGES), at the versions its run here used.
set -eu
cd "$(dirname "$0")/.."
bash ../shared/gpu/wheels.sh maxtext >/dev/null
# omegaconf 2.3 (the shared set's) fails every config.load (ReadonlyConfigError on the merge into
# the frozen schema); 2.4, the range's, needs no antlr4 runtime. flax: the newest the ranges give
# Python 3.12 (0.12.10 and later import with jax 0.11 and 0.12), whatever the image's is. The
# newest jax itself (0.12: jaxlib and its CUDA plugin, 230 MB) does not fit the 64 MiB a call
# carries; the session runs the image's jax (0.11.2), which CI's compiles cover with 0.12.
rm -f .whl/omegaconf-2.3.*.whl .whl/antlr4_python3_runtime-*.whl
py312=${PY312:-$(pyenv prefix 3.12 2>/dev/null || pyenv prefix 3.12.1)/bin/python}
"$py312" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 uvicorn==0.54.0 \
  ml-collections==1.1.0 xprof==2.24.2 omegaconf==2.4.0 flax==0.12.12
du -sh .whl
