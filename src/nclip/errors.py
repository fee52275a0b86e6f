"""The one exception type that the CLI turns into a one-line message and exit code 2."""


class NclipError(Exception):
    """A user-facing error: bad config, missing file, malformed input.

    The CLI prints ``nclip: error: <message>`` and exits with status 2, without a traceback.
    Raise it with a message that names the offending value, file or row.
    """
