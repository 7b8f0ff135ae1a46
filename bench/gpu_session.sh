#!/usr/bin/env bash
# What one GPU can prove about pipezero, in one call that fits a short loan of a GPU machine (under
# ten minutes on one H100 or H200); run it from anywhere in the checkout:
#     bash bench/gpu_session.sh             # results under $OUT (default bench/results/gpu_session/)
#     bash bench/gpu_session.sh --dry-run   # every part on CPU ranks at toy shapes (.ci/run runs this)
# It uses the machine's own torch (with CUDA; $PYTHON, default python); pipezero is imported from
# this checkout. Each part has its own timeout and its own result file (bench/gpu_session.py):
#  (a) layouts.json: 8 layouts of 2-4 ranks sharing the GPU (--share-device auto: NCCL refuses two
#      ranks on one GPU, so they run over gloo through host buffers, each capped to its share of the
#      GPU's memory), schedules from 1f1b to zb-v and dualpipe-v, ZeRO 0-3, fp32 and bf16, each through
#      `pipezero verify --memory-profile`: every rank matches one process, and every rank's predicted
#      peak is within 10% of the allocator's measured one.
#  (b) fit.json: the fit check's boundary on 2 ranks sharing the GPU (1b, bf16): a layout predicted
#      over its share refused before start; the same forced past the check (--gpu-memory far above
#      the share; the allocator's cap still holds) running out of memory; one predicted to fit with
#      10% to spare training.
#  (c) gpu_step.json: base and 1b MFU beside a plain PyTorch loop, eager and compiled (bench/gpu_step.py).
#  (d) offload.json: --offload optimizer: 1b plain and offloaded (each rank's device peak within 10%
#      of predicted, step times side by side), and 7b at 1,024 tokens, which fits the device only
#      offloaded: plain refused by the fit check, offloaded training its first steps.
# Then one table of every part, and summary.json beside the parts' files; exit 0 when every part passed.
# A dry run proves the script, not the GPU's figures: CPU ranks with the shared-GPU path forced
# (--share-device on), (a) on its first layout, (c) eager only, its files in a temporary folder.
set -u
dry=""
[ $# -le 1 ] || { echo "usage: bash bench/gpu_session.sh [--dry-run]" >&2; exit 2; }  # none read past the first
case "${1:-}" in
    --dry-run) dry=--dry-run ;;
    "") ;;
    *) echo "usage: bash bench/gpu_session.sh [--dry-run]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python}
runs=$(mktemp -d)  # the parts' run folders: fresh each session (train refuses a folder holding a run)
if [ -n "$dry" ]; then
    out=${OUT:-$(mktemp -d)}
    t_a=300 t_b=150 t_c=150 t_d=90  # CPU ranks; (a) took 200 s with 2 cores at load 30, 100 s at load 20
    a_args=(--layouts 1 --steps 1 --each-s 280)
    c_args=(--cases tiny --compile off --steps 2 --warm 1 --budget-s 60)
else
    out=${OUT:-bench/results/gpu_session}
    t_a=220 t_b=100 t_c=160 t_d=120  # 600 s in all
    a_args=(--steps 2 --each-s 60)
    c_args=(--cases base,1b --compile both --budget-s 120)
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
fi
mkdir -p "$out"
rm -f "$out"/{layouts,fit,gpu_step,offload,summary}.json  # a part that gives no result shows as such
$py -c 'import torch; c = torch.cuda.is_available(); print(torch.__version__, torch.cuda.get_device_name(0) if c else "cpu")'
part() {  # part NAME SECONDS COMMAND...: run it under its own timeout; its exit code in rc_NAME
    local name=$1 limit=$2
    shift 2
    echo "--- part ($name), at most ${limit} s"
    timeout "$limit" "$@"
    printf -v "rc_$name" %s $?
}
part a "$t_a" $py bench/gpu_session.py layouts $dry "${a_args[@]}" --json "$out/layouts.json" --out "$runs/a"
part b "$t_b" $py bench/gpu_session.py fit $dry --each-s 100 --json "$out/fit.json" --out "$runs/b"
part c "$t_c" $py bench/gpu_step.py "${c_args[@]}" --json "$out/gpu_step.json"
part d "$t_d" $py bench/gpu_session.py offload $dry --each-s 40 --json "$out/offload.json" --out "$runs/d"
rm -rf "$runs"
$py bench/gpu_session.py summary $dry --dir "$out" --codes "a=$rc_a,b=$rc_b,c=$rc_c,d=$rc_d"
