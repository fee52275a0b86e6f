"""Helpers of the bench tests: model builds counted, and a scratch HOME to count the bytes written.
(Not a conftest.py: tests import the root conftest's helpers as ``conftest``.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def count_builds(monkeypatch) -> list:
    """Every build_model call in this process, the trainer's and the bench's (both reach
    nclip.models.build_model: the trainer through nclip.train.loop, the bench through
    nclip.bench.shared_models), one entry each."""
    import nclip.models
    import nclip.train.loop

    calls = []
    real = nclip.models.build_model

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    for module in (nclip.train.loop, nclip.models):
        monkeypatch.setattr(module, "build_model", counted)
    return calls


def _written_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def scratch_home(tmp_path, monkeypatch, request) -> dict:
    """An empty working directory, HOME and TMPDIR for this process and its subprocesses, and
    ``written()``: the bytes passed to write() by this process and its finished subprocesses so far
    (Linux's /proc/self/io wchar: files, pipes and terminal output); skipped where that is missing.
    TMPDIR is a new folder beside the suite's own, not under ``tmp_path``: a loader worker's socket
    lives in it, and a path as deep as pytest's tmp paths can pass the kernel's limit for one
    (nclip.data.workers.check_worker_socket_path)."""
    import multiprocessing.util
    import shutil
    import tempfile

    if not os.path.exists("/proc/self/io"):
        pytest.skip("counts the bytes written through /proc/self/io (Linux)")
    dirs = {name: tmp_path / name for name in ("cwd", "home")}
    for d in dirs.values():
        d.mkdir()
    multiprocessing.util.get_temp_dir()  # this process's folder for loader sockets: made once, not in scratch
    dirs["tmp"] = Path(tempfile.mkdtemp(prefix="nclip-scratch-"))
    request.addfinalizer(lambda: shutil.rmtree(dirs["tmp"], ignore_errors=True))
    if os.environ.get("PYTHONPATH"):  # a relative one (PYTHONPATH=src) keeps naming the same folders
        paths = os.environ["PYTHONPATH"].split(os.pathsep)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(os.path.abspath(p) for p in paths))
    monkeypatch.chdir(dirs["cwd"])
    monkeypatch.setenv("HOME", str(dirs["home"]))
    monkeypatch.setenv("TMPDIR", str(dirs["tmp"]))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    return {**dirs, "written": _written_bytes}
