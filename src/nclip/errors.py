"""The exception types that the CLI turns into a one-line message and exit code 2."""

from __future__ import annotations

from contextlib import contextmanager


class NclipError(Exception):
    """A user-facing error: bad config, missing file, malformed input.

    The CLI prints ``nclip: error: <message>`` and exits with status 2, without a traceback.
    Raise it with a message that names the offending value, file or row.
    """


class SourceError(NclipError):
    """An error about the files of a model the user pointed nclip at (to start from, evaluate or
    load): ``path`` as given, ``problem`` what is wrong with it, never naming the option.

    Only the caller knows how the user named the path -- ``--checkpoint``, ``--baseline``,
    ``--init``, ``model.init`` -- and says so with :meth:`named`; unnamed (``nclip.load``), the
    message starts with the path.
    """

    def __init__(self, path, problem: str, option: str | None = None):
        self.path, self.problem, self.option = str(path), problem, option
        super().__init__(f"{option} {self.path}: {problem}" if option else f"{self.path}: {problem}")

    def named(self, option: str, shown=None) -> SourceError:
        """The same error, its path named by ``option`` (and shown as ``shown``, the user's spelling)."""
        return SourceError(self.path if shown is None else shown, self.problem, option)


@contextmanager
def source_named(option: str):
    """A :class:`SourceError` raised inside, its path named by ``option`` (e.g. ``model.init``)."""
    try:
        yield
    except SourceError as e:
        raise e.named(option) from None
