"""The papers' SGD linear probes (nclip.eval.metrics.sgd_linear, `nclip eval --probe sgd`): each
recipe's schedule and preprocessing as its paper states them, the batched learning-rate sweep equal
to heads trained one by one, the head chosen on validation, and the CLI's record in results.json."""

import json

import pytest
import torch

from nclip.cli import main
from nclip.errors import NclipError
from nclip.eval.metrics.sgd_linear import SGD_RECIPES, _lr_factor, _train_heads, sgd_linear_probe
from nclip.eval.settings import EvalSettings

from conftest import micro_sizes

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _blobs(n: int, seed: int, classes: int = 4, d: int = 8, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, d, generator=torch.Generator().manual_seed(99)) * 3
    y = torch.randint(0, classes, (n,), generator=g)
    return (centres[y] + torch.randn(n, d, generator=g)) * scale, y


def test_schedules_are_the_papers():
    steps = _lr_factor(SGD_RECIPES["cmsf"], 40)  # CompRess: x0.1 at epochs 15 and 30 of 40
    assert [steps(e) for e in (0, 14, 15, 29, 30, 39)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])
    shortened = _lr_factor(SGD_RECIPES["cmsf"], 8)  # milestones keep their place: epochs 3 and 6 of 8
    assert [shortened(e) for e in (2, 3, 5, 6)] == pytest.approx([1, 0.1, 0.1, 0.01])
    cosine = _lr_factor(SGD_RECIPES["protoclip"], 100)
    assert cosine(0) == 1 and cosine(50) == pytest.approx(0.5) and cosine(100) == pytest.approx(0)
    xclip, cmsf, proto = SGD_RECIPES["xclip"], SGD_RECIPES["cmsf"], SGD_RECIPES["protoclip"]
    assert (xclip.momentum, xclip.weight_decay, xclip.epochs, len(xclip.lrs) > 1) == (0, 0, 100, True)
    assert (cmsf.lrs, cmsf.momentum, cmsf.weight_decay, cmsf.epochs, cmsf.batch_size) == ((0.01,), 0.9, 1e-4, 40, 256)
    assert (proto.lrs, proto.momentum, proto.weight_decay, proto.epochs) == ((0.3,), 0.9, 1e-6, 100)


@pytest.mark.parametrize("recipe", ["xclip", "cmsf"])
def test_the_batched_sweep_equals_each_head_trained_alone(recipe):
    x, y = _blobs(300, 0)
    x = x.double()
    spec = SGD_RECIPES[recipe]
    lrs = (0.003, 0.05, 0.4)
    together = _train_heads(x, y, 4, lrs, spec, 3, seed=5)
    for lr, head in zip(lrs, together):
        alone = _train_heads(x, y, 4, (lr,), spec, 3, seed=5)[0]
        torch.testing.assert_close(head, alone, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(together[0], together[2])  # the rates did differ


def test_every_recipe_learns_and_the_sweep_picks_its_best_validation_head():
    xtr, ytr = _blobs(600, 1)
    xte, yte = _blobs(300, 2)
    for recipe in SGD_RECIPES:
        r = sgd_linear_probe(xtr, ytr, xte, yte, 4, recipe=recipe, epochs=5)
        assert r["top1"] > 0.9 and 0 < r["mean_per_class"] <= 1, (recipe, r)
        if recipe == "xclip":
            assert set(r["val_top1"]) == set(SGD_RECIPES["xclip"].lrs)
            assert r["val_top1"][r["lr"]] == max(r["val_top1"].values())
        else:
            assert r["val_top1"] == {} and r["lr"] == SGD_RECIPES[recipe].lrs[0]


def test_cmsf_normalises_the_features_as_compress_does():
    """L2 normalisation then standardisation: the probe cannot see the features' scale; the
    ProtoCLIP recipe reads z as it is, so a 1000x scale changes what it learns."""
    xtr, ytr = _blobs(200, 3)
    xte, yte = _blobs(100, 4)
    small = sgd_linear_probe(xtr, ytr, xte, yte, 4, recipe="cmsf", epochs=2)
    large = sgd_linear_probe(xtr * 1000, ytr, xte * 1000, yte, 4, recipe="cmsf", epochs=2)
    assert small["top1"] == pytest.approx(large["top1"])
    proto = [sgd_linear_probe(xtr * s, ytr, xte * s, yte, 4, recipe="protoclip", epochs=2)["top1"] for s in (1, 1e-4)]
    assert proto[0] != pytest.approx(proto[1])


def test_bad_arguments_are_named():
    x, y = _blobs(20, 0)
    with pytest.raises(ValueError, match="unknown SGD probe recipe 'moco'"):
        sgd_linear_probe(x, y, x, y, 4, recipe="moco")
    with pytest.raises(ValueError, match="leaves no validation rows"):
        sgd_linear_probe(x[:8], torch.arange(8) % 4, x, y, 4, recipe="xclip")
    with pytest.raises(ValueError, match="epochs"):
        sgd_linear_probe(x, y, x, y, 4, epochs=0)
    with pytest.raises(NclipError, match="applies to the SGD probe only: add --probe sgd"):
        EvalSettings().updated(probe_recipe="cmsf")


@pytest.mark.slow
def test_eval_probe_sgd_records_its_recipe(tmp_path, capsys):
    """`nclip eval --probe sgd` on a micro CMSF model: the objective's paper recipe (CompRess) by
    default, its hyper-parameters in results.json, and the chosen rate beside the accuracy."""
    from nclip.config import resolve
    from nclip.models import build_model
    from nclip.models.io import save_model

    cfg = resolve("micro", micro_sizes() + ["objective.name=cmsf"])
    model = save_model(build_model(cfg), cfg, tmp_path / "model")
    out = tmp_path / "eval"
    argv = ["eval", "--checkpoint", str(model), "--out", str(out), "--tasks", "linear", "--dataset", "synthetic",
            "--samples", "40", "--train-samples", "60", "--probe", "sgd", "--probe-epochs", "2", "--quiet",
            "--no-report", "--no-cache"]
    assert main(argv) == 0, capsys.readouterr().err
    doc = json.loads((out / "results.json").read_text())
    protocol = doc["config"]["linear_probe"]
    assert (protocol["optimizer"], protocol["recipe"], protocol["epochs"]) == ("SGD", "cmsf", 2)
    assert protocol["lrs"] == [0.01] and protocol["milestones"] == [15, 30]
    assert doc["config"]["probe"] == "sgd" and doc["config"]["probe_recipe"] == "cmsf"
    lr_keys = [k for k in doc["results"] if k.startswith("linear/") and k.endswith("/lr")]
    assert lr_keys and all(doc["results"][k] == 0.01 for k in lr_keys)
    assert main(argv[:-7] + ["--probe-recipe", "xclip", "--quiet", "--no-report", "--no-cache"]) == 2
    err = capsys.readouterr().err.strip()
    assert "applies to the SGD probe only" in err and len(err.splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("probe_args", [[], ["--probe", "sgd", "--probe-recipe", "xclip"]])
def test_too_few_images_per_class_skip_the_probe_in_one_line(tmp_path, capsys, probe_args):
    """A class-folder tree with 3 images per class leaves 2 per class to train on: nothing to hold
    out for choosing the L2 strength or the learning rate. The linear probe is skipped with that
    reason (it raised a traceback); k-NN still runs."""
    import numpy as np
    from PIL import Image

    from nclip.config import resolve
    from nclip.models import build_model
    from nclip.models.io import save_model

    for c in range(4):
        for i in range(3):
            path = tmp_path / "data" / f"class{c}" / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((20, 20, 3), 60 * c + i, np.uint8)).save(path)
    cfg = resolve("micro", micro_sizes())
    model = save_model(build_model(cfg), cfg, tmp_path / "model")
    out = tmp_path / "eval"
    assert main(["eval", "--checkpoint", str(model), "--out", str(out), "--tasks", "linear,knn", "--dataset",
                 f"folder:{tmp_path / 'data'}", "--quiet", "--no-report", "--no-cache", *probe_args]) == 0
    doc = json.loads((out / "results.json").read_text())
    reason = doc["skipped"]["linear/data-class"]
    assert "fewer than 3 training images" in reason and ("learning rate" in reason) == bool(probe_args)
    assert "knn/data-class/top1" in doc["results"] and not any(k.startswith("linear/") for k in doc["results"])
