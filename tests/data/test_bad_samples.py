"""Bad training samples, one policy for every source (nclip.data.bad_samples): skipped, counted,
named on stderr at the first skip and then at power-of-two counts, summed up at the end of the
batches; a class folder's unreadable image is skipped like a bad CSV row (issue 28.6)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from nclip.config import resolve
from nclip.data.bad_samples import SkipLog
from nclip.data.loader import train_loader
from nclip.data.tokenization import CaptionTokenizer

from conftest import decompression_bomb_png, micro_sizes


def _cfg(*extra):
    return resolve("micro", [*micro_sizes(), "train.batch_size=8", "train.threads=1", *extra])


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("nclip: warning:")]


def test_a_csv_with_missing_images_warns_at_the_first_skip_and_sums_up_at_the_end(tmp_path, capsys):
    rng = np.random.default_rng(0)
    (tmp_path / "img").mkdir()
    rows = ["filepath,title"]
    for i in range(40):
        if i % 2 == 0:  # half the images exist
            Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(tmp_path / "img" / f"{i}.png")
        rows.append(f"img/{i}.png,picture {i}")
    csv = tmp_path / "pairs.csv"
    csv.write_text("\n".join(rows) + "\n")
    cfg = _cfg("data.source=csv", f"data.csv={csv}", "train.steps=3", "data.max_bad_fraction=0.9")
    data = train_loader(cfg, CaptionTokenizer(cfg.data.text_length))
    next(iter(data))  # the first batch: its skips are named
    first = _warnings(capsys.readouterr().err)
    assert first and "skipped a bad sample" in first[0] and str(csv) in first[0] and "image not found" in first[0]
    assert ".png" in first[0] and len(first) <= 1 + int(np.log2(max(data.skipped, 1)))  # rate-limited
    data = train_loader(cfg, CaptionTokenizer(cfg.data.text_length))
    assert len(list(data)) == 3 and data.skipped > 0
    lines = _warnings(capsys.readouterr().err)
    counts = [n for n in range(1, data.skipped + 1) if n & (n - 1) == 0]  # 1, 2, 4, 8, ...
    assert len(lines) == len(counts) + 1, lines
    summary = lines[-1]
    assert f"{data.skipped} bad samples of {csv} skipped in this run" in summary and "image not found" in summary


@pytest.mark.parametrize("damage,reason", [
    (lambda path: path.write_bytes(b"not a png at all"), "cannot read image"),
    (decompression_bomb_png, "cannot read image: Image size (400000000 pixels) exceeds limit"),  # a traceback once
], ids=["corrupt", "decompression bomb"])
def test_a_folder_with_one_corrupt_image_skips_it_with_a_warning(tmp_path, capsys, damage, reason):
    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (tmp_path / c).mkdir()
        for i in range(6):
            Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(tmp_path / c / f"{i}.png")
    corrupt = tmp_path / "dog" / "3.png"
    damage(corrupt)
    cfg = _cfg("data.source=folder", f"data.folder={tmp_path}", "train.steps=4", "data.max_bad_fraction=0.5")
    data = train_loader(cfg, CaptionTokenizer(cfg.data.text_length))
    batches = list(data)  # 4 steps of 8 from 12 images: the corrupt one is drawn
    assert len(batches) == 4 and all(len(b) == 8 for b in batches) and data.skipped >= 1
    lines = _warnings(capsys.readouterr().err)
    assert str(corrupt) in lines[0] and reason in lines[0]
    assert "skipped in this run" in lines[-1] and str(corrupt) in lines[-1]


def test_skip_log_lines_come_at_the_first_skip_then_at_powers_of_two():
    lines = []
    log = SkipLog("data.csv x.csv", write=lines.append)
    log.add([(f"row {i}", "image not found") for i in range(100)])
    assert len(lines) == 7  # 1, 2, 4, 8, 16, 32, 64
    assert "row 0: image not found" in lines[0] and lines[-1].startswith("nclip: warning: 64 bad samples")
    summary = log.summary()
    assert "100 bad samples of data.csv x.csv" in summary and summary.endswith("row 4 (image not found), ...")
    assert SkipLog("x").summary() is None


def test_a_shard_record_that_does_not_decode_is_named_too(tmp_path, capsys):
    import io
    import tarfile

    from nclip.data.shards import ShardWriter

    rng = np.random.default_rng(0)
    with ShardWriter(tmp_path / "ok", 20, "png") as w:
        for i in range(20):
            w.write(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8), f"pair {i}")
    bad = tmp_path / "bad.tar"
    with tarfile.open(bad, "w") as tar:
        for name, data in (("b0.jpg", b"\xff\xd8 garbage"), ("b0.txt", b"a caption")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    cfg = _cfg("data.source=webdataset", f"data.shards={[*map(str, w.paths), str(bad)]}", "data.resampled=false",
               "data.shuffle_buffer=0", "train.steps=4")
    data = train_loader(cfg, CaptionTokenizer(cfg.data.text_length))
    assert len(list(data)) == 4 and data.skipped >= 1
    lines = _warnings(capsys.readouterr().err)
    assert f"{bad} b0: image does not decode" in lines[0] and "skipped in this run" in lines[-1]
