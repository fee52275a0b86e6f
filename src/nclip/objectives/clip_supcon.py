"""A label-aware auxiliary term beside CLIP or xCLIP: ``clip_supcon``.

    L = w_clip·L_CLIP [+ w_nclip·L_nCLIP]  +  w_supcon·Σ_{side} L_aux(side)

- the contrastive base (``contrastive``): ``clip``, InfoNCE on the CLIP heads (xCLIP paper Eq. 1;
  w_clip = 1), or ``xclip``, Eq. 5: λ_CLIP·L_CLIP + λ_nCLIP·L_nCLIP on the separate nCLIP head
  (Algorithm 1, with λ1, λ2; xCLIP's weights λ_CLIP = 0.2, λ_nCLIP = 1), computed by the same
  functions as the ``xclip`` objective (:func:`functional.clip_terms`,
  :func:`nclip.objectives.nclip.nclip_head_terms`);
- the auxiliary loss (``aux``) of the OmniBenchmark paper: SupCon (Eq. 2), PaCo (Eq. 3, its own
  learnable class centres per side) or ReCo (Eq. 7 on SupCon or PaCo, ``reco_base``; Eq. 5's
  Bernoulli mask drawn over the global batch from the seeded (seed, step, forward) stream);
  the modules of :mod:`nclip.objectives.supcon` compute it (:meth:`SupconObjective.contrast`);
- the side (``side``): ``image``, the "supcon" head's projection MLP on the image tower (Khosla
  et al.'s projection; ``model.supcon_dim``); ``text``, the CLIP head's projected text embeddings
  of the captions (``model.embed_dim``); ``both``, the sum of the two. The positives of an anchor
  are the other rows of its class: on tagging data (xCLIP Sec. 4.3) captions of one class written
  with different templates are positives of each other on the text side.

One view per image (``views = 1``): the candidates A(i) are the other rows of the (global) batch,
and an anchor whose class is alone in the batch has no positive and contributes nothing (Eq. 2's
1/|P(i)| over an empty set; see :mod:`nclip.objectives.functional.supcon`).

Every term is computed in float32 (the trainer casts the model's outputs once).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from nclip.batch import Batch
from nclip.objectives import functional
from nclip.objectives.base import (
    BranchWeights,
    ClipReduction,
    CollapseWatch,
    EncoderOutput,
    EntropyWeights,
    LabelRequest,
    LabelSpace,
    Objective,
    class_count,
)
from nclip.objectives.nclip import nclip_head_terms
from nclip.objectives.supcon import (
    _ALPHA_DOC,
    _BETA_DOC,
    _K_DOC,
    _TAU_DOC,
    PacoConfig,
    PacoObjective,
    RecoConfig,
    RecoObjective,
    SupconConfig,
    SupconFields,
    SupconObjective,
    _check_labelled_with_hierarchy,
)

SIDES = {"image": ("image",), "text": ("text",), "both": ("image", "text")}
XCLIP_W_CLIP = BranchWeights.model_fields["w_clip"].default  # λ_CLIP of xCLIP's Eq. 5 (0.2)
_TEXT_STREAM = 0x7E47  # the text side's ReCo draws: a stream of its own beside the image side's

# settings that only one choice reads: setting them otherwise is a mistake worth one line
_ONLY_FOR = {
    "w_nclip": ("contrastive", ("xclip",)), "lambda1": ("contrastive", ("xclip",)),
    "lambda2": ("contrastive", ("xclip",)),
    "temperature": ("aux", ("supcon", "reco")),
    "reco_alpha": ("aux", ("reco",)), "reco_base": ("aux", ("reco",)), "hierarchy": ("aux", ("reco",)),
}


class ClipSupconConfig(SupconFields, EntropyWeights, ClipReduction):
    name: Literal["clip_supcon"] = "clip_supcon"
    contrastive: Literal["clip", "xclip"] = Field("clip", title="base", description="the contrastive objective "
                                                  "beside the auxiliary term: clip (InfoNCE) or xclip (Eq. 5)")
    aux: Literal["supcon", "paco", "reco"] = Field("supcon", title="aux", description="the auxiliary label-aware "
                                                   "loss: SupCon (Eq. 2), PaCo (Eq. 3) or ReCo (Eq. 7)")
    side: Literal["image", "text", "both"] = Field("image", title="side", description="where the auxiliary term "
                                                   "applies: the image supcon head, the projected text "
                                                   "embeddings of the captions, or both (summed)")
    w_clip: float | None = Field(None, ge=0, title="w_CLIP", description="weight of InfoNCE; None: 1 beside clip, "
                                 "xCLIP's λ_CLIP = 0.2 beside xclip")
    w_nclip: float = Field(1.0, ge=0, title="λ_nCLIP", description="λ_nCLIP of Eq. 5 (contrastive xclip)")
    w_supcon: float = Field(1.0, ge=0, title="w_aux", description="weight of the auxiliary term (per side)")
    paco_alpha: float = Field(functional.PACO_ALPHA, ge=0, title="α_PaCo", description=_ALPHA_DOC)
    paco_beta: float = Field(functional.PACO_BETA, ge=0, title="β_PaCo", description=_BETA_DOC)
    paco_temperature: float = Field(functional.PACO_TEMPERATURE, gt=0, title="τ_PaCo", description=_TAU_DOC)
    num_classes: int | None = Field(None, ge=1, title="K", description=_K_DOC + " (PaCo)")
    reco_alpha: float = Field(1.0, ge=0, title="α", description="weight of L_ReCo in Eq. 7 (paper: 1)")
    reco_base: Literal["supcon", "paco"] = Field("supcon", title="base_ReCo", description="L_SupCon or L_PaCo "
                                                 "in Eq. 7")
    hierarchy: str | None = Field(None, title="hierarchy", description="class hierarchy file for ReCo's s "
                                  "(Eq. 4); None: the data source's built-in hierarchy")

    def _changed(self, field: str) -> bool:
        # a run's config.yaml lists every field at its default: only a changed value is a choice
        return getattr(self, field) != type(self).model_fields[field].default

    @model_validator(mode="after")
    def _settings_in_use(self) -> ClipSupconConfig:
        for field, (choice, values) in _ONLY_FOR.items():
            if self._changed(field) and getattr(self, choice) not in values:
                raise ValueError(f"{field} is only read with {choice} {' or '.join(values)} "
                                 f"(this config has {choice} {getattr(self, choice)})")
        paco_fields = [f for f in ("paco_alpha", "paco_beta", "paco_temperature", "num_classes") if self._changed(f)]
        if paco_fields and not self.uses_paco:
            raise ValueError(f"{paco_fields[0]} is only read with aux paco, or aux reco with reco_base paco")
        if self.queue_size and self.side != "image":
            raise ValueError("queue_size: the queue holds image-side projections only (side image)")
        return self

    @property
    def uses_paco(self) -> bool:
        return self.aux == "paco" or (self.aux == "reco" and self.reco_base == "paco")

    @property
    def clip_weight(self) -> float:
        """w_clip, or its default for the contrastive base (1 beside CLIP, xCLIP's 0.2 beside xCLIP)."""
        if self.w_clip is not None:
            return self.w_clip
        return XCLIP_W_CLIP if self.contrastive == "xclip" else 1.0

    def aux_config(self) -> SupconFields:
        """The config of the auxiliary module (:mod:`nclip.objectives.supcon`) these settings describe."""
        shared = {"label_key": self.label_key, "label_noise": self.label_noise, "queue_size": self.queue_size,
                  "global_batch": self.global_batch}
        if self.aux == "supcon":
            return SupconConfig(**shared, temperature=self.temperature)
        if self.aux == "paco":
            return PacoConfig(**shared, temperature=self.paco_temperature, alpha=self.paco_alpha,
                              beta=self.paco_beta, num_classes=self.num_classes)
        return RecoConfig(**shared, temperature=self.temperature, reco_alpha=self.reco_alpha, base=self.reco_base,
                          hierarchy=self.hierarchy, paco_alpha=self.paco_alpha, paco_beta=self.paco_beta,
                          paco_temperature=self.paco_temperature, num_classes=self.num_classes)


def _aux_module(cfg: ClipSupconConfig, dim: int, seed: int, label_space: LabelSpace | None) -> SupconObjective:
    """One side's auxiliary module, with PaCo's centres [K, dim] and ReCo's s from ``label_space``."""
    aux = cfg.aux_config()
    if cfg.aux == "supcon":
        return SupconObjective(aux, dim=dim, seed=seed)
    k = class_count(aux, label_space) if cfg.uses_paco else None
    if cfg.aux == "paco":
        return PacoObjective(aux, dim=dim, seed=seed, num_classes=k)
    similarity = label_space.similarity if label_space is not None else None
    return RecoObjective(aux, dim=dim, seed=seed, similarity=similarity, num_classes=k)


class ClipSupconObjective(Objective):
    """w_clip·L_CLIP (+ w_nclip·L_nCLIP beside xCLIP) + w_supcon·L_aux on the image side, the text
    side or both, one view per image (see the module docstring). The auxiliary modules are
    ``image_aux`` and ``text_aux`` (present for their side only); their terms are logged as
    ``<aux>/...`` (image) and ``<aux>_text/...`` (text)."""

    heads = frozenset({"clip", "nclip", "supcon"})  # the most it builds: heads_for(cfg) says which
    zero_shot = "clip"
    views = 1
    needs_label_space = True

    def __init__(self, cfg: ClipSupconConfig, dim: int = 128, text_dim: int | None = None, seed: int = 0,
                 label_space: LabelSpace | None = None):
        super().__init__()
        self.cfg = cfg
        sides = SIDES[cfg.side]
        if "image" in sides:
            self.image_aux = _aux_module(cfg, dim, seed, label_space)
        if "text" in sides:
            # a draw stream of its own, so that the two sides' ReCo masks are independent
            self.text_aux = _aux_module(cfg, dim if text_dim is None else text_dim, seed + _TEXT_STREAM, label_space)

    @classmethod
    def build(cls, cfg: ClipSupconConfig, run_cfg=None, label_space: LabelSpace | None = None) -> ClipSupconObjective:
        if run_cfg is None:
            return cls(cfg, label_space=label_space)
        m = run_cfg.model
        return cls(cfg, dim=m.supcon_dim, text_dim=m.embed_dim, seed=run_cfg.seed, label_space=label_space)

    def before_step(self, step: int, total_steps: int) -> None:
        for side in SIDES[self.cfg.side]:  # ReCo's draws are keyed by the step
            getattr(self, f"{side}_aux").before_step(step, total_steps)

    @classmethod
    def heads_for(cls, cfg: ClipSupconConfig) -> frozenset[str]:
        heads = {"clip"} | ({"nclip"} if cfg.contrastive == "xclip" else set())
        return frozenset(heads | ({"supcon"} if "image" in SIDES[cfg.side] else set()))

    @classmethod
    def collapse_watch(cls, cfg: ClipSupconConfig) -> CollapseWatch | None:
        return CollapseWatch("nclip", cfg.lambda1, cfg.lambda2) if cfg.contrastive == "xclip" else None

    @classmethod
    def check_run(cls, run_cfg) -> None:
        _check_labelled_with_hierarchy(run_cfg, wants_hierarchy=cls.hierarchy_request(run_cfg.objective) is not None)

    @classmethod
    def hierarchy_request(cls, cfg: ClipSupconConfig) -> str | None:
        return (cfg.hierarchy or "builtin") if cfg.aux == "reco" else None

    @classmethod
    def label_request(cls, run_cfg) -> LabelRequest | None:
        return SupconObjective.label_request(run_cfg)

    def forward(self, out: EncoderOutput, batch: Batch) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        labels = batch.labels
        if labels is None:
            raise ValueError("clip_supcon needs the batch's labels")
        clip = functional.clip_terms(out.image["clip"], out.text["clip"], out.logit_scale,
                                     global_batch=cfg.global_batch, reduction=cfg.clip_reduction)
        loss = cfg.clip_weight * clip["loss"]
        logged = {f"clip/{k}": v for k, v in clip.items()}
        if cfg.contrastive == "xclip":
            nclip = nclip_head_terms(out, cfg)
            loss = loss + cfg.w_nclip * nclip["loss"]
            logged.update({f"nclip/{k}": v for k, v in nclip.items()})
        for side in SIDES[cfg.side]:
            aux = getattr(self, f"{side}_aux")
            if side == "image":
                terms = aux.supcon_terms(out, labels)  # the "supcon" head's projections [B, 1, D]
            else:
                if "clip" not in out.text:
                    raise ValueError("clip_supcon on the text side needs the CLIP head's text embeddings")
                terms = aux.contrast(out.text["clip"][:, None], labels)  # [B, 1, D]: one caption per row
                terms = {k.replace(f"{aux.prefix}/", f"{aux.prefix}_text/", 1): v for k, v in terms.items()}
            loss = loss + cfg.w_supcon * terms[f"{aux.prefix}{'' if side == 'image' else '_text'}/loss"]
            logged.update(terms)
        return {"loss": loss, **logged}
