"""docs/transfer.md's LoRA section, as written there: its commands train an adapter on a random-weight
open_clip directory (tests/openclip_refs.py), continue it, evaluate, export it for open_clip and ONNX
(--hf: tests/models/test_lora.py) and fine-tune it; the merged model (RUN/model, and each export)
embeds as the unmerged one trained (RUN/checkpoints/step_N) to 1e-5, away from the model it started
from; and the page's snippet puts the adapter back on that model."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import nclip

from openclip_refs import build, save_hub, vit_cfg

DOC = Path(__file__).resolve().parents[2] / "docs" / "transfer.md"
CAPTIONS = ["a red circle", "two blue squares left of a star", "nothing at all"]


def _section() -> tuple[list[list[str]], str]:
    """(the section's commands as argument lists, its Python snippet)."""
    text = DOC.read_text(encoding="utf-8").split("## LoRA: adapt a pretrained model through peft", 1)
    assert len(text) == 2, "docs/transfer.md lost its LoRA section"
    commands = re.search(r"```bash\n(.*?)```", text[1], re.S)
    snippet = re.search(r"```python\n(.*?)```", text[1], re.S)
    assert commands and snippet, "the LoRA section lost its commands or its snippet"
    return [shlex.split(line) for line in commands.group(1).splitlines() if line.strip()], snippet.group(1)


def _unmerged(run: Path, step: str):
    """The run's model at ``step`` as it trained: built from RUN/config.yaml, peft's layers unmerged."""
    import yaml

    from nclip.config import validate
    from nclip.models import build_model
    from nclip.models.io import read_weights

    cfg = validate(yaml.safe_load((run / "config.yaml").read_text()))
    model = build_model(cfg, pretrained_text=False)
    model.load_state_dict(read_weights(run / "checkpoints" / step / "model.safetensors"))
    assert any(".lora_A.default." in k for k in model.state_dict())
    return model.eval()


@pytest.mark.slow
def test_the_pages_commands_train_export_and_finetune_an_adapter(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    pytest.importorskip("open_clip")
    ort = pytest.importorskip("onnxruntime")
    cfg = vit_cfg(image=16, patch=4, width=32, layers=2, head_width=16, text_width=32, text_layers=2, embed=32)
    save_hub(build(cfg), cfg, tmp_path / "models" / "open_clip-vit")
    commands, snippet = _section()
    for args in commands:
        assert args[0] == "nclip"
        done = subprocess.run([sys.executable, "-m", "nclip", *args[1:]], cwd=tmp_path, capture_output=True,
                              text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert done.returncode == 0, f"{shlex.join(args)}: {done.stderr[-800:]}"
        if "--init" in args:  # the start-up block says what LoRA adapts
            assert re.search(r"^  lora +rank 4, alpha 8, dropout 0 on 12 image \+ 12 text layers \(peft\)",
                             done.stderr, re.M), done.stderr[-2000:]
    run = tmp_path / "runs" / "lora"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 40
    model_dir = run / "model"
    size = {name: (model_dir / name).stat().st_size for name in ("adapter_model.safetensors", "model.safetensors")}
    assert size["adapter_model.safetensors"] * 20 < size["model.safetensors"]
    adapter = json.loads((model_dir / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and adapter["r"] == 4 and len(adapter["target_modules"]) == 24
    assert json.loads((model_dir / "config.json").read_text())["model"]["lora"] is None

    torch.manual_seed(1)
    pixels = torch.randn(4, 3, 16, 16)
    merged = nclip.load(run, device="cpu")
    start = nclip.load(tmp_path / "models" / "open_clip-vit", device="cpu")
    image, text = merged.encode_image(pixels), merged.encode_text(CAPTIONS)
    with torch.no_grad():  # the model as it trained: peft's layers, unmerged, from the last checkpoint
        unmerged = _unmerged(run, "step_00000040")
        ids, mask = merged.tokenizer(CAPTIONS)
        torch.testing.assert_close(F.normalize(unmerged.encode_image(pixels)["clip"], dim=-1), image, rtol=0,
                                   atol=1e-5)
        torch.testing.assert_close(F.normalize(unmerged.encode_text(ids, mask)["clip"], dim=-1), text, rtol=0,
                                   atol=1e-5)
    step = nclip.load(run / "checkpoints" / "step_00000040", device="cpu")  # a step checkpoint: merged on loading
    assert not any("lora" in k for k in step.model.state_dict())
    torch.testing.assert_close(step.encode_image(pixels), image, rtol=0, atol=1e-5)
    assert (image - start.encode_image(pixels)).abs().max() > 1e-3  # the adapter moved the model
    assert (text - start.encode_text(CAPTIONS)).abs().max() > 1e-3
    back = nclip.load(tmp_path / "runs" / "lora-open_clip", device="cpu")  # each export is the merged model
    torch.testing.assert_close(back.encode_image(pixels), image, rtol=0, atol=1e-5)
    torch.testing.assert_close(back.encode_text(CAPTIONS), text, rtol=0, atol=1e-5)
    onnx = tmp_path / "runs" / "lora-onnx"
    config = json.loads((onnx / "onnx_config.json").read_text())
    graph = ort.InferenceSession(str(onnx / config["image_encoder"]["file"]))
    torch.testing.assert_close(torch.from_numpy(graph.run(None, {"pixels": pixels.numpy()})[0]), image, rtol=0,
                               atol=1e-5)
    assert (tmp_path / "runs" / "lora-eval" / "results.json").is_file()
    assert (tmp_path / "runs" / "lora-finetune" / "results.json").is_file()

    monkeypatch.chdir(tmp_path)  # the snippet's paths are the commands'
    scope: dict = {}
    exec(snippet, scope)
    adapted = scope["adapted"]
    with torch.no_grad():
        again_image = F.normalize(adapted.encode_image(pixels)["clip"], dim=-1)
        again_text = F.normalize(adapted.encode_text(*merged.tokenizer(CAPTIONS))["clip"], dim=-1)
    torch.testing.assert_close(again_image, image, rtol=0, atol=1e-5)
    torch.testing.assert_close(again_text, text, rtol=0, atol=1e-5)
