"""`nclip embed` / `nclip search` / `nclip.Index`: the shards hold what `nclip.load(M).encode_image`
and `encode_text` give, the metadata lines up with them, the Faiss index ranks as brute-force cosine,
a killed run continues to the same files, and bad inputs are one line with exit status 2."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import nclip
from nclip.cli import main
from nclip.config import resolve
from nclip.embed import model as embed_model
from nclip.embed.index import Index
from nclip.models import build_model
from nclip.models.io import save_model

from conftest import MICRO_OVERRIDES, decompression_bomb_png

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROWS, SHARD, BATCH = 40, 16, 8
COLOURS = ["red", "green", "blue", "yellow", "white"]


def _run(tmp, name: str, seed: int):
    """A run directory whose model has random weights moved off their initial values."""
    cfg = resolve("micro", list(MICRO_OVERRIDES) + ["objective.name=clip"])
    torch.manual_seed(seed)
    model = build_model(cfg, pretrained_text=False).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    save_model(model, cfg, tmp / name / "model")
    return tmp / name


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(run, captions CSV, uninterrupted embedding directory) shared by the tests."""
    tmp = tmp_path_factory.mktemp("embed")
    run = _run(tmp, "run", 0)
    rng = np.random.default_rng(0)
    (tmp / "images").mkdir()
    lines = ["image,caption"]
    for i in range(ROWS):  # RGB, RGBA and P files: each becomes RGB where the model's convention converts it
        image = Image.fromarray(rng.integers(0, 256, (20 + i % 7, 24, 3 + (i % 3 == 1)), dtype=np.uint8))
        (image.quantize(colors=16) if i % 3 == 2 else image).save(tmp / "images" / f"{i}.png")
        lines.append(f"images/{i}.png,picture {i} of a {COLOURS[i % 5]} thing")
    (tmp / "pairs.csv").write_text("\n".join(lines) + "\n")
    out = tmp / "full"
    assert main(_embed_args(run, tmp / "pairs.csv", out)) == 0
    return run, tmp / "pairs.csv", out


def _embed_args(run, spec, out, *extra):
    return ["embed", str(spec), "--checkpoint", str(run), "--out", str(out), "--shard-size", str(SHARD),
            "--batch-size", str(BATCH), "--no-progress", "--device", "cpu", *extra]


def _metadata(out):
    return [json.loads(line) for line in (out / "metadata.jsonl").read_text().splitlines()]


def test_shards_are_nclip_load_embeddings_in_float16(setup):
    run, csv, out = setup
    doc = json.loads((out / "manifest.json").read_text())
    assert doc["complete"] and doc["rows"] == ROWS and [s["rows"] for s in doc["shards"]] == [16, 16, 8]
    assert doc["model"]["sha256"] == embed_model.resolve(run).sha256
    images = [np.load(out / s["images"]) for s in doc["shards"]]
    texts = [np.load(out / s["texts"]) for s in doc["shards"]]
    assert all(a.dtype == np.float16 for a in images + texts)
    rows = _metadata(out)
    assert [r["row"] for r in rows] == list(range(ROWS))
    assert [r["path"] for r in rows] == [str(csv.parent / "images" / f"{i}.png") for i in range(ROWS)]
    assert [r["caption"] for r in rows] == [f"picture {i} of a {COLOURS[i % 5]} thing" for i in range(ROWS)]
    model = nclip.load(run, device="cpu")
    want_images = model.encode_image([Image.open(r["path"]) for r in rows]).numpy()
    want_texts = model.encode_text([r["caption"] for r in rows]).numpy()
    assert np.abs(np.concatenate(images).astype(np.float32) - want_images).max() < 1e-3
    assert np.abs(np.concatenate(texts).astype(np.float32) - want_texts).max() < 1e-3


def test_faiss_ranks_as_brute_force_cosine(setup):
    _, _, out = setup
    index = nclip.Index.open(out)
    assert isinstance(index, Index) and len(index) == ROWS
    stored = index.embeddings("images")
    assert stored.shape == (ROWS, index.manifest["dim"]) and index.embeddings("texts").shape == stored.shape
    stored /= np.linalg.norm(stored, axis=1, keepdims=True)
    queries = np.random.default_rng(1).normal(size=(5, stored.shape[1])).astype(np.float32)
    for query, hits in zip(queries, index.search_vectors(queries, k=7)):
        cosine = stored @ (query / np.linalg.norm(query))
        assert [h.row for h in hits] == list(np.argsort(-cosine, kind="stable")[:7])
        assert np.allclose([h.score for h in hits], np.sort(cosine)[::-1][:7], atol=1e-5)


def test_search_cli_json_and_image_query(setup, capsys):
    run, _, out = setup
    caption = "picture 3 of a yellow thing"
    capsys.readouterr()
    assert main(["search", str(out), "--text", caption, "-k", "5", "--json", "--device", "cpu"]) == 0
    hits = json.loads(capsys.readouterr().out)
    stored = Index.open(out).embeddings()
    stored /= np.linalg.norm(stored, axis=1, keepdims=True)
    query = nclip.load(run, device="cpu").encode_text([caption]).numpy()[0]
    cosine = stored @ (query / np.linalg.norm(query))
    scores = [h["score"] for h in hits]
    assert len(hits) == 5 and scores == sorted(scores, reverse=True)
    assert [h["row"] for h in hits] == list(np.argsort(-cosine)[:5])
    assert np.allclose(scores, np.sort(cosine)[::-1][:5], atol=1e-4)
    # an image in the index finds itself first (cosine 1 up to float16 storage)
    own = _metadata(out)[11]["path"]
    assert main(["search", str(out), "--image", own, "-k", "3", "--json", "--device", "cpu"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert hits[0]["row"] == 11 and hits[0]["path"] == own and hits[0]["score"] > 0.999
    assert main(["search", str(out), "--image", own, "-k", "2", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and own in lines[0] and "picture 11 of a green thing" in lines[0]


def _dies_on_batch(monkeypatch, n: int) -> None:
    """The n-th batch the encoder is given raises KeyboardInterrupt (as a Ctrl-C or kill would stop it)."""
    encode, calls = embed_model.Encoder.images, []

    def dies(self, pixels):
        calls.append(len(pixels))
        if len(calls) == n:
            raise KeyboardInterrupt
        return encode(self, pixels)

    monkeypatch.setattr(embed_model.Encoder, "images", dies)


def _same_files(a, b) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert sorted(p.name for p in b.iterdir()) == names
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_kill_after_first_shard_then_rerun_gives_the_same_files(setup, tmp_path, monkeypatch, capsys):
    run, csv, full = setup
    out = tmp_path / "killed"
    with monkeypatch.context() as patch:
        _dies_on_batch(patch, 3)  # shard 0 is batches 1 and 2
        assert main(_embed_args(run, csv, out)) == 130
    doc = json.loads((out / "manifest.json").read_text())
    assert not doc["complete"] and len(doc["shards"]) == 1 and not (out / ".nclip.lock").exists()
    assert main(["search", str(out), "--text", "x"]) == 2  # unfinished: refused in one line
    assert "unfinished" in capsys.readouterr().err
    assert main(_embed_args(run, csv, out)) == 0
    _same_files(full, out)
    assert main(_embed_args(run, csv, out)) == 0  # finished: nothing to do
    assert "nothing to do" in capsys.readouterr().err


def _one_line_error(capsys, argv, *words):
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err


def test_another_models_or_settings_dir_is_refused_unless_force(setup, tmp_path, capsys):
    run, csv, full = setup
    other = _run(tmp_path, "other", 1)
    out = tmp_path / "out"
    assert main(_embed_args(run, csv, out)) == 0
    _one_line_error(capsys, _embed_args(other, csv, out), "another model")
    _one_line_error(capsys, _embed_args(run, csv, out, "--shard-size", "8"), "other settings", "shard_size")
    _one_line_error(capsys, ["search", str(out), "--text", "x", "--checkpoint", str(other)], "not the model")
    assert main(_embed_args(other, csv, out, "--force")) == 0
    assert json.loads((out / "manifest.json").read_text())["model"]["path"] == str(other.resolve())
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    _one_line_error(capsys, _embed_args(run, csv, tmp_path / "notes"), "not empty")


def test_bad_inputs_are_one_line(setup, tmp_path, capsys):
    run, csv, out = setup
    _one_line_error(capsys, _embed_args(tmp_path / "nowhere", csv, tmp_path / "a"), "checkpoint not found")
    _one_line_error(capsys, _embed_args(run, "nosuchkind:x", tmp_path / "a"), "unknown dataset")
    _one_line_error(capsys, _embed_args(run, csv, tmp_path / "a", "--batch-size", "0"), "--batch-size")
    _one_line_error(capsys, ["search", str(tmp_path), "--text", "x"], "manifest.json")
    _one_line_error(capsys, ["search", str(out), "--text", "x", "-k", "0"], "-k")
    (tmp_path / "fake.png").write_text("not an image")
    _one_line_error(capsys, ["search", str(out), "--image", str(tmp_path / "fake.png")], "is not an image")
    _one_line_error(capsys, ["search", str(out)], "--text")
    from nclip.runlock import DirLock

    with DirLock(tmp_path / "locked", "a test"):
        _one_line_error(capsys, _embed_args(run, csv, tmp_path / "locked"), "in use")


def test_webdataset_shards_resume_and_python_build(tmp_path, monkeypatch):
    """Training shards embed in tar order, with SHARD#KEY as the path and a record without an image
    left out (before the point a killed run resumes from); ``nclip.Index.build`` writes and opens."""
    import io
    import tarfile

    from nclip.data.shards import ShardWriter

    rng = np.random.default_rng(2)
    writer = ShardWriter(tmp_path / "shards", shard_size=6, image_format="png")
    for i in range(10):
        writer.write(rng.integers(0, 256, (18, 18, 3), dtype=np.uint8), f"shard caption {i}")
    writer.close()
    with tarfile.open(tmp_path / "shards" / "00000a.tar", "w") as tar:  # between the two: no image
        info = tarfile.TarInfo("lonely.txt")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"solo"))
    run = _run(tmp_path, "run", 0)
    options = dict(batch_size=4, shard_size=4, device="cpu", progress=False)
    index = nclip.Index.build(str(tmp_path / "shards"), run, tmp_path / "out", **options)
    assert len(index) == 10 and index.manifest["skipped_count"] == 1 and index.manifest["position"] == 11
    assert [r["caption"] for r in index.rows] == [f"shard caption {i}" for i in range(10)]
    assert index.rows[7]["path"].endswith("00001.tar#000010001")
    hits = index.search_text(["shard caption 4", "shard caption 5"], k=3)
    assert len(hits) == 2 and all(len(h) == 3 for h in hits)
    with monkeypatch.context() as patch:
        _dies_on_batch(patch, 3)  # after shards 0 and 1 (records 1-4, then 5, 6, the bad one, 7, 8)
        with pytest.raises(KeyboardInterrupt):
            nclip.Index.build(str(tmp_path / "shards"), run, tmp_path / "killed", **options)
    assert json.loads((tmp_path / "killed" / "manifest.json").read_text())["position"] == 9
    nclip.Index.build(str(tmp_path / "shards"), run, tmp_path / "killed", **options)
    _same_files(tmp_path / "out", tmp_path / "killed")


def test_import_nclip_leaves_index_lazy():
    code = ("import sys, nclip; assert 'torch' not in sys.modules; from nclip.embed.index import Index; "
            "assert nclip.Index is Index")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_help_and_early_mistakes_load_no_torch(tmp_path):
    """`nclip embed --help`, a bad --batch-size and a DIR without a manifest answer before torch loads."""
    code = ("import sys\nfrom nclip.cli import main\n"
            "for argv in (['embed', 'x', '--checkpoint', 'm', '--out', sys.argv[1], '--batch-size', '0'],"
            " ['search', sys.argv[1], '--text', 'x']):\n"
            "    assert main(argv) == 2, argv\n"
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'heavy import'\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 2 and "Traceback" not in done.stderr


def test_a_transformers_clip_directory_and_an_image_only_objective(setup, tmp_path, capsys):
    """Any model nclip.load takes: a transformers CLIPModel directory embeds as nclip.load encodes;
    an image-only objective (CMSF) embeds images only and refuses a text query in one line."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "models"))
    from hf_fixtures import save_tiny_clip

    _, csv, _ = setup
    save_tiny_clip(tmp_path / "hf")
    assert main(_embed_args(tmp_path / "hf", csv, tmp_path / "hf-emb")) == 0
    index = nclip.Index.open(tmp_path / "hf-emb")
    want = nclip.load(tmp_path / "hf", device="cpu").encode_image([Image.open(r["path"]) for r in index.rows])
    assert np.abs(index.embeddings() - want.numpy()).max() < 1e-3
    assert index.manifest["model"]["format"] == "transformers CLIPModel"
    assert [h.row for h in index.search_image(index.rows[5]["path"], k=1)] == [5]

    cfg = resolve("micro", list(MICRO_OVERRIDES) + ["objective.name=cmsf"])
    save_model(build_model(cfg, pretrained_text=False).eval(), cfg, tmp_path / "cmsf" / "model")
    assert main(_embed_args(tmp_path / "cmsf", csv, tmp_path / "cmsf-emb")) == 0
    doc = json.loads((tmp_path / "cmsf-emb" / "manifest.json").read_text())
    assert not doc["settings"]["texts"] and not list((tmp_path / "cmsf-emb").glob("texts-*"))
    _one_line_error(capsys, ["search", str(tmp_path / "cmsf-emb"), "--text", "x"], "image-only")
    assert main(["search", str(tmp_path / "cmsf-emb"), "--image", index.rows[2]["path"], "-k", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["row"] == 2


def _faiss_of(vectors: np.ndarray, path: Path) -> None:
    import faiss

    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(np.ascontiguousarray(vectors, dtype=np.float32))
    faiss.write_index(index, str(path))


# (id, damage(directory), words of the one line); each was a faiss or json traceback (or an
# IndexError at search) before the files were checked
DAMAGES = [
    ("index.faiss missing", lambda d: (d / "index.faiss").unlink(), ["index.faiss: not found"]),
    ("index.faiss garbage", lambda d: (d / "index.faiss").write_bytes(
        np.random.default_rng(0).bytes((d / "index.faiss").stat().st_size)), ["index.faiss: not a Faiss index"]),
    ("index.faiss truncated", lambda d: (d / "index.faiss").write_bytes((d / "index.faiss").read_bytes()[:300]),
     ["index.faiss: 300 bytes", "truncated"]),
    ("index.faiss of another dimension, same size", lambda d: _faiss_of(
        np.ones((ROWS // 2, 2 * Index.open(d).faiss.d)), d / "index.faiss"), ["vectors of", "dims, the manifest"]),
    ("index.faiss of another dimension", lambda d: _faiss_of(np.ones((ROWS, 3)), d / "index.faiss"),
     ["index.faiss:", "another directory's"]),
    ("metadata.jsonl truncated at a line", lambda d: (d / "metadata.jsonl").write_text(
        "".join((d / "metadata.jsonl").read_text().splitlines(True)[:30])), ["holds 30 rows, the manifest 40"]),
    ("metadata.jsonl truncated in a line", lambda d: (d / "metadata.jsonl").write_text(
        (d / "metadata.jsonl").read_text()[:1000]), ["metadata.jsonl: line", "is not a JSON object"]),
    ("metadata.jsonl malformed", lambda d: (d / "metadata.jsonl").write_text(
        (d / "metadata.jsonl").read_text().replace('"row": 7,', '"row": 7')), ["line 8 is not a JSON object"]),
    ("manifest without dim", lambda d: (d / "manifest.json").write_text(json.dumps(
        {k: v for k, v in json.loads((d / "manifest.json").read_text()).items() if k != "dim"})),
     ["manifest.json: its dim field"]),
]


@pytest.mark.parametrize("damage,words", [c[1:] for c in DAMAGES], ids=[c[0] for c in DAMAGES])
def test_a_damaged_directory_names_the_file_and_the_rebuild(setup, tmp_path, capsys, damage, words):
    """Search on a damaged directory is one line naming the file, and the command it gives
    (``nclip embed ... --force``) writes the directory again, after which search works."""
    import shlex
    import shutil

    run, csv, full = setup
    out = tmp_path / "emb"
    shutil.copytree(full, out)
    damage(out)
    rebuild = shlex.join(["nclip", "embed", f"captions:{csv}", "--checkpoint", str(run.resolve()),
                          "--shard-size", str(SHARD), "--batch-size", str(BATCH), "--out", str(out), "--force"])
    _one_line_error(capsys, ["search", str(out), "--text", "a red thing"], *words,
                    f"; rebuild the directory with: {rebuild}")
    assert main([*shlex.split(rebuild)[1:], "--device", "cpu", "--no-progress"]) == 0
    assert _metadata(out) == _metadata(full)
    assert main(["search", str(out), "--text", "a red thing", "-k", "2"]) == 0


def test_a_truncated_shard_is_one_line_when_read(setup, tmp_path, monkeypatch, capsys):
    """Search reads the index, not the shards: a truncated shard is met by ``Index.embeddings``
    and by an ``nclip embed`` that continues a killed run (which indexes the shards at its end)."""
    import shutil

    from nclip.errors import NclipError

    run, csv, full = setup
    shutil.copytree(full, tmp_path / "emb")
    shard = tmp_path / "emb" / "images-00001.npy"
    shard.write_bytes(shard.read_bytes()[:200])
    with pytest.raises(NclipError, match="images-00001.npy: not a readable .npy array.*--force$"):
        Index.open(tmp_path / "emb").embeddings()
    killed = tmp_path / "killed"
    with monkeypatch.context() as patch:
        _dies_on_batch(patch, 5)  # after shards 0 and 1 (two batches each)
        assert main(_embed_args(run, csv, killed)) == 130
    shard = killed / "images-00001.npy"
    shard.write_bytes(shard.read_bytes()[:200])
    _one_line_error(capsys, _embed_args(run, csv, killed), "images-00001.npy: not a readable .npy array", "--force")


def test_a_decompression_bomb_is_a_bad_image_like_any_other(setup, tmp_path, capsys):
    """Embedding refuses an image it cannot read in one line naming it (a bomb as a corrupt file),
    and so does a search by it; training skips and counts it (tests/data/test_bad_samples.py)."""
    run, csv, _ = setup
    for i in range(6):
        (tmp_path / "imgs" / ("cat", "owl")[i % 2]).mkdir(parents=True, exist_ok=True)
        (tmp_path / "imgs" / ("cat", "owl")[i % 2] / f"{i}.png").write_bytes(
            (csv.parent / "images" / f"{i}.png").read_bytes())
    bomb = tmp_path / "imgs" / "cat" / "bomb.png"
    decompression_bomb_png(bomb)
    _one_line_error(capsys, _embed_args(run, f"folder:{tmp_path / 'imgs'}", tmp_path / "emb"),
                    f"cannot read image {bomb}: Image size (400000000 pixels) exceeds limit")
    _one_line_error(capsys, ["search", str(setup[2]), "--image", str(bomb)], f"{bomb} is not an image",
                    "DecompressionBombError")


def test_a_shard_record_with_a_huge_caption_is_left_out_and_counted(setup, tmp_path, capsys):
    """A tar header claiming an 8 GiB caption: the record is left out unread (listed in the
    manifest, as a record without an image is), the shards around it embed."""
    import tarfile

    from nclip.data.shards import ShardWriter

    run = setup[0]
    rng = np.random.default_rng(3)
    with ShardWriter(tmp_path / "shards", shard_size=3, image_format="png") as writer:
        for i in range(6):
            writer.write(rng.integers(0, 256, (18, 18, 3), dtype=np.uint8), f"caption {i}")
    with open(tmp_path / "shards" / "00000a.tar", "wb") as fh:
        info = tarfile.TarInfo("huge.txt")
        info.size = 8 << 30
        fh.write(info.tobuf(format=tarfile.GNU_FORMAT) + b"a caption".ljust(512, b"\0") + b"\0" * 1024)
    capsys.readouterr()
    assert main(_embed_args(run, tmp_path / "shards", tmp_path / "emb")) == 0
    assert "left out 1 shard records" in capsys.readouterr().err
    doc = json.loads((tmp_path / "emb" / "manifest.json").read_text())
    assert doc["rows"] == 6 and doc["skipped_count"] == 1
    assert "huge.txt claims 8,589,934,592 bytes, over the 1,048,576 a .txt member may hold" in doc["skipped"][0]
