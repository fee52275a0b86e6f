"""Commands that need no model answer without importing torch, which alone takes seconds to import
on a small CPU: ``nclip --help``, ``nclip presets`` and a mistake in the config or the eval
settings (issue 28.10). Each runs in a fresh interpreter, which then reports what it imported."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nclip.config_files import preset_description, preset_names

# runs `nclip ARGS` in this interpreter, then prints the exit status and the heavy modules imported
_PROBE = """
import sys
from nclip.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
print("RESULT", rc, [m for m in ("torch", "transformers") if m in sys.modules])
"""

LIGHT = [
    (["--help"], 0),
    (["train", "--help"], 0),
    (["presets"], 0),
    (["config", "--set", "train.stepz=1"], 2),
    (["config", "--preset", "{tmp}/bad.yaml"], 2),
    (["train", "--out", "{tmp}/run", "--set", "train.stepz=1"], 2),
    (["train", "--out", "{tmp}/run", "--set", "data.image_size=5"], 2),
    (["eval", "--checkpoint", "{tmp}/run", "--out", "{tmp}/ev", "--batch-size", "0"], 2),
]


@pytest.mark.parametrize("argv, rc", LIGHT, ids=[" ".join(a) for a, _ in LIGHT])
def test_commands_without_a_model_do_not_import_torch(argv, rc, tmp_path):
    (tmp_path / "bad.yaml").write_text("train:\n  steps: [1\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    done = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=120)
    result = done.stdout.strip().splitlines()[-1]
    assert result == f"RESULT {rc} []", (result, done.stderr[-2000:])
    if rc:
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr


def test_objective_mistakes_are_still_found():
    """The objective section validates after the rest (it imports torch): its mistakes are errors too."""
    from nclip.config import resolve
    from nclip.errors import NclipError

    with pytest.raises(NclipError, match="config: objective.lambda9: unknown key"):
        resolve("tiny", ["objective.lambda9=1"])
    with pytest.raises(NclipError, match="config: train.stepz: unknown key"):  # the rest first
        resolve("tiny", ["objective.lambda9=1", "train.stepz=1"])


def test_presets_lists_each_with_its_one_line_description(capsys):
    from nclip.cli import main

    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == preset_names()
    for name, line in zip(preset_names(), lines):
        description = preset_description(name)
        assert line.endswith(description) and line.split(None, 1)[1] == description
        # a summary that stands alone: one sentence on one line (the header's first), not cut mid-sentence
        assert description.endswith(".") and 20 <= len(description) <= 98, (name, description)


def test_the_peers_import_beside_nclip_which_imports_no_torchvision():
    """``import nclip`` loads neither torch nor torchvision, and open_clip, OpenAI's CLIP code and
    transformers' CLIP then import in the same process (a CUDA-built torchvision beside CPU torch:
    nclip.torchvision_compat)."""
    pytest.importorskip("open_clip")
    probe = ("import sys, warnings; import nclip; before = [m for m in ('torch', 'torchvision') if m in sys.modules]; "
             "warnings.simplefilter('ignore'); import open_clip, clip; from transformers import CLIPModel; "
             "print('RESULT', before, 'torchvision' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "RESULT [] True"
