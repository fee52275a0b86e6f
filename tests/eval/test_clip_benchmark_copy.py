"""`nclip data write-shards --layout clip_benchmark` writes CLIP_benchmark's WebDataset layout: nclip's
reader (`wds:DIR`) and CLIP_benchmark's own (`build_wds_dataset`) read back the classes, prompts,
labels, captions and the very image files; mistakes are one line."""

from __future__ import annotations

import tarfile

import numpy as np
import pytest
from clip_benchmark_data import CLASSES, captions_csv, class_folders
from PIL import Image

import nclip  # noqa: F401 (torchvision importable beside the CPU torch, for CLIP_benchmark's import)
from nclip.cli import main
from nclip.config import resolve
from nclip.data.folders import FOLDER_TEMPLATES
from nclip.errors import NclipError
from nclip.eval import datasets as eval_data

# CLIP_benchmark leaves webdataset's shardshuffle unset (it reads the shards in order)
pytestmark = pytest.mark.filterwarnings("ignore:WebDataset.shardshuffle")


def write(*argv) -> int:
    return main(["data", "write-shards", "--preset", "micro", "--layout", "clip_benchmark", *map(str, argv)])


def read_nclip(spec):
    (data,) = eval_data.build(spec, image_size=16, max_objects=1, seed=0, test_samples=10, train_samples=10,
                              sts_pairs=0)
    return data


def read_clip_benchmark(root, split="test"):
    """(samples as (PIL image, label or captions), classes, templates) by CLIP_benchmark's reader."""
    builder = pytest.importorskip("clip_benchmark.datasets.builder")
    ds = builder.build_wds_dataset("copy", transform=None, split=split, data_dir=str(root))
    return list(ds), ds.classes, ds.templates


def members(shard):
    with tarfile.open(shard) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}


def test_class_folders_copy_their_files_and_both_readers_agree(tmp_path, capsys):
    files = class_folders(tmp_path / "colours", size=16, per_class=4)
    out = tmp_path / "wds_colours"
    assert write("--dataset", f"folder:{tmp_path / 'colours'}", "--out", out, "--shard-size", "5") == 0
    said = capsys.readouterr().out
    assert f"wrote CLIP_benchmark's layout (classification, 6 classes of 'class') to {out}" in said
    assert f"--dataset wds/wds_colours --dataset_root {out}" in said and "--no_amp" in said
    shards = int((out / "test" / "nshards.txt").read_text())
    assert shards == 2 and "--num_workers 2 " in said  # no more workers than shards: webdataset's rule

    source, copy = read_nclip(f"folder:{tmp_path / 'colours'}"), read_nclip(f"wds:{out}")
    assert copy.label_kinds["class"] == source.label_kinds["class"]  # names and FOLDER_TEMPLATES
    assert (out / "zeroshot_classification_templates.txt").read_text().splitlines() == \
        [t.replace("{}", "{c}") for t in FOLDER_TEMPLATES]
    for split in ("test", "train"):  # the seeded 70/30 split of the folder, both halves
        src, cp = source.splits[split], copy.splits[split]
        assert len(cp) == len(src) and int((out / split / "nshards.txt").read_text()) == -(-len(src) // 5)
        for i in range(len(src)):
            assert cp[i].labels == src[i].labels
            assert np.array_equal(np.asarray(cp[i].image), np.asarray(src[i].image))
    # the files themselves, under the extension CLIP_benchmark's reader looks for
    stored = members(out / "test" / "0.tar")
    first = source.splits["test"].paths[0]
    ext = {".jpeg": "jpg"}.get(first.suffix, first.suffix[1:])
    assert stored[f"s0000000.{ext}"] == first.read_bytes() and stored["s0000000.cls"].isdigit()
    assert len({w / h for _, w, h in files}) > 10  # non-square, many aspect ratios

    samples, classes, templates = read_clip_benchmark(out)
    assert classes == sorted(CLASSES)  # the sorted folders: nclip's class indices
    assert templates == [t.replace("{}", "{c}") for t in FOLDER_TEMPLATES]
    src = source.splits["test"]
    assert [y for _, y in samples] == [s.labels["class"] for s in src]
    for (image, _), s in zip(samples, src):
        assert np.array_equal(np.asarray(image), np.asarray(s.image))


def test_captions_csv_copies_as_retrieval(tmp_path):
    path = captions_csv(tmp_path / "caps", size=16, images=9)
    out = tmp_path / "wds_caps"
    assert write("--dataset", f"captions:{path}", "--out", out, "--format", "png") == 0
    assert (out / "dataset_type.txt").read_text() == "retrieval\n" and not (out / "classnames.txt").exists()
    assert not (out / "train").exists()
    source, copy = read_nclip(f"captions:{path}"), read_nclip(f"wds:{out}")
    assert copy.retrieval and len(copy.splits["test"]) == 9
    samples, _, _ = read_clip_benchmark(out)
    for s, c, (image, caps) in zip(source.splits["test"], copy.splits["test"], samples):
        assert c.captions == s.captions and tuple(caps) == s.captions
        assert np.array_equal(np.asarray(image), np.asarray(s.image)) and np.array_equal(c.image, s.image)


def test_builtin_scenes_lossless_with_a_chosen_label_or_captions(tmp_path):
    out = tmp_path / "scenes"
    assert write("--label", "colour", "--count", "7", "--shard-size", "3", "--out", out) == 0
    cfg = resolve("micro", [])
    source = eval_data.synthetic(cfg.data.image_size, cfg.data.max_objects, cfg.seed, 7, 7)
    copy = read_nclip(f"wds:{out}")
    assert copy.label_kinds["class"].names == source.label_kinds["colour"].names
    assert int((out / "test" / "nshards.txt").read_text()) == 3 and len(copy.splits["train"]) == 7
    for i in range(7):  # lossless WebP by default
        assert np.array_equal(copy.splits["test"][i].image, source.splits["test"][i].image)
        assert copy.splits["test"][i].labels["class"] == source.splits["test"][i].labels["colour"]
    samples, classes, _ = read_clip_benchmark(out, split="train")
    assert [y for _, y in samples] == [source.splits["train"][i].labels["colour"] for i in range(7)]

    caps = tmp_path / "scene_captions"
    assert write("--retrieval", "--count", "4", "--split", "test", "--out", caps) == 0
    samples, _, _ = read_clip_benchmark(caps)
    assert [tuple(c) for _, c in samples] == [source.splits["test"][i].captions for i in range(4)]


def test_line_breaks_in_captions_become_spaces(tmp_path):
    for n in range(2):
        Image.new("RGB", (20, 12), (n * 90, 10, 10)).save(tmp_path / f"{n}.png")
    (tmp_path / "c.jsonl").write_text('{"image": "0.png", "captions": ["two\\nlines", "one"]}\n'
                                      '{"image": "1.png", "caption": "x\\u2028y"}\n')
    assert write("--dataset", f"captions:{tmp_path / 'c.jsonl'}", "--out", tmp_path / "o") == 0
    samples, _, _ = read_clip_benchmark(tmp_path / "o")
    assert [c for _, c in samples] == [["two lines", "one"], ["x y"]]


@pytest.mark.parametrize("argv, needle", [
    (["--label", "texture"], "--label 'texture': synthetic has the label kinds shape, colour"),
    (["--label", "shape", "--retrieval"], "--label and --retrieval"),
    (["--dataset", "folder:{tmp}/f", "--retrieval"], "no captions to write for retrieval"),
    (["--dataset", "folder:{tmp}/f", "--split", "val"], "--split 'val': f has the splits test, train"),
    (["--dataset", "folder:{tmp}/nope"], "not found"),
    (["--out", "{tmp}/full"], "not empty; write a CLIP_benchmark copy to a new or empty folder"),
    (["--count", "0"], "--count must be >= 1"),
    (["--shard-size", "0"], "--shard-size must be >= 1"),
    (["--dataset", "folder:{tmp}/f", "--templates", "{tmp}/braces.txt"], "no other braces"),
])
def test_mistakes_are_one_line(tmp_path, capsys, argv, needle):
    class_folders(tmp_path / "f", size=16, per_class=2)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "braces.txt").write_text("a {} with {{braces}}\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    out = [] if "--out" in argv else ["--out", str(tmp_path / "o")]
    assert main(["data", "write-shards", "--preset", "micro", "--layout", "clip_benchmark", *argv, *out]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o.*"))  # nothing half-written


def test_clip_benchmark_options_need_the_layout(tmp_path, capsys):
    assert main(["data", "write-shards", "--preset", "micro", "--count", "2", "--label", "shape",
                 "--out", str(tmp_path / "s")]) == 2
    assert "--label needs --layout clip_benchmark" in capsys.readouterr().err
    assert main(["data", "write-shards", "--preset", "micro", "--out", str(tmp_path / "s")]) == 2
    assert "--count is required" in capsys.readouterr().err


def test_write_copy_rejects_a_name_that_is_not_one_line(tmp_path):
    from nclip.data.types import LabelKind
    from nclip.eval.wds_export import write_copy

    data = read_nclip("digits")
    data.label_kinds = {"digit": LabelKind(("zero\nnil",) + tuple(map(str, range(1, 10))), ("a {}.",))}
    with pytest.raises(NclipError, match="cannot be written as one line"):
        write_copy(data, tmp_path / "d")
    assert not (tmp_path / "d").exists()
