"""The model that embeds: any checkpoint ``nclip.load`` takes, found by
:func:`nclip.eval.checkpoint.resolve_checkpoint`, and its zero-shot embeddings computed as
``nclip.load(path).encode_image`` / ``encode_text`` compute them
(:func:`nclip.eval.features.zero_shot_embedding` of the model's head outputs, in float32).
``nclip.api`` sits above this package (layer 8), so the few lines that turn a path into a model are
the checkpoint resolver's, not ``nclip.load``'s."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from nclip.errors import NclipError


def resolve(path: str | Path, arch: str | None = None):
    """The :class:`~nclip.eval.checkpoint.Checkpoint` of ``path`` as ``nclip.load`` finds it (a file
    of an nclip model directory stands for its directory); one line if there is none."""
    from nclip.eval.checkpoint import resolve_checkpoint
    from nclip.models.io import WEIGHTS
    from nclip.models.openclip_files import WEIGHT_SUFFIXES, is_openclip

    p = Path(path).expanduser()
    if not p.exists():
        raise NclipError(f"checkpoint not found: {p}")
    if p.is_file() and not is_openclip(p, arch) and (p.name == WEIGHTS or p.suffix not in WEIGHT_SUFFIXES):
        p = p.parent
    return resolve_checkpoint(p, arch)


def describe(ck) -> dict:
    """The manifest's ``model``: where it is, the sha256 of its weights (the fingerprint a query's
    model must match), its format and objective."""
    return {"path": str(Path(ck.path).resolve()), "sha256": ck.sha256, "format": ck.format,
            "arch": ck.arch, "objective": ck.cfg.objective.name}


def zero_shot_space(cfg):
    """(the zero-shot score (:class:`nclip.objectives.scores.Score`) or None, probe features, a
    description) of a run config's objective: what its embeddings are, known before the model loads."""
    from nclip.objectives import plan_for

    objective = plan_for(cfg)
    score, features = objective.zero_shot, objective.probe_features
    return score, features, f"{score.name} head" if score else f"{features} features (image-only objective)"


class Encoder:
    """A model on a device with its zero-shot embedding of pixels and captions; ``cfg``: its run config."""

    def __init__(self, model, cfg, device: torch.device):
        from nclip.data.transforms import model_resize

        self.model, self.device = model.eval(), device
        self.score, self.probe_features, self.embedding = zero_shot_space(cfg)
        self.image_size = cfg.data.image_size
        self.resize = model_resize(model)

    @classmethod
    def load(cls, ck, device: str | torch.device | None = None) -> Encoder:
        """The model of a checkpoint on ``device`` (None or "auto": CUDA when there is one)."""
        if device is None or device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise NclipError(f"device {str(device)!r} requested but no CUDA device is available")
        return cls(ck.load(device), ck.cfg, device)

    def pixels(self, image) -> torch.Tensor:
        """[3, S, S] of a PIL image or uint8 [H, W, 3] array, by the eval transform."""
        from nclip.data.transforms import eval_tensor

        return eval_tensor(image if hasattr(image, "convert") else np.asarray(image), self.image_size, self.resize)

    @torch.no_grad()
    def images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[b, D] float32 on the CPU from pre-processed pixels [b, 3, S, S]."""
        from nclip.eval.features import _cat, zero_shot_embedding

        return zero_shot_embedding(_cat([self.model.encode_image(pixels.to(self.device))]), self.score,
                                   self.probe_features)

    @torch.no_grad()
    def texts(self, captions: list[str], batch_size: int) -> torch.Tensor:
        """[M, D] float32 on the CPU; one line for an image-only objective."""
        from nclip.eval.features import encode_texts, zero_shot_embedding

        if self.score is None:
            raise NclipError("this model's objective trains no text-aligned head (image-only): it embeds no text")
        return zero_shot_embedding(encode_texts(self.model, captions, self.device, batch_size), self.score,
                                   self.probe_features)
