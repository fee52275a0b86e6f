"""The Python API in the style of OpenCLIP: ``model = nclip.load(path)``, then ``model.encode_image``,
``model.encode_text`` and ``model.zero_shot``.

Everything here is the evaluation suite's own code behind a small object: the checkpoint is found
by :func:`nclip.eval.checkpoint.resolve_checkpoint`, images are pre-processed by the eval transform
(:func:`nclip.data.transforms.eval_tensor`: shorter side to the run's image size, bicubic, centre crop,
CLIP's mean and std), features come from :func:`nclip.eval.features.encode_images` /
:func:`~nclip.eval.features.encode_texts`, and zero-shot scores from
:func:`nclip.eval.zeroshot.scores` on prompt ensembles (:func:`nclip.eval.features.ensemble`), so a
prediction made here is the one ``nclip eval`` makes for the same image, class names and templates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.nn import functional as F

from nclip.data.folders import FOLDER_TEMPLATES
from nclip.data.transforms import eval_tensor, model_resize
from nclip.data.types import LabelKind
from nclip.defaults import EVAL_BATCH_SIZE
from nclip.errors import NclipError
from nclip.eval import zeroshot
from nclip.eval.checkpoint import resolve_checkpoint
from nclip.eval.features import _cat, encode_texts, ensemble, zero_shot_embedding
from nclip.plugin_consent import consent


class LoadedModel(nn.Module):
    """A trained nclip model for inference (see :func:`load`), in eval mode.

    Attributes: ``model`` (the :class:`~nclip.models.dual_encoder.DualEncoder`), ``cfg`` (its run
    config), ``tokenizer`` (list of captions → (ids, mask) [N, L]), ``score`` (the objective's
    zero-shot score, :class:`nclip.objectives.scores.Score`, with the run's options such as
    ``eval.nclip_score``; None for an image-only objective), ``head`` (its name: ``clip``, ``nclip``,
    ``yclip``, a plugin's, or None), ``device``, ``logit_bias`` (a transformers SiglipModel's b, else None).
    """

    def __init__(self, model, cfg, device: torch.device, path: Path | None = None, logit_bias: float | None = None):
        super().__init__()
        from nclip.objectives import plan_for

        self.model = model.eval()
        self.cfg = cfg
        self.path = path
        self.device = torch.device(device)
        self.tokenizer = model.tokenizer
        self.image_size = cfg.data.image_size
        objective = plan_for(cfg)
        self.score = objective.zero_shot
        self.probe_features = objective.probe_features
        self._logit_bias = logit_bias  # a SiglipModel's b (load): its logits exp(s)·cos + b

    @property
    def head(self) -> str | None:
        """The name of the zero-shot score (``clip``, ``nclip``, ``yclip``, a plugin's), None for an
        image-only objective."""
        return self.score.name if self.score is not None else None

    @property
    def logit_scale(self) -> float:
        """CLIP's learned multiplier 1/σ (clamped to exp(``model.logit_scale_max``): 100, or a SigLIP
        model's own t ≈ 117): ``(logit_scale * scores).softmax(-1)``
        turns CLIP-head cosines into CLIP's class probabilities."""
        return float(self.model.scale().detach())

    @property
    def logit_bias(self) -> float | None:
        """SigLIP's learned bias b of a transformers SiglipModel (its logits are exp(s)·cos + b, its
        probabilities their sigmoid); None for other models (CLIP's logits have no bias)."""
        return self._logit_bias

    def logits(self, image_emb: torch.Tensor, text_emb: torch.Tensor) -> torch.Tensor:
        """[N, M] the model's logits of :meth:`encode_image` against :meth:`encode_text` embeddings:
        :attr:`logit_scale` · cosine, plus :attr:`logit_bias` for SigLIP (transformers'
        ``logits_per_image``)."""
        cos = F.normalize(image_emb.float(), dim=-1) @ F.normalize(text_emb.float(), dim=-1).T
        return self._scaled(cos)

    def probabilities(self, image_emb: torch.Tensor, text_emb: torch.Tensor) -> torch.Tensor:
        """[N, M] SigLIP: the sigmoid of :meth:`logits`, each image–text pair on its own; CLIP: their
        softmax over the M texts."""
        logits = self.logits(image_emb, text_emb)
        return logits.sigmoid() if self.logit_bias is not None else logits.softmax(dim=-1)

    def _scaled(self, cos: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = self.model.scale().float().cpu()
        out = cos * scale.to(cos.device)
        return out + self.logit_bias if self.logit_bias is not None else out

    def transform(self, image) -> torch.Tensor:
        """The run's eval pre-processing of one image (a PIL image of any mode, or a uint8 [H, W, 3] RGB
        array) → float32 [3, S, S]: shorter side to S (bicubic), centre crop, CLIP normalisation -- or
        the run's ``data.eval_resize`` / ``eval_interpolation`` / ``eval_convention`` (a checkpoint's
        own preprocessing, pixel for pixel: docs/transfer.md)."""
        if isinstance(image, Image.Image):
            return eval_tensor(image, self.image_size, model_resize(self.model))
        image = np.asarray(image)
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise NclipError(f"transform takes a PIL image or a uint8 [H, W, 3] array, got {image.dtype} "
                             f"{list(image.shape)}")
        return eval_tensor(image, self.image_size, model_resize(self.model))

    # ------------------------------------------------------------------------------------------
    # every head's outputs (float32, on the CPU), as the evaluation extracts them
    # ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def image_outputs(self, images, batch_size: int = EVAL_BATCH_SIZE) -> dict[str, torch.Tensor]:
        """Every head's output for ``images``: PIL images / uint8 arrays, or pixels [N, 3, S, S]
        already pre-processed by :meth:`transform`. {"features", "clip", "nclip", ...} [N, ...] (keyed by head name)."""
        if isinstance(images, torch.Tensor):
            pixels = images[None] if images.ndim == 3 else images
            if pixels.ndim != 4:
                raise NclipError(f"pixels must be [N, 3, H, W], got {list(images.shape)}")
        else:
            pixels = torch.stack([self.transform(im) for im in _as_list(images, "images")])
        parts = [self.model.encode_image(pixels[i : i + batch_size].to(self.device))
                 for i in range(0, len(pixels), batch_size)]
        return _cat(parts)

    @torch.no_grad()
    def text_outputs(self, texts, batch_size: int = EVAL_BATCH_SIZE) -> dict[str, torch.Tensor]:
        """Every head's output for ``texts``: captions, the ``(ids, mask)`` pair :attr:`tokenizer`
        returns, or ids [M, L] alone (mask: the non-[PAD] positions)."""
        self._need_text("encode_text")
        if isinstance(texts, str):
            texts = [texts]
        if isinstance(texts, torch.Tensor):
            texts = (texts, (texts != self.tokenizer.pad_id).long())
        if isinstance(texts, tuple) and len(texts) == 2 and all(isinstance(t, torch.Tensor) for t in texts):
            ids, mask = texts
            parts = [self.model.encode_text(ids[i : i + batch_size].to(self.device),
                                            mask[i : i + batch_size].to(self.device))
                     for i in range(0, len(ids), batch_size)]
            return _cat(parts)
        return encode_texts(self.model, _as_list(texts, "texts"), self.device, batch_size)

    # ------------------------------------------------------------------------------------------
    # OpenCLIP-style calls
    # ------------------------------------------------------------------------------------------

    def encode_image(self, images, batch_size: int = EVAL_BATCH_SIZE) -> torch.Tensor:
        """[N, D] image embeddings of the zero-shot head (see :meth:`_embedding`)."""
        return self._embedding(self.image_outputs(images, batch_size))

    def encode_text(self, texts, batch_size: int = EVAL_BATCH_SIZE) -> torch.Tensor:
        """[M, D] caption embeddings of the zero-shot head (see :meth:`_embedding`)."""
        return self._embedding(self.text_outputs(texts, batch_size))

    def similarity(self, image_emb: torch.Tensor, text_emb: torch.Tensor) -> torch.Tensor:
        """[N, M] zero-shot scores of :meth:`encode_image` against :meth:`encode_text` outputs by
        :attr:`score` (:meth:`nclip.objectives.scores.Score.compare`): the cosine for the CLIP head,
        −L_CE (xCLIP Eq. 2) for nCLIP, yCLIP's S (App. B.2 Eq. 2)."""
        self._need_text("similarity")
        return self.score.compare(image_emb, text_emb)

    @torch.no_grad()
    def zero_shot(self, images, classnames: Sequence[str], templates: Sequence[str] | None = None,
                  batch_size: int = EVAL_BATCH_SIZE) -> torch.Tensor:
        """[N, C] zero-shot class scores of ``images`` for ``classnames``, higher is better (argmax:
        the prediction), as ``nclip eval``'s zero-shot classification: each class is the ensemble
        of its prompts (``templates``, each with one ``{}``; default: the generic ones ``nclip eval``
        uses for a user's class folders), scored with the objective's zero-shot head — CLIP's cosine
        (CLIP, xCLIP, SigLIP, ProtoCLIP), nCLIP's −L_CE symmetrised (xCLIP Sec. 3.1, Eq. 2; the
        run's ``eval.nclip_score``) or yCLIP's S. A transformers SiglipModel scores with its own
        logits exp(s)·cos + b (:meth:`logits`; ``.sigmoid()`` gives its probabilities)."""
        self._need_text("zero_shot")
        names = _as_list(classnames, "classnames")
        templates = tuple(templates) if templates is not None else FOLDER_TEMPLATES
        if not names or not templates or any(t.count("{}") != 1 for t in templates):
            raise NclipError("zero_shot needs at least one class name and templates with one '{}' each")
        space = LabelKind(tuple(names), templates)
        prompts = encode_texts(self.model, [p for c in range(len(space)) for p in space.prompts(c)],
                               self.device, batch_size)
        classes = ensemble(prompts, len(space), self.score)
        scores = zeroshot.scores(self.image_outputs(images, batch_size), classes, self.score)
        # SigLIP's own logits exp(s)·cos + b (a monotone map: the same ranking; sigmoid: its probabilities)
        return self._scaled(scores) if self.logit_bias is not None else scores

    def _embedding(self, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The zero-shot head's output (:func:`nclip.eval.features.zero_shot_embedding`): the CLIP
        head's embedding ℓ2-normalised (cosine = dot product); the nCLIP head's logits h as they are
        (compare them with :meth:`similarity`); an image-only objective's probe features, ℓ2-normalised."""
        return zero_shot_embedding(outputs, self.score, self.probe_features)

    def _need_text(self, what: str) -> None:
        if self.score is None:
            raise NclipError(f"{what}: objective {self.cfg.objective.name!r} trains no text-aligned head "
                             "(image-only: use encode_image features with a k-NN or linear probe)")


def _as_list(items, what: str) -> list:
    one_image = hasattr(items, "convert") or (isinstance(items, np.ndarray) and items.ndim == 3)
    if isinstance(items, (str, bytes)) or one_image:
        return [items]
    try:
        return list(items)
    except TypeError:
        raise NclipError(f"{what}: expected a list, got {type(items).__name__}") from None


def load(path: str | Path, device: str | torch.device | None = None, arch: str | None = None,
         trust_plugin: bool = False) -> LoadedModel:
    """The model of a run directory, a model directory (RUN/model: model.safetensors +
    config.json), a training checkpoint (RUN/checkpoints/step_N) or a ``model.safetensors`` file
    in one of those, ready for inference on ``device`` (None: CUDA when available, else the CPU).

    Also a model nclip did not train (docs/transfer.md): a transformers CLIPModel or SiglipModel directory, an
    open_clip directory (open_clip_config.json), an open_clip or OpenAI state-dict file with
    ``arch`` naming its open_clip config (e.g. "ViT-B-32"; without it, its architecture is read from
    its tensors as OpenAI's CLIP reads it, QuickGELU), or OpenAI's TorchScript ``.pt``.

    A config that names an objective plugin (``module:Class``) that is not installed is refused
    unless ``trust_plugin``: importing it from the working directory runs its code (docs/plugins.md)."""
    from nclip.models.io import WEIGHTS
    from nclip.models.openclip_files import WEIGHT_SUFFIXES, is_openclip

    p = Path(path).expanduser()
    if p.is_file() and not is_openclip(p, arch) and (p.name == WEIGHTS or p.suffix not in WEIGHT_SUFFIXES):
        p = p.parent  # a file of an nclip model directory
    with consent(trust_plugin):
        ck = resolve_checkpoint(p, arch)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise NclipError(f"device {str(device)!r} requested but no CUDA device is available")
    from nclip.models.siglip_import import FORMAT as SIGLIP

    bias = float(ck.cfg.objective.bias_init) if ck.format == SIGLIP else None  # the model's own (siglip_import)
    return LoadedModel(ck.load(device), ck.cfg, device, ck.path, logit_bias=bias).eval()
