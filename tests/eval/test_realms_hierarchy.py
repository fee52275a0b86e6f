"""Realm labels from a class hierarchy (nclip.eval.realms.from_hierarchy) equal the ones the data carries;
`nclip eval --hierarchy FILE|builtin` probes realms of any class-labelled dataset with them."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from nclip.cli import main
from nclip.data.hierarchies import builtin_hierarchy
from nclip.data.hierarchy import Hierarchy
from nclip.data.synthetic import SyntheticScenes
from nclip.errors import NclipError
from nclip.eval import realms


def test_builtin_hierarchy_reproduces_the_synthetic_realm_labels():
    data = SyntheticScenes("test", length=60, image_size=32)
    shapes = torch.tensor([data[i].labels["shape"] for i in range(len(data))])
    truth = torch.tensor([data[i].labels["realm"] for i in range(len(data))])
    ids, names = realms.from_hierarchy(builtin_hierarchy("synthetic"), data.label_kinds["shape"].names, shapes)
    assert names == list(data.label_kinds["realm"].names)
    assert torch.equal(ids, truth)


def test_realm_order_and_missing_class():
    h = Hierarchy({"b1": "B", "a1": "A", "a2": "A", "A": "root", "B": "root"})
    ids, names = realms.from_hierarchy(h, ["b1", "a1", "a2"], [2, 0, 1, 1])
    assert names == ["B", "A"] and ids.tolist() == [1, 0, 1, 1]
    with pytest.raises(NclipError, match="'c1'"):
        realms.from_hierarchy(h, ["a1", "c1"], [0])


# ---------------------------------------------------------------------------------------------
# nclip eval --hierarchy: realm labels from class labels for any class-labelled dataset
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, one_thread):
    """An untrained micro CLIP model (the realm plumbing needs no training)."""
    from nclip.config import resolve
    from nclip.models import build_model
    from nclip.models.io import save_model

    cfg = resolve("micro", ["objective.name=clip"])
    return save_model(build_model(cfg), cfg, tmp_path_factory.mktemp("hier") / "model")


@pytest.fixture(scope="module")
def pets(tmp_path_factory):
    """A folder dataset of four classes in two realms, and its TSV hierarchy."""
    root = tmp_path_factory.mktemp("pets")
    rng = np.random.default_rng(0)
    for c, name in enumerate(["husky", "golden_retriever", "siamese", "tabby"]):
        for i in range(6):
            img = rng.integers(0, 60, (16, 16, 3), dtype=np.uint8)
            img[..., c % 3] += 150
            path = root / "images" / name / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(path)
    tsv = root / "pets.tsv"
    tsv.write_text("# child\tparent\npet\t\ndog\tpet\ncat\tpet\nhusky\tdog\ngolden retriever\tdog\n"
                   "siamese\tcat\ntabby\tcat\n")
    return root


def _eval(model_dir, tmp_path, *argv):
    return main(["eval", "--checkpoint", str(model_dir), "--out", str(tmp_path / "o"), "--tasks", "realms",
                 "--no-report", "--quiet", *argv])


def test_digits_builtin_hierarchy_gives_the_three_realms(model_dir, tmp_path):
    from nclip.eval import runner

    settings = runner.EvalSettings(l2_grid=(1e-3,))
    doc = runner.run_eval(model_dir, None, tasks=["realms"], datasets=["digits"], settings=settings, cache_dir=None)
    assert "realms" not in {k.split("/")[0] for k in doc["results"]}  # digits carry no realm labels of their own
    doc = runner.run_eval(model_dir, None, tasks=["realms"], datasets=["digits"],
                          settings=settings.updated(hierarchy="builtin"), cache_dir=None)
    r = doc["results"]
    assert sorted(k for k in r if k.endswith("/top1")) == [
        "realms/digits-mixed/top1", "realms/digits-round/top1", "realms/digits-straight/top1"]
    assert r["realms/digits/mean_top1"] == pytest.approx(
        (r["realms/digits-mixed/top1"] + r["realms/digits-round/top1"] + r["realms/digits-straight/top1"]) / 3)
    assert doc["config"]["hierarchy"] == "builtin" and doc["skipped"] == {}


def test_folder_dataset_with_a_tsv_hierarchy_and_baseline(model_dir, pets, tmp_path):
    folder = ["--dataset", f"folder:{pets / 'images'}", "--hierarchy", str(pets / "pets.tsv")]
    assert _eval(model_dir, tmp_path, *folder) == 0
    r = json.loads((tmp_path / "o" / "results.json").read_text())["results"]
    assert {"realms/images-dog/top1", "realms/images-cat/top1", "realms/images/mean_top1"} <= set(r)
    # --baseline keeps working: the same model as its own baseline is 0 points better on every realm
    assert _eval(model_dir, tmp_path, *folder, "--baseline", str(model_dir), "--force") == 0
    r = json.loads((tmp_path / "o" / "results.json").read_text())["results"]
    assert r["realms/images-dog/relative"] == pytest.approx(0.0)
    assert r["realms/images/mean_relative"] == pytest.approx(0.0)


@pytest.mark.parametrize("argv,needle", [
    (["--hierarchy", "{tmp}/missing.tsv"], "hierarchy file not found"),
    (["--hierarchy", "{pets}/partial.tsv"], "dataset images (folder, class labels): 2 labels without a node "
                                            "in the hierarchy: 'siamese', 'tabby'"),
    (["--hierarchy", "{pets}/flat.tsv"], "'golden retriever' is a root of the hierarchy: it has no realm"),
    (["--hierarchy", "builtin"], "--hierarchy builtin: dataset images (folder, class labels): no built-in hierarchy"),
    (["--hierarchy", " "], "eval: --hierarchy: "),
])
def test_hierarchy_errors_are_one_line(model_dir, pets, tmp_path, capsys, argv, needle):
    (pets / "partial.tsv").write_text("pet\t\ndog\tpet\nhusky\tdog\ngolden retriever\tdog\n")
    (pets / "flat.tsv").write_text("husky\t\ngolden retriever\t\nsiamese\t\ntabby\t\n")
    argv = [a.format(tmp=tmp_path, pets=pets) for a in argv]
    assert _eval(model_dir, tmp_path, "--dataset", f"folder:{pets / 'images'}", *argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err
