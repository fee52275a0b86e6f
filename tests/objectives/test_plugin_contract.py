"""An objective of the user's own that gets its contract wrong while training, one line each (exit 2
unless said): a wrong dict from ``forward`` (checked on the first step), a loss that is never finite,
heads that changed before a resume; and an edited plugin file, which a resume names in a warning."""

import hashlib
import sys
import textwrap

import pytest
import torch

from nclip.cli import main
from nclip.errors import NclipError
from nclip.heads import base as head_registry
from nclip.objectives import registry
from nclip.objectives.contract import FirstStepCheck

# the objective returns what RETURNS[case] says, computed from a real CLIP loss
SOURCE = """
    from typing import ClassVar

    import torch

    from nclip.objectives import Objective, ObjectiveConfig
    from nclip.objectives.functional import clip_terms


    class Config(ObjectiveConfig):
        pass


    class Obj(Objective):
        Config = Config
        heads: ClassVar = frozenset({"clip"})
        zero_shot: ClassVar = "clip"

        def __init__(self, cfg):
            super().__init__()
            self.cfg, self.step = cfg, 0

        def before_step(self, step, total):
            self.step = step

        def forward(self, out, batch=None):
            loss = clip_terms(out.image["clip"], out.text["clip"], out.logit_scale, global_batch=False)["loss"]
            return RETURNED
"""

RETURNS = {
    "per_row_loss": ("loss * torch.ones(len(out.image['clip']))", "'loss' of shape [16]; expected a 0-d tensor"),
    "float_loss": ("{'loss': 1.5}", "'loss' as a float; expected a 0-d tensor"),
    "no_loss_key": ("{'total': loss}", "no 'loss' key (its keys: 'total', 'logit_scale'); expected a dict"),
    "detached_loss": ("{'loss': loss.detach()}", "'loss' that carries no gradient"),
    "non_tensor_term": ("{'loss': loss, 'acc': 0.5}", "'acc' as a float; expected a 0-d tensor"),
    "mixed_shapes": ("{'loss': loss, 'per_row': loss.detach().expand(3)}", "'per_row' of shape [3]; expected a 0-d"),
    "not_a_dict": ("loss", "returned a Tensor; expected a dict {'loss'"),
}
RETURNS["per_row_loss"] = ("{'loss': " + RETURNS["per_row_loss"][0] + "}", RETURNS["per_row_loss"][1])

SHORT = ["train.steps=2", "train.log_every=1", "train.checkpoint_every=1", "data.train_length=64"]


def _write(folder, module: str, returned: str) -> str:
    text = textwrap.dedent(SOURCE).replace("RETURNED", returned)
    (folder / f"{module}.py").write_text(text)
    return text


def _train_args(module: str, run, overrides=()) -> list[str]:
    sets = [x for o in (*SHORT, *overrides, f"objective.name={module}:Obj") for x in ("--set", o)]
    return ["train", "--preset", "micro", *sets, "--out", str(run), "--no-progress", "--no-eval"]


def _one_line(code: int, capsys, expected: int = 2) -> str:
    err = capsys.readouterr().err.strip()
    assert code == expected, err[-600:]
    lines = [x for x in err.splitlines() if x.startswith("nclip: error:")]
    assert "Traceback" not in err and len(lines) == 1, err[-600:]
    return lines[0]


@pytest.mark.parametrize("case", list(RETURNS))
def test_a_wrong_return_of_forward_is_one_line_on_the_first_step(case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    module = f"plugin_returns_{case}"
    returned, expected = RETURNS[case]
    _write(tmp_path, module, returned)
    line = _one_line(main(_train_args(module, tmp_path / "run")), capsys)
    assert f"objective.name '{module}:Obj': forward returned" in line and expected in line, line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_under_exact_accumulation_too(tmp_path, monkeypatch, capsys):
    """The heads and the objective run once on the whole batch there (nclip.train.accumulate): the
    dict is checked before that backward as well."""
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "plugin_returns_accumulated", RETURNS["detached_loss"][0])
    args = _train_args("plugin_returns_accumulated", tmp_path / "run", ["train.accumulation=2"])
    assert "'loss' that carries no gradient" in _one_line(main(args), capsys)


def test_the_check_reads_no_value_and_runs_once():
    """On a GPU, reading a tensor's value waits for every kernel queued before it: the check reads
    what the host knows (type, shape, device, requires_grad) and runs on the first step only."""
    from torch.profiler import ProfilerActivity, profile

    from host_syncs import SYNC_OPS

    loss = torch.ones(3, requires_grad=True).sum()
    check = FirstStepCheck("x:Obj")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        check({"loss": loss, "acc": loss.detach() / 2})
    assert not [e.name for e in prof.events() if e.name in SYNC_OPS]
    assert check("anything at all") == "anything at all"  # later steps are not checked
    with pytest.raises(NclipError, match="'x:Obj': forward returned 'acc' of shape"):
        FirstStepCheck("x:Obj")({"loss": loss, "acc": torch.ones(2)})


def test_a_loss_never_finite_in_a_short_run_writes_no_model_and_exits_2(tmp_path, monkeypatch, capsys):
    """3 steps, fewer than train.max_nonfinite_steps (10): every one skipped, the weights untrained."""
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "plugin_nan_always", "{'loss': loss * float('nan')}")
    line = _one_line(main(_train_args("plugin_nan_always", tmp_path / "run", ["train.steps=3"])), capsys)
    assert "steps 1 to 3, every step of the run, had a non-finite loss or gradient, so not one was taken" in line
    assert "neither model/ nor a checkpoint is written" in line and "'plugin_nan_always:Obj'" in line
    assert not (tmp_path / "run" / "model").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_a_run_that_ends_in_a_short_streak_says_which_weights_it_saved(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "plugin_nan_late", "{'loss': loss * float('nan') if self.step >= 2 else loss}")
    code = main(_train_args("plugin_nan_late", tmp_path / "run", ["train.steps=4"]))
    err = capsys.readouterr().err
    assert code == 0, err[-600:]
    assert "nclip: warning: the last 2 of the run's 4 steps had a non-finite loss or gradient and were skipped: " \
           "model/ holds the weights of step 2" in err
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()


@pytest.fixture
def registries():
    """The objective and head registries as before the test afterwards (a test here re-imports an
    edited plugin, as a new process would)."""
    objectives, sources, heads = dict(registry.REGISTRY), dict(registry.SOURCES), dict(head_registry._HEADS)
    yield
    for table, saved in ((registry.REGISTRY, objectives), (registry.SOURCES, sources), (head_registry._HEADS, heads)):
        table.clear()
        table.update(saved)


def _forget(module: str, name: str, heads=()) -> None:
    """As a new process: the edited file is imported again."""
    sys.modules.pop(module, None)
    registry.REGISTRY.pop(name, None)
    registry.SOURCES.pop(name, None)
    for head in heads:
        head_registry._HEADS.pop(head, None)


HEADED = SOURCE.replace('heads: ClassVar = frozenset({"clip"})', 'heads: ClassVar = frozenset({"clip", "tiny"})') + """

    @register_head
    class Tiny(TwoSidedHead):
        name = "tiny"

        @classmethod
        def build(cls, ctx):
            return cls(torch.nn.Linear(ctx.vision.width, WIDTH), torch.nn.Linear(ctx.text.width, WIDTH))
"""
HEADED = HEADED.replace("import torch\n", "import torch\n\n    from nclip.heads import TwoSidedHead, register_head\n")


def test_a_resume_after_the_plugins_heads_changed_is_one_line(tmp_path, monkeypatch, capsys, registries):
    monkeypatch.chdir(tmp_path)
    run, module = tmp_path / "run", "plugin_heads_changed"
    plugin = tmp_path / f"{module}.py"
    returned = "{'loss': loss + 0 * (out.image['tiny'].sum() + out.text['tiny'].sum())}"
    plugin.write_text(textwrap.dedent(HEADED).replace("RETURNED", returned).replace("WIDTH", "8"))
    assert main(_train_args(module, run)) == 0, capsys.readouterr().err[-600:]
    capsys.readouterr()
    plugin.write_text(textwrap.dedent(HEADED).replace("RETURNED", returned).replace("WIDTH", "12"))
    _forget(module, f"{module}:Obj", ["tiny"])
    line = _one_line(main(["train", "--out", str(run), "--extend-to", "3", "--trust-plugin", "--no-progress",
                           "--no-eval"]), capsys)
    assert f"checkpoint {run / 'checkpoints' / 'step_00000002'} was made with other heads than objective " \
           f"'{module}:Obj' builds now" in line, line
    assert "heads.tiny.image.weight is [8, 32] there, [12, 32] now" in line
    assert f"the plugin file {plugin} of objective '{module}:Obj' changed since the checkpoint" in line
    # a head of another name: the one it had is named as missing, the new one as not in the checkpoint
    plugin.write_text(textwrap.dedent(HEADED).replace("RETURNED", returned.replace("tiny", "small"))
                      .replace("WIDTH", "8").replace('"tiny"', '"small"'))
    _forget(module, f"{module}:Obj", ["tiny"])
    line = _one_line(main(["train", "--out", str(run), "--extend-to", "3", "--trust-plugin", "--no-progress",
                           "--no-eval"]), capsys)
    assert "(heads.small not in the checkpoint; heads.tiny only in the checkpoint)" in line, line
    # the heads as they were, but the objective now holds a buffer (a queue, say)
    plugin.write_text(textwrap.dedent(HEADED).replace("RETURNED", returned).replace("WIDTH", "8")
                      .replace("self.cfg, self.step = cfg, 0", "self.cfg, self.step = cfg, 0\n"
                               "        self.register_buffer('queue', torch.zeros(4))"))
    _forget(module, f"{module}:Obj", ["small"])
    line = _one_line(main(["train", "--out", str(run), "--extend-to", "3", "--trust-plugin", "--no-progress",
                           "--no-eval"]), capsys)
    assert f"was made with another state than objective '{module}:Obj' holds now" in line
    assert "(objective.queue not in the checkpoint)" in line, line


def test_a_resume_after_the_plugin_file_changed_names_it_and_both_hashes(tmp_path, monkeypatch, capsys, registries):
    monkeypatch.chdir(tmp_path)
    run, module = tmp_path / "run", "plugin_edited"
    before = _write(tmp_path, module, "{'loss': loss}")
    assert main(_train_args(module, run)) == 0, capsys.readouterr().err[-600:]
    capsys.readouterr()
    after = _write(tmp_path, module, "{'loss': 100 * loss}")  # the edit that took a loss from 2.8 to 287
    _forget(module, f"{module}:Obj")
    resume = ["train", "--out", str(run), "--trust-plugin", "--no-progress", "--no-eval", "--extend-to"]
    assert main([*resume, "3"]) == 0
    err = capsys.readouterr().err
    sha = [hashlib.sha256(text.encode()).hexdigest()[:12] for text in (before, after)]
    warnings = [x for x in err.splitlines() if x.startswith("nclip: warning: the plugin file")]
    assert warnings == [f"nclip: warning: the plugin file {tmp_path / module}.py of objective '{module}:Obj' changed "
                        f"since the checkpoint (sha256 {sha[0]} then, {sha[1]} now); the run continues with the file "
                        "as it is now, so its numbers after step_00000002 come from the edited code "
                        "(docs/plugins.md)"], err[-800:]
    # step 3's checkpoint was made with the edited file: resuming from it says nothing
    assert main([*resume, "4"]) == 0
    assert "plugin file" not in capsys.readouterr().err
