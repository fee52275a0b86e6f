"""How many intra-op threads a training process computes with: ``train.threads``.

torch's default takes every core the machine has. When another process keeps one of two cores busy, the
two OpenMP threads of every operation wait on each other and a CPU step runs about 4× slower than with
one thread (``--preset tiny``: 26 against 109 samples/s, the same losses). ``auto`` therefore takes the
cores this process may run on (its CPU affinity), shared among torchrun's local ranks, less the data
workers and less the cores other processes keep busy now, and at least one. "Now" is a fifth of a second
of ``/proc/stat``, not the one-minute load average: that average lags, so a run started right after
``pip install`` (``make demo``) counted the finished install as a busy core and trained an idle machine on
one thread. Where there is no ``/proc/stat`` (macOS) the load average stands in. The start-up block gives
the count and, where busy cores took threads away, a line naming the setting.
Where the environment sets ``OMP_NUM_THREADS`` (torchrun sets 1 for several ranks per machine; a job
script or a test suite may pin it), ``auto`` takes that count instead: a number the user chose. A number
is used as it is; ``null`` leaves torch's default.
"""

from __future__ import annotations

import os
import time

import torch

SAMPLE_SECONDS = 0.2

# the last decision of set_threads, for the start-up block
last_decision: dict = {}


def process_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def cpu_times(cores: set[int], path: str = "/proc/stat") -> tuple[int, int] | None:
    """(busy, total) clock ticks so far, summed over ``cores``, from ``/proc/stat``; None without it.
    Idle and waiting on I/O count as not busy."""
    try:
        with open(path) as stat:
            lines = stat.read().splitlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, *ticks = line.split() or [""]
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores and len(ticks) >= 8):
            continue
        values = [int(t) for t in ticks[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(values)
        busy += sum(values) - values[3] - values[4]
    return (busy, total) if total else None


def busy_cores(seconds: float = SAMPLE_SECONDS) -> int:
    """Cores of this process's affinity that other processes keep busy now: ``/proc/stat`` sampled over
    ``seconds`` while this process sleeps, rounded to whole cores; the one-minute load average where
    there is no ``/proc/stat``, and 0 where there is neither."""
    try:
        cores = os.sched_getaffinity(0)
    except AttributeError:
        cores = set()
    before = cpu_times(cores)
    if before is not None:
        time.sleep(seconds)
        after = cpu_times(cores)
        if after is not None and after[1] > before[1]:
            return int(round(len(cores) * (after[0] - before[0]) / (after[1] - before[1])))
    try:
        return int(round(os.getloadavg()[0]))
    except (AttributeError, OSError):
        return 0


def omp_threads() -> int | None:
    """``OMP_NUM_THREADS`` where the environment sets it to a positive count."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) >= 1 else None


def auto_threads(cores: int, local_ranks: int, workers: int, busy: int) -> int:
    """``auto``'s thread count: this rank's share of ``cores``, less its ``workers`` and its share of the
    ``busy`` cores, at least 1."""
    share = cores // max(local_ranks, 1)
    return max(1, share - workers - busy // max(local_ranks, 1))


def set_threads(setting: int | str | None, cfg, device) -> None:
    """Set torch's intra-op threads for ``train.threads`` of the run ``cfg`` on ``device`` (whose data
    workers :func:`nclip.data.workers.loader_workers` counts)."""
    from nclip.data.workers import loader_workers

    workers = loader_workers(cfg, device)
    last_decision.clear()
    if setting is None:
        return
    if setting == "auto" and omp_threads() is not None:
        threads = omp_threads()
        last_decision.update(threads=threads, omp=True)
    elif setting == "auto":
        cores, busy = process_cores(), busy_cores()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = auto_threads(cores, local, workers, busy)
        idle = auto_threads(cores, local, workers, 0)
        last_decision.update(threads=threads, cores=cores, busy=busy, idle=idle)
    else:
        threads = int(setting)
        last_decision.update(threads=threads)
    torch.set_num_threads(threads)


def describe(setting: int | str | None) -> str:
    """The start-up block's threads row."""
    if setting is None:
        return f"{torch.get_num_threads()} (torch's default)"
    if setting != "auto":
        return f"{setting} (train.threads)"
    d = last_decision
    if d.get("omp"):
        return f"{d['threads']} (auto: OMP_NUM_THREADS)"
    if "idle" not in d:  # a run built without set_threads (a test's)
        return f"{torch.get_num_threads()} (auto)"
    line = f"{d['threads']} (auto: {d['cores']} cores"
    if d["threads"] < d["idle"]:
        line += (f"; {d['busy']} busy with other processes, so {d['threads']} instead of {d['idle']}: "
                 "--set train.threads=N to choose")
    return line + ")"
