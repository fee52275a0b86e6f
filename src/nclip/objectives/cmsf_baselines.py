"""CMSF's supervised baselines of Sec. 2.1.1 (Tab. 1, Tab. 2c) as trainer objectives: ``protonw``
(Prototypical Networks over the memory bank) and ``frzproto`` (Frozen Prototypes). With ``xent``,
``supcon`` and ``cmsf`` (top-10 and top-all) they are the rows of the paper's Tab. 1
(``benchmarks/cmsf_baselines.yaml`` runs them as one ``nclip sweep``; docs/cmsf.md).

Why two registered objectives rather than an option of ``cmsf`` (e.g. ``objective.baseline``):

- ProtoNW shares CMSF's machinery — the online projection + predictor v, the momentum target u, the
  FIFO bank M of targets with their labels and the momentum update — and reuses it by subclassing
  :class:`~nclip.objectives.cmsf.CmsfObjective`. But none of CMSF's own settings apply to it (k, u ∈ S,
  the semi and cross-modal constraints, the purity diagnostic), while it has one CMSF lacks (τ): as
  an option they would be accepted and silently ignored, or need a refusal each. Its own typed config
  takes exactly the settings it has.
- FrzProto shares nothing with CMSF: no bank, no momentum target, one view per image, a projection
  MLP without a predictor and a frozen class matrix. Its head is the SupCon family's projection MLP
  (App. A.1 gives both the same layout: linear, BN, ReLU, linear).
- As registered objectives each row of Tab. 1 is one ``objective.name``, as ``xent`` and ``supcon``
  already are, logs under its own prefix (``protonw/``, ``frzproto/``), and is covered by the
  registry-wide tests (exact accumulation, 2 ranks) without a special case.

ProtoNW (Sec. 2.1.1, App. A.1): L = cross-entropy of softmax_c(cos(v, p_c)/τ) against the label,
p_c the mean of the class-c targets in M, "all its instances in the memory bank" (``prototypes: bank``;
``bank_and_batch`` adds the batch's targets, :func:`functional.protonw_terms`),
τ = 0.1, bank 128k (Sec. 2.1.2), target momentum 0.99 as CMSF's (the paper gives ProtoNW's no other).
The model builds the "cmsf" head; two views per image (v on the strong view, u on the weak one);
``constraint`` ``noisy_labels`` with ``label_noise`` trains on corrupted labels, as CMSF's Fig. 3.
Logged: ``protonw/loss``, ``protonw/acc`` and ``protonw/clean_acc`` (nearest prototype against the
training / clean label), ``protonw/classes`` (classes with a prototype), ``protonw/bank_fill``,
``protonw/momentum``.

FrzProto (Sec. 2.1.1, Tab. 2c "FC = MLP", App. A.1): z = MLP(backbone) on one view (``data.augment``),
L = mean_b ||ẑ_b − p̂_{y_b}||² against C random unit prototypes drawn once from the run's seed and
never trained (:func:`functional.frzproto_terms`, :func:`functional.frozen_prototypes`; a buffer, so
checkpointed). The paper's MLP is 2048 → 2048 → 2048 with a 1000 × 2048 prototype matrix on
ImageNet-1k: ``model.supcon_hidden`` / ``model.supcon_dim`` (defaults 2048 / 128; the paper-scale
preset ``cmsf-rn50-in1k`` sets 2048). ``head: fc`` is Tab. 2c's "FC" row: one linear layer
(backbone → ``model.supcon_dim``) instead of the MLP. Logged: ``frzproto/loss``, ``frzproto/acc`` and
``frzproto/clean_acc`` (the prototypes as the classifier, Sec. 2.1.3).

Both evaluate like CMSF: k-NN and linear probes of the backbone (the pre-MLP features, Tab. 2c's
point); ``nclip eval --tasks classifier`` adds FrzProto's (and Xent's) paper readout, the nearest
frozen prototype (:mod:`nclip.eval.classifier`). Inputs arrive in float32 (cast by the trainer) and the
losses are computed in float32.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from nclip.batch import Batch
from nclip.defaults import has_labels, unlabelled_reason
from nclip.objectives import functional
from nclip.objectives.base import EncoderOutput, LabelRequest, LabelSpace, Objective, class_count
from nclip.objectives.cmsf import BankFields, CmsfObjective, LabelFields, _label_request

_K_DOC = "classes C; None: the classes of the run's labels"


class ProtoNwConfig(BankFields):
    """ProtoNW (Sec. 2.1.1): prototypes of the bank's classes, a softmax over their cosines."""

    name: Literal["protonw"] = "protonw"
    constraint: Literal["labels", "noisy_labels"] = Field(
        "labels", title="labels", description="the labels that group the bank into prototypes: labels, or "
        "noisy_labels with label_noise (as CMSF's Sec. 2.2)")
    temperature: float = Field(functional.PROTONW_TEMPERATURE, gt=0, title="τ", description="softmax temperature "
                               "(App. A.1: 0.1)")
    num_classes: int | None = Field(None, ge=1, title="C", description=_K_DOC)
    prototypes: Literal["bank", "bank_and_batch"] = Field(
        "bank", title="prototypes of", description="bank: each class's mean over its instances in the memory "
        "bank (Sec. 2.1.1); bank_and_batch: the batch's targets count too, as in CMSF's search")

    @model_validator(mode="after")
    def _consistent(self):
        if self.label_noise > 0 and self.constraint != "noisy_labels":
            raise ValueError(f"label_noise {self.label_noise} needs constraint noisy_labels (got {self.constraint})")
        return self


class FrzProtoConfig(LabelFields):
    """FrzProto (Sec. 2.1.1): regress an MLP's output onto a frozen random prototype of its class."""

    name: Literal["frzproto"] = "frzproto"
    num_classes: int | None = Field(None, ge=1, title="C", description=_K_DOC)
    head: Literal["mlp", "fc"] = Field(
        "mlp", title="head", description="mlp: linear, BN, ReLU, linear (App. A.1); fc: one linear layer, "
        "Tab. 2c's 'FC' row (width model.supcon_dim)")


class ProtoNwObjective(CmsfObjective):
    """ProtoNW on CMSF's bank and momentum target: L = ``functional.protonw_terms`` (v, u, M before
    this batch); then the batch's targets of every rank are enqueued, as CMSF does."""

    needs_label_space = True

    def __init__(self, cfg: ProtoNwConfig, dim: int = 512, labelled_source: bool = True,
                 num_classes: int | None = None):
        super().__init__(cfg, dim, labelled_source)
        self.num_classes = num_classes or class_count(cfg, None)

    @classmethod
    def build(cls, cfg: ProtoNwConfig, run_cfg=None, label_space: LabelSpace | None = None) -> ProtoNwObjective:
        k = class_count(cfg, label_space)
        if run_cfg is None:
            return cls(cfg, num_classes=k)
        return cls(cfg, dim=run_cfg.model.cmsf_dim, labelled_source=has_labels(run_cfg.data), num_classes=k)

    def forward(self, out: EncoderOutput, batch: Batch) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        v, u = out.image.get("cmsf_pred"), out.image.get("cmsf_target")
        labels, true_labels = batch.labels, batch.true_labels
        if v is None or u is None or labels is None:
            raise ValueError("ProtoNW needs the online prediction v, the target u (a 'cmsf' head and pixels of two "
                             "views [B, 2, 3, S, S]) and the batch's labels")
        g = cfg.global_batch
        view = self.bank.rows()  # fixed shapes: the rows not written yet are masked out (bank_valid)
        t = functional.protonw_terms(v, u, view.embeddings, labels, view.labels, num_classes=self.num_classes,
                                     temperature=cfg.temperature, global_batch=g, bank_valid=view.valid,
                                     true_query_labels=true_labels if self.labelled_source else None,
                                     batch_in_prototypes=cfg.prototypes == "bank_and_batch")
        if self.training:  # the trainer's forward; evaluation leaves M alone
            self.bank.enqueue(u, labels, global_batch=g)
        terms = {f"protonw/{k}": val for k, val in t.items()}
        terms["protonw/bank_fill"] = self.bank.filled.float() / self.bank.size
        terms["protonw/momentum"] = self.next_momentum.clone()
        return {"loss": t["loss"], **terms}


class FrzProtoObjective(Objective):
    """FrzProto: L = ``functional.frzproto_terms`` of the "supcon" head's projection of one view
    against the frozen ``prototypes`` buffer [C, D]."""

    heads = frozenset({"supcon"})
    sgd_probe_recipe = "cmsf"  # a baseline of the CMSF paper, probed as CMSF is (Sec. 4)
    zero_shot = None  # no text-aligned head: evaluated by k-NN and linear probes
    needs_label_space = True

    def __init__(self, cfg: FrzProtoConfig, dim: int = 128, seed: int = 0, num_classes: int | None = None):
        super().__init__()
        self.cfg = cfg
        k = num_classes or class_count(cfg, None)
        self.register_buffer("prototypes", functional.frozen_prototypes(k, dim, seed))  # [C, D], never trained

    @classmethod
    def build(cls, cfg: FrzProtoConfig, run_cfg=None, label_space: LabelSpace | None = None) -> FrzProtoObjective:
        k = class_count(cfg, label_space)
        if run_cfg is None:
            return cls(cfg, num_classes=k)
        return cls(cfg, dim=run_cfg.model.supcon_dim, seed=run_cfg.seed, num_classes=k)

    @classmethod
    def check_run(cls, run_cfg) -> None:
        if not has_labels(run_cfg.data):
            raise ValueError(f"objective frzproto needs labelled data, but {unlabelled_reason(run_cfg.data)}")

    @classmethod
    def label_request(cls, run_cfg) -> LabelRequest | None:
        return _label_request(run_cfg.objective, run_cfg)

    def forward(self, out: EncoderOutput, batch: Batch) -> dict[str, torch.Tensor]:
        if "supcon" not in out.image or batch.labels is None:
            raise ValueError("FrzProto needs the 'supcon' head's projection and the batch's labels")
        t = functional.frzproto_terms(out.image["supcon"][:, 0], self.prototypes, batch.labels,
                                      true_labels=batch.true_labels)
        return {"loss": t["loss"], **{f"frzproto/{k}": v for k, v in t.items()}}


__all__ = ["FrzProtoConfig", "FrzProtoObjective", "ProtoNwConfig", "ProtoNwObjective"]
