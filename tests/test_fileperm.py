"""Files 0666 and folders 0777 less the umask, also where written atomically through a temporary
(issue 28.8: under umask 022 a run was 0600 files in 0700 folders, unreadable to colleagues)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from nclip import fileperm
from nclip.cli import main

from conftest import MICRO_OVERRIDES


@pytest.fixture(params=[0o022, 0o027])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)) + ("/" if p.is_dir() else ""): stat.S_IMODE(p.stat().st_mode)
            for p in [root, *root.rglob("*")]}


def test_umask_is_read_without_changing_it(umask):
    assert fileperm.umask() == umask and fileperm.umask() == umask


def test_settle_gives_the_modes_of_open_and_mkdir(tmp_path, umask):
    import tempfile

    fd, path = tempfile.mkstemp(dir=tmp_path)  # 0600 and 0700 whatever the umask
    os.close(fd)
    folder = tempfile.mkdtemp(dir=tmp_path)
    fileperm.settle(path)
    fileperm.settle(folder)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o777 & ~umask


def test_atomic_writes_respect_the_umask(tmp_path, umask):
    from nclip.eval.cache import FeatureCache
    from nclip.models.io import atomic_dir
    from nclip.train.teacher import _write

    with atomic_dir(tmp_path / "model") as tmp:
        (tmp / "weights.bin").write_bytes(b"0")
    _write(tmp_path / "teacher" / "feats.safetensors", {"a": 1}, torch.zeros(2, 3))
    FeatureCache(tmp_path / "cache", "w")._write(tmp_path / "cache" / "e.safetensors", {"b": 2}, {"x": torch.zeros(2)})
    modes = _modes(tmp_path)
    del modes["./"]  # pytest's own folder
    want = {k: 0o777 & ~umask if k.endswith("/") else 0o666 & ~umask for k in modes}
    assert modes == want


@pytest.mark.slow
def test_a_run_directory_under_umask_022_is_0644_files_in_0755_folders(tmp_path, capsys):
    old = os.umask(0o022)
    try:
        run = tmp_path / "R"
        sets = [x for o in MICRO_OVERRIDES for x in ("--set", o)]
        assert main(["train", "--preset", "micro", "--out", str(run), "--no-progress", *sets,
                     "--set", "train.steps=3"]) == 0, capsys.readouterr().err
        (run / "hf").mkdir(mode=0o700)  # the user's own folder: export keeps its mode
        assert main(["export", "--checkpoint", str(run), "--hf", str(run / "hf")]) == 0
    finally:
        os.umask(old)
    modes = _modes(run)
    assert "checkpoints/step_00000003/state.pt" in modes and "model/" in modes and "eval.json" in modes
    assert "hf/model.safetensors" in modes and modes.pop("hf/") == 0o700
    assert {k: v for k, v in modes.items() if v != (0o755 if k.endswith("/") else 0o644)} == {}
