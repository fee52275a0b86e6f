"""The CLI's subcommands and their runners: one table (nclip.cli.COMMANDS), in step with the parser."""

import argparse

from nclip.cli import COMMANDS, build_parser


def test_every_subcommand_has_a_runner_and_every_runner_a_subcommand():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(COMMANDS)
