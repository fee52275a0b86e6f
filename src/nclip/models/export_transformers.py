"""Export to a ``transformers`` ``CLIPModel`` directory (CLIP towers with a CLIP head only).

The nclip towers *are* transformers' CLIPVisionModel / CLIPTextModel and the CLIP heads are
bias-free linear maps, so the export is a renaming of tensors: CLIPModel.get_image_features and
get_text_features then give exactly nclip's CLIP-head embeddings. The text tower pools the first
position holding ``eos_token_id`` (nclip's [SEP], set in :func:`nclip.models.towers.text_config`),
which is CLIPModel's end-of-text pooling too.

Beside the weights the directory gets the run's tokenizer (the bundled WordPiece tokenizer with
``model_max_length`` = the run's text length) and a ``preprocessor_config.json`` for
``CLIPImageProcessor`` (PIL backend) that repeats the eval transform, so that ``AutoTokenizer``,
``AutoImageProcessor`` and ``CLIPModel.from_pretrained`` alone reproduce :func:`nclip.load`'s
features (the pixels agree to float rounding, ~1e-7, at every image size and aspect ratio).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import CLIPConfig, CLIPModel

from nclip.errors import NclipError
from nclip.models.export_base import atomic_export, check_clip_score, model_dir
from nclip.models.io import load_model
from nclip.models.siglip_towers import SiglipTextTower, SiglipVisionTower


def to_hf(model) -> CLIPModel:
    if model.cfg_text_kind != "transformer" or "clip" not in model.heads or model.vision.kind != "vit":
        raise NclipError("export --hf needs a ViT image tower, a CLIP text transformer and a CLIP head "
                         f"(this model: image tower {model.vision.kind!r}, text tower {model.cfg_text_kind!r}, "
                         f"heads {sorted(model.heads)})")
    if isinstance(model.vision, SiglipVisionTower) or isinstance(model.text, SiglipTextTower):
        raise NclipError("export --hf writes a CLIPModel: a SigLIP tower (model.vision.pooling map, "
                         "model.text.eos_pooling last) has no place in one")
    if "shared" in model.heads:  # the CLIP projection is then an MLP, which HF's CLIPModel has no place for
        raise NclipError(f"export --hf needs a linear CLIP head; this model shares {model.heads['shared'].count} "
                         "hidden layer(s) between its CLIP and nCLIP heads (model.nclip_shared_layers)")
    text_cfg = model.text.model.config
    vision_cfg = model.vision.model.config
    config = CLIPConfig(
        text_config=text_cfg.to_dict(),
        vision_config=vision_cfg.to_dict(),
        projection_dim=model.heads["clip"].image.out_features,
    )
    hf = CLIPModel(config).eval()
    state = {**clip_model_names("vision_model.", model.vision.model),
             **clip_model_names("text_model.", model.text.model)}
    clip = model.heads["clip"]
    state.update({f"{name}.weight": getattr(clip, side).weight for side, name in clip.hf_names.items()})
    state["logit_scale"] = model.logit_scale.detach().clamp(max=model.LOGIT_SCALE_MAX)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("position_ids")]
    if missing or unexpected:
        raise NclipError(f"export mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return hf


def clip_model_names(prefix: str, tower) -> dict:
    """A CLIPVisionModel's or CLIPTextModel's tensors under CLIPModel's names: they come with or
    without the vision_model./text_model. ``prefix`` depending on the transformers version."""
    return {k if k.startswith(prefix) else prefix + k: v for k, v in tower.state_dict().items()}


def save_tokenizer(cfg, out: Path) -> None:
    """The run's caption tokenizer (:class:`nclip.data.tokenization.CaptionTokenizer`: the bundled
    WordPiece tokenizer, or the transformers tokenizer files model.text.tokenizer names) as transformers
    tokenizer files of the run's text length (:func:`nclip.data.tokenization.fix_length`):
    ``tok(texts, padding="max_length", truncation=True)`` and
    ``tokenizers.Tokenizer.from_file(OUT/tokenizer.json)`` give nclip's ids and mask."""
    import shutil

    from transformers import AutoTokenizer

    from nclip.data.tokenization import bundled_model_dir, fix_length
    from nclip.models.io import TOKENIZER_FILES

    source = _own_tokenizer(cfg)
    if source is None:
        AutoTokenizer.from_pretrained(str(bundled_model_dir()), local_files_only=True).save_pretrained(str(out))
    elif source.is_file():  # a lone tokenizer.json
        shutil.copyfile(source, out / TOKENIZER_FILES[0])
    else:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
    fix_length(out, cfg.data.text_length)


def _own_tokenizer(cfg) -> Path | None:
    """model.text.tokenizer as a path (None: the bundled one); one line for a tokenizer that transformers'
    tokenizer files cannot carry id for id."""
    from nclip.data import clip_bpe
    from nclip.data.tokenization import sentencepiece_dir

    if cfg.model.text.tokenizer is None:
        return None
    source = Path(cfg.model.text.tokenizer).expanduser()
    if clip_bpe.bpe_file(source) is not None or sentencepiece_dir(source) is not None:
        kind = "CLIP's BPE vocabulary" if clip_bpe.bpe_file(source) is not None else "a SentencePiece model"
        raise NclipError(f"export --hf: the model's tokenizer is {kind} ({source}), which nclip does not write as "
                         "transformers tokenizer files: export with --open-clip or --onnx instead")
    return source


def image_processor(cfg):
    """A CLIPImageProcessor repeating :func:`nclip.data.transforms.eval_tensor` as far as it can: the
    shorter side to the run's image size S and an S×S centre crop (or both sides to S, data.eval_resize:
    squash) with the run's PIL resample, /255, CLIP's mean and std. It converts to RGB first and floors the
    crop (transformers' convention: docs/transfer.md). transformers 5 defaults to a torchvision backend
    whose bicubic is not PIL's: the PIL one is named explicitly."""
    import transformers

    from nclip.data.transforms import CLIP_MEAN, CLIP_STD, PIL_RESAMPLE

    cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    s, squash = cfg.data.image_size, cfg.data.eval_resize == "squash"
    resample = next(code for code, name in PIL_RESAMPLE.items() if name == cfg.data.eval_interpolation)
    return cls(do_resize=True, size={"height": s, "width": s} if squash else {"shortest_edge": s}, resample=resample,
               do_center_crop=not squash, crop_size={"height": s, "width": s}, do_rescale=True,
               rescale_factor=1 / 255, do_normalize=True, image_mean=CLIP_MEAN.tolist(), image_std=CLIP_STD.tolist(),
               do_convert_rgb=True)


def export_hf(checkpoint: Path, out: Path) -> str:
    """Write the model of ``checkpoint`` (a run or model directory) to ``out`` as a CLIPModel with
    its tokenizer and image processor (``nclip export`` first refuses targets that would overwrite
    a run: :func:`nclip.train.rundir.check_export_target`)."""
    model, cfg = load_model(model_dir(checkpoint))
    with torch.no_grad():
        hf = to_hf(model)  # a model a CLIPModel cannot hold is refused first
    check_clip_score(cfg, "--hf")
    _own_tokenizer(cfg)  # a tokenizer the files cannot carry: refused before anything is written
    with atomic_export(out, "hf") as tmp, _no_progress_bars():  # a full disk: one line naming OUT
        hf.save_pretrained(str(tmp), safe_serialization=True)
        save_tokenizer(cfg, tmp)
        image_processor(cfg).save_pretrained(str(tmp))
    return f"wrote a transformers CLIPModel with its tokenizer and image processor to {out}"


@contextmanager
def _no_progress_bars():
    """transformers' progress bars off, as the caller had them after: save_pretrained draws a
    "Writing model shards" bar for the one shard of a model, noise beside export's one line."""
    from huggingface_hub import utils as hub_utils
    from transformers.utils import logging as hf_logging

    # transformers' switch also flips huggingface_hub's: both are put back as they were
    was_on, hub_was_off = hf_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
        if hub_was_off:
            hub_utils.disable_progress_bars()
