"""Every user mistake a new user meets in the first hour is one line on stderr and exit status 2,
never a traceback: one table, command x bad input (issue #16)."""

from __future__ import annotations

import json
import os

import pytest
from PIL import Image

from nclip.cli import main

# (id, argv, needle); placeholders: {tmp} a fresh folder, {file} a regular file in it, {ro} a folder
# without write permission, {model} an untrained micro model directory
CASES = [
    ("train --out below a file", ["train", "--preset", "micro", "--out", "{file}/run"], "is a file, not a folder"),
    ("eval --out below a file", ["eval", "--checkpoint", "{model}", "--out", "{file}/ev"], "is a file, not a folder"),
    ("compare --out below a file", ["eval", "compare", "{tmp}/ok.json", "--out", "{file}/t.md"],
     "is a file, not a folder"),
    ("write-shards --out below a file", ["data", "write-shards", "--count", "2", "--out", "{file}/s"],
     "is a file, not a folder"),
    ("sweep --out below a file", ["sweep", "--preset", "micro", "--grid", "train.lr=[0.1]", "--out", "{file}/s"],
     "is a file, not a folder"),
    ("train --out unwritable", ["train", "--preset", "micro", "--out", "{ro}/run"], "permission denied"),
    ("eval --out unwritable", ["eval", "--checkpoint", "{model}", "--out", "{ro}/ev"], "permission denied"),
    ("folder: class of one image", ["eval", "--checkpoint", "{model}", "--out", "{tmp}/ev", "--dataset",
                                    "folder:{tmp}/imgs", "--tasks", "linear", "--quiet"], "1 image; the seeded"),
    ("compare: results.json not UTF-8", ["eval", "compare", "{tmp}/latin1.json"], "not UTF-8 text"),
    ("compare: results.json truncated", ["eval", "compare", "{tmp}/truncated.json"], "invalid JSON"),
    ("resume: config.yaml not UTF-8", ["train", "--out", "{tmp}/run", "--resume", "auto"], "not UTF-8 text"),
    ("--preset file not UTF-8", ["train", "--preset", "{tmp}/latin1.yaml", "--out", "{tmp}/r"], "not UTF-8 text"),
    # issue 28.7: never a fresh run of a preset nobody named, nor of the library defaults
    ("--resume auto on a mistyped --out", ["train", "--out", "{tmp}/runn", "--resume", "auto"],
     "holds no run to continue (does not exist); check --out, or give --preset"),
    ("--resume auto on an empty --out", ["train", "--out", "{tmp}/empty", "--resume", "auto"],
     "holds no run to continue (has no config.yaml)"),
    ("--extend-to on an empty --out", ["train", "--out", "{tmp}/empty", "--extend-to", "10"],
     "--extend-to: {tmp}/empty holds no run to extend"),
    ("train: empty --preset file", ["train", "--preset", "{tmp}/empty.yaml", "--out", "{tmp}/r"],
     "empty.yaml: the file is empty"),
    ("config: empty --preset file", ["config", "--preset", "{tmp}/empty.yaml"], "empty.yaml: the file is empty"),
    ("captions: --caption-key not in the header", ["eval", "--checkpoint", "{model}", "--out", "{tmp}/ev",
                                                   "--dataset", "captions:{tmp}/pairs.csv", "--caption-key", "text",
                                                   "--tasks", "retrieval", "--quiet"],
     "--caption-key 'text' is not a column"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """An untrained micro model directory: evaluation errors need a checkpoint, not a trained one."""
    from nclip.config import resolve
    from nclip.models import build_model
    from nclip.models.io import save_model

    from conftest import micro_sizes

    cfg = resolve("micro", micro_sizes())
    return save_model(build_model(cfg, pretrained_text=False), cfg, tmp_path_factory.mktemp("m") / "model")


def _inputs(tmp) -> dict[str, str]:
    (tmp / "afile").write_text("not a folder\n")
    ro = tmp / "readonly"
    ro.mkdir()
    ro.chmod(0o500)
    for name, n in (("cat", 3), ("owl", 1)):
        (tmp / "imgs" / name).mkdir(parents=True)
        for i in range(n):
            Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(tmp / "imgs" / name / f"{i}.png")
    (tmp / "pairs.csv").write_text("filepath,title\nimgs/cat/0.png,a cat\nimgs/owl/0.png,an owl\n")
    (tmp / "ok.json").write_text(json.dumps({"results": {"zeroshot/x/top1": 0.5}}))
    (tmp / "latin1.json").write_bytes('{"results": {"zéro": 1}}'.encode("latin-1"))
    (tmp / "truncated.json").write_text(json.dumps({"results": {"zeroshot/x/top1": 0.5}}, indent=1)[:20])
    (tmp / "latin1.yaml").write_bytes("seed: 0  # café\n".encode("latin-1"))
    (tmp / "run").mkdir()
    (tmp / "empty").mkdir()
    (tmp / "empty.yaml").write_text("# nothing here yet\n")
    (tmp / "run" / "config.yaml").write_bytes("seed: 0  # café\n".encode("latin-1"))
    (tmp / "run" / "metrics.jsonl").write_text("")
    return {"tmp": str(tmp), "file": str(tmp / "afile"), "ro": str(ro)}


@pytest.mark.parametrize("argv,needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_user_errors_are_one_line_exit_2(argv, needle, tmp_path, model_dir, capsys):
    names = _inputs(tmp_path)
    if "{ro}" in " ".join(argv) and os.access(names["ro"], os.W_OK):
        pytest.skip("running as root: a folder without write permission is still writable")
    argv = [a.format(model=model_dir, **names) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle.format(**names) in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_under_torchrun_only_rank_0_says_it(monkeypatch, tmp_path, capsys):
    """Every rank meets the same error (rank 0 decides, nclip.train.rundir.agree); one line in all."""
    names = _inputs(tmp_path)
    for rank, lines in (("1", 0), ("0", 1)):
        monkeypatch.setenv("RANK", rank)
        assert main(["train", "--preset", "micro", "--out", f"{names['file']}/run"]) == 2
        assert len(capsys.readouterr().err.splitlines()) == lines
