"""train.threads: auto takes this process's cores less its data workers and the cores other processes keep
busy, and the start-up block says so in one line naming the setting."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from nclip.config import resolve
from nclip.errors import NclipError
from nclip.train import threads

CFG = resolve("micro")  # no data workers on the CPU


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_auto_takes_the_cores_less_workers_busy_cores_and_local_ranks():
    assert threads.auto_threads(cores=2, local_ranks=1, workers=0, busy=0) == 2
    assert threads.auto_threads(cores=2, local_ranks=1, workers=0, busy=1) == 1
    assert threads.auto_threads(cores=2, local_ranks=1, workers=0, busy=5) == 1  # at least one
    assert threads.auto_threads(cores=16, local_ranks=2, workers=3, busy=0) == 5
    assert threads.auto_threads(cores=16, local_ranks=2, workers=3, busy=4) == 3


def test_the_default_is_auto_and_a_number_or_null_stay_accepted():
    assert resolve("micro").train.threads == "auto"
    assert resolve("micro", ["train.threads=3"]).train.threads == 3
    assert resolve("micro", ["train.threads=null"]).train.threads is None
    for bad in ("0", "many"):
        with pytest.raises(NclipError, match="train.threads"):
            resolve("micro", [f"train.threads={bad}"])


def test_a_busy_machine_gets_fewer_threads_and_the_start_up_line_names_the_setting(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS")  # the suite pins it (tests/conftest.py)
    monkeypatch.setattr(threads, "process_cores", lambda: 2)
    monkeypatch.setattr(threads, "busy_cores", lambda: 1)
    threads.set_threads("auto", CFG, "cpu")
    assert torch.get_num_threads() == 1
    line = threads.describe("auto")
    assert line.startswith("1 (auto: 2 cores; 1 busy with other processes") and "train.threads=N" in line
    monkeypatch.setattr(threads, "busy_cores", lambda: 0)
    threads.set_threads("auto", CFG, "cpu")
    assert torch.get_num_threads() == 2 and threads.describe("auto") == "2 (auto: 2 cores)"
    threads.set_threads(1, CFG, "cpu")
    assert torch.get_num_threads() == 1 and threads.describe(1) == "1 (train.threads)"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # set by the job (torchrun: 1 for several ranks)
    threads.set_threads("auto", CFG, "cpu")
    assert torch.get_num_threads() == 1 and threads.describe("auto") == "1 (auto: OMP_NUM_THREADS)"


def test_cpu_times_sum_the_busy_and_all_ticks_of_the_process_cores(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  30 0 10 50 10 0 0 0 0 0\n"
                    "cpu0 10 0 5 20 5 0 0 0 0 0\n"
                    "cpu1 20 0 5 30 5 0 0 0 0 0\n"
                    "intr 1 2 3\n")
    assert threads.cpu_times({0}, str(stat)) == (15, 40)
    assert threads.cpu_times({0, 1}, str(stat)) == (40, 100)
    assert threads.cpu_times({5}, str(stat)) is None
    assert threads.cpu_times({0}, str(tmp_path / "missing")) is None


def test_busy_cores_counts_what_is_busy_now_not_the_load_average(monkeypatch):
    # two samples 40 ticks apart on two cores, one of them busy throughout
    samples = iter([(100, 400), (120, 440)])
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "cpu_times", lambda cores: next(samples))
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (5.0, 5.0, 5.0))  # a finished install's lag
    assert threads.busy_cores(seconds=0) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_busy_cores_sees_a_process_spinning_on_one_of_our_cores():
    core = min(threads.os.sched_getaffinity(0))
    spin = f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    spinner = subprocess.Popen([sys.executable, "-c", spin])
    try:
        threads.time.sleep(0.3)
        assert threads.busy_cores(seconds=0.5) >= 1
    finally:
        spinner.kill()
        spinner.wait()
