"""docs/plugins.md: its example file, an objective with a head of its own, trains, resumes and evaluates
with the commands the page shows, as written there; resumed and accumulated, it gives the numbers of an
uninterrupted, whole-batch run, as a built-in objective does."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from nclip.config import resolve
from nclip.heads import base as head_registry
from nclip.objectives import registry
from nclip.train.loop import train

from conftest import metrics_then_resumed, micro_sizes

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
PLUGIN = "barlow_clip:BarlowClip"


def _example() -> tuple[str, list[list[str]]]:
    """(the page's example file, its commands as argument lists)."""
    text = DOC.read_text(encoding="utf-8")
    code = re.search(r"Save this as `barlow_clip.py`:\n\n```python\n(.*?)```", text, re.S)
    commands = re.search(r"## Train, resume, evaluate\n.*?```bash\n(.*?)```", text, re.S)
    assert code and commands, "docs/plugins.md lost its example file or its commands"
    return code.group(1), [shlex.split(line) for line in commands.group(1).splitlines() if line.strip()]


@pytest.fixture
def plugin_folder(tmp_path, monkeypatch):
    """The working directory holds the example file; the objective and head registries, and the
    module, are as before the test afterwards (other tests list the registered ones)."""
    (tmp_path / "barlow_clip.py").write_text(_example()[0])
    monkeypatch.chdir(tmp_path)
    objectives, heads = dict(registry.REGISTRY), dict(head_registry._HEADS)
    yield tmp_path
    registry.REGISTRY.clear()
    registry.REGISTRY.update(objectives)
    head_registry._HEADS.clear()
    head_registry._HEADS.update(heads)
    sys.modules.pop("barlow_clip", None)


@pytest.mark.slow
def test_the_pages_commands_train_resume_and_evaluate_its_file(plugin_folder):
    for args in _example()[1]:
        assert args[0] == "nclip"
        done = subprocess.run([sys.executable, "-m", "nclip", *args[1:]], cwd=plugin_folder, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert done.returncode == 0, f"{shlex.join(args)}: {done.stderr[-800:]}"
    rows = [json.loads(x) for x in (plugin_folder / "runs/barlow/metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 40 and all("barlow/L_BT" in r and "clip/loss" in r for r in rows)
    with safe_open(plugin_folder / "runs/barlow/model/model.safetensors", "pt") as weights:
        assert any(key.startswith("heads.barlow.image.") for key in weights.keys())
        assert any(key.startswith("heads.barlow.text.") for key in weights.keys())
    results = json.loads((plugin_folder / "runs/barlow-eval/results.json").read_text())
    assert any(key.startswith("zeroshot/") for key in results["results"]), sorted(results["results"])[:5]
    assert results["checkpoint"]["zero_shot_head"] == "clip"  # as the objective declared


SHORT = ["train.steps=4", "train.batch_size=16", "train.log_every=1", "train.checkpoint_every=2",
         "data.train_length=64", "train.eval_every=0", "train.warmup_steps=1", f"objective.name={PLUGIN}"]


@pytest.mark.slow
def test_the_plugin_resumes_exactly_and_accumulates_exactly(plugin_folder):
    cfg = resolve("micro", micro_sizes() + SHORT)
    first, resumed = metrics_then_resumed(cfg, plugin_folder / "resume")
    assert first == resumed and "barlow/L_BT" in first[-1]

    def losses(k: int) -> list[float]:
        run = plugin_folder / f"acc{k}"
        train(resolve("micro", micro_sizes() + SHORT + [f"train.accumulation={k}"]), run, progress=False,
              evaluate=False)
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [r[key] for r in rows for key in ("loss", "barlow/L_BT")]

    assert losses(4) == pytest.approx(losses(1), rel=1e-5)  # the head's BatchNorm sees the whole batch
