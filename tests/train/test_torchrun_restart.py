"""A 2-rank gloo job under torchrun whose worker is SIGKILLed after its first checkpoint: torchrun restarts
both ranks (--max-restarts 1), they meet again in a rendezvous of their own (the store prefixed by the
restart count: nclip.train.launch) and resume (--resume auto), and the job logs the metrics an uninterrupted
job logs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nclip.train.logbook import WALL_CLOCK

from conftest import micro_sizes

pytestmark = pytest.mark.slow

OVERRIDES = micro_sizes() + [
    "train.steps=16", "train.batch_size=16", "train.warmup_steps=2", "train.log_every=1",
    "train.checkpoint_every=4", "train.keep_checkpoints=3", "data.train_length=256", "train.threads=1",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
            "-m", "nclip", "train", "--preset", "micro", "--out", str(out), "--no-progress", "--no-eval",
            "--resume", "auto", *[x for o in OVERRIDES for x in ("--set", o)]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _rows(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        for key in WALL_CLOCK:
            r.pop(key, None)
    return rows


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds torchrun's workers in /proc")
def test_a_killed_worker_restarts_and_the_job_logs_the_uninterrupted_metrics(tmp_path):
    reference = _torchrun(tmp_path / "reference")
    assert reference.wait(timeout=600) == 0, reference.stderr.read()[-3000:]
    expected = _rows(tmp_path / "reference" / "metrics.jsonl")
    assert [r["step"] for r in expected] == list(range(1, 17))

    run = tmp_path / "killed"
    job = _torchrun(run)
    deadline, killed = time.monotonic() + 300, None
    while time.monotonic() < deadline and job.poll() is None and killed is None:
        if (run / "checkpoints").is_dir() and any((run / "checkpoints").iterdir()):
            workers = _children(job.pid)
            if len(workers) == 2:
                killed = workers[1]
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.01)
    assert killed is not None, "the job ended (or never checkpointed) before a worker was killed"
    assert job.wait(timeout=600) == 0, job.stderr.read()[-3000:]
    assert _rows(run / "metrics.jsonl") == expected
