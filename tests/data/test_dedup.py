"""dHash de-duplication (OmniBenchmark Sec. 3.4): bit layout, faiss search, the CLI and its errors."""

import json

import numpy as np
import pytest
from PIL import Image

from nclip.cli import main
from nclip.data.dedup import dhash_code, find_duplicates, hash_images, load_exclusions
from nclip.errors import NclipError


def _gradient(width=90, height=80, rising=True) -> Image.Image:
    row = np.linspace(0, 255, width) if rising else np.linspace(255, 0, width)
    return Image.fromarray(np.tile(row, (height, 1)).astype(np.uint8))


def _natural(seed: int, size=(160, 120)) -> Image.Image:
    """A smooth random RGB picture (an upsampled 8x6 noise image): natural-ish low frequencies."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize(size, Image.BICUBIC)


def _bits(code: np.ndarray) -> np.ndarray:
    return np.unpackbits(code).reshape(8, 8)


def test_dhash_bit_layout():
    # brightness rising to the right: every "right > left" comparison is 1 (imagehash's convention)
    assert _bits(dhash_code(_gradient())).all()
    assert not _bits(dhash_code(_gradient(rising=False))).any()
    # a 9x8 image is hashed as is: row r rises everywhere except one fall between columns r and r + 1,
    # so bit (r, c) is 0 exactly on the diagonal -- rows are bytes, the leftmost comparison the top bit
    pixels = np.tile(30 + np.arange(9, dtype=np.uint8) * 20, (8, 1))
    for r in range(8):
        pixels[r, r + 1] = pixels[r, r] - 10
    code = dhash_code(Image.fromarray(pixels))
    assert np.array_equal(_bits(code), 1 - np.eye(8, dtype=np.uint8))
    assert code[0] == 0b01111111 and code[7] == 0b11111110


def test_exact_and_resized_copies_found_distinct_not(tmp_path):
    originals = [_natural(s) for s in range(20)]
    ref = hash_images([(f"r{i}", lambda im=im: im.copy()) for i, im in enumerate(originals)])
    copies = [("same", originals[3]), ("half", originals[5].resize((80, 60))),
              ("double", originals[7].resize((320, 240))), ("new", _natural(100)), ("new2", _natural(101))]
    tgt = hash_images([(k, lambda im=im: im.copy()) for k, im in copies])
    found = {(tgt.ids[t], ref.ids[r]): d for t, r, d in find_duplicates(ref.codes, tgt.codes, 4)}
    assert found[("same", "r3")] == 0
    assert ("half", "r5") in found and ("double", "r7") in found
    assert not any(t.startswith("new") for t, _ in found)
    exact = find_duplicates(ref.codes, tgt.codes, 0)
    assert [(tgt.ids[t], ref.ids[r]) for t, r, _ in exact] == [("same", "r3")] + \
        [(k, r) for k, r in (("half", "r5"), ("double", "r7")) if found[(k, r)] == 0]


@pytest.mark.parametrize("method", ["flat", "hash"])
@pytest.mark.parametrize("d", [0, 3, 8, 13])
def test_faiss_radius_search_equals_brute_force(method, d):
    rng = np.random.default_rng(d)
    ref = rng.integers(0, 256, (300, 8), dtype=np.uint8)
    tgt = rng.integers(0, 256, (200, 8), dtype=np.uint8)
    # plant near copies so that every radius has hits: flip k random bits of some reference codes
    for i, k in enumerate(rng.integers(0, 16, 100)):
        bits = np.unpackbits(ref[i])
        bits[rng.choice(64, k, replace=False)] ^= 1
        tgt[i] = np.packbits(bits)
    tgt[100:110] = ref[200:210]  # exact copies
    tgt[110:115] = tgt[0]  # repeated targets
    ham = np.unpackbits(tgt[:, None, :] ^ ref[None, :, :], axis=2).sum(axis=2)  # [M, N]
    brute = sorted((int(t), int(r), int(ham[t, r])) for t, r in zip(*np.nonzero(ham <= d)))
    got = find_duplicates(ref, tgt, d, method=method)
    assert len(brute) > 10
    assert sorted(got) == brute
    assert got == sorted(got, key=lambda x: (x[0], x[2], x[1]))


def test_unreadable_images_are_listed(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png")
    out = hash_images([("good", lambda: _natural(0)), ("bad", lambda: Image.open(bad))], workers=2)
    assert out.ids == ["good"] and out.codes.shape == (1, 8)
    assert out.bad[0][0] == "bad" and "does not decode" in out.bad[0][1]


def test_load_exclusions(tmp_path):
    j = tmp_path / "duplicates.json"
    j.write_text(json.dumps([{"target": "a.jpg", "reference": "x", "distance": 0},
                             {"target": "b.jpg", "reference": "y", "distance": 2}]))
    assert load_exclusions(j) == {"a.jpg", "b.jpg"}
    t = tmp_path / "list.txt"
    t.write_text("# leave out\na.jpg\n\n  c.jpg \n")
    assert load_exclusions(t) == {"a.jpg", "c.jpg"}
    for text, needle in (("{}", "JSON list"), ("[{}]", "entry 0"), ("[1,", "invalid JSON")):
        j.write_text(text)
        with pytest.raises(NclipError, match=needle):
            load_exclusions(j)
    with pytest.raises(NclipError, match="not found"):
        load_exclusions(tmp_path / "nope.txt")


def _folders(tmp_path):
    ref, tgt = tmp_path / "ref" / "cats", tmp_path / "tgt"
    ref.mkdir(parents=True)
    tgt.mkdir()
    for i in range(6):
        _natural(i).save(ref / f"{i}.png")
    _natural(2).save(tgt / "copy.jpg", quality=95)
    _natural(4).resize((80, 60)).save(tgt / "small.png")
    _natural(50).save(tgt / "new.png")
    return tmp_path / "ref", tgt


def test_cli_end_to_end(tmp_path, capsys):
    ref, tgt = _folders(tmp_path)
    out = tmp_path / "out"
    assert main(["data", "dedup", "--reference", str(ref), "--target", str(tgt), "--max-distance", "4",
                 "--out", str(out), "--write-filtered"]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and "6 reference, 3 target images" in line and "images/s" in line
    rows = json.loads((out / "duplicates.json").read_text())
    pairs = {(r["target"], r["reference"]) for r in rows}
    assert pairs == {(str(tgt / "copy.jpg"), str(ref / "cats" / "2.png")),
                     (str(tgt / "small.png"), str(ref / "cats" / "4.png"))}
    assert all(isinstance(r["distance"], int) and 0 <= r["distance"] <= 4 for r in rows)
    assert (out / "filtered.txt").read_text() == f"{tgt / 'new.png'}\n"
    page = (out / "duplicates.html").read_text()
    assert page.count("data:image/png;base64,") == 4 and "showing 2 of 2 pairs" in page
    assert load_exclusions(out / "duplicates.json") == {str(tgt / "copy.jpg"), str(tgt / "small.png")}


def test_cli_csv_target_filtered(tmp_path, capsys):
    ref, tgt = _folders(tmp_path)
    csv = tmp_path / "pairs.csv"
    csv.write_text("filepath,title\ntgt/copy.jpg,a copy\ntgt/new.png,\"new, fresh\"\n")
    out = tmp_path / "out"
    assert main(["data", "dedup", "--reference", str(ref), "--target", str(csv), "--out", str(out),
                 "--write-filtered"]) == 0
    assert (out / "filtered.csv").read_text().splitlines() == ["filepath,title", 'tgt/new.png,"new, fresh"']


def test_cli_builtin_sources(tmp_path, capsys):
    # the same split against itself: every image is its own exact duplicate
    assert main(["data", "dedup", "--reference", "digits:test:30", "--target", "digits:test:30",
                 "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "duplicates.json").read_text())
    assert {("digits:test:%d" % i,) * 2 for i in range(30)} <= {(r["target"], r["reference"]) for r in rows}


@pytest.mark.parametrize("args, needle", [
    (["--reference", "{missing}", "--target", "{tgt}"], "not found"),
    (["--reference", "{ref}", "--target", "{tgt}", "--max-distance", "-1"], "--max-distance"),
    (["--reference", "{ref}", "--target", "{tgt}", "--max-distance", "65"], "--max-distance"),
    (["--reference", "{ref}", "--target", "{empty}"], "no images"),
    (["--reference", "{ref}", "--target", "{broken}"], "no readable images"),
    (["--reference", "{ref}", "--target", "{tgt}", "--write-filtered"], "needs --out"),
    (["--reference", "{ref}", "--target", "digits:nope"], "split"),
    (["--reference", "{ref}", "--target", "{tgt}", "--workers", "0"], "--workers"),
])
def test_cli_bad_input_one_line_exit_2(tmp_path, capsys, args, needle):
    ref, tgt = _folders(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "x.png").write_bytes(b"junk")
    paths = {"ref": ref, "tgt": tgt, "missing": tmp_path / "missing", "empty": tmp_path / "empty",
             "broken": tmp_path / "broken"}
    argv = ["data", "dedup"] + [a.format(**paths) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nclip: error: ") and needle in err, err
    assert "Traceback" not in err


def test_fast_jpeg_close_to_full_decoding(tmp_path):
    paths = []
    for i in range(5):
        paths.append(tmp_path / f"{i}.jpg")
        _natural(i, (500, 375)).save(paths[-1], quality=90)
    items = [(str(p), lambda p=p: Image.open(p)) for p in paths]
    full, fast = hash_images(items), hash_images(items, fast_jpeg=True)
    gaps = np.unpackbits(full.codes ^ fast.codes, axis=1).sum(axis=1)
    assert full.ids == fast.ids and gaps.max() <= 4


def test_training_loader_leaves_out_the_excluded_samples(tmp_path):
    """data.exclude: a built-in sample listed by its dedup identifier is never drawn for training,
    and the drawn items keep their own dataset index."""
    from nclip.config import resolve
    from nclip.data.loader import train_loader
    from nclip.data.tokenization import CaptionTokenizer

    excluded = set(range(0, 1212, 3))  # every third digit of the training split
    (tmp_path / "exclude.txt").write_text("# leaked\n" + "\n".join(f"digits:train:{i}" for i in excluded) + "\n")
    cfg = resolve("micro", ["data.source=digits", f"data.exclude={tmp_path / 'exclude.txt'}", "train.steps=40",
                            "objective.name=cmsf", "objective.constraint=cross_modal", "objective.bank_size=64"])
    from nclip.objectives.base import FrozenEmbedding, LabelRequest

    data = train_loader(cfg, CaptionTokenizer(cfg.data.text_length), views=2,
                        labels=LabelRequest(optional=True, frozen=FrozenEmbedding()))
    seen = {i for batch in data for i in batch.index.tolist()}
    assert seen and not seen & excluded and len(seen) > 600  # 40 × 16 draws over the 808 kept digits
    bad = tmp_path / "none.txt"
    bad.write_text("\n".join(f"digits:train:{i}" for i in range(1212)))
    with pytest.raises(NclipError, match="leaves no training sample"):
        train_loader(resolve("micro", ["data.source=digits", f"data.exclude={bad}"]), CaptionTokenizer(16))
