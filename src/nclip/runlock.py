"""One writer per directory: an exclusive advisory lock on a run (or export, or fine-tuning)
directory, held for the whole of the command that writes into it (docs/runs.md).

The lock is ``flock(LOCK_EX | LOCK_NB)`` on ``DIR/.nclip.lock``, taken *before* the directory is
read to decide what to do (:func:`nclip.train.rundir.plan_run`), so two processes started together
cannot both decide that the directory is theirs: the second is refused in one line that names the
holder. The kernel releases a flock when its holder exits, however it exits (SIGKILL and the OOM
killer included), so a lock file left behind by a dead process is stale by construction: the next
command locks it and writes its own name into it. A clean exit removes the file, and the
directories the lock itself created when nothing else was written into them.

Removing the file on release would let a waiter lock the removed file while a third process locks
a new one; so after locking, the holder checks that the path still names the file it locked, and
tries again if not.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
import time
from pathlib import Path

from nclip.errors import NclipError
from nclip.jsonio import check_writable_dir

LOCK_NAME = ".nclip.lock"


class DirLock:
    """``DirLock(path, "nclip train").acquire()`` ... ``release()``; or as a context manager."""

    def __init__(self, directory: str | Path, what: str, option: str = "--out"):
        self.directory, self.what, self.option = Path(directory).expanduser(), what, option
        self.fd: int | None = None
        self.created: list[Path] = []  # directories the lock made (removed again if left empty)

    @property
    def path(self) -> Path:
        return self.directory / LOCK_NAME

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc) -> bool:
        self.release()
        return False

    def acquire(self) -> DirLock:
        """Lock the directory (creating it), or raise a one-line NclipError if another process
        holds it. Calling it again while held does nothing."""
        if self.fd is not None:
            return self
        if self.directory.exists() and not self.directory.is_dir():
            raise NclipError(f"{self.option} {self.directory} is a file, not a directory")
        check_writable_dir(self.directory, self.option)
        while True:
            self._make_dirs()
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            except FileNotFoundError:  # a releasing holder removed the (empty) directory: make it again
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read(fd)
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise NclipError(f"{self.option} {self.directory} is in use by another nclip process "
                                     f"({holder or 'holder unknown'}); wait for it to finish, or use another "
                                     f"{self.option}") from None
                # a filesystem without locks (ENOLCK, EOPNOTSUPP): say so and go on unprotected
                print(f"nclip: warning: cannot lock {self.path} ({e.strerror}); make sure no other nclip "
                      f"process writes into {self.directory}", file=sys.stderr)
                return self
            if _same_file(fd, self.path):
                break
            os.close(fd)  # we locked a file its holder removed on release: lock the one at the path now
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}: {self.what}, since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file (while still holding it), unlock, and remove the directories the
        lock made if nothing else was written into them."""
        if self.fd is None:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self.fd)  # closing the last descriptor releases the flock
        self.fd = None
        for directory in reversed(self.created):
            try:
                directory.rmdir()
            except OSError:  # not empty (the run wrote into it), or already gone
                break
        self.created = []

    def _make_dirs(self) -> None:
        missing = []
        d = self.directory
        while not d.exists() and d.parent != d:
            missing.append(d)
            d = d.parent
        for d in reversed(missing):
            try:
                d.mkdir()
                self.created.append(d)
            except FileExistsError:
                pass


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 400, 0).decode("utf-8", "replace").strip().splitlines()[0]
    except (OSError, IndexError):
        return ""
