"""Tagging data as image–text pairs (xCLIP Sec. 4.3) and labels from the user's data (a CSV label
column, a class-folder tree): captions, epochs, resume, ranks, templates files, label objectives."""

import numpy as np
import pytest
import torch
from PIL import Image

from nclip.cli import main
from nclip.config import resolve
from nclip.data.digits import DIGIT_NAMES, DIGIT_TEMPLATES
from nclip.data.folders import FOLDER_TEMPLATES
from nclip.data.labels import label_kind, tag_captions
from nclip.data.loader import train_loader
from nclip.data.sources import build_dataset
from nclip.data.step_batches import StepBatches
from nclip.data.tokenization import CaptionTokenizer
from nclip.errors import NclipError
from nclip.objectives import REGISTRY

from conftest import micro_sizes

DIGITS = ["data.source=digits", "data.tagging.enabled=true", "train.batch_size=8", "train.steps=6"]
CLASSES = ("red_square", "blue-circle", "green star")  # folder names; class names: spaces


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NCLIP_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tokenizer():
    return CaptionTokenizer(16)


def _cfg(*extra):
    return resolve("micro", [*micro_sizes(), *extra])


def _image(rng, side=20):
    return rng.integers(0, 256, (side, side, 3), dtype=np.uint8)


def _folder(root, per_class=4):
    rng = np.random.default_rng(0)
    for name in CLASSES:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(_image(rng, 18 + i)).save(root / name / f"{i}.png")
    return root


def _csv(tmp_path, n=12):
    rng = np.random.default_rng(1)
    (tmp_path / "img").mkdir()
    rows = ["filepath,title,kind"]
    for i in range(n):
        Image.fromarray(_image(rng)).save(tmp_path / "img" / f"{i}.png")
        rows.append(f"img/{i}.png,picture number {i},{('cat', 'dog', 'bird')[i % 3]}")
    path = tmp_path / "pairs.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


def _caption(data, step, index):
    """The caption the loader's dataset gives a key (step, index)."""
    return data.loader.dataset[(step, index)][1]


# ---------------------------------------------------------------------------------------------
# captions
# ---------------------------------------------------------------------------------------------


def test_captions_come_from_the_templates_and_name_the_class(tokenizer):
    cfg = _cfg(*DIGITS)
    data = train_loader(cfg, tokenizer)
    samples = build_dataset(cfg, "train")
    for i in range(0, len(samples), 97):
        name = DIGIT_NAMES[samples[i].labels["digit"]]  # the zero-shot class names ("three")
        assert _caption(data, 0, i) in {t.format(name) for t in DIGIT_TEMPLATES}


def test_captions_are_resampled_every_epoch_and_reproducible(tokenizer):
    cfg = _cfg(*DIGITS)
    data = train_loader(cfg, tokenizer)
    sampler: StepBatches = data.loader.batch_sampler
    per_epoch = len(build_dataset(cfg, "train")) // 8
    assert sampler.epoch(per_epoch - 1) == 0 and sampler.epoch(per_epoch) == 1
    # the same epoch (any of its steps) gives the same caption; other epochs draw anew
    assert _caption(data, 0, 5) == _caption(data, per_epoch - 1, 5)
    over_epochs = {_caption(data, e * per_epoch, 5) for e in range(12)}
    assert len(over_epochs) > 1
    again = train_loader(cfg, tokenizer)
    assert [_caption(again, e * per_epoch, 5) for e in range(12)] == [_caption(data, e * per_epoch, 5)
                                                                       for e in range(12)]
    tags, key = tag_captions(cfg)
    assert key == "digit" and _caption(data, 3 * per_epoch, 7) == tags(3, 7, build_dataset(cfg, "train")[7].labels[key])


def test_tagged_batches_resume_exactly_and_split_over_ranks(tokenizer):
    cfg = _cfg(*DIGITS, "train.steps=160")  # past the first epoch (151 steps of 8 of 1,212 digits)
    full = list(train_loader(cfg, tokenizer))
    resumed = list(train_loader(cfg, tokenizer, start_step=155))
    for a, b in zip(resumed, full[155:]):
        assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))
    halves = [list(train_loader(cfg, tokenizer, start_step=150, rank=r, world_size=2)) for r in range(2)]
    for step in range(150, 160):  # the two ranks hold the halves of the same global batch, captions included
        parts = zip(halves[0][step - 150].tensors(), halves[1][step - 150].tensors(), full[step].tensors())
        assert all(torch.equal(torch.cat([first, second]), whole) for first, second, whole in parts)
    plain = list(train_loader(_cfg(*[o for o in DIGITS if "tagging" not in o], "train.steps=160"), tokenizer,
                              start_step=150))
    assert not torch.equal(plain[0].ids, full[150].ids)  # the tagging captions replace the digits' own


def test_synthetic_scenes_tag_their_main_shape_or_a_named_label(tokenizer):
    cfg = _cfg("data.source=synthetic", "data.tagging.enabled=true", "data.train_length=64", "train.batch_size=8")
    data = train_loader(cfg, tokenizer)
    s = build_dataset(cfg, "train")[3]
    spaces = s.labels
    shape = label_kind(cfg, "shape")[1]
    assert _caption(data, 0, 3) in shape.prompts(spaces["shape"])
    colour = _cfg("data.source=synthetic", "data.tagging.enabled=true", "data.tagging.label_key=colour",
                  "data.train_length=64", "train.batch_size=8")
    assert _caption(train_loader(colour, tokenizer), 0, 3) in label_kind(colour, "colour")[1].prompts(spaces["colour"])


def test_a_user_templates_file_is_used(tmp_path, tokenizer):
    path = tmp_path / "prompts.txt"
    path.write_text("# my prompts\n\nitap of a {}.\n  a low-resolution {} \n")
    cfg = _cfg(*DIGITS, f"data.tagging.templates={path}")
    data = train_loader(cfg, tokenizer)
    sample = build_dataset(cfg, "train")[0]
    name = DIGIT_NAMES[sample.labels["digit"]]
    assert {_caption(data, 151 * e, 0) for e in range(10)} == {f"itap of a {name}.", f"a low-resolution {name}"}


@pytest.mark.parametrize("text,match", [
    ("a photo of a {}.\n# fine\na photo\n", r"prompts.txt:3: a template needs exactly one \{\}"),
    ("a {name}.\n", r"prompts.txt:1: .*no other braces"),
    ("{} and {}\n", r"prompts.txt:1: a template needs exactly one"),
    ("# only comments\n\n", r"prompts.txt: no templates"),
])
def test_bad_templates_are_a_one_line_error(tmp_path, tokenizer, text, match):
    path = tmp_path / "prompts.txt"
    path.write_text(text)
    with pytest.raises(NclipError, match=match) as e:
        train_loader(_cfg(*DIGITS, f"data.tagging.templates={path}"), tokenizer)
    assert "\n" not in str(e.value)


def test_bad_tagging_configs_are_one_line(tmp_path, capsys):
    for extra, match in [
        (["data.tagging.templates=x.txt"], "label_key and templates need enabled: true"),
        (["data.source=csv", "data.csv=x.csv", "data.tagging.enabled=true"],
         "data.tagging needs labelled data, but data.source csv without data.csv_label_key"),
        (["data.source=folder", "data.folder=x", "data.tagging.enabled=true", "data.tagging.label_key=shape"],
         "label_key 'shape' is not a label of data.source folder"),
        (["data.source=folder"], "data.source folder needs data.folder"),
        (["data.csv_label_key=kind"], "data.csv_label_key needs data.source csv"),
    ]:
        with pytest.raises(NclipError, match=match) as e:
            _cfg(*extra)
        assert "\n" not in str(e.value)
    args = ["train", "--preset", "micro", "--out", str(tmp_path / "r"), "--no-progress", "--no-eval"]
    missing = [*DIGITS, f"data.tagging.templates={tmp_path / 'none.txt'}"]
    assert main(args + [a for o in missing for a in ("--set", o)]) == 2
    err = capsys.readouterr().err.strip()
    assert "data.tagging.templates: file not found" in err and "\n" not in err


# ---------------------------------------------------------------------------------------------
# labels from the user's data: a folder tree, a CSV label column
# ---------------------------------------------------------------------------------------------


def test_folder_source_labels_names_and_captions(tmp_path, tokenizer):
    root = _folder(tmp_path / "classes")
    cfg = _cfg("data.source=folder", f"data.folder={root}", "train.batch_size=6")
    samples = build_dataset(cfg, "train")
    assert len(samples) == 12 and [s.name for s in samples.paths[:2]] == ["0.png", "1.png"]
    key, space = label_kind(cfg)
    # class ids: the sorted folder names; names with spaces
    assert key == "label" and space.names == ("blue circle", "green star", "red square")
    assert samples[0].caption == "blue circle" and samples[0].labels == {"label": 0}
    tagged = _cfg("data.source=folder", f"data.folder={root}", "train.batch_size=6", "data.tagging.enabled=true")
    assert _caption(train_loader(tagged, tokenizer), 0, 11) in {t.format("red square") for t in FOLDER_TEMPLATES}
    (root / "empty").mkdir()
    with pytest.raises(NclipError, match=r"empty: no images") as e:
        build_dataset(cfg, "train")
    assert "\n" not in str(e.value)


def test_csv_label_column_gives_labels_to_cmsf_and_xent(tmp_path, tokenizer):
    path = _csv(tmp_path)
    base = ["data.source=csv", f"data.csv={path}", "data.csv_label_key=kind", "train.batch_size=6", "train.steps=2"]
    for objective in (["objective.name=cmsf", "objective.constraint=labels", "objective.bank_size=12"],
                      ["objective.name=xent"]):
        cfg = _cfg(*base, *objective)
        request = REGISTRY[cfg.objective.name][1].label_request(cfg)
        assert request is not None and not request.optional
        views = REGISTRY[cfg.objective.name][1].views
        batches = list(train_loader(cfg, tokenizer, views=views, labels=request))
        assert len(batches[0]) == 6
        keys = train_loader(cfg, tokenizer).loader.batch_sampler.global_batch(0)
        expected = torch.tensor([("bird", "cat", "dog").index(("cat", "dog", "bird")[i % 3]) for i in keys])
        assert torch.equal(batches[0].labels, expected) and torch.equal(batches[0].true_labels, expected)  # clean
    assert label_kind(_cfg(*base))[1].names == ("bird", "cat", "dog")
    tagged = _cfg(*base, "data.tagging.enabled=true", "data.csv_caption_key=absent")  # captions not read
    assert _caption(train_loader(tagged, tokenizer), 0, 1) in {t.format("dog") for t in FOLDER_TEMPLATES}


def test_label_constraint_on_a_csv_without_labels_is_one_line(tmp_path):
    path = _csv(tmp_path)
    with pytest.raises(NclipError, match="constraint labels needs labelled data, but data.source csv has no "
                                         "labels without data.csv_label_key") as e:
        _cfg("data.source=csv", f"data.csv={path}", "objective.name=cmsf", "objective.constraint=labels")
    assert "\n" not in str(e.value)


def test_teacher_captions_are_the_epoch_zero_captions(tmp_path):
    from nclip.train.teacher import dataset_identity, train_captions

    root = _folder(tmp_path / "classes")
    plain = _cfg("data.source=folder", f"data.folder={root}")
    assert train_captions(plain)[:5] == ["blue circle"] * 4 + ["green star"]
    cfg = _cfg("data.source=folder", f"data.folder={root}", "data.tagging.enabled=true")
    tags, key = tag_captions(cfg)
    assert train_captions(cfg) == [tags(0, i, i // 4) for i in range(12)]
    assert dataset_identity(cfg)["tagging"]["templates"] == list(FOLDER_TEMPLATES)
    assert dataset_identity(cfg) != dataset_identity(plain)


# ---------------------------------------------------------------------------------------------
# training through the CLI
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["clip", "nclip"])
def test_folder_tagging_trains_through_the_cli(tmp_path, objective):
    root = _folder(tmp_path / "classes")
    sets = [*micro_sizes(), "data.source=folder", f"data.folder={root}", "data.tagging.enabled=true",
            f"objective.name={objective}", "train.steps=5", "train.batch_size=6", "train.log_every=1",
            "train.threads=1"]
    out = tmp_path / "run"
    assert main(["train", "--preset", "micro", "--out", str(out), "--no-progress",
                 *[a for o in sets for a in ("--set", o)]]) == 0
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 5


def test_tagging_preset_validates_and_compares_three_objectives():
    for name in ("clip", "nclip", "xclip"):
        cfg = resolve("tagging-digits-tiny", [f"objective.name={name}"])
        assert cfg.data.source == "digits" and cfg.data.tagging.enabled and cfg.model.vision.kind == "convnet"
