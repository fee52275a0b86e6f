"""A config with absurd sizes is refused in one line, naming the field, before anything is allocated
(it was an allocator RuntimeError, or minutes of construction and swap); the estimate behind it is a
lower bound of the real parameter count, so no model that fits is refused."""

import json

import pytest
import torch

import nclip
from nclip.cli import main
from nclip.config import resolve
from nclip.config_files import preset_names
from nclip.errors import NclipError
from nclip.models import build_model
from nclip.models.io import save_model
from nclip.models.size_check import check_model_size, machine_memory, parameter_terms
from nclip.objectives import plan_for

from conftest import micro_sizes

VARIANTS = [(name, []) for name in preset_names()] + [
    ("micro", ["objective.name=xclip", "model.nclip_layers=2", "model.nclip_shared_layers=1"]),
    ("micro", ["objective.name=nclip", "model.nclip_bottleneck=16"]),
    ("supcon-tiny", ["objective.name=frzproto", "objective.head=fc"]),
    ("micro", ["model.text.vocab_size=40000"]),
]


@pytest.mark.parametrize("preset,overrides", VARIANTS, ids=[" ".join([p, *o]) for p, o in VARIANTS])
def test_the_estimate_is_a_lower_bound_of_every_preset(preset, overrides):
    cfg = resolve(preset, overrides)
    with torch.device("meta"):  # the true count, without allocating (ViT-B/16 and ResNet-50 presets among them)
        model = build_model(cfg, pretrained_text=False)
    estimate = sum(count for _, count in parameter_terms(cfg, plan_for(cfg).heads))
    assert 0 < estimate <= sum(p.numel() for p in model.parameters())


# (id, the field, its absurd value, the part the line names); the objective builds the head of the field
ABSURD = [
    ("vision width 1e9", "model.vision.width", 10**9, "model.vision.width=1000000000² (the vision blocks)"),
    # a billion: a million layers of the micro width would still fit a machine of 64 GiB
    ("a billion layers", "model.vision.layers", 10**9, "model.vision.layers=1000000000 × "),
    ("vocabulary 1e12", "model.text.vocab_size", 10**12, "model.text.vocab_size=1000000000000 × model.text.width"),
    ("head K 1e10", "model.nclip_dim", 10**10, "model.nclip_dim=10000000000 (the nCLIP heads' last layers)"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = resolve("micro", [*micro_sizes(), "objective.name=xclip"])
    return save_model(build_model(cfg, pretrained_text=False), cfg, tmp_path_factory.mktemp("m") / "model")


@pytest.mark.parametrize("key,value,part", [c[1:] for c in ABSURD], ids=[c[0] for c in ABSURD])
def test_a_model_config_with_absurd_sizes_is_one_line(model_dir, tmp_path, capsys, key, value, part):
    """nclip eval --checkpoint and nclip.load of a model whose config.json was edited, and a
    training run given the size on the command line: one line naming the field, exit 2."""
    if machine_memory() is None:
        pytest.skip("this system tells neither its physical memory nor a cgroup limit")
    doc = json.loads((model_dir / "config.json").read_text())
    *sections, field = key.split(".")
    node = doc
    for name in sections:
        node = node[name]
    node[field] = value
    if field == "width":
        node["heads"] = 1  # the width must divide by the heads
    edited = tmp_path / "model"
    edited.mkdir()
    (edited / "config.json").write_text(json.dumps(doc))
    (edited / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(edited), "--out", str(tmp_path / "ev"), "--tasks", "zeroshot",
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("nclip: error: the model does not fit in memory: ")
    assert part in err and "more than this machine's" in err, err
    with pytest.raises(NclipError, match="does not fit in memory"):
        nclip.load(edited, device="cpu")
    assert main(["train", "--preset", "micro", "--set", "objective.name=xclip", "--set", f"{key}={value}",
                 *(["--set", "model.vision.heads=1"] if field == "width" else []), "--out", str(tmp_path / "run")]) == 2
    assert part in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_a_model_that_fits_passes(monkeypatch):
    """The refusal is against the machine's memory: the micro model passes, and is refused on a
    machine with less memory than its parameters take."""
    cfg = resolve("micro", micro_sizes())
    heads = plan_for(cfg).heads
    check_model_size(cfg, heads)
    import nclip.models.size_check as size_check

    monkeypatch.setattr(size_check, "machine_memory", lambda: (1000, "a test's"))
    with pytest.raises(NclipError, match=r"more than this machine's 0 GiB \(a test's\)"):
        check_model_size(cfg, heads)
