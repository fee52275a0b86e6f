import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nclip.config import load_preset

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# `make test` runs the suite in parallel processes (pytest-xdist): each gets its share of the cores,
# so that two workers on two cores do not each start two threads
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
torch.set_num_threads(_THREADS)
# train.threads auto would follow the machine's load, which a parallel suite moves: runs that a test compares
# bitwise (in this process or in `nclip train` subprocesses) compute with one pinned count
os.environ["OMP_NUM_THREADS"] = str(_THREADS)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.passed_its_call = report.passed
    return report


@pytest.fixture(autouse=True)
def _free_the_disk_after_a_passing_test(request):
    """Delete a passing test's ``tmp_path`` as soon as it ends. A full run writes about 7 GB of
    run folders; kept to the end (pytest's retention), they filled a CI machine's disk."""
    yield
    path = request.node.funcargs.get("tmp_path")
    if path is not None and getattr(request.node, "passed_its_call", False):
        shutil.rmtree(path, ignore_errors=True)


def micro_sizes() -> list[str]:
    """The data and model sizes of presets/micro.yaml as overrides: with them any preset makes a
    seconds-long run. The one place the tests take their tiny sizes from."""
    raw = load_preset("micro")
    sizes = {"data": {k: v for k, v in raw["data"].items() if k != "source"}, "model": raw["model"]}
    return [f"{key}={json.dumps(value)}" for key, value in _leaves(sizes)]


# the objectives' own sizes that micro_sizes() cannot carry (they are fields of one objective's section),
# at the paper's by default: CMSF's memory bank of 128k rows (and ProtoNW's), ProtoCLIP's
# episode of 200k pairs and its 20k clusters. Small, but a bank still holds several batches and wraps.
MICRO_OBJECTIVE = {"bank_size": 64, "episode_size": 32, "clusters": 4}


def micro_objective(name: str) -> list[str]:
    """``objective.name=NAME`` and, of :data:`MICRO_OBJECTIVE`, the sizes that objective has: with
    :func:`micro_sizes`, a seconds-long run of any registered objective (the registry-wide tests)."""
    from nclip.objectives.registry import config_class

    fields = config_class(name).model_fields
    return [f"objective.name={name}", *(f"objective.{k}={v}" for k, v in MICRO_OBJECTIVE.items() if k in fields)]


def _leaves(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def decompression_bomb_png(path: Path, side: int = 20_000) -> None:
    """A 60-byte PNG whose header claims side x side pixels: PIL refuses it at open as a
    decompression bomb (DecompressionBombError, not an OSError)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b""))
                     + chunk(b"IEND", b""))


# micro sizes and a six-step schedule (also for module-scoped fixtures, which cannot use the
# function-scoped fixture below)
MICRO_OVERRIDES = (
    *micro_sizes(),
    "train.steps=6", "train.batch_size=8", "train.warmup_steps=1", "train.log_every=2",
    "train.checkpoint_every=3", "eval.samples=32", "eval.batch_size=32",
)


@pytest.fixture
def micro_overrides():
    """Overrides that make any preset a seconds-long run."""
    return list(MICRO_OVERRIDES)


def metrics_then_resumed(cfg, run: Path) -> tuple[list[dict], list[dict]]:
    """Train ``cfg`` into ``run``, then drop its newest checkpoint (as if killed just before it)
    and resume: the rows of metrics.jsonl after each, without the wall-clock ``samples_per_s``;
    equal lists mean the resume was exact."""
    import shutil

    from nclip.train.checkpoint import list_checkpoints
    from nclip.train.logbook import WALL_CLOCK
    from nclip.train.loop import train

    def rows() -> list[dict]:
        out = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        for r in out:
            for key in WALL_CLOCK:
                r.pop(key, None)
        return out

    train(cfg, run, progress=False, evaluate=False)
    first = rows()
    shutil.rmtree(list_checkpoints(run)[-1])
    train(cfg, run, resume=True, progress=False, evaluate=False)
    return first, rows()


def train_and_kill(args: list[str], metrics: Path, after_lines: int, timeout: float = 120.0) -> None:
    """Run ``nclip ARGS`` in a child process and SIGKILL it once ``metrics`` has ``after_lines``
    lines (a crash at an arbitrary step); fails if the run ends before it is killed."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "nclip", *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= after_lines:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it was killed: {proc.stderr.read()[-500:]!r}"


@pytest.fixture(scope="module")
def one_thread():
    """Micro models are all small ops: on a shared 2-core machine one thread is several times faster.
    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before, omp = torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # training's train.threads: auto follows it
    yield
    torch.set_num_threads(before)
    os.environ["OMP_NUM_THREADS"] = omp
