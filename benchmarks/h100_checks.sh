#!/usr/bin/env bash
# The GPU checks of docs/performance.md ("On an H100"), as one prepared script for one device call
# (issue 32 item 8). Wheels of nclip's dependencies that the GPU image lacks go first into .whl/
# (see `benchmarks/h100_wheels.sh`, run on the development machine); the results go to $OUT (or
# ./h100-out). Each stage has its own time limit, so a slow one cannot take the others' time.
#
#   bash benchmarks/h100_checks.sh            # on the GPU machine, from the repository root
set -uo pipefail
OUT=${OUT:-h100-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:.whl/site  # .whl/site: the MiniLM stand-in (tokenizer files only)
fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/device.txt"

# 1. no host sync in a quiet step, with the device's own sync detector (every objective and option)
timeout 150 python3 benchmarks/gpu_sync_check.py --json "$OUT/sync.json" 2>&1 | tail -40
# 2. trainer overhead at a small model, where it shows most
timeout 120 python3 -m nclip bench --preset tiny --json "$OUT/bench-tiny.json" 2>&1 | tail -30
# 3. the issue-24 table at ViT-B/16, batch 256, bf16: eager, then compiled, with OpenCLIP beside it
timeout 240 python3 -m nclip bench --preset vit-b16-xclip --set train.batch_size=256 --set data.num_workers=8 \
  --compare open_clip --json "$OUT/bench-b16.json" 2>&1 | tail -40
echo "done: $OUT"
