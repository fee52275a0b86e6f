"""SupCon, PaCo and ReCo on the user's labelled data (issue 27.6): a class-folder tree
(``data.source: folder``) or a CSV with a label column (``data.csv_label_key``), two views per
image, and ReCo's class similarity s from the user's hierarchy file (JSON or TSV)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from nclip.cli import main
from nclip.config import resolve
from nclip.data.step_batches import StepBatches
from nclip.errors import NclipError
from nclip.objectives.supcon import SupconObjective

from conftest import micro_sizes

# folder names (sorted: class ids 0, 1, 2) and the class names they give (``_`` as a space)
FOLDERS = ("golden_retriever", "husky", "tabby")
NAMES = ("golden retriever", "husky", "tabby")
PER_CLASS = (4, 3, 5)  # unequal, so that a label that came from the wrong row shows
# the hand-written hierarchy of the folder classes: all leaves at depth 2
TREE = {"animal": None, "dog": "animal", "cat": "animal", "golden retriever": "dog", "husky": "dog", "tabby": "cat"}
# a CSV's label column (class ids: its distinct values sorted: car 0, cat 1, dog 2, pickup 3) and a
# TSV hierarchy of them with one leaf deeper than the others
CSV_CLASSES = ("dog", "car", "cat", "pickup", "dog", "cat", "car", "pickup", "cat", "dog", "car", "dog")
TSV = "# child\tparent\nthing\t\nanimal\tthing\nvehicle\tthing\ncat\tanimal\ndog\tanimal\ncar\tvehicle\n" \
      "truck\tvehicle\npickup\ttruck\n"
STEPS, BATCH = 2, 8


def _image(path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(path)


def _tree(root: Path) -> Path:
    for c, (folder, n) in enumerate(zip(FOLDERS, PER_CLASS)):
        (root / folder).mkdir(parents=True)
        for i in range(n):
            _image(root / folder / f"{i}.png", 10 * c + i)
    return root


def _csv(root: Path) -> Path:
    root.mkdir()
    rows = ["filepath,title,label"]
    for i, label in enumerate(CSV_CLASSES):
        _image(root / f"{i}.png", 100 + i)
        rows.append(f"{i}.png,a photo number {i},{label}")
    (root / "pairs.csv").write_text("\n".join(rows) + "\n")
    return root / "pairs.csv"


def _source(tmp_path: Path, kind: str) -> list[str]:
    if kind == "folder":
        return ["data.source=folder", f"data.folder={_tree(tmp_path / 'tree')}"]
    return ["data.source=csv", f"data.csv={_csv(tmp_path / 'table')}", "data.csv_label_key=label"]


def _hierarchy(tmp_path: Path, kind: str) -> Path:
    if kind == "folder":
        path = tmp_path / "tree.json"
        path.write_text(json.dumps(TREE))
    else:
        path = tmp_path / "tree.tsv"
        path.write_text(TSV)
    return path


def _sets(tmp_path: Path, kind: str, objective: str, extra: tuple[str, ...] = ()) -> list[str]:
    sets = [*micro_sizes(), *_source(tmp_path, kind), f"objective.name={objective}", f"train.steps={STEPS}",
            f"train.batch_size={BATCH}", "train.warmup_steps=0", "train.log_every=1", "train.threads=1",
            "model.supcon_hidden=16", "model.supcon_dim=8", *extra]
    if objective == "reco":
        sets.append(f"objective.hierarchy={_hierarchy(tmp_path, kind)}")
    return sets


def _expected_labels(kind: str, seed: int) -> list[list[int]]:
    """The class id of every row of every step's batch, from the sampler's indices and the source's
    own class of each index (a folder: class by class in sorted order; a CSV: its rows)."""
    if kind == "folder":
        of_index = [c for c, n in enumerate(PER_CLASS) for _ in range(n)]
    else:
        ids = sorted(set(CSV_CLASSES))
        of_index = [ids.index(v) for v in CSV_CLASSES]
    sampler = StepBatches(len(of_index), BATCH, STEPS, seed)
    return [[of_index[i] for i in sampler.global_batch(step)] for step in range(STEPS)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["folder", "csv"])
@pytest.mark.parametrize("objective", ["supcon", "paco", "reco"])
def test_trains_on_folder_and_csv_labels_with_two_views(tmp_path, monkeypatch, kind, objective):
    from nclip.train.loop import train

    seen = []
    forward = SupconObjective.forward

    def spy(self, out, batch):
        seen.append((tuple(out.image["supcon"].shape), batch.labels.tolist(), batch.true_labels.tolist()))
        return forward(self, out, batch)

    monkeypatch.setattr(SupconObjective, "forward", spy)
    cfg = resolve("supcon-tiny", _sets(tmp_path, kind, objective))
    result = train(cfg, tmp_path / "run", progress=False, evaluate=False)
    assert result.steps == STEPS
    assert [shape for shape, _, _ in seen] == [(BATCH, 2, 8)] * STEPS  # two views of every image
    expected = _expected_labels(kind, cfg.seed)
    assert [labels for _, labels, _ in seen] == expected  # the folder's / the CSV column's classes
    assert [true for _, _, true in seen] == expected
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS and all(math.isfinite(r[f"{objective}/loss"]) for r in rows)


def _space(tmp_path: Path, kind: str, extra: tuple[str, ...] = ()):
    from nclip.data.labels import label_space_for

    return label_space_for(resolve("supcon-tiny", _sets(tmp_path, kind, "reco", extra)))


def test_reco_similarity_of_a_json_hierarchy_over_class_folders(tmp_path):
    space = _space(tmp_path, "folder")
    assert space.classes == NAMES
    # Eq. 4, every class at depth 2 (root 0): s(m, m) = log 5, siblings (d = 2) log(5/3), across the
    # root (d = 4) log 1 = 0; normalised by the largest value, log 5
    r = math.log(5 / 3) / math.log(5)
    expected = torch.tensor([[1, r, 0], [r, 1, 0], [0, 0, 1]], dtype=torch.float32)
    torch.testing.assert_close(space.similarity, expected)


def test_reco_similarity_of_a_tsv_hierarchy_over_a_csv_label_column(tmp_path):
    space = _space(tmp_path, "csv")
    assert space.classes == ("car", "cat", "dog", "pickup")
    # depths: car, cat, dog 2; pickup 3. s = log((2·max l + 1) / (d + 1)), scaled by the largest, log 7
    raw = [[math.log(5), 0.0, 0.0, math.log(7 / 4)],  # car–pickup: LCA vehicle, d = 1 + 2
           [0.0, math.log(5), math.log(5 / 3), math.log(7 / 6)],  # cat–pickup: across the root, d = 5
           [0.0, math.log(5 / 3), math.log(5), math.log(7 / 6)],
           [math.log(7 / 4), math.log(7 / 6), math.log(7 / 6), math.log(7)]]
    expected = torch.tensor(raw, dtype=torch.float64) / math.log(7)
    torch.testing.assert_close(space.similarity, expected.float())


def test_paco_centres_count_the_user_classes(tmp_path):
    from nclip.data.labels import label_space_for
    from nclip.objectives import build_objective

    cfg = resolve("supcon-tiny", _sets(tmp_path, "csv", "paco"))
    space = label_space_for(cfg)
    assert space.classes == ("car", "cat", "dog", "pickup") and space.similarity is None
    assert build_objective(cfg.objective, cfg, label_space=space).centers.shape == (4, 8)


def _one_line_error(capsys, args: list[str]) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nclip: error: "), err
    return err[0]


def _train_args(tmp_path: Path, sets: list[str]) -> list[str]:
    return ["train", "--preset", "supcon-tiny", "--out", str(tmp_path / "run"), "--no-progress"] + \
        [x for s in sets for x in ("--set", s)]


def test_reco_on_user_data_without_a_hierarchy_is_one_line(tmp_path, capsys):
    sets = [s for s in _sets(tmp_path, "folder", "supcon") if not s.startswith("objective.name")]
    err = _one_line_error(capsys, _train_args(tmp_path, [*sets, "objective.name=reco"]))
    assert "objective reco on data.source folder needs objective.hierarchy" in err
    err = _one_line_error(capsys, _train_args(tmp_path, [*sets, "objective.name=clip_supcon", "objective.aux=reco"]))
    assert "objective clip_supcon on data.source folder needs objective.hierarchy" in err
    assert not (tmp_path / "run").exists()


def test_supcon_on_a_csv_without_a_label_column_is_one_line(tmp_path, capsys):
    sets = [s for s in _sets(tmp_path, "csv", "supcon") if s != "data.csv_label_key=label"]
    for name in ("supcon", "paco"):
        err = _one_line_error(capsys, _train_args(tmp_path, [*sets, f"objective.name={name}"]))
        assert f"objective {name} needs labelled data, but data.source csv has no labels without " \
               "data.csv_label_key" in err


@pytest.mark.parametrize("tree,message", [
    # a class missing from the tree, and a leaf that is no class (a typo of one)
    ({"animal": None, "dog": "animal", "cat": "animal", "golden_retriever": "dog", "husky": "dog", "tabby": "cat"},
     "the hierarchy does not match the 3 classes of the class folders of data.folder {tree}: 1 class without a "
     "node: 'golden retriever'; 1 leaf not among the classes: 'golden_retriever'"),
    # extra leaves only
    ({**TREE, "persian": "cat", "siamese": "cat"}, "2 leaves not among the classes: 'persian', 'siamese'"),
    # the classes in two trees of a forest: no path between them
    ({"dog": None, "cat": None, "golden retriever": "dog", "husky": "dog", "tabby": "cat"}, "no path between"),
])
def test_a_hierarchy_that_does_not_fit_the_classes_is_one_line(tmp_path, capsys, tree, message):
    sets = _sets(tmp_path, "folder", "reco")
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(tree))
    err = _one_line_error(capsys, _train_args(tmp_path, sets))
    assert f"objective.hierarchy {path}: " in err and message.format(tree=tmp_path / "tree") in err, err
    assert not (tmp_path / "run").exists()  # refused before the run directory: fix the file and run again


def test_a_label_kind_the_user_source_lacks_is_one_line(tmp_path):
    from nclip.data.labels import label_space_for

    with pytest.raises(NclipError, match=r"objective.label_key 'digit' is not a label of data.source csv "
                                         r"\(it has label\)"):
        label_space_for(resolve("supcon-tiny", _sets(tmp_path, "csv", "supcon", ("objective.label_key=digit",))))
