"""The one table of dataset kinds (nclip.dataset_specs): the grammar, the builders, the prompt
files each kind takes and the CLI's help all come from it."""

import contextlib
import io
import sys

import pytest

from nclip.dataset_specs import CLASSNAMES, DATASET_KINDS, TEMPLATES, checked_spec, kinds_taking, parse_spec, spec_help
from nclip.defaults import BUILTIN_SOURCES
from nclip.errors import NclipError


def test_spec_parsing():
    assert parse_spec("synthetic") == ("synthetic", None)
    assert parse_spec("Folder: /data/x ") == ("folder", "/data/x")
    assert parse_spec("karpathy:a.json:imgs:val") == ("karpathy", "a.json:imgs:val")
    for bad in ("imagenet", "folder", "folder:", "synthetic:/x", "digits:x"):
        with pytest.raises(NclipError, match="unknown dataset"):
            parse_spec(bad)
    with pytest.raises(ValueError, match="unknown dataset 'nope'; use one of synthetic, digits or KIND:PATH"):
        checked_spec("nope")


def test_every_kind_parses_as_its_syntax_is_written():
    """The help shows each kind's syntax: written as shown, it is a spec of that kind."""
    for name, kind in DATASET_KINDS.items():
        example = kind.syntax.split("|")[0].replace("[", "").replace("]", "")
        assert parse_spec(example)[0] == name, kind.syntax
    assert {name for name, kind in DATASET_KINDS.items() if not kind.takes_path} == set(BUILTIN_SOURCES)


def test_builders_cover_the_table():
    from nclip.eval import datasets

    assert set(datasets._BUILDERS) == set(DATASET_KINDS)


def test_prompt_files_apply_to_the_kinds_that_take_them():
    from nclip.eval.settings import EvalSettings

    assert "folder" in kinds_taking(CLASSNAMES) and "realms" not in kinds_taking(CLASSNAMES)
    assert "realms" in kinds_taking(TEMPLATES) and "captions" not in kinds_taking(TEMPLATES)
    EvalSettings(datasets=("realms:/x",), templates="imagenet80")
    with pytest.raises(ValueError, match="applies to folder:, multilabel:, wds:, imagefolder: datasets"):
        EvalSettings(datasets=("realms:/x",), classnames="imagenet80")


def test_eval_help_lists_every_kind_task_and_recipe():
    from nclip.cli import main
    from nclip.eval.settings import TASK_TABLE
    from nclip.eval.sgd_recipes import SGD_RECIPES

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = " ".join(out.getvalue().split())
    assert " ".join(spec_help().split()) in text
    for name in [*TASK_TABLE, *SGD_RECIPES]:
        assert name in text, name


def test_config_checks_eval_datasets_without_importing_eval(tmp_path):
    """train.eval_datasets is checked by the grammar of layer 0: the config imports no eval module."""
    import subprocess

    code = ("import sys; from nclip.config import resolve\n"
            "try:\n    resolve('micro', ['train.eval_datasets=[folderz:x]'])\n"
            "except Exception as e:\n    print('ERR', e)\n"
            "print('EVAL', sorted(m for m in sys.modules if m.startswith('nclip.eval')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "ERR config: train.eval_datasets: unknown dataset 'folderz:x'" in out
    assert "EVAL []" in out
