"""No code runs from a received model without consent (docs/plugins.md, "Whose code runs"): a run
whose config names a plugin ``evil_obj:Obj``, sent with an ``evil_obj.py`` beside it (and one in the
folder it was unpacked into), is refused in one line by every command that loads it, run from
inside it, and ``evil_obj`` is never imported; ``--trust-plugin`` / ``trust_plugin=True`` load it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import nclip
from nclip.cli import main
from nclip.config import resolve
from nclip.errors import NclipError
from nclip.heads import base as head_registry
from nclip.objectives import registry
from nclip.train.loop import train

from conftest import MICRO_OVERRIDES

pytestmark = pytest.mark.usefixtures("one_thread")

MARK = "PWNED"
EVIL = f'''"""An objective that came with a model: importing it leaves a file beside it."""
from pathlib import Path
from typing import ClassVar

from nclip.objectives import Objective, ObjectiveConfig
from nclip.objectives.functional import clip_terms

Path(__file__).with_name("{MARK}").write_text("evil_obj ran")


class ObjConfig(ObjectiveConfig):
    pass


class Obj(Objective):
    Config = ObjConfig
    heads: ClassVar = frozenset({{"clip"}})
    zero_shot: ClassVar = "clip"

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def forward(self, out, batch=None):
        return {{"loss": clip_terms(out.image["clip"], out.text["clip"], out.logit_scale)["loss"]}}
'''


class _Registries:
    """The objective and head registries and sys.modules as they are now, to put back after a test
    that loaded the plugin."""

    def __init__(self):
        self.objectives, self.heads = dict(registry.REGISTRY), dict(head_registry._HEADS)

    def restore(self) -> None:
        registry.REGISTRY.clear()
        registry.REGISTRY.update(self.objectives)
        head_registry._HEADS.clear()
        head_registry._HEADS.update(self.heads)
        sys.modules.pop("evil_obj", None)


@pytest.fixture(scope="module")
def received(tmp_path_factory) -> Path:
    """downloads/model/: a finished run of objective evil_obj:Obj, with evil_obj.py in it and in
    downloads/, as a stranger would send it (they trained it with their consent)."""
    downloads = tmp_path_factory.mktemp("downloads")
    run = downloads / "model"
    run.mkdir()
    for folder in (downloads, run):
        (folder / "evil_obj.py").write_text(EVIL)
    before, cwd = _Registries(), os.getcwd()
    os.chdir(run)
    try:
        cfg = resolve("micro", [*MICRO_OVERRIDES, "objective.name=evil_obj:Obj", "train.steps=3"])
        train(cfg, run, progress=False, evaluate=False)
    finally:
        os.chdir(cwd)
        before.restore()
    (run / MARK).unlink()  # the sender's import
    return run


@pytest.fixture
def inside(received, monkeypatch, tmp_path):
    """The working directory is the received run, and on sys.path as `python -m` puts it; the
    registries are put back afterwards, and the marks of a test that consented are removed."""
    before = _Registries()
    monkeypatch.chdir(received)
    monkeypatch.setattr(sys, "path", [str(received), *sys.path])
    yield received
    before.restore()
    for folder in (received.parent, received):
        (folder / MARK).unlink(missing_ok=True)


def _marks(run: Path) -> list[Path]:
    return [p for p in (run.parent / MARK, run / MARK) if p.exists()]


def _commands(out: Path) -> dict[str, list[str]]:
    """Every command that loads the run in the working directory, writing into ``out``."""
    return {
        "eval": ["eval", "--checkpoint", ".", "--out", str(out / "eval"), "--tasks", "zeroshot", "--samples", "16"],
        "embed": ["embed", "synthetic", "--checkpoint", ".", "--out", str(out / "embed"), "--samples", "8"],
        "export": ["export", "--checkpoint", ".", "--hf", str(out / "hf")],
        "merge": ["merge", ".", ".", "--alpha", "0.5", "--out", str(out / "merged")],
        "finetune": ["finetune", "--checkpoint", ".", "--out", str(out / "ft"), "--epochs", "1"],
        "resume": ["train", "--out", ".", "--resume", "auto"],
        "init": ["train", "--preset", "micro", "--init", ".", "--out", str(out / "init")],
    }


@pytest.mark.parametrize("command", list(_commands(Path("/x"))))
def test_every_command_refuses_a_received_plugin_in_one_line(command, inside, tmp_path, capsys):
    assert main(_commands(tmp_path)[command]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "'evil_obj'" in err and "is not installed" in err and "--trust-plugin" in err, err
    assert _marks(inside) == [] and "evil_obj" not in sys.modules
    assert not any((tmp_path / name).exists() for name in ("eval", "embed", "hf", "merged", "ft", "init"))


def test_nclip_load_refuses_it_and_loads_it_with_trust_plugin(inside):
    with pytest.raises(NclipError, match=r"module 'evil_obj' is not installed.*trust_plugin=True") as refused:
        nclip.load(".")
    assert "\n" not in str(refused.value) and _marks(inside) == []
    model = nclip.load(".", device="cpu", trust_plugin=True)
    assert model.head == "clip" and _marks(inside) == [inside / MARK]  # the module of the working directory


@pytest.mark.parametrize("command", ["export", "resume"])
def test_trust_plugin_loads_it(command, inside, tmp_path, capsys):
    assert main([*_commands(tmp_path)[command], "--trust-plugin"]) == 0, capsys.readouterr().err
    assert _marks(inside) == [inside / MARK]
    if command == "export":
        assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_python_m_and_the_console_script_refuse_it_from_the_run_and_from_its_parent(received, tmp_path):
    """The real start-ups: `python -m nclip` puts the working directory on sys.path, the console
    script does not; neither imports evil_obj, from the run or from the folder above it."""
    script = shutil.which("nclip", path=str(Path(sys.executable).parent))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(nclip.__file__).parents[1]),
                                                          os.environ.get("PYTHONPATH", "")])}
    for cwd, launcher, checkpoint in [(received, [sys.executable, "-m", "nclip"], "."),
                                      (received.parent, [script], received.name)]:
        done = subprocess.run([*launcher, "eval", "--checkpoint", checkpoint, "--out", str(tmp_path / "eval")],
                              cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr[-800:]
        assert "'evil_obj'" in done.stderr and "--trust-plugin" in done.stderr
        assert _marks(received) == []


def test_an_installed_plugin_needs_no_consent(tmp_path, monkeypatch):
    """A module found without the working directory (here a PYTHONPATH entry) is the user's own:
    a config that names it loads as before."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "evil_obj.py").write_text(EVIL.replace(f'Path(__file__).with_name("{MARK}").write_text("evil_obj ran")',
                                                   ""))
    before = _Registries()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.chdir(tmp_path)
    try:
        from nclip.config import validate

        cfg = validate({"objective": {"name": "evil_obj:Obj"}})
        assert cfg.objective.name == "evil_obj:Obj"
    finally:
        before.restore()
