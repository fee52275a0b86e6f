"""Bad training samples: one policy for every source (CSV rows, class-folder files, shard records).

A sample whose image is missing or does not decode (or whose caption is empty) is skipped, counted
and replaced: a map-style source (CSV, folder) reads the next good one in its place
(:func:`first_good`), so every batch keeps its size; a streamed source takes the next record. The
run stops, in one line, when more than ``data.max_bad_fraction`` of the last ``data.bad_window``
samples were bad (:class:`BadWindow`) or when ``MAX_BAD_IN_A_ROW`` map-style samples in a row are.

Below that limit the run goes on, but never silently (:class:`SkipLog`): the first skipped sample is
named with its reason on stderr, then one line at every power-of-two count (2, 4, 8, ...: a
million bad samples make twenty lines), and the end of the training prints the count and the first
few samples skipped. Each rank reports the samples it read itself.
"""

from __future__ import annotations

import collections
import sys
from typing import Callable, TypeVar

from nclip.data.shards import Bad
from nclip.errors import NclipError

MAX_BAD_IN_A_ROW = 100
T = TypeVar("T")


def first_good(index: int, n: int, read: Callable[[int], T | str], where: Callable[[int], str]
               ) -> tuple[T, int, list[tuple[str, str]]]:
    """(item, row read, [(where, reason) of the rows skipped for it]): ``read(row)`` of ``index``
    or of the next rows (cyclically) until one is good (``read`` returns a str, the reason, for a
    bad one); an :class:`NclipError` after ``MAX_BAD_IN_A_ROW`` bad ones in a row."""
    bad: list[tuple[str, str]] = []
    for attempt in range(min(MAX_BAD_IN_A_ROW, n)):
        row = (index + attempt) % n
        out = read(row)
        if isinstance(out, str):
            bad.append((where(row), out))
            continue
        return out, row, bad
    raise NclipError(f"{len(bad)} unusable samples in a row from {bad[0][0]} ({bad[0][1]})")


class BadWindow:
    """Share of bad records among the last ``window`` ones; raises when it passes ``max_fraction``."""

    def __init__(self, window: int, max_fraction: float):
        self.window, self.limit = window, max_fraction * window
        self.outcomes: collections.deque = collections.deque()
        self.bad_urls: collections.Counter = collections.Counter()
        self.examples: dict[str, str] = {}

    def add(self, bad: Bad | None, url: str) -> None:
        self.outcomes.append(url if bad is not None else None)
        if bad is not None:
            self.bad_urls[url] += 1
            self.examples[url] = f"{bad.key}: {bad.reason}" if bad.key else bad.reason
        if len(self.outcomes) > self.window:
            old = self.outcomes.popleft()
            if old is not None:
                self.bad_urls[old] -= 1
        n_bad = sum(self.bad_urls.values())
        if n_bad > self.limit:
            worst, count = self.bad_urls.most_common(1)[0]
            raise NclipError(
                f"too many bad samples: {n_bad} of the last {len(self.outcomes)} "
                f"(more than {self.limit / self.window:.0%} of a window of {self.window}); "
                f"{count} from shard {worst} (e.g. {self.examples.get(worst, '?')})"
            )


class SkipLog:
    """Says which samples were skipped (module docstring): ``add`` the (where, reason) of each as it
    is skipped, ``summary()`` at the end. ``what`` names the source (the CSV file, the folder, the
    shards' config key); ``write`` takes each line (default: stderr)."""

    EXAMPLES = 5  # samples named in the summary

    def __init__(self, what: str, write: Callable[[str], None] | None = None):
        self.what, self.count, self.first = what, 0, []
        self.write = write or (lambda line: print(line, file=sys.stderr, flush=True))

    def add(self, bad: list[tuple[str, str]]) -> None:
        for where, reason in bad:
            self.count += 1
            if len(self.first) < self.EXAMPLES:
                self.first.append(f"{where} ({reason})")
            if self.count == 1:
                self.write(f"nclip: warning: skipped a bad sample of {self.what}: {where}: {reason} (it is replaced "
                           "by the next good one; more lines at 2, 4, 8, ... skipped, a summary at the end)")
            elif self.count & (self.count - 1) == 0:  # a power of two
                self.write(f"nclip: warning: {self.count} bad samples of {self.what} skipped so far "
                           f"(latest: {where}: {reason})")

    def summary(self) -> str | None:
        """One line: how many samples were skipped and the first few; None when none was."""
        if not self.count:
            return None
        more = ", ..." if self.count > len(self.first) else ""
        return (f"nclip: warning: {self.count} bad sample{'s' if self.count > 1 else ''} of {self.what} skipped "
                f"in this run: {', '.join(self.first)}{more}")
