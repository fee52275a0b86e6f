"""CMSF (Constrained Mean Shift, Sec. 2, Eq. 1) as trainer objectives: ``cmsf`` (image-only) and
``clip_cmsf`` (w_clip·InfoNCE + w_cmsf·CMSF on the image side). The paper's baselines are beside it:
``xent``, the supervised cross-entropy of Fig. 3, in :mod:`nclip.objectives.xent`; ProtoNW and
FrzProto (Sec. 2.1.1) in :mod:`nclip.objectives.cmsf_baselines` (ProtoNW subclasses :class:`CmsfObjective`).

What the rest of nclip does for them (declared by the class attributes, see :class:`Objective`):

- the model builds the "cmsf" head: online projection + predictor and a momentum copy of the image
  tower and projection (:class:`nclip.models.dual_encoder.DualEncoder`); the data gives two views
  per image (``views = 2``: strong for the online branch, weak for the target) and, on labelled
  data (:func:`nclip.defaults.has_labels`), the rows' training and clean labels (:meth:`label_request`);
- the objective holds the memory bank M (:class:`~nclip.objectives.cmsf_bank.MemoryBank`, buffers:
  checkpointed with the objective, restored by the trainer when a step is skipped), computes
  :func:`functional.cmsf_terms` on (v, u, M before this batch) and then enqueues the batch's targets
  of every rank (training only);
- :meth:`after_step` moves the target branch: θf ← m·θf + (1 − m)·θg with m =
  :func:`momentum_at` (step, ``train.steps``), constant 0.99 (Sec. 2.1.2) or BYOL's cosine ramp to 1.

Constraints (``constraint``): ``labels`` (Sec. 2, supervised), ``noisy_labels`` (Sec. 2.2: the same
with ``label_noise`` of the training labels corrupted, seeded, for Fig. 3), ``semi`` (Sec. 2.1.5: a
``labelled_share`` of the rows keep their label; two equal-size banks, labelled and all rows),
``cross_modal`` (Sec. 2.3: the candidates are the ``k_prime`` nearest neighbours of the query in a
frozen second embedding — by default the captions embedded by the bundled MiniLM, see
:mod:`nclip.train.frozen_embedding` — and S is the top-k of u among them), ``none`` (MSF).

Cross-modal bookkeeping: the paper keeps a second memory bank M_c of the frozen embeddings in M's
order. Here the frozen embedding is a fixed function of the sample (the frozen encoder sees the
un-augmented caption or image), so the bank keeps each row's dataset index (``index_bank``) and
M_c is looked up in the table the trainer attaches (:meth:`attach_frozen_embedding`): the same
M_c, in M's order, at a fraction of the memory.

Diagnostics: ``cmsf/purity`` (share of the selected neighbours whose *clean* label is the query's:
Fig. 2's argument for top-k under noise; labelled data only (for a CSV or folder source the clean
label is the label itself), not in the semi setting),
``cmsf/bank_fill``, ``cmsf/constrained_size`` (mean |M̂|), ``cmsf/neighbours`` (mean |S|),
``cmsf/momentum`` (the m of this step's update).

The bank's width is the model's ``model.cmsf_dim``: :meth:`build` takes it from the run config.
Inputs arrive in float32 (cast by the trainer), and the loss is computed in float32.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from nclip.batch import Batch
from nclip.defaults import MAP_SOURCES, has_labels, unlabelled_reason
from nclip.objectives import functional
from nclip.objectives.base import (
    ClipReduction,
    EncoderOutput,
    FrozenEmbedding,
    LabelRequest,
    Objective,
    ObjectiveConfig,
)
from nclip.objectives.cmsf_bank import MemoryBank
from nclip.objectives.momentum import momentum_at, momentum_update

LABELLED = ("labels", "noisy_labels", "semi")  # the constraints that read training labels


class LabelFields(ObjectiveConfig):
    """Mixin: which labels of the data the run trains on, and their noise."""

    label_key: str | None = Field(None, title="labels", description="label kind (digits: digit; synthetic: shape, "
                                  "colour, count, realm, size; csv/folder: label); None: the source's main one")
    label_noise: float = Field(0.0, ge=0, le=1, title="noise", description="share of training labels corrupted "
                               "uniformly at random, seeded (Sec. 2.2, Fig. 3)")


class BankFields(LabelFields):
    """Mixin: the memory bank M of momentum targets and the target momentum, shared by CMSF and its
    ProtoNW baseline (:mod:`nclip.objectives.cmsf_baselines`)."""

    bank_size: int = Field(128_000, ge=1, title="|M|", description="memory bank rows (Sec. 3: 128k)")
    momentum: float = Field(0.99, ge=0, le=1, title="m", description="target momentum (Sec. 2.1.2: 0.99)")
    momentum_schedule: Literal["constant", "cosine"] = Field("constant", title="m schedule",
                                                             description="cosine: BYOL's ramp to 1")


class CmsfFields(BankFields):
    """The CMSF settings shared by ``cmsf`` and ``clip_cmsf`` (defaults: the paper's Sec. 3)."""

    k: int | None = Field(10, ge=1, title="k", description="neighbours in the top-k (Sec. 2.1.2: 10); None: top-all")
    constraint: Literal["none", "labels", "noisy_labels", "semi", "cross_modal"] = Field(
        "labels", title="constraint", description="none = MSF; labels (Sec. 2); noisy_labels (Sec. 2.2); "
        "semi (Sec. 2.1.5); cross_modal (Sec. 2.3: neighbours in a frozen embedding of the captions)")
    labelled_share: float = Field(0.1, gt=0, le=1, title="labelled", description="semi: share of rows with a label")
    include_target: bool = Field(True, title="u ∈ S", description="u itself among its neighbours (Tab. 2e: false)")
    k_prime: int = Field(10, ge=1, title="n", description="cross_modal: neighbours in the frozen embedding "
                         "(the paper's n; Tab. 3: n = 10 with k = 5)")
    constraint_encoder: str | None = Field(None, title="frozen encoder", description="cross_modal: None = the "
                                           "bundled MiniLM on the captions; a local transformers encoder directory "
                                           "(captions), or an nclip run or model directory (see modality)")
    constraint_modality: Literal["text", "image"] = Field("text", title="frozen modality", description=(
        "cross_modal: what the frozen encoder embeds, the captions or the un-augmented images (nclip directories)"))

    @model_validator(mode="after")
    def _consistent(self):
        if self.label_noise > 0 and self.constraint != "noisy_labels":
            raise ValueError(f"label_noise {self.label_noise} needs constraint noisy_labels (got {self.constraint})")
        if self.constraint != "cross_modal" and (self.constraint_encoder is not None
                                                 or self.constraint_modality != "text"):
            raise ValueError("constraint_encoder and constraint_modality need constraint cross_modal "
                             f"(got {self.constraint})")
        return self


def _check_cmsf_run(cfg: CmsfFields, run_cfg) -> None:
    batch = run_cfg.train.batch_size
    if cfg.bank_size < batch:
        raise ValueError(f"objective.bank_size {cfg.bank_size} is smaller than the batch (train.batch_size {batch})")
    if cfg.constraint in LABELLED and not has_labels(run_cfg.data):
        raise ValueError(f"objective.constraint {cfg.constraint} needs labelled data, but "
                         f"{unlabelled_reason(run_cfg.data)}")
    if cfg.constraint == "cross_modal" and run_cfg.data.source not in MAP_SOURCES:
        raise ValueError(f"objective.constraint cross_modal needs the captions of a map-style source "
                         f"({', '.join(MAP_SOURCES)}), not data.source {run_cfg.data.source}")


def _label_request(cfg, run_cfg) -> LabelRequest | None:
    constraint = getattr(cfg, "constraint", None)
    if constraint == "cross_modal":  # labels only for the purity diagnostic; the frozen embedding always
        return LabelRequest(cfg.label_key, optional=True,
                            frozen=FrozenEmbedding(cfg.constraint_encoder, cfg.constraint_modality))
    if not has_labels(run_cfg.data):
        return None  # no labels: the label constraints are refused by check_run, purity is not logged
    labelled = cfg.labelled_share if constraint == "semi" else 1.0
    return LabelRequest(cfg.label_key, cfg.label_noise, labelled)


class CmsfConfig(CmsfFields):
    name: Literal["cmsf"] = "cmsf"


class ClipCmsfConfig(CmsfFields, ClipReduction):
    name: Literal["clip_cmsf"] = "clip_cmsf"
    w_clip: float = Field(1.0, ge=0, title="w_CLIP", description="weight of InfoNCE")
    w_cmsf: float = Field(1.0, ge=0, title="w_CMSF", description="weight of the image-side CMSF loss")


class CmsfObjective(Objective):
    """Image-only CMSF: L = Eq. (1) on v (online + predictor, strong view) and u (target, weak view)."""

    heads = frozenset({"cmsf"})
    sgd_probe_recipe = "cmsf"  # CMSF Sec. 4 "Linear IN-1k" (CompRess)
    zero_shot = None  # no text-aligned head: evaluated by k-NN and linear probes
    views = 2

    def __init__(self, cfg: CmsfFields, dim: int = 512, labelled_source: bool = True):
        super().__init__()
        self.cfg, self.labelled_source = cfg, labelled_source
        self.bank = MemoryBank(dim, cfg.bank_size)  # M: targets and training labels
        # clean labels of M's rows, in M's order, for the purity diagnostic (a width-1 bank of ones)
        self.true_bank = MemoryBank(1, cfg.bank_size)
        if cfg.constraint == "semi":  # Sec. 2.1.5: a second, equal-size bank of the labelled rows
            self.labelled_bank = MemoryBank(dim, cfg.bank_size)
        if cfg.constraint == "cross_modal":  # the dataset index of M's rows: M_c = frozen[index] (module doc)
            self.index_bank = MemoryBank(1, cfg.bank_size)
            self.frozen: torch.Tensor | None = None  # [N_train, Da], attached by the trainer
        self.register_buffer("next_momentum", torch.tensor(float(cfg.momentum)))

    @classmethod
    def build(cls, cfg: CmsfFields, run_cfg=None) -> CmsfObjective:
        if run_cfg is None:
            return cls(cfg)
        return cls(cfg, dim=run_cfg.model.cmsf_dim, labelled_source=has_labels(run_cfg.data))

    @classmethod
    def check_run(cls, run_cfg) -> None:
        _check_cmsf_run(run_cfg.objective, run_cfg)

    @classmethod
    def label_request(cls, run_cfg) -> LabelRequest | None:
        return _label_request(run_cfg.objective, run_cfg)

    def attach_frozen_embedding(self, table: torch.Tensor) -> None:
        if self.cfg.constraint != "cross_modal":
            raise ValueError(f"only the cross_modal constraint uses a frozen embedding, not {self.cfg.constraint}")
        self.frozen = table.to(self.bank.bank.device, torch.float32)  # once, not per step: the objective's device

    def forward(self, out: EncoderOutput, batch: Batch) -> dict[str, torch.Tensor]:
        terms = self.cmsf_terms(out, batch)
        return {"loss": terms["cmsf/loss"], **terms}

    def _cross_modal_mask(self, index: torch.Tensor | None, g: bool) -> torch.Tensor:
        """Sec. 2.3: [B, C] the n = k_prime nearest candidates of each query in the frozen embedding."""
        if self.frozen is None or index is None:
            raise ValueError("constraint cross_modal needs the frozen embedding (attach_frozen_embedding) and the "
                             "batch's dataset indices")
        bank = self.index_bank.rows()  # unwritten rows: index NO_LABEL, not valid (no neighbour)
        cand = functional.cmsf_candidates(index, bank.labels.clamp(min=0), global_batch=g)  # [C]
        valid = torch.cat([bank.valid.new_ones(cand.shape[0] - bank.valid.shape[0]), bank.valid])  # [C]
        return functional.topk_constraint(self.frozen[index], self.frozen[cand], self.cfg.k_prime, valid)

    def cmsf_terms(self, out: EncoderOutput, batch: Batch) -> dict[str, torch.Tensor]:
        """The CMSF loss and diagnostics (``cmsf/...``) of a batch (its labels and dataset indices, when
        the constraint reads them); enqueues it when training."""
        cfg = self.cfg
        labels, true_labels, index = batch.labels, batch.true_labels, batch.index
        v, u = out.image.get("cmsf_pred"), out.image.get("cmsf_target")
        if v is None or u is None:
            raise ValueError("CMSF needs the online prediction v and the target u: a model with a 'cmsf' head "
                             "and pixels of two views [B, 2, 3, S, S]")
        if cfg.constraint in LABELLED and labels is None:
            raise ValueError(f"constraint {cfg.constraint} needs the batch's labels")
        g = cfg.global_batch
        view = self.bank.rows()  # fixed shapes: the rows not written yet are masked out (bank_valid)
        bank, kw = view.embeddings, {"bank_valid": view.valid}
        if cfg.constraint in ("labels", "noisy_labels"):
            kw.update(query_labels=labels, bank_labels=view.labels)
        elif cfg.constraint == "semi":
            lab = self.labelled_bank.rows()
            bank = torch.cat([lab.embeddings, view.embeddings])
            kw = {"bank_valid": torch.cat([lab.valid, view.valid]),
                  "constraint_mask": functional.semi_supervised_constraint(labels, lab.labels, view.embeddings.shape[0],
                                                                           global_batch=g)}
        elif cfg.constraint == "cross_modal":
            kw["constraint_mask"] = self._cross_modal_mask(index, g)
        if true_labels is not None and cfg.constraint != "semi" and self.labelled_source:
            kw.update(true_query_labels=true_labels, true_bank_labels=self.true_bank.rows().labels)
        t = functional.cmsf_terms(v, u, bank, k=cfg.k, include_target=cfg.include_target, global_batch=g, **kw)
        if self.training:  # the trainer's forward; evaluation leaves M alone
            self.bank.enqueue(u, labels, global_batch=g)
            if true_labels is not None:
                self.true_bank.enqueue(torch.ones_like(u[:, :1]), true_labels, global_batch=g)
            if cfg.constraint == "semi":
                self.labelled_bank.enqueue(u, labels, keep=labels != functional.UNLABELLED, global_batch=g)
            if cfg.constraint == "cross_modal":
                self.index_bank.enqueue(torch.ones_like(u[:, :1]), index, global_batch=g)
        terms = {f"cmsf/{k}": val for k, val in t.items()}
        terms["cmsf/bank_fill"] = self.bank.filled.float() / self.bank.size
        terms["cmsf/momentum"] = self.next_momentum.clone()
        return terms

    @torch.no_grad()
    def after_step(self, model, step: int, total_steps: int, taken: torch.Tensor) -> None:
        """θf ← m·θf + (1 − m)·θg after optimizer step ``step`` (0-based), m = momentum_at(step);
        nothing moves after a skipped step (``taken`` 0, gated on the device)."""
        cfg = self.cfg
        m, head = momentum_at(step, total_steps, cfg.momentum, cfg.momentum_schedule), model.heads["cmsf"]
        momentum_update(head.target_vision, model.vision, m, taken)  # the tower's copy, then the projection's
        momentum_update(head.target_image, head.image, m, taken)
        following = momentum_at(min(step + 1, total_steps), total_steps, cfg.momentum, cfg.momentum_schedule)
        self.next_momentum.copy_(torch.where(taken.bool(), following, self.next_momentum))


class ClipCmsfObjective(CmsfObjective):
    """w_clip·L_CLIP + w_cmsf·L_CMSF: InfoNCE on the CLIP heads (image side on the strong view) and
    CMSF on the image side, so the image tower mean-shifts within its constrained neighbourhoods."""

    heads = frozenset({"clip", "cmsf"})
    zero_shot = "clip"

    def forward(self, out: EncoderOutput, batch: Batch) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        clip = functional.clip_terms(out.image["clip"], out.text["clip"], out.logit_scale,
                                     global_batch=cfg.global_batch, reduction=cfg.clip_reduction)
        terms = self.cmsf_terms(out, batch)
        loss = cfg.w_clip * clip["loss"] + cfg.w_cmsf * terms["cmsf/loss"]
        return {"loss": loss, **{f"clip/{k}": v for k, v in clip.items()}, **terms}
