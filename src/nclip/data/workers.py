"""How many loader worker processes a rank runs, the DataLoader options that go with them, and the
one-line message of an error raised in a worker.

``data.num_workers`` unset (None) is "auto": 0 on the CPU, where a worker would take the cores the
step itself runs on (tests and CPU results stay those of the in-process loader), and on CUDA a
count from the cores this process may use, so that the input pipeline keeps the GPU busy.
"""

from __future__ import annotations

import os
import sys

import torch

from nclip.config import RunConfig
from nclip.errors import NclipError

AUTO_WORKERS_CAP = 8  # beyond this a worker per core mostly adds shared memory and start-up time
SOCKET_PATH_MAX = 103 if sys.platform == "darwin" else 107  # bytes of a Unix socket's path, less the NUL


def loader_workers(cfg: RunConfig, device: torch.device | str | None = None) -> int:
    """``data.num_workers``, or for None (auto): 0 off CUDA (on a CPU the workers would take the
    cores the step runs on), on CUDA the cores this process may run on per local rank (torchrun's
    ``LOCAL_WORLD_SIZE``), less one for the process that drives the GPU, between 1 and
    :data:`AUTO_WORKERS_CAP`."""
    if cfg.data.num_workers is not None:
        return cfg.data.num_workers
    if device is None or torch.device(device).type != "cuda":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    return max(1, min(AUTO_WORKERS_CAP, cores // local - 1))


def loader_options(workers: int, device: torch.device | str | None = None, seed: int = 0) -> dict:
    """DataLoader keyword arguments: ``workers`` processes kept for the whole run with two batches
    each in flight (:func:`init_worker` in each), pinned batches on CUDA (the copy to the GPU can
    then be asynchronous), and a generator of the loader's own seeded by ``seed``: starting an
    iterator draws the workers' base seed from it instead of from torch's global RNG, which a
    resumed run has just restored (a draw there would shift every later dropout draw)."""
    cuda = device is not None and torch.device(device).type == "cuda"
    if workers > 0:
        check_worker_socket_path()
    more = dict(persistent_workers=True, prefetch_factor=2, worker_init_fn=init_worker) if workers > 0 else {}
    return dict(num_workers=workers, pin_memory=cuda, generator=torch.Generator().manual_seed(seed), **more)


def check_worker_socket_path() -> None:
    """Refuse, in one line, a temporary folder too deep for the workers' batches to reach this process.

    A worker hands a batch over in shared memory whose file descriptors travel through a Unix socket
    that multiprocessing makes in its temporary folder (under TMPDIR). The kernel caps a socket's
    path (107 bytes on Linux); past it the worker's send fails in a background thread that only
    prints, the batch is dropped, and this process would wait for it forever."""
    from multiprocessing.connection import arbitrary_address

    if not hasattr(os, "fork"):  # no Unix sockets: Windows hands handles over another way
        return
    path = arbitrary_address("AF_UNIX")  # where a worker's socket will be (the folder is made now)
    if path.startswith("\0") or len(os.fsencode(path)) <= SOCKET_PATH_MAX:  # "\0": Linux's abstract names
        return
    raise NclipError(f"the temporary folder is too deep for data loader workers: their socket {path} is "
                     f"{len(os.fsencode(path))} bytes, the system allows {SOCKET_PATH_MAX}; set TMPDIR to a "
                     f"shorter folder (for example TMPDIR=/tmp) or data.num_workers=0")


def init_worker(worker_id: int) -> None:
    """One thread per worker: the workers are the parallelism. torch already sets one intra-op
    thread in a DataLoader worker; the tokenizer's own thread pool (one thread per core, in every
    worker) is turned off here, as ``tokenizers`` reads this variable at every batch."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def worker_message(e: Exception) -> str:
    """The original one-line message of an error re-raised by a DataLoader worker."""
    text = str(e)
    if "Original Traceback" not in text:
        return text
    last = [line for line in text.strip().splitlines() if line.strip()][-1]
    return last.split("NclipError: ", 1)[-1]
