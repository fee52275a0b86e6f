"""The evaluation data adapters for user data, their one-line errors, and the feature cache."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from nclip.errors import NclipError
from nclip.eval import datasets as eval_data
from nclip.eval.cache import FeatureCache


def _png(path, colour=(200, 30, 30), size=12):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size, size, 3), colour, np.uint8)).save(path)
    return path


def test_image_folder_with_and_without_splits(tmp_path):
    for c, name in enumerate(["red_car", "blue_boat", "green-tree"]):
        for i in range(10):
            _png(tmp_path / "flat" / name / f"{i}.png", (80 * c, 10, 10))
    data = eval_data.image_folder(tmp_path / "flat", seed=0)
    assert data.name == "flat" and data.label_kinds["class"].names == ("blue boat", "green tree", "red car")
    assert len(data.splits["train"]) == 21 and len(data.splits["test"]) == 9  # stratified 70 / 30
    s = data.splits["test"][0]
    assert s.image.shape == (12, 12, 3) and s.captions[0].startswith("a photo of a ")
    test_labels = sorted(data.splits["test"].labels[i]["class"] for i in range(9))
    assert test_labels == [0, 0, 0, 1, 1, 1, 2, 2, 2]

    for split, n in (("train", 4), ("test", 2)):
        for name in ("cat", "dog"):
            for i in range(n):
                _png(tmp_path / "split" / split / name / f"{i}.jpg")
    data = eval_data.image_folder(tmp_path / "split")
    assert len(data.splits["train"]) == 8 and len(data.splits["test"]) == 4
    ident = data.identity["files"]
    _png(tmp_path / "split" / "test" / "cat" / "9.jpg")
    assert eval_data.image_folder(tmp_path / "split").identity["files"] != ident  # a new file invalidates the cache key


def test_realm_folders(tmp_path):
    for realm, classes in {"animals": ["cat", "dog"], "tools": ["hammer", "saw", "drill"]}.items():
        for name in classes:
            for i in range(5):
                _png(tmp_path / "r" / realm / name / f"{i}.png")
    data = eval_data.realm_folders(tmp_path / "r")
    assert data.realm == ("realm", "class")
    assert data.label_kinds["realm"].names == ("animals", "tools")
    assert data.label_kinds["class"].names == ("cat", "dog", "drill", "hammer", "saw")
    labels = data.splits["train"].labels + data.splits["test"].labels
    assert {(lab["realm"], lab["class"]) for lab in labels} == {(0, 0), (0, 1), (1, 2), (1, 3), (1, 4)}


def test_caption_files_csv_and_jsonl(tmp_path):
    for i in range(3):
        _png(tmp_path / "img" / f"{i}.png")
    (tmp_path / "caps.csv").write_text(
        "image,caption,caption_2\nimg/0.png,a red square,a square in red\nimg/1.png,one red block,\n"
        "img/0.png,red again,\nimg/2.png,three,\n")
    data = eval_data.caption_file(tmp_path / "caps.csv")
    samples = data.splits["test"]
    assert len(samples) == 3 and data.retrieval
    assert samples[0].captions == ("a red square", "a square in red", "red again")
    assert samples[1].captions == ("one red block",)

    lines = [{"image": "img/0.png", "captions": ["a", "b"]}, {"image": "img/1.png", "caption": "c"}]
    (tmp_path / "caps.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    data = eval_data.caption_file(tmp_path / "caps.jsonl")
    assert [s.captions for s in data.splits["test"]] == [("a", "b"), ("c",)]


def test_captions_csv_of_the_training_run_and_chosen_columns(tmp_path):
    """The CSV a run trained on (data.csv_image_key/csv_caption_key, filepath,title by default)
    evaluates as it is; --image-key/--caption-key pick columns of any other header."""
    for i in range(2):
        _png(tmp_path / "img" / f"{i}.png")
    (tmp_path / "train.csv").write_text("filepath,title,caption\nimg/0.png,a red square,x\nimg/1.png,a blue one,y\n")
    data = eval_data.caption_file(tmp_path / "train.csv", run_keys=("filepath", "title"))
    assert [s.captions for s in data.splits["test"]] == [("a red square",), ("a blue one",)]
    assert data.identity["columns"] == ["filepath", "title"]
    # without the run's keys, the caption* columns (another identity, so no cached features mix)
    other = eval_data.caption_file(tmp_path / "train.csv")
    assert other.splits["test"][0].captions == ("x",) and other.identity != data.identity
    (tmp_path / "mine.csv").write_text("pic,text\nimg/0.png,red\nimg/1.png,blue\n")
    data = eval_data.caption_file(tmp_path / "mine.csv", image_key="pic", caption_key="Text")
    assert [s.captions for s in data.splits["test"]] == [("red",), ("blue",)]
    with pytest.raises(NclipError, match="line 1: the header needs an image column"):
        eval_data.caption_file(tmp_path / "mine.csv", run_keys=("filepath", "title"))


def test_sts_file(tmp_path):
    (tmp_path / "sts.tsv").write_text("sentence1\tsentence2\tscore\na cat\ta dog\t1.5\nsame\tsame\t5\n")
    data = eval_data.sts_file(tmp_path / "sts.tsv")
    assert data.sts == [("a cat", "a dog", 1.5), ("same", "same", 5.0)]


@pytest.mark.parametrize(
    "name,content,needle",
    [
        ("c.csv", "image,caption\nimg/0.png,ok\nimg/missing.png,x\n", "c.csv line 3: image not found"),
        ("c.csv", "picture,text\nimg/0.png,ok\n", "c.csv line 1: the header needs an image column"),
        ("c.csv", "image,caption\nimg/0.png,ok\nimg/0.png,\n", "c.csv line 3: no caption"),
        ("c.csv", "image,caption\nimg/0.png,ok,extra\n", "c.csv line 2: more fields than the header"),
        ("c.jsonl", '{"image": "img/0.png", "caption": "a"}\n{"image": "img/0.png", "caption": \n',
         "c.jsonl line 2: invalid JSON"),
        ("c.jsonl", '{"image": "img/0.png", "caption": 3}\n', "c.jsonl line 1: 'caption' must be"),
        ("c.jsonl", '{"caption": "a"}\n', "c.jsonl line 1: missing image path"),
        ("c.txt", "whatever", "must be a .csv, .tsv or .jsonl"),
    ],
)
def test_caption_file_errors_name_file_and_line(tmp_path, name, content, needle):
    _png(tmp_path / "img" / "0.png")
    (tmp_path / name).write_text(content)
    with pytest.raises(NclipError) as e:
        eval_data.caption_file(tmp_path / name)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "content,needle",
    [
        ("a,b,score\nx,y,1\n", "line 1: the header must name sentence1, sentence2 and score"),
        ("sentence1,sentence2,score\nx,y,1\nx,y,high\n", "line 3: score 'high' is not a number"),
        ("sentence1,sentence2,score\nx,,1\n", "line 2: empty sentence"),
        ("sentence1,sentence2,score\nx,y,1\n", "at least 2 sentence pairs"),
    ],
)
def test_sts_file_errors(tmp_path, content, needle):
    (tmp_path / "s.csv").write_text(content)
    with pytest.raises(NclipError, match=needle):
        eval_data.sts_file(tmp_path / "s.csv")


def test_folder_errors(tmp_path):
    with pytest.raises(NclipError, match="dataset folder not found"):
        eval_data.image_folder(tmp_path / "nope")
    _png(tmp_path / "one" / "only" / "0.png")
    with pytest.raises(NclipError, match="at least 2"):
        eval_data.image_folder(tmp_path / "one")
    _png(tmp_path / "few" / "a" / "0.png")
    _png(tmp_path / "few" / "a" / "1.png")
    _png(tmp_path / "few" / "b" / "0.png")
    with pytest.raises(NclipError, match=r"few/b: 1 image; the seeded 70%/30% split needs at least 2"):
        eval_data.image_folder(tmp_path / "few")
    _png(tmp_path / "two" / "a" / "0.png")
    (tmp_path / "two" / "b").mkdir()
    with pytest.raises(NclipError, match=r"two/b: no images"):
        eval_data.image_folder(tmp_path / "two")
    (tmp_path / "bad" / "a").mkdir(parents=True)
    (tmp_path / "bad" / "a" / "0.png").write_bytes(b"not a png")
    files = eval_data.FileSamples([tmp_path / "bad" / "a" / "0.png"], [("x",)], [{}], ["caps.csv line 7: "])
    with pytest.raises(NclipError, match="caps.csv line 7: cannot read image"):
        files[0]


def test_feature_cache_roundtrip_and_identity(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return {"image.emb": torch.arange(6.0).view(2, 3), "label.shape": torch.tensor([1, 2])}

    cache = FeatureCache(tmp_path, "ab" * 32)
    a = cache.get("synthetic-test", {"n": 2}, compute)
    b = cache.get("synthetic-test", {"n": 2}, compute)
    assert len(calls) == 1 and cache.hits == ["synthetic-test"] and torch.equal(a["image.emb"], b["image.emb"])
    cache.get("synthetic-test", {"n": 3}, compute)  # another identity: recomputed
    FeatureCache(tmp_path, "cd" * 32).get("synthetic-test", {"n": 2}, compute)  # other weights: recomputed
    assert len(calls) == 3
    path = cache.path("synthetic-test", {"n": 2})
    path.write_bytes(b"garbage")  # a corrupt entry is recomputed, not fatal
    cache.get("synthetic-test", {"n": 2}, compute)
    assert len(calls) == 4
    assert FeatureCache(None, "ab" * 32).get("x", {}, compute) and len(calls) == 5
    assert not list(tmp_path.rglob(".*.safetensors.*"))  # no temporary files left behind
