"""docs/plugins.md: its example files, an objective with a head of its own and one that also scores
zero-shot with its own head, train, resume, evaluate, embed and export with the commands the page shows,
as written there; resumed and accumulated, the first gives the numbers of an uninterrupted, whole-batch
run, as a built-in objective does."""

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
from nclip.objectives import registry, scores
from nclip.train.loop import train

from conftest import metrics_then_resumed, micro_sizes

DOC = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
PLUGIN = "barlow_clip:BarlowClip"


# each example file of the page and the heading above its commands
EXAMPLES = {"barlow_clip": "## Train, resume, evaluate", "mlp_clip": "From the folder that holds `mlp_clip.py`:"}


def _example(module: str = "barlow_clip") -> tuple[str, list[list[str]]]:
    """(the page's example file ``module``.py, its commands as argument lists)."""
    text = DOC.read_text(encoding="utf-8")
    code = re.search(rf"Save this as `{module}.py`:\n\n```python\n(.*?)```", text, re.S)
    commands = re.search(rf"{re.escape(EXAMPLES[module])}\n.*?```bash\n(.*?)```", text, re.S)
    assert code and commands, f"docs/plugins.md lost its example file {module}.py or its commands"
    return code.group(1), [shlex.split(line) for line in commands.group(1).splitlines() if line.strip()]


@pytest.fixture
def plugin_folder(tmp_path, monkeypatch):
    """The working directory holds the example files; the objective, head and score registries, and
    the modules, are as before the test afterwards (other tests list the registered ones)."""
    for module in EXAMPLES:
        (tmp_path / f"{module}.py").write_text(_example(module)[0])
    monkeypatch.chdir(tmp_path)
    objectives, heads, kinds = dict(registry.REGISTRY), dict(head_registry._HEADS), dict(scores._SCORES)
    yield tmp_path
    registry.REGISTRY.clear()
    registry.REGISTRY.update(objectives)
    head_registry._HEADS.clear()
    head_registry._HEADS.update(heads)
    scores._SCORES.clear()
    scores._SCORES.update(kinds)
    for module in EXAMPLES:
        sys.modules.pop(module, None)


def _run_commands(module: str, folder: Path) -> None:
    """The page's commands for ``module``, each a fresh ``nclip`` process in ``folder``: no traceback."""
    for args in _example(module)[1]:
        assert args[0] == "nclip"
        done = subprocess.run([sys.executable, "-m", "nclip", *args[1:]], cwd=folder, capture_output=True,
                              text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert done.returncode == 0 and "Traceback" not in done.stderr, f"{shlex.join(args)}: {done.stderr[-800:]}"


@pytest.mark.slow
def test_the_pages_commands_train_resume_and_evaluate_its_file(plugin_folder):
    _run_commands("barlow_clip", plugin_folder)
    rows = [json.loads(x) for x in (plugin_folder / "runs/barlow/metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 40 and all("barlow/L_BT" in r and "clip/loss" in r for r in rows)
    with safe_open(plugin_folder / "runs/barlow/model/model.safetensors", "pt") as weights:
        assert any(key.startswith("heads.barlow.image.") for key in weights.keys())
        assert any(key.startswith("heads.barlow.text.") for key in weights.keys())
    results = json.loads((plugin_folder / "runs/barlow-eval/results.json").read_text())
    assert any(key.startswith("zeroshot/") for key in results["results"]), sorted(results["results"])[:5]
    assert results["checkpoint"]["zero_shot_head"] == "clip"  # as the objective declared


@pytest.mark.slow
def test_a_plugin_that_scores_with_its_own_head_evaluates_embeds_and_exports(plugin_folder):
    import numpy as np
    import onnxruntime as ort
    import torch

    import nclip

    _run_commands("mlp_clip", plugin_folder)
    runs = plugin_folder / "runs"
    end_of_run = json.loads((runs / "mlp/eval.json").read_text())  # evaluated at the end of the run
    assert end_of_run["eval/head"] == "mlp" and any(k.startswith("zeroshot/") for k in end_of_run)
    results = json.loads((runs / "mlp-eval/results.json").read_text())
    assert results["checkpoint"]["zero_shot_head"] == results["checkpoint"]["head"] == "mlp"
    assert any(k.startswith("zeroshot/") for k in results["results"]) and "retrieval" not in results["skipped"]
    manifest = json.loads((runs / "mlp-embed/manifest.json").read_text())
    assert manifest["settings"]["embedding"] == "mlp head" and manifest["settings"]["texts"]
    config = json.loads((runs / "mlp-onnx/onnx_config.json").read_text())
    assert config["embedding"]["score"] == config["embedding"]["output"] == "mlp"
    assert config["image_encoder"]["outputs"]["embedding"]["l2_normalised"]
    # the graph computes the score's embedding of the model nclip.load loads
    model = nclip.load(runs / "mlp", device="cpu", trust_plugin=True)
    assert model.head == "mlp"
    pixels = torch.randn(3, 3, model.image_size, model.image_size, generator=torch.Generator().manual_seed(0))
    graph = ort.InferenceSession(str(runs / "mlp-onnx" / config["image_encoder"]["file"]))
    got = graph.run(None, {"pixels": pixels.numpy()})[0]
    np.testing.assert_allclose(got, model.encode_image(pixels).numpy(), rtol=0, atol=1e-5)
    stored = np.load(runs / "mlp-embed/texts-00000.npy")
    assert np.allclose(np.linalg.norm(stored.astype(np.float32), axis=1), 1, atol=1e-2)  # the score's ℓ2 norm


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
