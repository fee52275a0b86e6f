"""Which image features the probes read (`nclip eval --features`, eval settings ``features``, the run
config's ``eval.probe_features``): each objective's paper default, recorded in results.json, the
same numbers through the CLI and benchmarks/protoclip_ablation.py, and one-line errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from nclip.cli import main
from nclip.config import resolve
from nclip.heads import head_class
from nclip.objectives import REGISTRY, plan_of

MICRO = [
    "data.image_size=16", "data.text_length=16",
    "model.vision.patch_size=4", "model.vision.width=32", "model.vision.layers=1", "model.vision.heads=2",
    "model.text.width=32", "model.text.layers=1", "model.text.heads=2",
    "model.embed_dim=32", "model.nclip_hidden=64", "model.nclip_dim=128", "model.proto_hidden=64",
    "model.proto_dim=16", "eval.samples=32", "eval.batch_size=32", "train.threads=1",
]
SMALL = ["--dataset", "synthetic", "--samples", "40", "--train-samples", "60", "--no-report", "--no-cache", "--quiet"]
ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _untrained(root: Path, objective: str, *extra) -> Path:
    """A model directory with random weights: the protocol plumbing needs no training."""
    from nclip.models import build_model
    from nclip.models.io import save_model

    cfg = resolve("micro", MICRO + [f"objective.name={objective}", *extra])
    torch.manual_seed(0)
    return save_model(build_model(cfg, pretrained_text=True), cfg, root / objective / "model")


@pytest.fixture(scope="module")
def proto_model(tmp_path_factory):
    return _untrained(tmp_path_factory.mktemp("proto"), "protoclip")


def _ablation():
    spec = importlib.util.spec_from_file_location("protoclip_ablation", ROOT / "benchmarks" / "protoclip_ablation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paper_defaults_per_objective():
    for name, (config, objective) in REGISTRY.items():
        f = objective.probe_features
        assert f == "backbone" or (f in objective.heads and head_class(f).probe), name
        assert plan_of(config()).probe_problem(f) is None, name
    # ProtoCLIP App. B: z (the CLIP-head embedding); xCLIP Sec. 4.2.1 ([CLS] of the frozen backbone) for
    # CLIP, nCLIP and xCLIP; CMSF: the frozen backbone
    assert REGISTRY["protoclip"][1].probe_features == "clip"
    for name in ("clip", "nclip", "xclip", "cmsf"):
        assert REGISTRY[name][1].probe_features == "backbone", name


def test_cli_features_match_the_ablation_script(proto_model, tmp_path, monkeypatch):
    monkeypatch.setenv("NCLIP_CACHE", str(tmp_path / "cache"))
    runs = {}
    for features in (None, "clip", "proto", "backbone"):
        # the linear probe (the costly task) where the ablation script is compared; k-NN tells the
        # default and the backbone apart from z on its own
        tasks = "linear,knn,cluster" if features in ("clip", "proto") else "knn"
        out = tmp_path / f"eval-{features}"
        assert main(["eval", "--checkpoint", str(proto_model), "--out", str(out), "--tasks", tasks]
                    + SMALL + ([] if features is None else ["--features", features])) == 0
        doc = json.loads((out / "results.json").read_text())
        assert doc["config"]["features"] == (features or "clip")  # ProtoCLIP's default: z (App. B)
        assert doc["config"]["probe_features"].startswith(doc["config"]["features"] + ": ")
        runs[features] = doc["results"]
    knn = {f: {k: v for k, v in r.items() if k.startswith("knn/")} for f, r in runs.items()}
    assert knn[None] == knn["clip"] and knn[None]
    assert knn["clip"] != knn["proto"] and knn["clip"] != knn["backbone"]
    # the ablation script's evaluation is the same code path: the same linear and k-NN numbers
    ablation = _ablation()
    for features in ("clip", "proto"):
        ab = ablation.evaluate(proto_model, 60, 40, features)
        assert ab["probe_features"] == features
        for kind in ablation.KINDS:
            for task in ("linear", "knn"):
                assert ab[f"{kind}/{task}"] == runs[features][f"{task}/synthetic-{kind}/top1"], (features, kind, task)
            assert ab[f"{kind}/ARI"] == runs[features][f"cluster/synthetic-{kind}/ari"]
    assert ablation.evaluate(proto_model, 60, 40)["probe_features"] == "clip"
    # k-NN on z: the cosine of the CLIP-head embeddings, computed here from the model directly
    from nclip.eval import probe
    from nclip.eval.datasets import synthetic
    from nclip.eval.features import extract
    from nclip.models.io import load_model

    model, cfg = load_model(proto_model)
    data = synthetic(cfg.data.image_size, cfg.data.max_objects, 0, 40, 60)
    tr = extract(model, data.splits["train"], cfg.data.image_size, "cpu", texts=False)
    te = extract(model, data.splits["test"], cfg.data.image_size, "cpu", texts=False)
    knn = probe.knn(tr.image["clip"], tr.labels["colour"], te.image["clip"], te.labels["colour"],
                    len(data.label_kinds["colour"]))
    assert knn["top1"] == pytest.approx(runs["clip"]["knn/synthetic-colour/top1"])


def test_default_recorded_and_bad_choices(proto_model, tmp_path, capsys):
    clip_model = _untrained(tmp_path, "clip")
    out = tmp_path / "eval-clip"
    assert main(["eval", "--checkpoint", str(clip_model), "--out", str(out), "--tasks", "knn"] + SMALL) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["features"] == "backbone" and doc["config"]["probe_features"].startswith("backbone: image")
    capsys.readouterr()
    cmsf_model = _untrained(tmp_path, "cmsf", "objective.bank_size=64", "model.cmsf_hidden=32", "model.cmsf_dim=16")
    for model, features, needle in ((clip_model, "proto", "objective 'clip' trains no 'proto' head"),
                                    (proto_model, "nclip", "objective 'protoclip' trains no 'nclip' head"),
                                    (proto_model, "pooled", "objective 'protoclip' trains no 'pooled' head"),
                                    (cmsf_model, "cmsf", "its 'cmsf' head offers no probe features (choose backbone)")):
        code = main(["eval", "--checkpoint", str(model), "--out", str(tmp_path / "bad"), "--tasks", "knn",
                     "--features", features] + SMALL)
        err = capsys.readouterr().err.strip()
        assert code == 2 and needle in err and len(err.splitlines()) == 1, err


def test_end_of_run_probe_features(tmp_path):
    from nclip.errors import NclipError
    from nclip.eval.quick import evaluate_run
    from nclip.models import build_model

    base = ["data.source=digits", "objective.name=cmsf", "objective.bank_size=64", "model.cmsf_hidden=32",
            "model.cmsf_dim=16", "train.batch_size=16"]
    cfg = resolve("micro", MICRO + base)
    assert cfg.eval.probe_features is None
    torch.manual_seed(0)
    res = evaluate_run(build_model(cfg, pretrained_text=True), cfg, "cpu")
    assert res["eval/probe_features"] == "backbone" and "knn/digit/top1" in res
    with pytest.raises(NclipError, match="eval.probe_features clip: objective 'cmsf' trains no 'clip' head"):
        resolve("micro", MICRO + base + ["eval.probe_features=clip"])
    with pytest.raises(NclipError, match="eval.probe_features"):
        resolve("micro", MICRO + ["eval.probe_features=pooled"])
    proto = resolve("micro", MICRO + ["objective.name=protoclip", "eval.probe_features=proto"])
    assert proto.eval.probe_features == "proto"
