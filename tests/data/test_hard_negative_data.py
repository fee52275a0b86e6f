"""Hard negative captions in training data (nclip.data.hard_negatives): a CSV/TSV column, JSONL field or
shard sample's .json field of the user's own (data.hard_negative_key), or NegCLIP's swaps of the positive
caption (data.hard_negatives swap); their slots in the batch; a run that trains and resumes bitwise;
`nclip data inspect` and the start-up block count them; one-line errors for bad input and for
objectives that cannot take them."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from nclip.cli import main
from nclip.config import resolve
from nclip.data.hard_negatives import record_negatives, swap_caption
from nclip.data.loader import train_loader
from nclip.data.tokenization import CaptionTokenizer
from nclip.errors import NclipError

from conftest import metrics_then_resumed, micro_sizes

N = 12  # rows; row i has i % 3 negatives


def _negatives(i: int) -> list[str]:
    return [f"not photo {i} but {c}" for c in range(i % 3)]


def _images(root) -> None:
    rng = np.random.default_rng(0)
    (root / "img").mkdir(exist_ok=True)
    for i in range(N):
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(root / "img" / f"{i}.png")


def _csv(root, negatives=_negatives) -> str:
    _images(root)
    rows = ["filepath,title,negs"] + [f"img/{i}.png,photo {i},{'|'.join(negatives(i))}" for i in range(N)]
    (root / "pairs.csv").write_text("\n".join(rows) + "\n")
    return str(root / "pairs.csv")


def _jsonl(root, value=lambda i: _negatives(i) or "") -> str:  # no negatives: an empty string (a list may not be empty)
    _images(root)
    rows = [json.dumps({"filepath": f"img/{i}.png", "title": f"photo {i}", "negs": value(i)}) for i in range(N)]
    (root / "pairs.jsonl").write_text("\n".join(rows) + "\n")
    return str(root / "pairs.jsonl")


def _cfg(*extra):
    return resolve("micro", [*micro_sizes(), "objective.name=clip", "train.batch_size=4", "train.steps=6", *extra])


def _sets(path: str, *extra) -> list[str]:
    """A CSV's negatives split by "|"; a JSONL's in lists (a separator found nowhere would be refused)."""
    separator = [] if path.endswith(".jsonl") else ['data.caption_separator="|"']
    return ["data.source=csv", f"data.csv={path}", *separator, "data.hard_negative_key=negs", *extra]


@pytest.fixture(scope="module")
def tokenizer():
    return CaptionTokenizer(16)


def _ids(tokenizer, text: str) -> torch.Tensor:
    return tokenizer([text])[0][0]


@pytest.mark.parametrize("writer", [_csv, _jsonl])
def test_the_batch_carries_each_images_own_negatives_after_its_caption(tmp_path, tokenizer, writer):
    cfg = _cfg(*_sets(writer(tmp_path)))
    data = train_loader(cfg, tokenizer)
    batch = next(iter(data))
    assert batch.ids.shape[:2] == (4, 3) and batch.negative_valid.shape == (4, 2)
    keys = [key for key in data.loader.batch_sampler][0]  # the (step, index) keys of the first batch
    indices = [index for _, index in keys]
    assert batch.negative_valid.sum(1).tolist() == [i % 3 for i in indices]
    for b, i in enumerate(indices):
        assert torch.equal(batch.ids[b, 0], _ids(tokenizer, f"photo {i}"))
        slots = _negatives(i) + [""] * (2 - len(_negatives(i)))  # the empty slots: empty captions, masked out
        for j, text in enumerate(slots):
            assert torch.equal(batch.ids[b, 1 + j], _ids(tokenizer, text)), (i, j)


def test_a_run_with_negatives_trains_and_resumes_bitwise(tmp_path):
    cfg = _cfg(*_sets(_csv(tmp_path)), "train.checkpoint_every=3", "train.log_every=1")
    rows, again = metrics_then_resumed(cfg, tmp_path / "run")
    assert len(rows) == 6 and again == rows and all(np.isfinite(r["loss"]) for r in rows)
    assert "clip/acc_hard" in rows[0]


def test_swap_makes_negclips_attribute_and_word_order_swaps_by_seed_and_index():
    caption = "a red circle left of a blue square."
    made = [swap_caption(caption, 0, i) for i in range(200)]
    attribute = "a blue circle left of a red square."
    assert set(made) == {attribute, "a circle red left of a blue square.", "a square circle left of a blue red.",
                         "a red blue left of a circle square.", "a red square left of a blue circle.",
                         "a red circle left of a square blue."}
    assert made.count(attribute) > 80  # the attribute swap half the time, and once among the word swaps
    assert made == [swap_caption(caption, 0, i) for i in range(200)]  # pure
    assert made != [swap_caption(caption, 1, i) for i in range(200)]  # seeded
    assert swap_caption("something black.", 0, 0) is None  # one content word: nothing to swap
    assert swap_caption("A Dog, chasing cats", 0, 3) in {"A Chasing, dog cats", "A Cats, chasing dog",
                                                          "A Dog, cats chasing"} | {"A chasing, Dog cats",
                                                                                    "A cats, chasing Dog",
                                                                                    "A Dog, cats chasing"}


def test_swap_negatives_in_the_batch_are_the_swaps_of_its_captions(tokenizer):
    cfg = _cfg("data.hard_negatives=swap")
    data = train_loader(cfg, tokenizer)
    batch = next(iter(data))
    assert batch.ids.shape[:2] == (4, 2) and batch.negative_valid.shape == (4, 1)
    keys = [key for key in data.loader.batch_sampler][0]
    for b, key in enumerate(keys):
        caption = data.loader.dataset[key][1]
        swapped = swap_caption(caption, cfg.seed, key[1])
        assert bool(batch.negative_valid[b, 0]) == (swapped is not None)
        if swapped is not None:
            assert torch.equal(batch.ids[b, 1], _ids(tokenizer, swapped))


def test_each_rank_gets_the_negatives_of_its_rows_of_the_one_process_batch(tmp_path, tokenizer):
    for sets in (["data.hard_negatives=swap"], _sets(_csv(tmp_path))):
        cfg = _cfg(*sets)
        whole = next(iter(train_loader(cfg, tokenizer)))
        for rank in (0, 1):
            part = next(iter(train_loader(cfg, tokenizer, rank=rank, world_size=2)))
            rows = slice(2 * rank, 2 * rank + 2)
            assert torch.equal(part.ids, whole.ids[rows])
            assert torch.equal(part.negative_valid, whole.negative_valid[rows]) and whole.negative_valid.any()


@pytest.mark.slow
def test_clip_trains_on_the_scenes_with_swap_negatives_and_resumes_bitwise(tmp_path):
    cfg = _cfg("data.hard_negatives=swap", "train.checkpoint_every=3", "train.log_every=1")
    rows, again = metrics_then_resumed(cfg, tmp_path / "run")
    assert len(rows) == 6 and again == rows and "clip/acc_hard" in rows[0]


# ---------------------------------------------------------------------------------------------
# bad input, objectives that cannot take negatives
# ---------------------------------------------------------------------------------------------


def _train(tmp_path, sets) -> int:
    return main(["train", "--preset", "micro", "--out", str(tmp_path / "run"), "--no-progress", "--no-eval",
                 *[a for o in ["objective.name=clip", *sets] for a in ("--set", o)]])


@pytest.mark.parametrize("kind,needle", [
    ("missing column", "pairs.csv: no column 'negs' (data.hard_negative_key); columns: filepath, title"),
    ("missing field", "pairs.jsonl line 1: no field 'negs' (data.hard_negative_key)"),
    ("empty list", "pairs.jsonl line 3: hard negatives 'negs': the caption list is empty"),
    ("no negative at all", "pairs.csv: the hard negative column 'negs' (data.hard_negative_key) holds no negative"),
])
def test_bad_negative_input_is_one_line_with_exit_2(tmp_path, capsys, kind, needle):
    if kind == "missing column":
        _images(tmp_path)
        (tmp_path / "pairs.csv").write_text("filepath,title\n" + "".join(f"img/{i}.png,p {i}|q\n" for i in range(N)))
        path = str(tmp_path / "pairs.csv")
    elif kind == "missing field":
        _images(tmp_path)
        (tmp_path / "pairs.jsonl").write_text(json.dumps({"filepath": "img/0.png", "title": "p|q"}) + "\n")
        path = str(tmp_path / "pairs.jsonl")
    elif kind == "empty list":
        path = _jsonl(tmp_path, value=lambda i: [] if i == 2 else ["a", "b"])
    else:
        path = _csv(tmp_path, negatives=lambda i: [])
        text = (tmp_path / "pairs.csv").read_text().replace("photo 1,", "photo 1|x,")
        (tmp_path / "pairs.csv").write_text(text)
    assert _train(tmp_path, _sets(path)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nclip: error: ") and needle in err and "\n" not in err, err


@pytest.mark.parametrize("name", ["xclip", "nclip", "xsiglip", "protoclip"])
def test_an_objective_that_cannot_take_negatives_refuses_them_in_one_line(tmp_path, capsys, name):
    assert _train(tmp_path, ["data.hard_negatives=swap", f"objective.name={name}"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"data.hard_negatives: objective {name!r} takes no hard negative captions" in err and "\n" not in err, err


@pytest.mark.parametrize("sets,needle", [
    (["data.hard_negative_key=negs"], "data.hard_negative_key names a column of a CSV/JSONL file or a field"),
    (["data.source=csv", "data.csv=x.csv", "data.hard_negative_key=negs", "data.hard_negatives=swap"],
     "two sources of negatives; set one"),
    (["data.source=webdataset", "data.shards=x.tar", "data.hard_negative_key=negs"],
     "needs data.negatives_per_image (the negative slots per image"),
    (["data.source=csv", "data.csv=x.csv", "data.negatives_per_image=2"], "sizes the negative slots of"),
])
def test_negative_settings_that_cannot_apply_are_one_line(sets, needle):
    with pytest.raises((NclipError, ValueError)) as e:
        _cfg(*sets)
    assert needle in str(e.value)


# ---------------------------------------------------------------------------------------------
# WebDataset shards, inspect, the start-up block
# ---------------------------------------------------------------------------------------------


def _shard(root, negatives=_negatives) -> str:
    """N samples: sample i's .json holds its negatives under "negs" (none: the field left out)."""
    path = root / "negs.tar"
    with tarfile.open(path, "w") as tar:
        for i in range(N):
            buf = io.BytesIO()
            Image.fromarray(np.random.default_rng(i).integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(buf, "PNG")
            meta = {"negs": negatives(i)} if negatives(i) else {}
            for name, data in ((f"{i:04d}.png", buf.getvalue()), (f"{i:04d}.txt", f"photo {i}".encode()),
                               (f"{i:04d}.json", json.dumps(meta).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def _stream(url: str, *extra) -> list[str]:
    return ["data.source=webdataset", f"data.shards={url}", "data.shuffle_buffer=0", "data.num_workers=0", *extra]


def test_a_shard_samples_negatives_come_from_its_json_field():
    assert record_negatives({"json": b'{"negs": ["a ", "", "b"]}'}, "negs") == ("a", "b")
    assert record_negatives({"json": b'{"negs": "one"}'}, "negs") == ("one",)
    for absent in ({}, {"json": b"{}"}, {"json": b'{"negs": []}'}, {"json": b'{"negs": null}'}):
        assert record_negatives(absent, "negs") == ()  # an image without negatives
    assert "is not valid JSON" in record_negatives({"json": b"{broken"}, "negs")
    assert "the caption list holds 3 (int)" in record_negatives({"json": b'{"negs": ["a", 3]}'}, "negs")
    assert "must be a string or a list" in record_negatives({"json": b'{"negs": 5}'}, "negs")


def test_webdataset_batches_carry_each_samples_negatives_in_its_slots(tmp_path, tokenizer):
    cfg = _cfg(*_stream(_shard(tmp_path), "data.hard_negative_key=negs", "data.negatives_per_image=2"))
    batches = list(train_loader(cfg, tokenizer))
    for step, batch in enumerate(batches[:3]):  # records in tar order, 4 per batch
        assert batch.ids.shape[:2] == (4, 3)
        for row in range(4):
            i = 4 * step + row
            assert torch.equal(batch.ids[row, 0], _ids(tokenizer, f"photo {i}"))
            assert batch.negative_valid[row].tolist() == [j < i % 3 for j in range(2)]
            for j, text in enumerate(_negatives(i)):
                assert torch.equal(batch.ids[row, 1 + j], _ids(tokenizer, text))
    one = next(iter(train_loader(_cfg(*_stream(_shard(tmp_path), "data.hard_negative_key=negs",
                                                "data.negatives_per_image=1")), tokenizer)))
    assert one.ids.shape[:2] == (4, 2) and torch.equal(one.ids[2, 1], _ids(tokenizer, "not photo 2 but 0"))


def test_webdataset_swap_negatives_are_the_swaps_of_the_stream_captions(tmp_path, tokenizer):
    url = _shard(tmp_path, negatives=lambda i: [])
    cfg = _cfg(*_stream(url, "data.hard_negatives=swap"))
    batch = next(iter(train_loader(cfg, tokenizer)))
    assert batch.ids.shape[:2] == (4, 2) and not batch.negative_valid.any()  # "photo i": nothing to swap
    (tmp_path / "s").mkdir()
    with tarfile.open(tmp_path / "s" / "s.tar", "w") as tar:
        for i in range(4):
            buf = io.BytesIO()
            Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buf, "PNG")
            for name, data in ((f"{i}.png", buf.getvalue()), (f"{i}.txt", b"a red circle left of a blue square")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    batch = next(iter(train_loader(_cfg(*_stream(str(tmp_path / "s" / "s.tar"), "data.hard_negatives=swap")),
                                   tokenizer)))
    assert batch.negative_valid.all()
    for row in range(4):
        want = swap_caption("a red circle left of a blue square", cfg.seed, [0, 0, 0, row])
        assert torch.equal(batch.ids[row, 1], _ids(tokenizer, want))


def test_a_sample_with_a_malformed_negative_field_is_skipped_and_counted(tmp_path, tokenizer):
    url = _shard(tmp_path, negatives=lambda i: [3] if i == 1 else _negatives(i))
    cfg = _cfg(*_stream(url, "data.hard_negative_key=negs", "data.negatives_per_image=2", "data.bad_window=10",
                        "data.max_bad_fraction=0.5"))
    data = train_loader(cfg, tokenizer)
    batch = next(iter(data))
    assert torch.equal(batch.ids[1, 0], _ids(tokenizer, "photo 2")) and data.skipped == 1


def test_a_webdataset_run_with_negatives_trains_and_resumes_bitwise(tmp_path):
    cfg = _cfg(*_stream(_shard(tmp_path), "data.hard_negative_key=negs", "data.negatives_per_image=2"),
               "train.checkpoint_every=3", "train.log_every=1")
    rows, again = metrics_then_resumed(cfg, tmp_path / "run")
    assert len(rows) == 6 and again == rows and "clip/acc_hard" in rows[0]


def test_inspect_counts_negatives_per_image(tmp_path, capsys):
    for argv in (["data", "inspect", _csv(tmp_path), "--caption-separator", "|", "--hard-negative-key", "negs"],
                 ["data", "inspect", _jsonl(tmp_path), "--hard-negative-key", "negs"],
                 ["data", "inspect", _shard(tmp_path), "--hard-negative-key", "negs"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "negatives/img min 0, mean 1.0, max 2" in out, out
    assert main(["data", "inspect", _shard(tmp_path), "--json"]) == 0
    assert "negatives_per_image" not in json.loads(capsys.readouterr().out)


def test_the_start_up_block_says_what_texts_an_image_has(tmp_path, capsys):
    assert _train(tmp_path, _sets(_csv(tmp_path), "train.steps=1")) == 0
    rows = {line.split()[0]: line.split(None, 1)[1] for line in capsys.readouterr().err.splitlines()
            if line.startswith("  ")}
    assert rows["texts"] == "hard negatives: 'negs', 0–2 per image (mean 1.0)", rows
    assert main(["train", "--preset", "micro", "--out", str(tmp_path / "swap"), "--no-progress", "--no-eval",
                 "--set", "objective.name=clip", "--set", "data.hard_negatives=swap", "--set", "train.steps=1",
                 "--set", "data.caption_choice=first"]) == 0
    assert "  texts  " in (err := capsys.readouterr().err)
    assert "captions: first; hard negatives: a swap of the caption (1 slot)" in err, err


def test_the_caption_and_negative_slots_read_the_file_once(tmp_path, monkeypatch):
    from nclip.data import csv_source
    from nclip.data.loader import slot_counts

    cfg = _cfg(*_sets(_csv(tmp_path)), "data.caption_choice=all")
    reads = []
    real = csv_source.CsvTrainPairs.__init__

    def counted(self, *args, **kwargs):
        reads.append(1)
        real(self, *args, **kwargs)

    monkeypatch.setattr(csv_source.CsvTrainPairs, "__init__", counted)
    assert slot_counts(cfg) == (1, 2) and len(reads) == 1  # one caption a row, at most two negatives
    assert slot_counts(_cfg("data.hard_negatives=swap")) == (None, 1) and len(reads) == 1  # nothing to read
