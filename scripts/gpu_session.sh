#!/usr/bin/env bash
# Prepared calls on a short-lived, offline GPU machine whose image has Python 3.12 and a CUDA
# build of jax 0.11 (docs/performance.md, "Measuring on a GPU"). In the repository's root:
#
#   bash scripts/gpu_wheels.sh                # beforehand, with the network: the wheels into .whl/
#   bash scripts/gpu_session.sh               # on the GPU machine, .whl/ carried: the first call
#   bash scripts/gpu_session.sh STEP...       # later calls: the steps the first left out
#
# A lent machine gives about 15 minutes in all, start-up included, and one call at most 10, so
# the steps come in the order of what they prove, and the first call (no STEP: moe cudnn peer:1,
# about 6 minutes expected) fits in 8. Later calls, as time is left: `tests peer:2` (about 6),
# then `peer:3 suite:4,5` (about 7).
#
# It installs the wheels the image lacks into /tmp/site, writes machine.txt (nvidia-smi, versions),
# then runs each STEP in order, each one's output into a file of its own under $OUT
# (/tmp/gpu_session without it):
#   moe            the MoE experts' grouped GPU kernel against XLA's -> gpu_moe.txt
#   cudnn          cuDNN attention against XLA on packed batches     -> gpu_cudnn.txt
#   tests          the other gpu tests of tests/test_gpu.py          -> gpu_tests.txt
#   suite[:ROWS]   jaxtron bench --suite gpu [--rows ROWS]     -> suite[_ROWS].md, .jsonl
#   peer[:ROWS]    the same with --peer (MaxText on each row)   -> peer[_ROWS].md, .jsonl
# ROWS as `jaxtron bench --suite gpu --list` numbers them (1,2). A step that fails does not stop
# the next; the exit status is the first failing step's. BENCH_SUITE=smoke rehearses it all on a
# CPU machine (the gpu tests skip there).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_session}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  date -u
  nvidia-smi || true
  python3 - <<'EOF'
import importlib.metadata as m, sys
print("python", sys.version.split()[0])
for p in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "flax",
          "optax", "orbax-checkpoint", "grain", "omegaconf", "protobuf", "nvidia-cudnn-cu13",
          "nvidia-cudnn-cu12", "maxtext", "torch", "transformers"):
    try:
        print(p, m.version(p))
    except m.PackageNotFoundError:
        pass
EOF
} >"$out/machine.txt" 2>&1

status=0
(( $# )) || set -- moe cudnn peer:1
for step in "$@"; do
  name=${step%%:*}
  rows=""
  [[ "$step" == *:* ]] && rows=${step#*:}
  file=$name${rows:+_${rows//,/-}}
  echo "== $step ($(date -u +%T))"
  case $name in
    moe | cudnn | tests)
      case $name in
        moe) only="moe" ;;
        cudnn) only="cudnn" ;;
        tests) only="not moe and not cudnn" ;;
      esac
      python3 -m pytest -m gpu tests/test_gpu.py -k "$only" -q -rs -p no:cacheprovider 2>&1 \
        | tee "$out/gpu_$name.txt" ;;
    suite | peer)
      python3 tools/bench.py --suite "${BENCH_SUITE:-gpu}" ${rows:+--rows "$rows"} \
        $([[ $name == peer ]] && echo --peer) --out "$out/$file.jsonl" 2>&1 | tee "$out/$file.md" ;;
    *) echo "gpu_session.sh: error: unknown step '$step' (moe, cudnn, tests, suite[:ROWS]," \
            "peer[:ROWS])" >&2
       exit 2 ;;
  esac
  code=$?
  [[ $status == 0 ]] && status=$code
done
exit "$status"
