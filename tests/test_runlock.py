"""One writer per run directory (docs/runs.md, issue 28.1): an exclusive flock on ``R/.nclip.lock``
taken before the directory is read, held to the end, released however the holder exits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from nclip.cli import main
from nclip.errors import NclipError
from nclip.runlock import LOCK_NAME, DirLock

from conftest import MICRO_OVERRIDES

SRC = str(Path(__file__).resolve().parents[2] / "src")
ENV = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}

# holds the lock on argv[1] until argv[2] exists (or is killed), saying "locked" once it holds it
HOLDER = textwrap.dedent("""
    import os, sys, time
    from nclip.runlock import DirLock
    with DirLock(sys.argv[1], "test holder"):
        print("locked", flush=True)
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.02)
""")


def _holder(run: Path, stop: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), str(stop)], env=ENV, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_writer_is_refused_in_one_line_while_the_first_holds_the_lock(tmp_path):
    run = tmp_path / "R"
    holder = _holder(run, tmp_path / "stop")
    try:
        with pytest.raises(NclipError, match=r"--out .*R is in use by another nclip process \(pid \d+ .*test holder"):
            DirLock(run, "nclip train").acquire()
    finally:
        (tmp_path / "stop").touch()
        holder.wait(10)
    assert holder.returncode == 0
    assert not run.exists()  # released: the lock file and the directory it made are gone
    with DirLock(run, "nclip train"):  # and now it is free
        assert (run / LOCK_NAME).read_text().startswith(f"pid {os.getpid()} ")


def test_a_dead_holders_lock_file_is_stale_and_taken_over(tmp_path):
    """SIGKILL leaves the lock file behind, but the kernel has released its flock."""
    run = tmp_path / "R"
    run.mkdir()
    (run / "notes.txt").write_text("mine\n")
    holder = _holder(run, tmp_path / "never")
    holder.send_signal(signal.SIGKILL)
    holder.wait(10)
    assert "test holder" in (run / LOCK_NAME).read_text()  # the stale file is still there
    with DirLock(run, "nclip train"):
        assert "nclip train" in (run / LOCK_NAME).read_text()
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]  # a directory it did not make is kept


def test_processes_started_together_get_the_lock_one_at_a_time(tmp_path):
    """Many processes released at once: never two holders, each sees itself alone in the directory."""
    run, go = tmp_path / "R", tmp_path / "go"
    script = textwrap.dedent("""
        import os, sys, time
        from nclip.errors import NclipError
        from nclip.runlock import DirLock
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.001)
        try:
            with DirLock(sys.argv[1], "racer"):
                mark = os.path.join(sys.argv[1], "holder")
                assert not os.path.exists(mark)
                open(mark, "w").close()
                time.sleep(0.3)
                os.unlink(mark)
        except NclipError as e:
            print(e, file=sys.stderr)
            sys.exit(2)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(run), str(go)], env=ENV, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    time.sleep(1.0)  # every racer imported and waiting
    go.touch()
    results = [(p.wait(30), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in results)[0] == 0 and {rc for rc, _ in results} <= {0, 2}, results
    assert 1 <= sum(rc == 0 for rc, _ in results) and all("in use by another nclip process" in err
                                                          for rc, err in results if rc == 2), results
    assert not run.exists()


def test_train_into_a_locked_directory_is_refused_before_anything_is_written(tmp_path, capsys):
    run = tmp_path / "R"
    with DirLock(run, "nclip export"):  # another process's lock, as far as flock is concerned
        code = main(["train", "--preset", "micro", "--out", str(run), "--no-progress", "--no-eval",
                     *[x for o in MICRO_OVERRIDES for x in ("--set", o)]])
        assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is in use by another nclip process" in err[0], err
    assert f"pid {os.getpid()}" in err[0] and "nclip export" in err[0]


# the real CLI, with every process held at the door of the run directory until all have arrived
# (or 20 s passed): whoever decides first, the others must not decide in the same moment
RACER = textwrap.dedent("""
    import os, sys, time
    from nclip.train import rundir
    door, me, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    check = rundir._check_request
    def at_the_door(*args):
        open(os.path.join(door, me), "w").close()
        t = time.time()
        while len(os.listdir(door)) < n and time.time() - t < 20:
            time.sleep(0.001)
        return check(*args)
    rundir._check_request = at_the_door
    from nclip.cli import main
    sys.exit(main(sys.argv[4:]))
""")


@pytest.mark.slow
def test_two_trainings_started_together_on_one_out_one_wins(tmp_path):
    run, door = tmp_path / "R", tmp_path / "door"
    door.mkdir()
    sets = [x for o in MICRO_OVERRIDES for x in ("--set", o)]
    procs = {seed: subprocess.Popen(
        [sys.executable, "-c", RACER, str(door), f"seed{seed}", "2", "train", "--preset", "micro", "--out", str(run),
         "--no-progress", "--no-eval", *sets, "--set", "train.steps=2", "--set", f"seed={seed}"],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in (1, 2)}
    out = {seed: (p.wait(240), p.stderr.read()) for seed, p in procs.items()}
    codes = sorted(rc for rc, _ in out.values())
    assert codes == [0, 2], out
    winner = next(seed for seed, (rc, _) in out.items() if rc == 0)
    loser_err = [line for line in out[3 - winner][1].splitlines() if line.strip()]
    assert len(loser_err) == 1 and "in use by another nclip process" in loser_err[0], out
    assert "Traceback" not in out[3 - winner][1]
    # the run is the winner's alone: its config.yaml, its model, its checkpoints
    assert yaml.safe_load((run / "config.yaml").read_text())["seed"] == winner
    assert json.loads((run / "model" / "config.json").read_text())["seed"] == winner
    assert not (run / LOCK_NAME).exists()
