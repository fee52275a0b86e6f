"""Export to ONNX: ``image_encoder.onnx``, ``text_encoder.onnx`` and ``onnx_config.json``.

Each graph returns the embedding of the model's zero-shot space, as :func:`nclip.load`'s
``encode_image`` / ``encode_text`` define it (:meth:`nclip.api.LoadedModel._embedding`): the output
of the head the objective's zero-shot score reads, as the score embeds it
(:meth:`nclip.objectives.scores.Score.embed`: the CLIP head's output ℓ2-normalised, so the score is
the dot product; the nCLIP head's logits as they are, since nCLIP's and yCLIP's scores read the
softmax, which normalising would change); an image-only objective's probe features ℓ2-normalised,
and no text encoder. The image encoder takes pixels
[N, 3, S, S] float32 as nclip's evaluation transform makes them, which ``onnx_config.json``'s
``image`` states step by step for code without nclip (:func:`nclip.data.transforms.describe_eval`:
the resize, its PIL resample, the crop's rounding and the conversion to RGB of the model's
``data.eval_convention``, /255, CLIP's mean and std; a tower trained with other statistics
re-normalises inside the graph). The text encoder takes token ids and attention mask [N, L] int64
from the model's tokenizer, copied into ``tokenizer/`` with its files set to pad and truncate to L
(:func:`nclip.data.tokenization.fix_length`). N is a dynamic axis. ``onnx_config.json`` names all of it.

The exporter is torch's TorchScript-based one (``dynamo=False``): it traces these towers in a
fraction of a second, offline, and needs only ``onnx``; the dynamo exporter (torch 2.13's default)
takes seconds per tower through torch.export and, on these graphs, wrote an invalid model (an output
name defined twice). The CLIP text transformer reads no mask (causal, pooled at the end-of-text
token: :class:`nclip.models.towers.ClipTextTower`), so the tracer drops that input; it is put back
as an unused graph input, so that every text encoder takes the same two inputs.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nclip.data import clip_bpe
from nclip.data.tokenization import TOKENIZER_FILE, bundled_model_dir, fix_length, sentencepiece_dir
from nclip.data.transforms import describe_eval, preprocess_of
from nclip.errors import NclipError
from nclip.models.export_base import atomic_export, model_dir
from nclip.models.io import copy_tokenizer, load_model
from nclip.objectives.scores import Score

IMAGE, TEXT, CONFIG, TOKENIZER = "image_encoder.onnx", "text_encoder.onnx", "onnx_config.json", "tokenizer"
OPSET = 17
EXAMPLE_BATCH = 2  # traced at this batch size; the batch axis is dynamic


class Embedding(nn.Module):
    """``model``'s ``encode_image`` or ``encode_text`` output ``key`` as ``score`` embeds it
    (:meth:`~nclip.objectives.scores.Score.embed`); ℓ2-normalised without a score (an image-only
    objective's probe features)."""

    def __init__(self, model, modality: str, key: str, score: Score | None):
        super().__init__()
        self.model, self.modality, self.key, self.score = model, modality, key, score

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        out = (self.model.encode_image if self.modality == "image" else self.model.encode_text)(*inputs)[self.key]
        return self.score.embed(out) if self.score is not None else F.normalize(out, dim=-1)


def embedding_space(cfg) -> tuple[Score | None, str, bool]:
    """(the zero-shot score, :class:`~nclip.objectives.scores.Score`, or None for an image-only
    objective; the encode_* output key it reads, or the probe features'; whether the embedding is
    ℓ2-normalised)."""
    from nclip.heads import probe_output
    from nclip.objectives import plan_for

    objective = plan_for(cfg)
    score = objective.zero_shot
    if score is None:
        return None, probe_output(objective.probe_features), True
    return score, score.head, score.normalised


def export_onnx(checkpoint: Path, out: Path) -> str:
    """Write the model of ``checkpoint`` (a run or model directory) to ``out`` as ONNX graphs with
    their config and tokenizer, atomically (:func:`nclip.models.export_base.atomic_export`)."""
    try:
        import onnx
    except ImportError:
        raise NclipError("export --onnx needs the onnx package: pip install 'nclip[onnx]'") from None
    model, cfg = load_model(model_dir(checkpoint))
    score, key, normalise = embedding_space(cfg)
    size, length = cfg.data.image_size, cfg.data.text_length
    pixels = torch.zeros(EXAMPLE_BATCH, 3, size, size)
    # captions of different lengths: the traced attention masks have padding, as most will
    ids, mask = model.tokenizer(["a photo", "a photo of two red circles left of a blue square"][:EXAMPLE_BATCH])
    with atomic_export(out, "onnx") as tmp:
        _export(Embedding(model, "image", key, score), (pixels,), ["pixels"], tmp / IMAGE)
        if score is not None:
            _export(Embedding(model, "text", key, score), (ids, mask), ["input_ids", "attention_mask"],
                    tmp / TEXT)
            if model.cfg_text_kind == "transformer":  # the CLIP text tower reads no mask (module docstring)
                _keep_input(onnx, tmp / TEXT, "attention_mask", 1, length)
        source = Path(cfg.model.text.tokenizer).expanduser() if cfg.model.text.tokenizer else bundled_model_dir()
        copy_tokenizer(source, tmp / TOKENIZER)
        fix_length(tmp / TOKENIZER, length)  # the graph takes no other length
        with torch.no_grad():
            description = config(model, cfg, score, key, normalise, tokenizer_kind(tmp / TOKENIZER))
        (tmp / CONFIG).write_text(json.dumps(description, indent=2) + "\n")
    files = f"{IMAGE}, {TEXT}" if score is not None else f"{IMAGE} (image-only objective: no text encoder)"
    return f"wrote {files}, {CONFIG} and the tokenizer to {out}"


def _export(module: nn.Module, args: tuple, names: list[str], path: Path) -> None:
    with warnings.catch_warnings(), torch.no_grad():
        # the tracer's warnings about Python conditions on shapes: they test the text length and the
        # image size, which are fixed, or the mask's padding, where the traced branch is the general one
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), args, str(path), input_names=names, output_names=["embedding"],
                          dynamic_axes={n: {0: "batch"} for n in [*names, "embedding"]}, opset_version=OPSET,
                          dynamo=False)


def _keep_input(onnx, path: Path, name: str, index: int, length: int) -> None:
    """Put back the int64 [batch, length] input ``name`` where the tracer dropped it as unused."""
    graph_model = onnx.load(str(path))
    if all(i.name != name for i in graph_model.graph.input):
        graph_model.graph.input.insert(index, onnx.helper.make_tensor_value_info(
            name, onnx.TensorProto.INT64, ["batch", length]))
        onnx.save(graph_model, str(path))


def tokenizer_kind(directory: Path) -> str:
    """What the tokenizer copy ``directory`` holds: CLIP's BPE vocabulary, SigLIP's SentencePiece model,
    or a tokenizers ``tokenizer.json`` (the bundled WordPiece one, unless model.text.tokenizer named another)."""
    if clip_bpe.bpe_file(directory) is not None:
        return "clip_bpe"
    return "sentencepiece" if sentencepiece_dir(directory) is not None else "wordpiece"


def config(model, cfg, score: Score | None, key: str, normalise: bool, tokenizer: str) -> dict:
    """What onnx_config.json says: the graphs' inputs and outputs, the image preprocessing, the
    tokenizer and the score that compares the embeddings."""
    size, length = cfg.data.image_size, cfg.data.text_length
    width = int(model.encode_image(torch.zeros(1, 3, size, size))[key].shape[-1])
    output = {"embedding": {"dtype": "float32", "shape": ["batch", width], "l2_normalised": normalise}}
    tok = model.tokenizer
    tokens = {"dtype": "int64", "shape": ["batch", length]}
    text = None if score is None else {"file": TEXT, "inputs": {"input_ids": tokens, "attention_mask": tokens},
                                       "outputs": output}
    return {
        "image_encoder": {"file": IMAGE, "inputs": {"pixels": {"dtype": "float32", "shape": ["batch", 3, size, size]}},
                          "outputs": output},
        "text_encoder": text,
        "embedding": {"output": key, "score": score.name if score is not None else None,
                      "logit_scale": float(model.scale()), **(score.options() if score is not None else {})},
        "image": describe_eval(size, preprocess_of(cfg.data)),
        # a tokenizer.json pads and truncates to text_length as it is; the other kinds have none to read alone
        # (CLIP's BPE splits its words in Python, nclip.data.clip_bpe; SentencePiece is transformers' tokenizer)
        "tokenizer": {"kind": tokenizer, "path": TOKENIZER,
                      "file": f"{TOKENIZER}/{TOKENIZER_FILE}" if tokenizer == "wordpiece" else None,
                      "text_length": length, "pad_id": tok.pad_id, "bos_id": tok.cls_id, "eos_id": tok.eos_id},
        "opset": OPSET,
    }
