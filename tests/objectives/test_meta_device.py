"""Every tensor a training step makes lives on the model's device (issue 32.2), checked on the CPU.

The model and the objective are moved to the ``meta`` device (shapes and dtypes, no data) and run a
step as the trainer does: the objective's ``before_step``, ``TrainStep``'s forward (towers, heads,
objective), the backward, the trainer's stack of the logged terms and the objective's
``after_step``. A tensor made on the CPU and mixed into the step (xCLIP's warm-up weight made with
``torch.tensor(w)`` was one, a crash on CUDA) fails there as it would on a GPU, and a term left on
the CPU is named. A meta tensor has no values either, so a host read on the step's path (``item``,
``bool``, boolean indexing, ``nonzero``) fails too.
"""

from __future__ import annotations

import pytest
import torch

from nclip.config import resolve
from nclip.data.labels import label_space_for
from nclip.models.dual_encoder import build_model
from nclip.objectives import REGISTRY, build_objective
from nclip.objectives.supcon import RecoObjective
from nclip.train.memory_check import probe_batch
from nclip.train.step import TrainStep, _term_vector

from conftest import micro_objective, micro_sizes

META = torch.device("meta")
B, STEPS = 8, 5

# the step's options that add work to an objective's path: name -> (objective, overrides)
VARIANTS = {
    "xclip-warmup": ("xclip", ["objective.nclip_warmup_start=1", "objective.nclip_warmup_steps=3"]),
    "cmsf-semi": ("cmsf", ["objective.constraint=semi"]),
    "cmsf-labels": ("cmsf", ["objective.constraint=labels"]),
    "cmsf-top-all": ("cmsf", ["objective.k=null"]),
    "supcon-queue": ("supcon", ["objective.queue_size=32"]),
    "paco-queue": ("paco", ["objective.queue_size=32"]),
    "reco-paco-queue": ("reco", ["objective.queue_size=32", "objective.base=paco"]),
    "clip_supcon-reco-both": ("clip_supcon", ["objective.aux=reco", "objective.side=both"]),
    "protoclip-no-external": ("protoclip", ["objective.w_ext=0"]),
}
CASES = {**{name: (name, []) for name in REGISTRY}, **VARIANTS}


def _set_episode(objective, cfg) -> torch.Tensor:
    """ProtoCLIP's episode state on the meta device (what nclip.train.episodic broadcasts), with the
    batch's episode positions; prototypes in every direction, some clusters empty (``valid``)."""
    oc, m, d = objective.cfg, 2 * B, cfg.model.proto_dim
    k = {"i2t": oc.clusters, "t2i": oc.clusters, "i2e": oc.k_ext, "t2e": oc.k_ext}
    state = {}
    for direction in ("i2t", "t2i", "i2e", "t2e") if oc.use_ext else ("i2t", "t2i"):
        state[f"{direction}_centroids"] = torch.empty(k[direction], d, device=META)
        state[f"{direction}_valid"] = torch.empty(k[direction], dtype=torch.bool, device=META)
    objective.set_episode(max(oc.warmup_episodes, 0), torch.empty(m, 3, dtype=torch.long, device=META), **state)
    assert objective.proto_active()
    return torch.empty(B, dtype=torch.long, device=META)  # the rows' episode positions


def _step_on_meta(name: str, overrides: list[str]):
    cfg = resolve("micro", micro_sizes() + micro_objective(name) + [f"train.batch_size={B}", *overrides])
    cls = REGISTRY[name][1]
    model = build_model(cfg, pretrained_text=False)
    objective = build_objective(cfg.objective, cfg, label_space=label_space_for(cfg))
    step = TrainStep(model, objective).to(META).train()
    batch = probe_batch(model, cfg, B, cls.views, cls.label_request(cfg), META)
    if cls.episodic:
        batch.episode = _set_episode(objective, cfg)
    objective.before_step(3, STEPS)
    terms = step(batch)
    terms["loss"].backward()
    vector = _term_vector(terms, list(terms))  # the trainer's stack of the terms, as on every step
    objective.after_step(model, 3, STEPS, taken=torch.ones((), device=META))
    return step, terms, vector


@pytest.mark.parametrize("case", list(CASES))
def test_every_tensor_of_a_step_lives_on_the_models_device(case, monkeypatch):
    name, overrides = CASES[case]
    # torch makes no generator on the meta device: ReCo's draws (a generator seeded on the host, on
    # the labels' device) come from the default meta RNG here; the rest of its step is checked
    monkeypatch.setattr(RecoObjective, "generator", lambda self, device: None)
    step, terms, vector = _step_on_meta(name, overrides)
    assert not {k: str(v.device) for k, v in terms.items() if v.device != META}, "terms off the model's device"
    assert vector.device == META and vector.shape == (len(terms),)
    trainable = [p for p in step.parameters() if p.requires_grad]
    assert trainable and all(p.grad is None or p.grad.device == META for p in trainable)
    assert all(p.grad is not None for p in step.objective.parameters() if p.requires_grad), "unused parameters"
    assert all(b.device == META for b in step.buffers())


def test_a_cpu_tensor_in_the_step_fails_on_the_meta_device(monkeypatch):
    """The check is not blind: xCLIP's warm-up weight made on the CPU, as it once was, fails."""
    from nclip.objectives.nclip import XclipObjective

    original = XclipObjective.forward

    def forward(self, out, batch=None):
        terms = original(self, out, batch)
        terms["nclip/lambda"] = torch.tensor(0.5)  # torch.tensor(w) made on the CPU: a crash on CUDA
        return terms

    monkeypatch.setattr(XclipObjective, "forward", forward)
    with pytest.raises((RuntimeError, NotImplementedError), match="device|meta"):
        _step_on_meta("xclip", VARIANTS["xclip-warmup"][1])


def test_a_host_read_in_the_step_fails_on_the_meta_device(monkeypatch):
    """... and so does a read of a device value on the host (a sync on a GPU)."""
    from nclip.objectives.clip import ClipObjective

    original = ClipObjective.forward

    def forward(self, out, batch=None):
        terms = original(self, out, batch)
        if terms["loss"] > 0:  # a bool() of a device tensor
            pass
        return terms

    monkeypatch.setattr(ClipObjective, "forward", forward)
    with pytest.raises((RuntimeError, NotImplementedError)):
        _step_on_meta("clip", [])
