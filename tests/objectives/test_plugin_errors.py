"""An objective of the user's own (docs/plugins.md): found by module:Class or by an entry point, its
options validated like a built-in's, and every way of getting it wrong one line with exit status 2."""

import textwrap

import pytest

from nclip.cli import main
from nclip.config import resolve
from nclip.objectives import plan_for

GOOD = """
    from typing import ClassVar

    from pydantic import Field

    from nclip.objectives import Objective, ObjectiveConfig
    from nclip.objectives.functional import clip_terms


    class ScaledClipConfig(ObjectiveConfig):
        weight: float = Field(1.0, ge=0)


    class ScaledClip(Objective):
        Config = ScaledClipConfig
        heads: ClassVar = frozenset({"clip"})
        zero_shot: ClassVar = "clip"

        def __init__(self, cfg):
            super().__init__()
            self.cfg = cfg

        def forward(self, out, batch=None):
            return {"loss": self.cfg.weight * clip_terms(out.image["clip"], out.text["clip"], out.logit_scale)["loss"]}
"""


@pytest.fixture(autouse=True)
def _registries_as_they_were():
    """The objective, head and score registries as before each test: a refused plugin stays registered
    in the process that refused it, and other tests list the registered ones."""
    from nclip.heads import base as heads
    from nclip.objectives import registry, scores

    saved = [(table, dict(table)) for table in (registry.REGISTRY, heads._HEADS, scores._SCORES)]
    yield
    for table, entries in saved:
        table.clear()
        table.update(entries)


def _write(folder, module: str, source: str) -> None:
    (folder / f"{module}.py").write_text(textwrap.dedent(source))


def _refused(args: list[str], capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_a_plugin_from_the_working_directory_validates_its_options(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "plugin_good_a", GOOD)
    cfg = resolve("micro", ["objective.name=plugin_good_a:ScaledClip", "objective.weight=0.5"])
    assert cfg.objective.weight == 0.5 and cfg.objective.name == "plugin_good_a:ScaledClip"
    plan = plan_for(cfg)
    assert plan.heads == {"clip"} and plan.zero_shot.name == "clip"
    assert resolve("micro", ["objective.name=xclip"]).objective.name == "xclip"  # the built-ins still validate


def test_a_plugin_from_an_entry_point(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    _write(site, "plugin_good_b", GOOD)
    info = site / "plugin_good_b-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plugin-good-b\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[nclip.objectives]\nscaled_clip = plugin_good_b:ScaledClip\n")
    monkeypatch.syspath_prepend(str(site))
    cfg = resolve("micro", ["objective.name=scaled_clip", "objective.weight=2"])
    assert plan_for(cfg).objective_class.__name__ == "ScaledClip" and cfg.objective.weight == 2


@pytest.mark.parametrize("case, source, needle", [
    ("import_error", "import does_not_exist_anywhere\n", "does not import (ModuleNotFoundError"),
    ("missing_method", GOOD.replace('zero_shot: ClassVar = "clip"', ""), "does not define zero_shot"),
    ("no_config", GOOD.replace("Config = ScaledClipConfig", ""), "does not define Config"),
    ("not_an_objective", "class ScaledClip:\n    pass\n", "not a subclass of nclip.objectives.Objective"),
    ("bad_config", GOOD.replace("Config = ScaledClipConfig", "Config = dict"), "Config is not a subclass"),
    # what evaluation will ask for is checked when the config is resolved, not after training
    ("unknown_score", GOOD.replace('zero_shot: ClassVar = "clip"', 'zero_shot: ClassVar = "mine"'),
     "its zero_shot: unknown zero-shot score 'mine'; registered: clip, nclip, yclip"),
    ("unbuilt_head", GOOD.replace('zero_shot: ClassVar = "clip"', 'zero_shot: ClassVar = "nclip"'),
     "its zero-shot score 'nclip' reads the 'nclip' head, which it does not build (it has clip)"),
    ("unknown_head", GOOD.replace('frozenset({"clip"})', 'frozenset({"clip", "mine"})'),
     "names the head 'mine', which is not registered"),
    ("unknown_probe", GOOD.replace('zero_shot: ClassVar = "clip"', 'zero_shot: ClassVar = "clip"\n'
                                   '        probe_features: ClassVar = "proto"'),
     "ScaledClip.probe_features 'proto': objective"),
])
def test_a_wrong_plugin_is_one_line(case, source, needle, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, f"plugin_bad_{case}", source)
    err = _refused(["train", "--preset", "micro", "--set", f"objective.name=plugin_bad_{case}:ScaledClip",
                    "--out", str(tmp_path / "run")], capsys)
    assert needle in err and f"plugin_bad_{case}" in err


def test_a_bad_option_and_an_unknown_name_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "plugin_good_c", GOOD)
    err = _refused(["train", "--preset", "micro", "--set", "objective.name=plugin_good_c:ScaledClip",
                    "--set", "objective.weight=-1", "--out", str(tmp_path / "run")], capsys)
    assert "objective.weight" in err and "greater than or equal to 0" in err
    err = _refused(["train", "--preset", "micro", "--set", "objective.name=plugin_good_c:ScaledClip",
                    "--set", "objective.wieght=1", "--out", str(tmp_path / "run")], capsys)
    assert "objective.wieght: unknown key" in err
    err = _refused(["train", "--preset", "micro", "--set", "objective.name=no_such_objective",
                    "--out", str(tmp_path / "run")], capsys)
    assert "unknown objective 'no_such_objective'" in err and "xclip" in err
    err = _refused(["train", "--preset", "micro", "--set", "objective.name=plugin_good_c:Missing",
                    "--out", str(tmp_path / "run")], capsys)
    assert "has no 'Missing'" in err


def test_a_plugins_config_pickles_into_a_fresh_process(tmp_path, monkeypatch):
    """A spawned worker (torchrun's, a spawn-context DataLoader's) unpickles the run config: the
    plugin's config class is found again by loading the plugin there."""
    import pickle
    import subprocess
    import sys

    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "plugin_good_d", GOOD)
    cfg = resolve("micro", ["objective.name=plugin_good_d:ScaledClip", "objective.weight=0.25"])
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    (tmp_path / "cfg.pkl").write_bytes(pickle.dumps(cfg))
    code = "import pickle; print(pickle.load(open('cfg.pkl', 'rb')).objective.weight)"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "0.25", done.stderr[-500:]
