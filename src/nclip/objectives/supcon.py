"""SupCon, PaCo and ReCo (OmniBenchmark paper, Sec. 4.1–4.3, Eq. 2–7) as trainer objectives:
``supcon``, ``paco``, ``reco`` (image-only). Beside CLIP or xCLIP, on either side, they are the
auxiliary term of ``clip_supcon`` (:mod:`nclip.objectives.clip_supcon`), which builds them and calls
:meth:`SupconObjective.contrast` on the embeddings of its side.

What the rest of nclip does for them (declared by the class attributes, see :class:`Objective`):

- the model builds the "supcon" head (:class:`nclip.heads.builtin.SupconHead`): SupCon's projection
  MLP on the *online* image tower, applied to every view (``out.image["supcon"]`` [B, V, D], sizes
  ``model.supcon_hidden`` / ``model.supcon_dim``);
- the data gives two views per image (``views = 2``: the 2N multi-view batch of Eq. 1, both views
  anchors) and the rows' training labels (:meth:`label_request`) of any labelled source
  (:func:`nclip.defaults.has_labels`: the built-in data, a class-folder tree, a CSV with
  ``data.csv_label_key``);
- the trainer hands the run's label space in at construction (``needs_label_space``; built by
  :func:`nclip.data.labels.label_space_for`, since objectives may not import the data layer): the
  class count for PaCo's centres and, for ReCo, the [C, C] normalised class similarity s (Eq. 4) of
  the file ``hierarchy`` names or, on built-in data only, of the source's built-in hierarchy.

State: PaCo's class centres C (a parameter [K, D], optimised with the model: the trainer's optimizer
takes the objective's parameters, and DDP averages them); the optional queue of past embeddings
(``queue_size`` > 0; a :class:`~nclip.objectives.cmsf_bank.MemoryBank` of every view's detached
projection and label, extra candidates as in PaCo's MoCo queue; buffers, so checkpointed and restored
when a step is skipped).

ReCo's randomness: the Bernoulli mask of Eq. (5) is drawn over the *global* multi-view batch from a
generator seeded by (``seed`` of the run, optimizer step, training forward within the step), the same
on every rank, so 2 ranks draw what 1 process draws. The step is the one the trainer announces
(:meth:`RecoObjective.before_step`), so the key is host data: no device read on the step (a draw
counter kept on the device would be one), a resumed run draws what the uninterrupted one drew, and
a skipped step has nothing to restore. Evaluation forwards draw from the current key without
advancing it.

Inputs arrive in float32 (cast by the trainer), and every loss is computed in float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from nclip.batch import Batch
from nclip.defaults import BUILTIN_SOURCES, has_labels, unlabelled_reason
from nclip.objectives import functional
from nclip.objectives.base import (
    EncoderOutput,
    LabelRequest,
    LabelSpace,
    Objective,
    ObjectiveConfig,
    class_count,
    every_row_labelled,
)
from nclip.objectives.cmsf_bank import MemoryBank

_DRAW_MIX = 0x9E3779B97F4A7C15  # golden-ratio multiplier: (seed, step, forward) → one 63-bit generator seed


class SupconFields(ObjectiveConfig):
    """Settings shared by the SupCon family: labels, temperature, queue."""

    label_key: str | None = Field(None, title="labels", description="label kind (digits: digit; synthetic: shape, "
                                  "colour, count, realm, size); None: digit / shape")
    label_noise: float = Field(0.0, ge=0, le=1, title="noise", description="share of training labels corrupted "
                               "uniformly at random, seeded")
    temperature: float = Field(functional.SUPCON_TEMPERATURE, gt=0, title="τ",
                               description="SupCon temperature (Khosla et al.: 0.1; Eq. 2 and 6 write none)")
    queue_size: int = Field(0, ge=0, title="|Q|", description="queue of past embeddings as extra candidates "
                            "(MoCo-style, as PaCo's code); 0: off")


# PaCo (Cui et al., "Parametric Contrastive Learning", ICCV 2021): the authors' ResNet-50 scripts for
# ImageNet and ImageNet-LT pass --alpha 0.05 --beta 1.0 --moco-t 0.2 (see functional.supcon)
_ALPHA_DOC = "weight of the sample positives P(i) (PaCo's code: 0.05)"
_BETA_DOC = "weight of the class-centre positive c_y (PaCo's code: 1.0)"
_TAU_DOC = "PaCo temperature (PaCo's code: --moco-t 0.2)"
_K_DOC = "class centres K; None: the classes of the run's labels"


class SupconConfig(SupconFields):
    name: Literal["supcon"] = "supcon"


class PacoConfig(SupconFields):
    name: Literal["paco"] = "paco"
    temperature: float = Field(functional.PACO_TEMPERATURE, gt=0, title="τ", description=_TAU_DOC)
    alpha: float = Field(functional.PACO_ALPHA, ge=0, title="α", description=_ALPHA_DOC)
    beta: float = Field(functional.PACO_BETA, ge=0, title="β", description=_BETA_DOC)
    num_classes: int | None = Field(None, ge=1, title="K", description=_K_DOC)


class RecoConfig(SupconFields):
    name: Literal["reco"] = "reco"
    reco_alpha: float = Field(1.0, ge=0, title="α", description="weight of L_ReCo in Eq. 7 (paper: 1)")
    base: Literal["supcon", "paco"] = Field("supcon", title="base", description="L_SupCon or L_PaCo in Eq. 7")
    hierarchy: str | None = Field(None, title="hierarchy", description="class hierarchy file (JSON or TSV) for s "
                                  "(Eq. 4); None: the built-in data's own hierarchy")
    paco_alpha: float = Field(functional.PACO_ALPHA, ge=0, title="α_PaCo", description=_ALPHA_DOC)
    paco_beta: float = Field(functional.PACO_BETA, ge=0, title="β_PaCo", description=_BETA_DOC)
    paco_temperature: float = Field(functional.PACO_TEMPERATURE, gt=0, title="τ_PaCo", description=_TAU_DOC)
    num_classes: int | None = Field(None, ge=1, title="K", description=_K_DOC + " (base paco)")


def _check_labelled(run_cfg) -> None:
    if not has_labels(run_cfg.data):
        raise ValueError(f"objective {run_cfg.objective.name} needs labelled data, but "
                         f"{unlabelled_reason(run_cfg.data)}")


def _check_labelled_with_hierarchy(run_cfg, wants_hierarchy: bool) -> None:
    """ReCo's run check: labelled data and, when the class similarity is wanted, ``objective.hierarchy``
    an existing file, or left unset on built-in data (which has its own hierarchy). Whether the file's
    classes match the data's is checked when the trainer reads both (:mod:`nclip.data.labels`)."""
    _check_labelled(run_cfg)
    path, source = run_cfg.objective.hierarchy, run_cfg.data.source
    if path is not None and not Path(path).is_file():
        raise ValueError(f"objective.hierarchy {path} is not a file")
    if wants_hierarchy and path is None and source not in BUILTIN_SOURCES:
        raise ValueError(f"objective {run_cfg.objective.name} on data.source {source} needs objective.hierarchy: a "
                         "JSON or TSV class hierarchy whose leaves are the class names (only the built-in sources, "
                         f"{', '.join(BUILTIN_SOURCES)}, have one of their own)")


class SupconObjective(Objective):
    """Image-only SupCon: L = Eq. (2) over the 2N multi-view batch of the "supcon" head."""

    heads = frozenset({"supcon"})
    zero_shot = None  # no text-aligned head: evaluated by k-NN and linear probes
    views = 2
    needs_label_space = True
    prefix = "supcon"

    def __init__(self, cfg: SupconFields, dim: int = 128, seed: int = 0):
        super().__init__()
        self.cfg, self.seed = cfg, int(seed)
        if cfg.queue_size:
            self.queue = MemoryBank(dim, cfg.queue_size)

    @classmethod
    def build(cls, cfg: SupconFields, run_cfg=None, label_space: LabelSpace | None = None) -> SupconObjective:
        if run_cfg is None:
            return cls(cfg)
        return cls(cfg, dim=run_cfg.model.supcon_dim, seed=run_cfg.seed)

    @classmethod
    def check_run(cls, run_cfg) -> None:
        _check_labelled(run_cfg)

    @classmethod
    def label_request(cls, run_cfg) -> LabelRequest | None:
        return every_row_labelled(run_cfg)

    def forward(self, out: EncoderOutput, batch: Batch) -> dict[str, torch.Tensor]:
        terms = self.supcon_terms(out, batch.labels)
        return {"loss": terms[f"{self.prefix}/loss"], **terms}

    def _features(self, out: EncoderOutput, labels: torch.Tensor | None) -> torch.Tensor:
        if "supcon" not in out.image:
            raise ValueError(f"{self.prefix} needs the 'supcon' head's projections (EncoderOutput.image['supcon'])")
        if labels is None:
            raise ValueError(f"{self.prefix} needs the batch's labels")
        return out.image["supcon"]  # [B, V, D]

    def _queue(self) -> dict:
        if not self.cfg.queue_size:
            return {}
        view = self.queue.rows()  # fixed shapes: the rows not written yet are masked out (queue_valid)
        return {"queue": view.embeddings, "queue_labels": view.labels, "queue_valid": view.valid}

    def _enqueue(self, z: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self.cfg.queue_size:
            return {}
        if self.training:  # the trainer's forward; evaluation leaves the queue alone
            v = z.shape[1]
            self.queue.enqueue(z.detach().reshape(-1, z.shape[-1]), labels.repeat_interleave(v),
                               global_batch=self.cfg.global_batch)
        return {f"{self.prefix}/queue_fill": self.queue.filled.float() / self.queue.size}

    def supcon_terms(self, out: EncoderOutput, labels: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The loss and its logged terms on the "supcon" head's projections of ``out``."""
        return self.contrast(self._features(out, labels), labels)

    def contrast(self, z: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """The loss and its logged terms (``<prefix>/loss``, ...) on projections z [B, V, D] with labels
        [B]: any side's embeddings (``clip_supcon`` also applies it to the text side's)."""
        t = functional.supcon_terms(z, labels, temperature=self.cfg.temperature, global_batch=self.cfg.global_batch,
                                    **self._queue())
        terms = {f"{self.prefix}/{k}": v for k, v in t.items()}
        return {**terms, **self._enqueue(z, labels)}


def _centres(num_classes: int, dim: int) -> torch.nn.Parameter:
    # PaCo's centres are a linear classifier's weights (nn.Linear's init, U(±1/√D)); they are
    # ℓ2-normalised by the loss, so only their directions matter
    bound = 1 / dim**0.5
    return torch.nn.Parameter(torch.empty(num_classes, dim).uniform_(-bound, bound))


class PacoObjective(SupconObjective):
    """Image-only PaCo: L = Eq. (3) with the learnable class centres ``centers`` [K, D]."""

    prefix = "paco"

    def __init__(self, cfg: PacoConfig, dim: int = 128, seed: int = 0, num_classes: int | None = None):
        super().__init__(cfg, dim, seed)
        self.centers = _centres(num_classes or class_count(cfg, None), dim)

    @classmethod
    def build(cls, cfg: PacoConfig, run_cfg=None, label_space: LabelSpace | None = None) -> PacoObjective:
        k = class_count(cfg, label_space)
        if run_cfg is None:
            return cls(cfg, num_classes=k)
        return cls(cfg, dim=run_cfg.model.supcon_dim, seed=run_cfg.seed, num_classes=k)

    def contrast(self, z: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        t = functional.paco_terms(z, labels, self.centers, alpha=cfg.alpha, beta=cfg.beta, temperature=cfg.temperature,
                                  global_batch=cfg.global_batch, check_labels=False, **self._queue())  # K ≥ classes
        terms = {f"{self.prefix}/{k}": v for k, v in t.items()}
        return {**terms, **self._enqueue(z, labels)}


class RecoObjective(SupconObjective):
    """ReCo: L = L_SupCon (or L_PaCo, ``base``) + α·L_ReCo (Eq. 7), L_ReCo = Eq. (6) over the negatives
    kept by Eq. (5)'s Bernoulli trials with P = 1 − s(ỹ_i, ỹ_k), s the [C, C] ``similarity`` buffer."""

    prefix = "reco"

    def __init__(self, cfg: RecoConfig, dim: int = 128, seed: int = 0, similarity: torch.Tensor | None = None,
                 num_classes: int | None = None):
        super().__init__(cfg, dim, seed)
        if similarity is None:
            raise ValueError("objective reco needs the class similarity s [C, C] (Eq. 4): built by the trainer from "
                             "objective.hierarchy or the data source's built-in hierarchy")
        s = torch.as_tensor(similarity, dtype=torch.float32)
        if s.ndim != 2 or s.shape[0] != s.shape[1] or bool(((s < 0) | (s > 1)).any()):
            raise ValueError(f"the class similarity must be [C, C] with values in [0, 1], got shape {tuple(s.shape)}")
        # derived from the config and the hierarchy at construction, so not checkpointed
        self.register_buffer("similarity", s, persistent=False)
        # the draw key's host parts: the announced optimizer step (-1: none yet, e.g. outside the
        # trainer) and the training forwards since (several under independent accumulation)
        self._step, self._forwards = -1, 0
        if cfg.base == "paco":
            self.centers = _centres(num_classes or s.shape[0], dim)

    @classmethod
    def build(cls, cfg: RecoConfig, run_cfg=None, label_space: LabelSpace | None = None) -> RecoObjective:
        s = label_space.similarity if label_space is not None else None
        k = class_count(cfg, label_space) if cfg.base == "paco" else None
        if run_cfg is None:
            return cls(cfg, similarity=s, num_classes=k)
        return cls(cfg, dim=run_cfg.model.supcon_dim, seed=run_cfg.seed, similarity=s, num_classes=k)

    @classmethod
    def check_run(cls, run_cfg) -> None:
        _check_labelled_with_hierarchy(run_cfg, wants_hierarchy=True)

    @classmethod
    def hierarchy_request(cls, cfg: RecoConfig) -> str | None:
        return cfg.hierarchy or "builtin"

    def before_step(self, step: int, total_steps: int) -> None:
        self._step, self._forwards = step, 0

    def generator(self, device: torch.device) -> torch.Generator:
        """The source of this forward's Bernoulli draws: seeded by (run seed, step, forward within the
        step), the same on every rank; made on the host, nothing read from the device."""
        key = ((self.seed * _DRAW_MIX + self._step + 1) * _DRAW_MIX + self._forwards) % (2**63 - 1)
        return torch.Generator(device=device).manual_seed(key)

    def contrast(self, z: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        queue = self._queue()
        rows = functional.multiview_labels(labels, z.shape[1], global_batch=cfg.global_batch)  # [N_g]
        cols = torch.cat([rows, queue["queue_labels"].to(rows)]) if queue else rows  # [N_g + Q]
        keep = functional.reco_keep_mask(rows, self.similarity, self.generator(rows.device), candidate_labels=cols,
                                         check_labels=False)  # the run's labels index s (label space)
        if self.training:
            self._forwards += 1
        paco = {}
        if cfg.base == "paco":
            paco = {"centers": self.centers, "paco_alpha": cfg.paco_alpha, "paco_beta": cfg.paco_beta,
                    "paco_temperature": cfg.paco_temperature}
        t = functional.reco_terms(z, labels, keep, alpha=cfg.reco_alpha, temperature=cfg.temperature,
                                  global_batch=cfg.global_batch, check_labels=False, **paco, **queue)
        terms = {f"{self.prefix}/{k}": v for k, v in t.items()}
        return {**terms, **self._enqueue(z, labels)}
