"""Zero-shot scores as kinds registered by name: how an image is compared with a caption, or with a
class's prompt ensemble, in zero-shot classification and retrieval.

A score says which head output it reads (:attr:`Score.head`: ``encode_image(x)[head]``, the head's
own name by the outputs rule of :mod:`nclip.heads`), how it makes an embedding of that output
(:meth:`Score.embed`: what ``nclip.load(...).encode_image`` returns, ``nclip embed`` stores and the
ONNX graphs compute), how the prompts of a class ensemble into one class output
(:meth:`Score.ensemble`), how two sets of outputs compare (:meth:`Score.compare`, higher is more
similar) and the distance the report's t-SNE maps (:meth:`Score.distance`).

An objective names its score (``Objective.zero_shot``) and the plan resolves it once
(``ObjectivePlan.zero_shot``); ``nclip eval --head`` names another. Evaluation, export, embedding,
``nclip.load``, the report and the checks while training ask that object, never a table of names, so
a plugin's score on a head of its own (docs/plugins.md) is evaluated as a built-in one is.

The built-in scores: ``clip`` (the cosine of the CLIP head's ℓ2-normalised outputs), ``nclip``
(nCLIP's −L_CE on the nCLIP head, xCLIP Sec. 3.1, symmetrised or image→text: the run's
``eval.nclip_score``) and ``yclip`` (yCLIP's S on the nCLIP head, App. B.2 Eq. 2). Every score
computes in float32 (docs/precision.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F

from nclip.defaults import NCLIP_SCORES
from nclip.heads.base import add_named
from nclip.objectives.functional import nclip_similarity, yclip_similarity


@dataclass(frozen=True)
class Score:
    """One zero-shot score. Subclasses set :attr:`name`, :attr:`head` and :attr:`normalised` and
    define :meth:`ensemble` and :meth:`compare`; one with options (nCLIP's direction) takes them from
    an evaluation config in :meth:`configured` and records them in :meth:`options`."""

    name: ClassVar[str]  # Objective.zero_shot, nclip eval --head, results.json's zero_shot_head
    head: ClassVar[str]  # the head whose output it reads: encode_image(x)[head], encode_text(...)[head]
    normalised: ClassVar[bool]  # its embedding is the output ℓ2-normalised (else the output as it is)
    distance_name: ClassVar[str] = "the score's distance"  # the report's t-SNE title

    def configured(self, eval_cfg) -> Score:
        """This score with the options of an evaluation config (the run config's ``eval`` section, or
        ``nclip eval``'s settings: both have ``nclip_score``); itself for a score without options."""
        return self

    def options(self) -> dict[str, str]:
        """The options that change its values, as results and onnx_config.json record them."""
        return {}

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """[N, D] the embedding of the head's outputs x [N, D]."""
        return F.normalize(x, dim=-1) if self.normalised else x

    def ensemble(self, prompts: torch.Tensor) -> torch.Tensor:
        """[C, D] one output per class from its prompts' outputs [C, T, D]."""
        raise NotImplementedError

    def compare(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """[N, M] scores of image outputs [N, D] against text (or class) outputs [M, D], higher is more
        similar; the outputs as the head gives them or as :meth:`embed` makes them, alike."""
        raise NotImplementedError

    def distance(self, x: torch.Tensor) -> torch.Tensor:
        """[N, N] float64 distances between outputs x [N, D] for the report's t-SNE: by default the
        score's own, d(i, j) = (s(i, i) + s(j, j)) / 2 − (s(i, j) + s(j, i)) / 2, which is 1 − cos for a
        cosine and the symmetrised KL divergence for −L_CE."""
        s = self.compare(x, x).double()
        self_score = s.diagonal()
        return (self_score[:, None] + self_score[None, :]) / 2 - (s + s.T) / 2


@dataclass(frozen=True)
class CosineScore(Score):
    """The cosine of ℓ2-normalised outputs, the prompts of a class ensembled as CLIP's (each prompt
    embedding normalised, averaged, renormalised: CLIP Sec. 3.1.4). A subclass names the head."""

    normalised = True
    distance_name = "cosine distance"

    def ensemble(self, prompts):
        return F.normalize(F.normalize(prompts, dim=-1).mean(dim=1), dim=-1)

    def compare(self, image, text):
        return F.normalize(image, dim=-1) @ F.normalize(text, dim=-1).T

    def distance(self, x):
        xn = F.normalize(x.double(), dim=1)
        return 1.0 - xn @ xn.T


@dataclass(frozen=True)
class DistributionScore(Score):
    """A score of the nCLIP head's distributions p = softmax(h): its embedding is the logits h as they
    are (normalising them would change p); a class is the mean of its prompts' distributions, whose
    log is its logits (softmax(log p̄) = p̄); t-SNE maps the symmetrised KL divergence."""

    head = "nclip"
    normalised = False
    distance_name = "symmetrised KL of the nCLIP distributions"

    def ensemble(self, prompts):
        return F.softmax(prompts, dim=-1).mean(1).clamp_min(1e-30).log()

    def distance(self, x):
        logp = F.log_softmax(x.double(), dim=1)
        p = logp.exp()
        kl = (p * logp).sum(1, keepdim=True) - p @ logp.T  # KL(p_i || p_j)
        return 0.5 * (kl + kl.T)


_SCORES: dict[str, type[Score]] = {}


def register_score(cls: type[Score]) -> type[Score]:
    """Class decorator: register a score kind under ``cls.name`` (a built-in's name, or a plugin's)."""
    if not (isinstance(cls, type) and issubclass(cls, Score)):
        raise ValueError(f"{cls!r} is not a subclass of nclip.objectives.scores.Score")
    missing = [a for a in ("name", "head", "normalised") if not hasattr(cls, a)]
    if missing:
        raise ValueError(f"score class {cls.__qualname__} does not define {', '.join(missing)}")
    return add_named(_SCORES, cls, "score")


def score_named(name: str) -> Score:
    """The score registered as ``name``, with its default options; a one-line ValueError if none is."""
    if name not in _SCORES:
        raise ValueError(f"unknown zero-shot score {name!r}; registered: {', '.join(_SCORES)}")
    return _SCORES[name]()


def registered_scores() -> tuple[str, ...]:
    """The names of every score kind, in the order of registration."""
    return tuple(_SCORES)


@register_score
@dataclass(frozen=True)
class ClipScore(CosineScore):
    """CLIP's score: the cosine of the CLIP head's embeddings g."""

    name = "clip"
    head = "clip"


@register_score
@dataclass(frozen=True)
class NclipScore(DistributionScore):
    """nCLIP's −L_CE (xCLIP Sec. 3.1, Eq. 2) on the nCLIP head, symmetrised (``direction``
    "symmetric") or image→text only ("image_to_text"): the run's ``eval.nclip_score``, ``nclip eval
    --nclip-score`` (:func:`~nclip.objectives.functional.nclip_similarity`)."""

    name = "nclip"
    direction: str = "symmetric"

    def __post_init__(self):
        if self.direction not in NCLIP_SCORES:
            raise ValueError(f"nclip score: direction must be one of {', '.join(NCLIP_SCORES)}, got {self.direction!r}")

    def configured(self, eval_cfg):
        return replace(self, direction=eval_cfg.nclip_score)

    def options(self):
        return {"nclip_score": self.direction}

    def compare(self, image, text):
        return nclip_similarity(image, text, self.direction)


@register_score
@dataclass(frozen=True)
class YclipScore(DistributionScore):
    """yCLIP's own score S of App. B.2 Eq. 2 on the nCLIP head
    (:func:`~nclip.objectives.functional.yclip_similarity`)."""

    name = "yclip"

    def compare(self, image, text):
        return yclip_similarity(image, text)
