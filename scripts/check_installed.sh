#!/usr/bin/env bash
# Every jaxtron command, run from the installed package in a fresh empty directory: proof that a
# wheel trains and that no command reads a file it was not shipped with (a checkout's presets,
# docs or tests). Uses only the `jaxtron` on PATH and its environment's Python.
#
#     pip install 'jaxtron[gpu-aot] @ file:///path/to/jaxtron-*.whl' && bash check_installed.sh
#
# One line per command: `installed: jaxtron ARGS ... ok (N s)`; the first that exits non-zero (or
# leaves out a file it should write) ends the script with its name, its exit status and the end of
# its output. Sizes are tiny: a few minutes on a 2-core CPU, no GPU (--compile-for needs the
# gpu-aot extra, not a GPU). JAXTRON_CACHE, when set, is the cache the stdlib corpus's tokenizer
# and tokens go to (e.g. one a CI job keeps); by default a fresh one, so the tokenizer is trained
# here. JAXTRON_CHECK_TIMEOUT: seconds each command may take (default 600). The work directory
# (each command's output in logs/) is removed when all pass, kept when one fails or when
# JAXTRON_CHECK_KEEP=1.
set -euo pipefail

if ! command -v jaxtron >/dev/null; then
    echo "installed: no jaxtron command on PATH; activate the environment it is installed in" >&2
    exit 1
fi
bin=$(dirname "$(command -v jaxtron)")
py=$bin/python
[[ -x $py ]] || py=$(command -v python3)

unset PYTHONPATH  # the package under test is the installed one, nothing put in front of it
work=$(mktemp -d "${TMPDIR:-/tmp}/jaxtron-installed.XXXXXX")
cd "$work"
export JAXTRON_CACHE=${JAXTRON_CACHE:-$work/cache}
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}  # the same numbers with or without a GPU
limit=${JAXTRON_CHECK_TIMEOUT:-600}
mkdir -p logs
started=$SECONDS
n=0

# check OUTPUT... -- jaxtron ARGS...: run it here; it must exit 0 and leave each OUTPUT non-empty.
check() {
    local outputs=() rc=0 t0=$SECONDS
    while [[ $1 != -- ]]; do outputs+=("$1"); shift; done
    shift
    local shown=${JAX_NUM_CPU_DEVICES:+JAX_NUM_CPU_DEVICES=$JAX_NUM_CPU_DEVICES} arg
    for arg; do  # as a shell would take it back, with the work directory as $work
        if [[ ! $arg =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]]; then
            if [[ $arg == *\'* ]]; then printf -v arg '%q' "$arg"; else arg="'$arg'"; fi
        fi
        shown+="${shown:+ }${arg//$work/\$work}"
    done
    n=$((n + 1))
    local log
    log=$(printf '%s/logs/%02d-%s.log' "$work" "$n" "$2")
    if command -v timeout >/dev/null; then
        timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1 </dev/null || rc=$?
    else
        "$@" >"$log" 2>&1 </dev/null || rc=$?
    fi
    local why=""
    if ((rc == 124 || rc == 137)) && command -v timeout >/dev/null; then
        why="timed out after $limit s (exit $rc)"
    elif ((rc)); then
        why="exit status $rc"
    else
        local out
        for out in "${outputs[@]}"; do
            [[ -s $out ]] || { why="exit 0 but it wrote no ${out//$work/\$work}"; break; }
        done
    fi
    if [[ -n $why ]]; then
        {
            echo "installed: $shown ... FAILED: $why; the end of its output ($log):"
            tail -n 40 "$log" | sed 's/^/    /'
            echo "installed: FAILED: $shown (work directory kept: \$work=$work)"
        } >&2
        exit 1
    fi
    echo "installed: $shown ... ok ($((SECONDS - t0)) s)"
}

# The package itself: a wheel's files in the environment's site-packages, not a checkout's (an
# editable install, or a checkout on sys.path, would hide files missing from the wheel).
where=$("$py" - <<'EOF'
import pathlib, sysconfig
import jaxtron
pkg = pathlib.Path(jaxtron.__file__).resolve().parent
site = {pathlib.Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
if pkg.parent not in site:
    raise SystemExit(f"jaxtron is imported from {pkg}, not from site-packages "
                     f"({', '.join(map(str, site))}): install the wheel (not `pip install -e`) "
                     "and run from outside the checkout")
print(pkg)
EOF
) || { echo "installed: FAILED: import jaxtron" >&2; rm -rf "$work"; exit 1; }
echo "installed: jaxtron package at $where ... ok"

run=$work/runs/tiny  # not ./tiny: a directory named like a preset would be taken for --config tiny

# Training, its plan, and its program for GPUs.
check "$run/metrics.jsonl" "$run/config.yaml" -- \
    jaxtron train --config tiny train.steps=3 train.log_every=1 run.dir="$run"
if ! "$py" - "$run/metrics.jsonl" <<'EOF'; then
import json, math, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert [r["step"] for r in rows] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows), rows
EOF
    echo "installed: FAILED: jaxtron train's metrics.jsonl lacks steps 1..3 with finite losses" >&2
    exit 1
fi
check -- jaxtron train --config llama3_8b --dry-run --devices 8 mesh.fsdp=8
check aot.json -- jaxtron train --config tiny --compile-for h100 --devices 8 --report aot.json \
    model.num_layers=1 train.batch_size=8 train.seq_len=128

# The run's outputs.
check -- jaxtron inspect-ckpt "$run"
check -- jaxtron generate "$run" --prompt "def " --max-new-tokens 4
check plots/loss.png -- jaxtron plot "$run" --out plots
check hf/model.safetensors hf/config.json hf/tokenizer.model -- \
    jaxtron convert-hf export "$run" hf
check imported/config.yaml imported/tokenizer.model -- jaxtron convert-hf import hf imported
check -- jaxtron inspect-ckpt imported

# Data: a small corpus tokenized with the run's tokenizer (the export holds it), and the input
# pipeline on the stdlib and on that dataset (6 documents: one of them falls in val).
mkdir -p text
for i in 0 1 2 3 4 5; do
    for _ in $(seq 20); do echo "Document $i: the quick brown fox jumps over the lazy dog."; done \
        >"text/doc$i.txt"
done
check data/manifest.json data/tokenizer.model -- \
    jaxtron prepare-data text --tokenizer hf --out data --val-fraction 0.5 --workers 1
check -- jaxtron bench-data --config tiny --batches 2 --warmup 1 --workers 0 \
    train.batch_size=2 train.seq_len=64
check -- jaxtron bench-data --config tiny --batches 2 --warmup 1 --workers 0 \
    train.batch_size=2 train.seq_len=64 data.source=arrayrecord "data.mixture=[{path: data}]"

# Planning, set-up checks and benchmarks.
check plan.json -- jaxtron plan --config llama3_8b --devices 8 --remat full --top 1 --json plan.json
check -- jaxtron doctor --config tiny
check bench.jsonl -- jaxtron bench --suite smoke --rows 1 --out bench.jsonl
JAX_NUM_CPU_DEVICES=2 check commbench.json -- \
    jaxtron commbench mesh.fsdp=2 --sizes 1KiB --ops all_reduce --warmup 1 --iters 1 \
    --json commbench.json

echo "installed: every command ok in $((SECONDS - started)) s"
if [[ ${JAXTRON_CHECK_KEEP:-0} == 1 ]]; then
    echo "installed: work directory kept: $work"
else
    rm -rf "$work"
fi
