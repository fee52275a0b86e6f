"""docs/own-data.md, as written there: its Python and bash blocks run in order in an empty folder (the
built-in scenes written as a folder of PNGs with a JSONL and a CSV; several captions per image; hard
negatives from the file and made by swaps; LoRA from a run, exported and loaded), each without a
traceback; what the page shows each block print, the block prints (numbers aside: they are the page's
run's, and another machine's float rounding may move them); and the runs wrote what the page says."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "own-data.md"
# a block, then the ```text block right after it (what it prints), if any
_BLOCK = re.compile(r"```(python|bash)\n(.*?)```\n(?:\n```text\n(.*?)```)?", re.S)


def blocks() -> list[tuple[str, str, str | None]]:
    """(language, code, what the page shows it print or None) of every runnable block, in order."""
    found = [(m.group(1), m.group(2), m.group(3)) for m in _BLOCK.finditer(DOC.read_text(encoding="utf-8"))]
    assert len(found) >= 6, "docs/own-data.md lost its worked examples"
    return found


def run_block(language: str, code: str, folder: Path) -> str:
    """Run one block in ``folder`` as a reader would (``nclip`` is this checkout's); its stdout and
    stderr together. A failure or a traceback fails the test with the block's last lines."""
    src = str(DOC.parents[1] / "src")  # this checkout's nclip, whatever the folder the block runs in
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    if language == "python":
        argv, stdin = [sys.executable, "-"], code
    else:
        argv, stdin = ["bash", "-euo", "pipefail", "-s"], f'nclip() {{ "{sys.executable}" -m nclip "$@"; }}\n{code}'
    done = subprocess.run(argv, input=stdin, cwd=folder, capture_output=True, text=True, env=env, timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in out, f"{code.strip()[:300]}\n...\n{out[-1500:]}"
    return out


def _shape(line: str) -> str:
    """A printed line with its numbers blanked: the excerpts' numbers are the page's own run's."""
    return re.sub(r"[-+]?\d+(\.\d+)?(e[-+]?\d+)?", "#", line.rstrip())


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> tuple[Path, list[str]]:
    """The folder the page's blocks ran in, and each block's output."""
    folder = tmp_path_factory.mktemp("own-data")
    outputs = []
    for language, code, shown in blocks():
        out = run_block(language, code, folder)
        if shown is not None:
            printed = {_shape(line) for line in re.split(r"[\r\n]", out)}
            missing = [line for line in shown.splitlines() if line.strip() and _shape(line) not in printed]
            assert not missing, f"docs/own-data.md shows lines this block does not print: {missing}\n{out[-1500:]}"
        outputs.append(out)
    return folder, outputs


def _results(folder: Path, evaluation: str) -> dict:
    return json.loads((folder / "runs" / evaluation / "results.json").read_text())["results"]


def _last_row(folder: Path, run: str) -> dict:
    return json.loads((folder / "runs" / run / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.mark.slow
def test_the_scenes_are_written_as_files_with_several_captions_and_negatives(page):
    folder, _ = page
    rows = [json.loads(line) for line in (folder / "scenes" / "pairs.jsonl").read_text().splitlines()]
    assert len(rows) == 512 and all(len(r["captions"]) >= 2 and (folder / "scenes" / r["filepath"]).is_file()
                                    for r in rows)
    assert sum(bool(r["negatives"]) for r in rows) > 500
    assert (folder / "scenes" / "pairs.csv").read_text().startswith("filepath,captions,negatives\n")


@pytest.mark.slow
def test_several_captions_train_and_evaluate_every_caption_as_ground_truth(page):
    folder, _ = page
    for run in ("all", "random"):
        assert _last_row(folder, run)["step"] == 20
        results = _results(folder, f"{run}-eval")
        assert "retrieval/pairs/mean_recall" in results and "retrieval/pairs/i2t@1" in results
    config = (folder / "runs" / "all" / "config.yaml").read_text()
    assert "caption_choice: all" in config


@pytest.mark.slow
def test_hard_negatives_from_the_file_and_from_swaps_train_and_evaluate(page):
    folder, _ = page
    for run in ("neg", "swap"):
        assert "clip/acc_hard" in _last_row(folder, run)  # the share of images whose caption beats its negatives
    for evaluation in ("neg-eval", "swap-eval", "random-hardneg"):
        results = _results(folder, evaluation)
        assert results["retrieval/pairs/hardneg_rows"] == 64 and 0 <= results["retrieval/pairs/hardneg_top1"] <= 1


@pytest.mark.slow
def test_lora_saves_an_adapter_exports_merged_and_loads(page):
    folder, outputs = page
    model = folder / "runs" / "lora" / "model"
    adapter = json.loads((model / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and adapter["r"] == 4
    assert (model / "adapter_model.safetensors").stat().st_size * 20 < (model / "model.safetensors").stat().st_size
    assert json.loads((model / "config.json").read_text())["model"]["lora"] is None  # RUN/model is merged
    hf = json.loads((folder / "runs" / "lora-hf" / "config.json").read_text())
    assert hf["model_type"] == "clip" and not any("lora" in p.name for p in (folder / "runs" / "lora-hf").iterdir())
    assert "tensor([[" in outputs[-1]  # the page's nclip.load snippet scored an image against two captions
