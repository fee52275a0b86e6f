"""Loader workers under a temporary folder too deep for their Unix socket: one line and exit 2, never a
wait for a batch that was dropped (the suite once hung for CI's 90 minutes on it: the bench test's
scratch TMPDIR under a long pytest tmp path)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nclip.data import workers


def test_a_usual_temporary_folder_passes():
    workers.check_worker_socket_path()  # the suite's own TMPDIR: every loader test with workers runs here


def test_a_deep_tmpdir_is_refused_in_one_line_before_a_worker_starts(tmp_path):
    """In a fresh process: multiprocessing makes its temporary folder once per process. Before the
    check, this run waited forever for its first batch (the timeout turns that into a failure)."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    env = dict(os.environ, TMPDIR=str(deep))
    done = subprocess.run([sys.executable, "-m", "nclip", "train", "--preset", "micro", "--out", str(tmp_path / "run"),
                           "--set", "data.num_workers=1", "--set", "train.steps=2"],
                          capture_output=True, text=True, env=env, timeout=240)
    err = done.stderr.strip()
    assert done.returncode == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "TMPDIR" in err and f"allows {workers.SOCKET_PATH_MAX}" in err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's abstract socket names")
def test_an_abstract_socket_name_has_no_path_to_be_too_long(monkeypatch):
    import multiprocessing.connection

    monkeypatch.setattr(multiprocessing.connection, "arbitrary_address", lambda family: "\0listener-" + "x" * 200)
    workers.check_worker_socket_path()
