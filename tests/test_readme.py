"""The README's commands work for a newcomer as written, in order (issue 28.9): it opens with the two
set-up commands and then says how to reach `nclip`; every run or evaluation a command reads was
made by an earlier command; no two evaluations write to the same folder."""

import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _commands() -> list[list[str]]:
    """Every `nclip ...` command of the README's bash blocks, in order, as argv (comments dropped,
    continued lines joined)."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if line.startswith("nclip ")]


def _option(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_it_opens_with_the_set_up_then_says_how_to_reach_nclip():
    text = README.read_text()
    assert text.startswith("# nclip\n\n```bash\nmake demo   #") and "\nmake test   #" in text.split("```")[1]
    assert [line.split()[:2] for line in text.split("```")[1].strip().splitlines()[1:]] == [["make", "demo"],
                                                                                             ["make", "test"]]
    before_first_command = text.split("## Quick start")[0]
    assert ". .venv/bin/activate" in before_first_command and ".venv/bin/nclip" in before_first_command


def test_what_a_command_reads_an_earlier_one_made_and_no_two_evaluations_share_a_folder():
    made, eval_outs = set(), []
    for argv in _commands():
        command = argv[1]
        if command == "eval" and argv[2:3] == ["compare"]:
            inputs = [a for a in argv[3:] if not a.startswith("--") and a != _option(argv, "--out")]
            missing = [a for a in inputs if a not in made]
            assert not missing, f"{' '.join(argv)}: nothing above makes {missing}"
            continue
        checkpoint = _option(argv, "--checkpoint")
        if command in ("eval", "export", "finetune") and checkpoint and checkpoint.startswith("runs/"):
            assert checkpoint in made, f"{' '.join(argv)}: nothing above makes {checkpoint}"
        out = _option(argv, "--out")
        if command == "eval":
            assert out not in eval_outs, f"{' '.join(argv)}: --out {out} overwrites an evaluation above"
            eval_outs.append(out)
        if out:
            made.add(out)
    assert len(eval_outs) >= 4
