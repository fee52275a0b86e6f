"""The README is a front door that works for a newcomer as written: it opens with the two set-up
commands and then says how to reach `nclip`; it stays short; its first screen shows what a `micro`
run really prints and where its results are; every run or evaluation a command reads was made by an
earlier command, in the README and in the docs pages that took over its longer sections; its preset
table names every shipped preset; and docs/README.md indexes every docs page."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from nclip.config_files import preset_names

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_LINES = 160


def _commands(page: Path) -> list[list[str]]:
    """Every `nclip ...` command of a page's bash blocks, in order, as argv (comments dropped,
    continued lines joined)."""
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.startswith("nclip ")]


def _option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _check_order(page: Path, made: set[str]) -> list[str]:
    """Walk a page's commands in order: what an eval, export, finetune or compare reads under runs/
    is in `made` or made above it, and no two evaluations of the page write one folder. Adds what
    the page makes to `made`; returns the page's evaluation folders."""
    eval_outs: list[str] = []
    for argv in _commands(page):
        command = argv[1]
        if command == "eval" and argv[2:3] == ["compare"]:
            inputs = [a for a in argv[3:] if not a.startswith("--") and a != _option(argv, "--out")]
            missing = [a for a in inputs if a not in made]
            assert not missing, f"{page.name}: {' '.join(argv)}: nothing above makes {missing}"
            continue
        checkpoint = _option(argv, "--checkpoint")
        if command in ("eval", "export", "finetune", "embed") and checkpoint and checkpoint.startswith("runs/"):
            assert checkpoint in made, f"{page.name}: {' '.join(argv)}: nothing above makes {checkpoint}"
        out = _option(argv, "--out")
        if command == "eval":
            assert out not in eval_outs, f"{page.name}: {' '.join(argv)}: --out {out} overwrites an evaluation above"
            eval_outs.append(out)
        if out:
            made.add(out)
    return eval_outs


def test_it_opens_with_the_set_up_then_says_how_to_reach_nclip():
    text = README.read_text(encoding="utf-8")
    assert text.startswith("# nclip\n\n```bash\nmake demo   #") and "\nmake test   #" in text.split("```")[1]
    assert [line.split()[:2] for line in text.split("```")[1].strip().splitlines()[1:]] == [["make", "demo"],
                                                                                             ["make", "test"]]
    before_first_command = text[:text.index("```bash", text.index("make test"))]
    assert ". .venv/bin/activate" in before_first_command and ".venv/bin/nclip" in before_first_command


def test_the_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines, more than {MAX_LINES}: move the detail to a docs page"


def test_what_a_command_reads_an_earlier_one_made_and_no_two_evaluations_share_a_folder():
    readme_made: set[str] = set()
    readme_evals = _check_order(README, readme_made)
    # the evaluation page reads the README's runs; the training page stands on its own
    page_evals = _check_order(DOCS / "evaluation.md", set(readme_made))
    _check_order(DOCS / "training.md", set())
    assert len(readme_evals) >= 2 and len(page_evals) >= 4


def test_the_preset_table_has_a_row_for_every_shipped_preset():
    table = README.read_text(encoding="utf-8").split("## Presets")[1]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    named = [name for row in rows for name in re.findall(r"`([^`]+)`", row)]
    assert sorted(named) == preset_names(), "every shipped preset needs a row in the README's table, and only they"


def test_the_docs_index_links_every_page_once_with_a_line_on_what_it_holds():
    index = DOCS / "README.md"
    entries = re.findall(r"^- \[([^\]]+)\]\(([^)]+)\) — (.+)$", index.read_text(encoding="utf-8"), flags=re.M)
    linked = [target for _, target, _ in entries]
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md")
    missing, strays = sorted(set(pages) - set(linked)), sorted(set(linked) - set(pages))
    assert sorted(linked) == pages, f"docs/README.md links every page once: missing {missing}, not pages {strays}"
    assert len(set(linked)) == len(linked)
    assert all(len(what.split()) >= 5 for _, _, what in entries)


def test_every_relative_link_of_the_readme_the_docs_index_and_the_pages_it_fed_resolves():
    for page in (README, DOCS / "README.md", DOCS / "training.md", DOCS / "evaluation.md"):
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links {target}, which is not there"


def _first_screen() -> tuple[str, list[str], list[str]]:
    """The README's first-run command, the start-up block it pastes, and the files its table names."""
    section = README.read_text(encoding="utf-8").split("## A first run")[1].split("\n## ")[0]
    command = re.search(r"```bash\n(nclip [^\n#]*?)\s*#", section).group(1)
    printed = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    files = re.findall(r"^\| `([^`]+)`(?:, `([^`]+)`)? \|", section, flags=re.M)
    return command, printed.splitlines(), [name for pair in files for name in pair if name]


@pytest.mark.slow
def test_the_first_screen_shows_what_the_micro_run_prints_and_where_its_results_are(tmp_path):
    command, shown, files = _first_screen()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "nclip", *shlex.split(command)[1:]]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr
    start_up = [line for line in shown if line == "nclip train" or line.startswith("  ")]
    real = done.stderr.splitlines()
    assert start_up[0] == "nclip train" and len(start_up) >= 8
    missing = [line for line in start_up if line not in real]  # trimmed, never altered
    assert not missing, f"the README's start-up block differs from the run's: {missing}"
    summary_keys = [line.split("  ")[0] for line in shown if re.match(r"^[a-z][\w/@ ()]+?\s{2,}\S", line)]
    real_keys = {line.split("  ")[0] for line in done.stdout.splitlines()}
    assert summary_keys and not set(summary_keys) - real_keys, set(summary_keys) - real_keys
    run = tmp_path / shlex.split(command)[shlex.split(command).index("--out") + 1]
    absent = [name for name in files if not (run / name).exists()]
    assert files and not absent, f"the README's table names {absent}, which the run did not write"
