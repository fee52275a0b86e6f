"""The benchmark layouts researchers keep on disk, read offline (issue 26 item 1): CLIP_benchmark's
WebDataset copies (``wds:``), an ImageFolder split (``imagefolder:``), a Karpathy-split JSON
(``karpathy:``) -- their samples, labels, prompts, and the one-line error of each damaged copy."""

import json
import shutil

import numpy as np
import pytest
from benchmark_layouts import COLOURS, write_imagefolder, write_karpathy, write_wds

from nclip.errors import NclipError
from nclip.eval import datasets as eval_data
from nclip.eval.settings import EvalSettings


def _build(spec, **kw):
    (data,) = eval_data.build(spec, image_size=16, max_objects=1, seed=0, test_samples=10, train_samples=10,
                              sts_pairs=0, **kw)
    return data


def test_wds_classification_two_shards(tmp_path):
    root = write_wds(tmp_path / "wds_cifar10", per_class=3, shards=2)
    write_wds(root, per_class=2, shards=2, split="train")
    data = _build(f"wds:{root}")
    assert data.name == "cifar10"
    test = data.splits["test"]
    assert len(test) == 9  # both shards
    assert [test[i].labels["class"] for i in range(len(test))] == [0, 1, 2] * 3
    space = data.label_kinds["class"]
    assert space.names == COLOURS and space.templates == ("a photo of a {}.", "a {} picture.")
    s = test[4]
    assert s.image.shape == (12, 12, 3) and s.image[..., 1].mean() > 150  # green, decoded from webp
    assert s.caption == "a photo of a green."
    assert len(data.splits["train"]) == 6  # indexed on first use
    assert data.identity["split"] == "test" and not data.retrieval


def test_wds_user_prompts_and_split(tmp_path):
    root = write_wds(tmp_path / "pets", per_class=1, shards=2, split="val", fmt="png")
    names = tmp_path / "names.txt"
    names.write_text("crimson\nlime\nnavy\n")
    data = _build(f"wds:{root}:val", classnames=str(names), templates="imagenet80")
    assert data.label_kinds["class"].names == ("crimson", "lime", "navy")
    assert len(data.label_kinds["class"].templates) == 80
    assert len(data.splits["test"]) == 3 and "train" not in data.splits


def test_wds_retrieval_captions(tmp_path):
    root = write_wds(tmp_path / "wds_flickr", per_class=2, shards=2, retrieval=True, fmt="jpg")
    data = _build(f"wds:{root}")
    assert data.retrieval and not data.label_kinds
    s = data.splits["test"][0]
    assert s.captions == ("a red square", "a mostly red picture number 0")


def _damage(root, what):
    split = root / "test"
    if what == "nshards":
        (split / "nshards.txt").unlink()
    elif what == "shard":
        (split / "1.tar").unlink()
    elif what == "range":
        (root / "classnames.txt").write_text("red\ngreen\n")
    elif what == "split":
        shutil.move(split, root / "valid")
    elif what == "tar":
        (split / "0.tar").write_bytes((split / "0.tar").read_bytes()[:700])
    elif what == "classnames":
        (root / "classnames.txt").unlink()


@pytest.mark.parametrize("what, needle", [
    ("nshards", r"test/nshards.txt: not found"),
    ("shard", r"test/1.tar: shard not found; nshards.txt says 2 shards"),
    ("range", r"test/0.tar: sample 's0000002': class index 2 out of range for 2 class names"),
    ("split", r"no split 'test' \(splits here: valid\)"),
    ("tar", r"0.tar: not a readable tar"),
    ("classnames", r"classnames.txt: not found"),
])
def test_wds_damaged_copy_is_one_line(tmp_path, what, needle):
    root = write_wds(tmp_path / "c10", per_class=3, shards=2)
    _damage(root, what)
    with pytest.raises(NclipError, match=needle) as e:
        _build(f"wds:{root}")
    assert "\n" not in str(e.value)


def test_wds_caption_over_the_member_limit_is_one_line_unread(tmp_path, monkeypatch):
    """Every member is read whole into memory: one larger than a caption may be (an 8 GiB one, here
    a limit made small) is refused before it is read."""
    from nclip.data import shards

    root = write_wds(tmp_path / "wds_flickr", per_class=2, shards=2, retrieval=True, fmt="jpg")
    monkeypatch.setattr(shards, "MAX_TEXT_BYTES", 40)  # the captions are 42 bytes
    with pytest.raises(NclipError, match=r"0.tar: sample 's0000000': member s0000000.txt claims 42 bytes, over the "
                                         r"40 a .txt member may hold$"):
        _build(f"wds:{root}")


def test_imagefolder_split_with_class_index_file(tmp_path):
    root = write_imagefolder(tmp_path / "imagenet", per_class=2, splits=("val", "train"))
    data = _build(f"imagefolder:{root / 'val'}", classnames=str(root / "class_index.json"))
    assert data.name == "imagenet"
    assert data.label_kinds["class"].names == COLOURS
    test = data.splits["test"]
    assert len(test) == 6  # the whole split: no 70/30 carving
    assert [test[i].labels["class"] for i in range(6)] == [0, 0, 1, 1, 2, 2]
    assert len(data.splits["train"]) == 6  # the sibling train/ for probes
    plain = _build(f"imagefolder:{root / 'val'}")  # default names: the folder names
    assert plain.label_kinds["class"].names[0] == "n000000"


@pytest.mark.parametrize("index, needle", [
    ({"0": "red", "1": "green", "2": "blue", "3": "cyan"}, r"class index 3 out of range for 3 class folders"),
    ({"0": "red", "1": "green"}, r"class index 2 \(class folder 'n020002'\) has no class name"),
    ({"0": ["n010001", "red"], "1": ["n010001", "g"], "2": "b"}, r"class index 0 is class folder 'n010001'"),
])
def test_imagefolder_class_index_errors(tmp_path, index, needle):
    root = write_imagefolder(tmp_path / "in", per_class=1)
    bad = tmp_path / "index.json"
    bad.write_text(json.dumps(index))
    with pytest.raises(NclipError, match=needle):
        _build(f"imagefolder:{root / 'val'}", classnames=str(bad))


def test_imagefolder_missing_split(tmp_path):
    with pytest.raises(NclipError, match="image folder split not found"):
        _build(f"imagefolder:{tmp_path / 'nope'}")


def test_karpathy_test_split_five_captions(tmp_path):
    path, images = write_karpathy(tmp_path, per_split=4, captions=6)
    data = _build(f"karpathy:{path}:{images}")
    assert data.name == "coco" and data.retrieval
    test = data.splits["test"]
    assert len(test) == 4
    assert len(test[0].captions) == 5 and test[0].captions[0] == "a green square, caption 0 of image 4"
    assert np.asarray(test[0].image).shape == (12, 12, 3)
    assert len(_build(f"karpathy:{path}:{images}:val").splits["test"]) == 2


@pytest.mark.parametrize("what, needle", [
    ("missing", r"dataset_coco.json images\[5\] \(id 5\): image not found: .*COCO_val2014_000000000005.jpg"),
    ("split", r"no image in split 'tst' \(splits here: test, train, val\)"),
    ("folder", r"Karpathy image folder not found"),
    ("file", r"Karpathy split file not found"),
])
def test_karpathy_errors_are_one_line(tmp_path, what, needle):
    path, images = write_karpathy(tmp_path, per_split=4)
    spec = f"karpathy:{path}:{images}"
    if what == "missing":
        next(images.glob("val2014/*000005.jpg")).unlink()
    elif what == "split":
        spec += ":tst"
    elif what == "folder":
        spec = f"karpathy:{path}:{tmp_path / 'none'}"
    else:
        spec = f"karpathy:{tmp_path / 'none.json'}:{images}"
    with pytest.raises(NclipError, match=needle) as e:
        _build(spec)
    assert "\n" not in str(e.value)


def test_specs_parse_and_take_prompts(tmp_path):
    settings = EvalSettings().updated(datasets=("wds:/x/c10:train", "imagefolder:/x/val", "karpathy:/a.json:/b"),
                                      templates="imagenet80")
    assert settings.templates == "imagenet80"
    with pytest.raises(NclipError, match="expected karpathy:FILE.json:IMAGES_DIR"):
        _build("karpathy:/only.json")
