"""Several captions per image (nclip.data.captions): a CSV cell split by data.caption_separator, a JSONL
list, WebDataset .txt members and .json lists; data.caption_choice random / first / all, the same on any
number of workers and ranks and on resume; `nclip data inspect`'s captions per image; evaluation on the
training file; one-line errors for bad input."""

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
from nclip.data.loader import train_loader
from nclip.data.shards import Bad, Record, decode, decode_captions, iter_records
from nclip.data.tokenization import CaptionTokenizer
from nclip.errors import NclipError
from nclip.eval.datasets import caption_file

from conftest import metrics_then_resumed, micro_sizes

N = 12  # rows; row i has 1 + i % 3 captions


def _captions(i: int) -> list[str]:
    return [f"photo {i} caption {c}" for c in range(1 + i % 3)]


@pytest.fixture(scope="module")
def tokenizer():
    return CaptionTokenizer(16)


def _cfg(*extra):
    return resolve("micro", [*micro_sizes(), "train.batch_size=4", "train.steps=8", *extra])


def _images(root, n: int = N) -> None:
    rng = np.random.default_rng(0)
    (root / "img").mkdir(exist_ok=True)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(root / "img" / f"{i}.png")


def _csv(root, captions=_captions, sep: str = "|", name: str = "pairs.csv") -> str:
    _images(root)
    rows = ["filepath,title"] + [f"img/{i}.png,{sep.join(captions(i))}" for i in range(N)]
    (root / name).write_text("\n".join(rows) + "\n")
    return str(root / name)


def _jsonl(root, value=lambda i: _captions(i), name: str = "pairs.jsonl") -> str:
    _images(root)
    rows = [json.dumps({"filepath": f"img/{i}.png", "title": value(i)}) for i in range(N)]
    (root / name).write_text("\n".join(rows) + "\n\n")  # a blank line at the end is no row
    return str(root / name)


def _csv_cfg(path: str, *extra):
    return _cfg("data.source=csv", f"data.csv={path}", 'data.caption_separator="|"', *extra)


def _caption(data, step: int, index: int) -> str:
    """The caption the loader's dataset gives the key (step, index)."""
    return data.loader.dataset[(step, index)][1]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))


# ---------------------------------------------------------------------------------------------
# caption_choice random and first
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["csv", "jsonl"])
def test_random_draws_one_of_a_rows_captions_per_epoch_and_first_takes_the_first(tmp_path, tokenizer, source):
    path = _csv(tmp_path) if source == "csv" else _jsonl(tmp_path)
    data = train_loader(_csv_cfg(path) if source == "csv" else _cfg("data.source=csv", f"data.csv={path}"), tokenizer)
    assert data.loader.batch_sampler.epoch(2) == 0 and data.loader.batch_sampler.epoch(3) == 1  # 12 rows, 4 a step
    for i in range(N):
        assert _caption(data, 0, i) in _captions(i)
    assert _caption(data, 0, 2) == _caption(data, 2, 2)  # one draw per epoch
    assert {_caption(data, 3 * epoch, 2) for epoch in range(30)} == set(_captions(2))  # every caption in turn
    first = train_loader(_cfg("data.source=csv", f"data.csv={path}", "data.caption_choice=first",
                              *(['data.caption_separator="|"'] if source == "csv" else [])), tokenizer)
    assert [_caption(first, 3 * e, 2) for e in range(10)] == [_captions(2)[0]] * 10


def test_a_one_caption_file_trains_on_its_own_captions_in_sampler_order(tmp_path, tokenizer):
    path = _csv(tmp_path, captions=lambda i: [f"  a lone caption {i} "])
    data = train_loader(_cfg("data.source=csv", f"data.csv={path}"), tokenizer)  # random, nothing to draw
    sampler = data.loader.batch_sampler
    for step, batch in enumerate(data):
        rows = sampler.global_batch(step)
        ids, mask = tokenizer([f"a lone caption {i}" for i in rows])
        assert torch.equal(batch.ids, ids) and torch.equal(batch.mask, mask) and batch.caption_valid is None


def test_the_draw_is_the_same_on_any_workers_and_ranks_and_on_resume(tmp_path, tokenizer):
    cfg = _csv_cfg(_csv(tmp_path), "train.steps=9")
    full = list(train_loader(cfg, tokenizer))
    firsts = list(train_loader(_csv_cfg(str(tmp_path / "pairs.csv"), "train.steps=9", "data.caption_choice=first"),
                               tokenizer))
    assert any(not torch.equal(a.ids, b.ids) for a, b in zip(full, firsts))  # the draw picks other captions
    workers = list(train_loader(_csv_cfg(str(tmp_path / "pairs.csv"), "train.steps=9", "data.num_workers=2"),
                                tokenizer))
    assert len(workers) == 9 and all(_same(a, b) for a, b in zip(workers, full))
    halves = [list(train_loader(cfg, tokenizer, rank=r, world_size=2)) for r in range(2)]
    for step in range(9):  # the two ranks hold the halves of the same global batch, captions included
        parts = zip(halves[0][step].tensors(), halves[1][step].tensors(), full[step].tensors())
        assert all(torch.equal(torch.cat([first, second]), whole) for first, second, whole in parts)
    resumed = list(train_loader(cfg, tokenizer, start_step=5, state={"kind": "map", "skipped": 0}))
    assert len(resumed) == 4 and all(_same(a, b) for a, b in zip(resumed, full[5:]))


def test_a_run_with_random_captions_resumes_bitwise(tmp_path):
    cfg = _cfg("data.source=csv", f"data.csv={_jsonl(tmp_path)}", "objective.name=clip", "train.steps=4",
               "train.checkpoint_every=2", "train.log_every=1")
    rows, again = metrics_then_resumed(cfg, tmp_path / "run")
    assert len(rows) == 4 and again == rows


# ---------------------------------------------------------------------------------------------
# caption_choice all
# ---------------------------------------------------------------------------------------------


def test_all_gives_every_caption_in_slots_with_their_validity(tmp_path, tokenizer):
    path = _csv(tmp_path)
    data = train_loader(_csv_cfg(path, "data.caption_choice=all", "objective.name=clip"), tokenizer)
    sampler = data.loader.batch_sampler
    for step, batch in enumerate(data):
        rows = sampler.global_batch(step)
        assert batch.ids.shape == (4, 3, 16) and batch.mask.shape == (4, 3, 16)  # 3: the most captions of a row
        assert batch.caption_valid.tolist() == [[c < 1 + i % 3 for c in range(3)] for i in rows]
        for r, i in enumerate(rows):
            n = 1 + i % 3
            assert torch.equal(batch.ids[r, :n], tokenizer(_captions(i))[0])
    capped = next(iter(train_loader(_csv_cfg(path, "data.caption_choice=all", "data.captions_per_image=2",
                                             "objective.name=clip"), tokenizer)))
    assert capped.ids.shape == (4, 2, 16) and capped.caption_valid.sum(1).max() == 2  # the first two kept


def test_all_splits_over_ranks_and_resumes(tmp_path, tokenizer):
    cfg = _csv_cfg(_csv(tmp_path), "data.caption_choice=all", "objective.name=clip", "train.steps=5")
    full = list(train_loader(cfg, tokenizer))
    halves = [list(train_loader(cfg, tokenizer, rank=r, world_size=2)) for r in range(2)]
    for step in range(5):
        parts = zip(halves[0][step].tensors(), halves[1][step].tensors(), full[step].tensors())
        assert all(torch.equal(torch.cat([first, second]), whole) for first, second, whole in parts)
    resumed = list(train_loader(cfg, tokenizer, start_step=3))
    assert all(_same(a, b) for a, b in zip(resumed, full[3:]))


def test_all_trains_clip_and_resumes_bitwise(tmp_path):
    cfg = _csv_cfg(_csv(tmp_path), "data.caption_choice=all", "objective.name=clip", "train.steps=4",
                   "train.checkpoint_every=2", "train.log_every=1")
    rows, again = metrics_then_resumed(cfg, tmp_path / "run")
    assert len(rows) == 4 and again == rows and all(np.isfinite(r["loss"]) for r in rows)


@pytest.mark.parametrize("extra,needle", [
    (["objective.name=xclip"], "objective 'xclip' takes one caption per image"),
    (["objective.name=nclip"], "objective 'nclip' takes one caption per image"),
    (["objective.name=siglip"], "objective 'siglip' takes one caption per image"),
])
def test_an_objective_without_several_positives_refuses_all_in_one_line(tmp_path, capsys, extra, needle):
    path = _csv(tmp_path)
    sets = ["data.source=csv", f"data.csv={path}", 'data.caption_separator="|"', "data.caption_choice=all", *extra]
    assert main(["train", "--preset", "micro", "--out", str(tmp_path / "run"), "--no-progress", "--no-eval",
                 *[a for o in sets for a in ("--set", o)]]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err, err


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sets,needle", [
    (["data.caption_choice=all", "objective.name=clip"], "needs a source with several captions per image"),
    (['data.caption_separator="|"'], "data.caption_separator splits the captions of a CSV/JSONL file"),
    (["data.source=csv", "data.csv=x.csv", "data.caption_separator=|"], "data.caption_separator is empty; quote"),
    (["data.json_caption_key=captions"], "data.json_caption_key names a field of WebDataset"),
    (["data.captions_per_image=3"], "data.captions_per_image sizes the caption slots"),
    (["data.source=webdataset", "data.shards=x.tar", "data.caption_choice=all", "objective.name=clip"],
     "data.caption_choice all on WebDataset needs data.captions_per_image"),
])
def test_caption_settings_that_cannot_apply_are_one_line(sets, needle):
    with pytest.raises((NclipError, ValueError)) as e:
        _cfg(*sets)
    assert needle in str(e.value)


@pytest.mark.parametrize("kind,needle", [
    ("empty list", "line 3: field 'title': the caption list is empty"),
    ("not strings", "line 3: field 'title': the caption list holds 3 (int); expected strings only"),
    ("a number", "line 3: field 'title': the caption must be a string or a list of strings, got 2.5 (float)"),
    ("separator never found", "data.caption_separator ';' is found in no caption"),
])
def test_bad_caption_input_is_one_line_with_exit_2(tmp_path, capsys, kind, needle):
    sets = []
    if kind == "separator never found":
        path, sets = _csv(tmp_path), ["data.caption_separator=;"]
    else:
        bad = {"empty list": [], "not strings": ["fine", 3], "a number": 2.5}[kind]
        path = _jsonl(tmp_path, value=lambda i: bad if i == 2 else _captions(i))
    sets = ["data.source=csv", f"data.csv={path}", *sets]
    assert main(["train", "--preset", "micro", "--out", str(tmp_path / "run"), "--no-progress", "--no-eval",
                 *[a for o in sets for a in ("--set", o)]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nclip: error: ") and needle in err and "\n" not in err, err


def test_a_row_whose_captions_are_all_empty_is_a_bad_row_replaced_by_the_next(tmp_path, tokenizer):
    path = _csv(tmp_path, captions=lambda i: [" ", ""] if i == 4 else _captions(i))
    data = train_loader(_csv_cfg(path), tokenizer)
    image, caption, bad, _, _, _ = data.loader.dataset[(0, 4)]
    assert caption in _captions(5) and bad == [(f"{path} row 6 ({tmp_path}/img/4.png)", "empty caption")]


# ---------------------------------------------------------------------------------------------
# WebDataset
# ---------------------------------------------------------------------------------------------


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _shard(path, members) -> str:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def _caption_shard(tmp_path) -> str:
    """6 samples: sample k has k % 3 + 1 captions, as .txt members and as a .json list."""
    members = []
    for k in range(6):
        captions = [f"sample {k} text {c}" for c in range(k % 3 + 1)]
        members += [(f"{k:04d}.png", _png(k)), (f"{k:04d}.txt", captions[0].encode())]
        members += [(f"{k:04d}.{c}.txt", t.encode()) for c, t in enumerate(captions[1:], start=1)]
        members += [(f"{k:04d}.json", json.dumps({"captions": captions, "caption": captions[0]}).encode())]
    return _shard(tmp_path / "caps.tar", members)


def test_a_shard_samples_captions_come_from_its_txt_members_or_a_json_list(tmp_path):
    records = list(iter_records(_caption_shard(tmp_path)))
    for k, rec in enumerate(records):
        want = tuple(f"sample {k} text {c}" for c in range(k % 3 + 1))
        assert decode_captions(rec)[1] == want and decode_captions(rec, "captions")[1] == want
        assert decode(rec)[1] == want[0]  # the one-caption reader: the .txt member
        assert decode_captions(rec, "caption")[1] == want[:1]
    png = _png(0)
    for parts, key, reason in [
        ({"png": png, "json": b'{"captions": []}'}, "captions", "the caption list is empty"),
        ({"png": png, "json": b'{"captions": ["a", null]}'}, "captions", "the caption list holds null"),
        ({"png": png, "json": b'{"other": "a"}'}, "captions", "no field 'captions' (data.json_caption_key)"),
        ({"png": png, "json": b"{broken"}, "captions", "is not valid JSON"),
        ({"png": png, "txt": b" ", "1.txt": b""}, None, "empty caption"),
    ]:
        out = decode_captions(Record("k", "u", parts), key)
        assert isinstance(out, Bad) and reason in out.reason, (parts, out)


@pytest.mark.parametrize("json_key", [None, "captions"])
def test_webdataset_streams_choose_among_a_samples_captions(tmp_path, tokenizer, json_key):
    url = _caption_shard(tmp_path)
    keys = [f"data.json_caption_key={json_key}"] if json_key else []
    base = ["data.source=webdataset", f"data.shards={url}", "data.shuffle_buffer=0", "data.num_workers=0",
            "train.batch_size=2", "train.steps=60", *keys]
    texts = [[f"sample {k} text {c}" for c in range(k % 3 + 1)] for k in range(6)]
    first = list(train_loader(_cfg(*base, "data.caption_choice=first"), tokenizer))
    drawn = list(train_loader(_cfg(*base), tokenizer))
    assert torch.equal(first[0].ids, tokenizer([texts[0][0], texts[1][0]])[0])  # records in tar order
    picked = {k: set() for k in range(6)}
    for step, batch in enumerate(drawn):
        for row in range(2):
            k = (2 * step + row) % 6
            options = [tokenizer([t])[0][0] for t in texts[k]]
            match = [c for c, ids in enumerate(options) if torch.equal(batch.ids[row], ids)]
            assert match, (step, row)
            picked[k].add(match[0])
    assert picked[2] == {0, 1, 2} and picked[0] == {0}  # every caption in turn; one caption: always it
    again = list(train_loader(_cfg(*base), tokenizer))
    assert all(_same(a, b) for a, b in zip(again, drawn))
    every = next(iter(train_loader(_cfg(*base, "data.caption_choice=all", "data.captions_per_image=3",
                                        "objective.name=clip"), tokenizer)))
    assert every.ids.shape == (2, 3, 16) and every.caption_valid.tolist() == [[True, False, False], [True, True, False]]


# ---------------------------------------------------------------------------------------------
# inspect and evaluation
# ---------------------------------------------------------------------------------------------


def test_inspect_reports_captions_per_image(tmp_path, capsys):
    csv_path, jsonl = _csv(tmp_path), _jsonl(tmp_path)
    for argv in (["data", "inspect", csv_path, "--caption-separator", "|"], ["data", "inspect", jsonl],
                 ["data", "inspect", _caption_shard(tmp_path)]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "captions/img  min 1, mean 2.0, max 3" in out, out
    assert main(["data", "inspect", csv_path, "--json"]) == 0  # no separator: one caption per cell
    summary = json.loads(capsys.readouterr().out)
    assert summary["captions_per_image"] == {"min": 1, "mean": 1.0, "max": 1} and summary["good"] == N


@pytest.mark.parametrize("source", ["csv", "jsonl"])
def test_evaluation_on_the_training_file_takes_every_caption_as_ground_truth(tmp_path, source):
    path = _csv(tmp_path) if source == "csv" else _jsonl(tmp_path)
    keys = _csv_cfg(path).data.caption_keys() if source == "csv" else ("filepath", "title", None)
    data = caption_file(path, run_keys=keys)
    test = data.splits["test"]
    assert [tuple(test.captions[i]) for i in range(N)] == [tuple(_captions(i)) for i in range(N)]
    if source == "csv":  # without the run's separator a cell is one caption
        assert caption_file(path, run_keys=keys[:2]).splits["test"].captions[2] == ("|".join(_captions(2)),)
        assert data.identity["caption_separator"] == "|"


def test_the_memory_check_probes_every_caption_slot(tmp_path):
    from nclip.models import build_model
    from nclip.train.memory_check import probe_batch

    cfg = _csv_cfg(_csv(tmp_path), "data.caption_choice=all", "objective.name=clip")
    batch = probe_batch(build_model(cfg), cfg, 4, 1, None, torch.device("cpu"))
    assert batch.ids.shape[:2] == (4, 3) and batch.caption_valid.all()  # 3: the most captions of a row
    capped = cfg.model_copy(update={"data": cfg.data.model_copy(update={"captions_per_image": 2})})
    assert probe_batch(build_model(capped), capped, 4, 1, None, torch.device("cpu")).ids.shape[:2] == (4, 2)
