"""Consent to run a plugin's code (docs/plugins.md, "Whose code runs").

A config that names an objective ``module:Class`` makes nclip import ``module``, which runs its
code. A module that Python finds without the working directory (an installed package, a
``PYTHONPATH`` entry of the user's, an entry point) is imported as any installed library is. One
that would come from the working directory is imported only under consent: the user's own
``--preset`` / ``--set`` (:func:`nclip.config.resolve`), ``--trust-plugin`` on the command line, or
``trust_plugin=True`` in the Python API. A model or run someone else sent must never run the
``evil.py`` that came with it because its config names it.

The consent holds for the block that gives it (a context variable), in this process; a spawned
worker of a consented run gets it with the plugin's pickled config class
(:mod:`nclip.objectives.registry`).
"""

from __future__ import annotations

import contextlib
import contextvars

FLAG = "--trust-plugin"
API_ARGUMENT = "trust_plugin=True"
_GIVEN = contextvars.ContextVar("nclip_plugin_consent", default=False)


@contextlib.contextmanager
def consent(given: bool = True):
    """Within the block, a plugin module that a config names may be imported from the working
    directory. ``given=False`` adds nothing (a consent given around the block still holds)."""
    token = _GIVEN.set(_GIVEN.get() or bool(given))
    try:
        yield
    finally:
        _GIVEN.reset(token)


def given() -> bool:
    return _GIVEN.get()


def add_flag(parser) -> None:
    """``--trust-plugin`` on a command that loads a model or run (argparse; ``args.trust_plugin``)."""
    parser.add_argument(FLAG, action="store_true", dest="trust_plugin",
                        help="import the objective plugin (module:Class) that the model's or run's config names "
                        "from the working directory, running its code; an installed one needs no consent "
                        "(docs/plugins.md)")
