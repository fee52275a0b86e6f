"""Real data: WebDataset shards (img2dataset layout) and CSV files — export, inspect, stream splits,
weighted mixing, bad samples, exact resume — and training on them."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from nclip.cli import main
from nclip.config import resolve
from nclip.data.loader import train_loader
from nclip.data.shards import Bad, ShardWriter, decode, decode_captions, encode_image, expand_shards, iter_records
from nclip.data.tokenization import CaptionTokenizer
from nclip.data.webdataset import Source, raw_stream
from nclip.errors import NclipError

from conftest import metrics_then_resumed

MICRO = [
    "data.image_size=16", "data.text_length=12", "model.vision.patch_size=8", "model.vision.width=16",
    "model.vision.layers=1", "model.vision.heads=2", "model.text.width=16", "model.text.layers=1",
    "model.text.heads=2", "model.embed_dim=16", "model.nclip_hidden=32", "model.nclip_dim=32",
    "train.batch_size=8", "train.warmup_steps=1", "train.log_every=1", "train.threads=1",
]


@pytest.fixture(scope="module")
def tokenizer():
    return CaptionTokenizer(12)


def _image(rng, h=20, w=24):
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


def _write(directory: Path, n: int, prefix: str = "pair", shard_size: int = 10, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    with ShardWriter(directory, shard_size, "png") as w:
        for i in range(n):
            w.write(_image(rng), f"{prefix} number {i}", {"i": i})
    return [str(p) for p in w.paths]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _cfg(*extra):
    return resolve("micro", MICRO + list(extra))


# --------------------------------------------------------------------------------------------
# export and inspect
# --------------------------------------------------------------------------------------------


def test_write_shards_and_inspect(tmp_path, capsys):
    out = tmp_path / "shards"
    assert main(["data", "write-shards", "--preset", "micro", "--count", "20", "--shard-size", "8",
                 "--out", str(out), "--format", "png"]) == 0
    assert f"wrote 20 samples to 3 shards: {out}/{{00000..00002}}.tar" in capsys.readouterr().out
    with tarfile.open(out / "00000.tar") as tar:
        names = tar.getnames()
    assert names[:3] == ["000000000.png", "000000000.txt", "000000000.json"] and len(names) == 24
    recs = list(iter_records(str(out / "00002.tar")))
    assert [r.key for r in recs] == ["000020000", "000020001", "000020002", "000020003"]
    image, caption, meta = decode(recs[0])
    assert image.shape == (16, 16, 3) and caption and meta["caption"] == caption
    assert set(meta["labels"]) >= {"shape", "colour"} and meta["split"] == "train"

    assert main(["data", "inspect", f"{out}/{{00000..00002}}.tar"]) == 0
    text = capsys.readouterr().out
    assert "shards        3" in text and "20 good, 0 bad" in text
    assert main(["data", "inspect", str(out), "--json", "--limit", "5"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["read"] == 5 and summary["image_width"]["max"] == 16 and len(summary["examples"]) == 3


def test_brace_expansion_and_lists():
    assert expand_shards("/d/{000..002}.tar") == ["/d/000.tar", "/d/001.tar", "/d/002.tar"]
    assert expand_shards(["/a/{0..1}.tar", "/b/x.tar"]) == ["/a/0.tar", "/a/1.tar", "/b/x.tar"]
    assert expand_shards("/a/0.tar::/b/{1,2}.tar") == ["/a/0.tar", "/b/1.tar", "/b/2.tar"]


# --------------------------------------------------------------------------------------------
# streams: rank/worker splits, weighted mixing
# --------------------------------------------------------------------------------------------


def _keys(stream, n):
    return [next(stream).key for _ in range(n)]


def test_shards_split_over_ranks_and_workers_without_resampling(tmp_path):
    src = Source("s", tuple(_write(tmp_path, 40, shard_size=10)), 1.0)  # 4 shards
    seen = []
    for rank in range(2):
        for worker in range(2):
            slot = rank * 2 + worker
            keys = _keys(raw_stream([src], 0, rank, worker, slot, 4, False, 0), 30)  # 3 passes over 1 shard
            assert len(set(keys)) == 10
            seen.append(set(keys))
    assert set().union(*seen) == {f"{s:05d}{i:04d}" for s in range(4) for i in range(10)}
    # one stream, every shard: each pass visits all 40 samples once, in a new shard order
    keys = _keys(raw_stream([src], 0, 0, 0, 0, 1, False, 0), 80)
    assert len(set(keys[:40])) == 40 and set(keys[40:]) == set(keys[:40]) and keys[:40] != keys[40:]


def test_sources_mix_by_weight_and_the_shuffle_buffer_shuffles(tmp_path):
    a = Source("a", tuple(_write(tmp_path / "a", 20, "alpha", seed=1)), 3.0)
    b = Source("b", tuple(_write(tmp_path / "b", 20, "beta", seed=2)), 1.0)
    recs = [r for r, _ in zip(raw_stream([a, b], 0, 0, 0, 0, 1, True, 0), range(800))]
    share_a = np.mean([r.url.startswith(str(tmp_path / "a")) for r in recs])
    assert 0.7 < share_a < 0.8
    plain = _keys(raw_stream([a], 0, 0, 0, 0, 1, False, 0), 20)
    shuffled = _keys(raw_stream([a], 0, 0, 0, 0, 1, False, 8), 20)
    assert plain != shuffled and len(set(shuffled)) > 12


# --------------------------------------------------------------------------------------------
# bad samples
# --------------------------------------------------------------------------------------------


def _damaged_shards(directory: Path) -> tuple[list[str], int]:
    """A shard of 40 good pairs with 4 bad ones among them, and a truncated shard: (urls, bad per pass)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    good = directory / "mixed.tar"
    with tarfile.open(good, "w") as tar:
        for i in range(40):
            _add(tar, f"k{i:03d}.jpg", encode_image(_image(rng), "jpg"))
            _add(tar, f"k{i:03d}.txt", f"good pair {i}".encode())
            if i == 10:
                _add(tar, "t010.jpg", encode_image(_image(rng), "jpg")[:60])  # truncated JPEG
                _add(tar, "t010.txt", b"truncated image")
            if i == 20:
                _add(tar, "e020.png", encode_image(_image(rng), "png"))
                _add(tar, "e020.txt", b"   ")  # empty caption
            if i == 30:
                _add(tar, "n030.jpg", b"this is not an image")
                _add(tar, "n030.txt", b"not an image")
                _add(tar, "m030.txt", b"caption without image")
    full = directory / "full.tar"
    with tarfile.open(full, "w") as tar:
        for i in range(10):
            _add(tar, f"f{i:03d}.png", encode_image(_image(rng), "png"))
            _add(tar, f"f{i:03d}.txt", f"tail pair {i}".encode())
    with tarfile.open(full) as tar:
        cut = tar.getmember("f006.png")
    data = full.read_bytes()
    (directory / "broken.tar").write_bytes(data[: cut.offset_data + cut.size // 2])  # cut mid-member
    full.unlink()
    return [str(good), str(directory / "broken.tar")], 5


def test_bad_samples_are_skipped_and_counted(tmp_path, tokenizer):
    urls, bad_per_pass = _damaged_shards(tmp_path)
    outcomes = [decode(r) for u in urls for r in iter_records(u)]
    reasons = sorted(o.reason.split(":")[0] for o in outcomes if isinstance(o, Bad))
    assert reasons == ["broken tar after member 'f006'", "empty caption", "image does not decode",
                       "image does not decode", "no image member (.jpg/.jpeg/.png/.webp)"]
    assert len(reasons) == bad_per_pass
    cfg = _cfg("data.source=webdataset", f"data.shards={urls}", "data.resampled=false", "data.shuffle_buffer=0",
               "train.steps=12")
    data = train_loader(cfg, tokenizer)
    batches = list(data)
    assert len(batches) == 12 and all(b.pixels.shape == (8, 3, 16, 16) for b in batches)
    consumed = data.state()["streams"][0][0]
    src = Source("s", tuple(urls), 1.0)
    expected_bad = sum(isinstance(decode(r), Bad) for r, _ in zip(raw_stream([src], 0, 0, 0, 0, 1, False, 0),
                                                                      range(consumed)))
    assert data.skipped == expected_bad and expected_bad >= bad_per_pass


def test_a_member_over_its_size_limit_is_a_bad_record_left_unread(tmp_path, monkeypatch, tokenizer):
    """A member is read whole into memory, so one over its limit (here a caption over a limit made
    small: an 8 GiB one in use) is a bad record, skipped and counted, and the record after it in
    the same tar still reads; a header claiming 8 GiB that the file does not hold ends the shard."""
    import nclip.data.shards as shards

    rng = np.random.default_rng(0)
    tar_path = tmp_path / "long.tar"
    with tarfile.open(tar_path, "w") as tar:
        for i in range(8):
            _add(tar, f"k{i}.png", encode_image(_image(rng), "png"))
            _add(tar, f"k{i}.txt", b"x" * (5000 if i == 3 else 20))
    monkeypatch.setattr(shards, "MAX_TEXT_BYTES", 4096)
    records = list(iter_records(str(tar_path)))
    assert [r.key for r in records] == [f"k{i}" for i in range(8)]
    assert [isinstance(r, Bad) for r in records] == [i == 3 for i in range(8)]
    assert records[3].reason == "member k3.txt claims 5,000 bytes, over the 4,096 a .txt member may hold"
    cfg = _cfg("data.source=webdataset", f"data.shards={[str(tar_path)]}", "data.resampled=false",
               "data.shuffle_buffer=0", "train.steps=2", "train.batch_size=4", "data.max_bad_fraction=0.5")
    data = train_loader(cfg, tokenizer)
    assert len(list(data)) == 2 and data.skipped == 1

    monkeypatch.undo()
    claims = tmp_path / "claims.tar"
    with open(claims, "wb") as fh:  # the header says 8 GiB, the file holds a few bytes
        info = tarfile.TarInfo("big.txt")
        info.size = 8 << 30
        fh.write(info.tobuf(format=tarfile.GNU_FORMAT) + b"a caption".ljust(512, b"\0") + b"\0" * 1024)
    (bad,) = iter_records(str(claims))
    assert isinstance(bad, Bad) and bad.reason.startswith("member big.txt claims 8,589,934,592 bytes, over the "
                                                          "1,048,576 a .txt member may hold; broken tar")


def test_too_many_bad_samples_stop_with_the_shard_name(tmp_path, tokenizer):
    rng = np.random.default_rng(0)
    good = _write(tmp_path / "ok", 30)
    bad = tmp_path / "bad.tar"
    with tarfile.open(bad, "w") as tar:
        for i in range(30):
            _add(tar, f"b{i:03d}.jpg", b"\xff\xd8 garbage" if i % 2 else encode_image(_image(rng), "jpg"))
            _add(tar, f"b{i:03d}.txt", b"some caption")
    cfg = _cfg("data.source=webdataset", f"data.shards={good + [str(bad)]}", "data.bad_window=40",
               "data.num_workers=1", "train.steps=50")
    with pytest.raises(NclipError) as err:
        list(train_loader(cfg, tokenizer))
    msg = str(err.value)
    assert "\n" not in msg and "too many bad samples" in msg and f"from shard {bad}" in msg, msg


# --------------------------------------------------------------------------------------------
# exact resume of the streams, through loader workers
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_stream_resumes_exactly_from_its_saved_position(tmp_path, tokenizer):
    urls = _write(tmp_path, 30, shard_size=7)
    cfg = _cfg("data.source=webdataset", f"data.shards={urls}", "data.shuffle_buffer=6", "data.num_workers=2",
               "train.steps=7")
    data = train_loader(cfg, tokenizer)
    full, saved = [], None
    for step, batch in enumerate(data):
        full.append(batch)
        if step == 2:  # the position after 3 steps, as a checkpoint at step 3 would hold it
            saved = data.state()
    assert saved["kind"] == "stream" and len(saved["streams"]) == 2
    resumed = list(train_loader(cfg, tokenizer, start_step=3, state=saved))
    assert len(resumed) == 4
    for a, b in zip(full[3:], resumed):
        for x, y in zip(a.tensors(), b.tensors()):
            assert torch.equal(x, y)
    # other world sizes / worker counts, or exact_resume off: re-seeded, valid, different data
    other = list(train_loader(_cfg("data.source=webdataset", f"data.shards={urls}", "data.shuffle_buffer=6",
                                   "data.num_workers=2", "train.steps=7", "data.exact_resume=false"),
                              tokenizer, start_step=3, state=saved))
    assert len(other) == 4 and not torch.equal(other[0].pixels, full[3].pixels)


@pytest.mark.slow
def test_training_on_shards_resumes_bitwise(tmp_path):
    urls, _ = _damaged_shards(tmp_path / "data")
    cfg = _cfg("data.source=webdataset", f"data.shards={urls}", "data.shuffle_buffer=16", "data.num_workers=2",
               "train.steps=6", "train.checkpoint_every=3")
    rows, again = metrics_then_resumed(cfg, tmp_path / "a")  # resumed from step 3
    assert rows[-1]["data/skipped"] > 0 and not (tmp_path / "a" / "eval.json").exists()
    assert again == rows


# --------------------------------------------------------------------------------------------
# CSV / TSV
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_csv_source_skips_bad_rows_and_trains(tmp_path, tokenizer):
    from PIL import Image

    rng = np.random.default_rng(0)
    (tmp_path / "img").mkdir()
    rows = ["path\tcaption"]
    for i in range(30):
        Image.fromarray(_image(rng)).save(tmp_path / "img" / f"{i}.png")
        rows.append(f"img/{i}.png\tpicture {i}")
    rows += ["img/missing.png\ta missing file", "img/3.png\t  "]  # two bad rows of 32
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("\n".join(rows) + "\n")
    cfg = _cfg("data.source=csv", f"data.csv={tsv}", "data.csv_image_key=path", "data.csv_caption_key=caption",
               "train.steps=8")
    data = train_loader(cfg, tokenizer)
    batches = list(data)
    assert len(batches) == 8 and all(b.pixels.shape == (8, 3, 16, 16) for b in batches)
    # every epoch (32 rows = 4 steps) draws both bad rows once; the missing file's stand-in is the
    # next row, the empty caption, so it is skipped too: 3 per epoch
    assert data.skipped == 3 * 2
    # step-indexed: a resumed loader gives the same batches
    later = list(train_loader(cfg, tokenizer, start_step=5, state=data.state()))
    assert all(torch.equal(a.pixels, b.pixels) for a, b in zip(batches[5:], later))
    assert main(["data", "inspect", str(tsv), "--image-key", "path", "--caption-key", "caption"]) == 0


def test_empty_shards_stop_with_a_clear_error(tmp_path, tokenizer):
    for i in range(2):
        with tarfile.open(tmp_path / f"{i}.tar", "w"):
            pass
    cfg = _cfg("data.source=webdataset", f"data.shards={tmp_path}/{{0..1}}.tar", "train.steps=2")
    with pytest.raises(NclipError, match=r"data.shards: no samples in \d+ shard reads in a row .*are the shards empty"):
        list(train_loader(cfg, tokenizer))


# --------------------------------------------------------------------------------------------
# data.exclude on shards: the sample keys `nclip data dedup --target SHARDS` writes
# --------------------------------------------------------------------------------------------


def test_dedup_of_shards_excluded_from_training_removes_exactly_those_samples(tmp_path, tokenizer, monkeypatch):
    import nclip.data.webdataset as webdataset

    urls = _write(tmp_path / "shards", 30, shard_size=10)  # 3 shards, keys SSSSSIIII
    ref = tmp_path / "benchmark"
    ref.mkdir()
    leaked = set()
    for url in urls[::2]:  # two images of shards 0 and 2 are also in the "benchmark"
        for rec in iter_records(url):
            if rec.key.endswith(("0002", "0007")):
                (ref / f"{rec.key}.png").write_bytes(rec.parts["png"])
                leaked.add(rec.key)
    assert main(["data", "dedup", "--reference", str(ref), "--target", str(tmp_path / "shards"),
                 "--out", str(tmp_path / "dedup")]) == 0
    duplicates = tmp_path / "dedup" / "duplicates.json"
    assert {d["target"] for d in json.loads(duplicates.read_text())} == leaked

    decoded = []  # every record the training stream decodes, by key

    def spy(rec, json_caption_key=None):
        decoded.append(rec.key)
        return decode_captions(rec, json_caption_key)

    monkeypatch.setattr(webdataset, "decode_captions", spy)
    cfg = _cfg("data.source=webdataset", f"data.shards={urls}", "data.resampled=false", "data.shuffle_buffer=4",
               f"data.exclude={duplicates}", "train.steps=7")  # 56 draws: two passes over the 26 kept samples
    data = train_loader(cfg, tokenizer)
    batches, saved = [], None
    for step, batch in enumerate(data):
        batches.append(batch)
        saved = data.state() if step == 2 else saved
    assert len(batches) == 7 and data.state()["streams"][0][0] == 56  # excluded records are not consumed
    everything = {rec.key for url in urls for rec in iter_records(url)}
    assert set(decoded) == everything - leaked and len(decoded) == 56
    # the decode-free replay of a resume skips the same records: the same batches follow
    resumed = list(train_loader(cfg, tokenizer, start_step=3, state=saved))
    assert len(resumed) == 4 and all(torch.equal(a.pixels, b.pixels) for a, b in zip(batches[3:], resumed))


def test_excluding_every_shard_sample_is_one_line(tmp_path, tokenizer):
    urls = _write(tmp_path, 12, shard_size=6)
    listed = tmp_path / "all.txt"
    listed.write_text("\n".join(rec.key for url in urls for rec in iter_records(url)) + "\n")
    cfg = _cfg("data.source=webdataset", f"data.shards={urls}", f"data.exclude={listed}", "train.steps=2")
    with pytest.raises(NclipError, match=r"data.shards: data.exclude leaves no sample in the 2 shard\(s\)"):
        list(train_loader(cfg, tokenizer))
