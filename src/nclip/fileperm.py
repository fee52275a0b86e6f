"""Files and folders written with the permissions the umask gives, also where written atomically.

``tempfile.mkstemp`` makes files 0600 and ``mkdtemp`` folders 0700 whatever the umask, and
safetensors (0.8) writes its files 0600, so a checkpoint, model or cache written through them and
renamed into place could be read by its owner alone; on shared storage colleagues could not read
the run. :func:`settle` gives a path the mode ``open`` or ``mkdir`` would have given it: 0666 or
0777 less the process's umask (0644 and 0755 under the usual 022).
"""

from __future__ import annotations

import os
from pathlib import Path


def umask() -> int:
    """The process's umask, read without changing it where the kernel says it (Linux ≥ 4.7);
    elsewhere set and restored at once."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def settle(path: str | Path, mask: int | None = None) -> None:
    """Give ``path`` (a file or folder, not a link) the mode it would have had from ``open`` or
    ``mkdir`` under the umask (``mask``)."""
    path = Path(path)
    if path.is_symlink():
        return
    mask = umask() if mask is None else mask
    os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def settle_tree(root: str | Path, since: float | None = None) -> None:
    """:func:`settle` ``root`` and everything under it; with ``since``, only what is under it and
    was modified at or after that time (the files a command wrote into a folder that is not its
    own, which keeps its mode)."""
    mask = umask()
    for path in [*([Path(root)] if since is None else []), *Path(root).rglob("*")]:
        if since is None or path.lstat().st_mtime >= since:
            settle(path, mask)
