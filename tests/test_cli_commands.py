"""The CLI's subcommands and their runners: one table (nclip.cli.COMMANDS), in step with the parser and
with the list in nclip.cli's docstring."""

import argparse
import re

import nclip.cli
from nclip.cli import COMMANDS, build_parser


def test_every_subcommand_has_a_runner_and_every_runner_a_subcommand():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(COMMANDS)


def test_the_module_docstring_lists_every_command():
    listed = re.search(r"``nclip ([a-z |\n]+)``", nclip.cli.__doc__).group(1)
    assert sorted(name.strip() for name in listed.split("|")) == sorted(COMMANDS)
