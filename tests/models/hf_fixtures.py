"""A tiny transformers CLIPModel saved with save_pretrained (random weights, a byte-level BPE
tokenizer of 516 tokens, non-CLIP pixel statistics): the real file layout of a pretrained CLIP
directory, built in a test without downloading anything."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_MEAN, TINY_STD = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
IMAGE_SIZE, TEXT_LENGTH = 32, 16


def tiny_clip_tokenizer():
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    for token in ("th", "the</w>", "<|startoftext|>", "<|endoftext|>"):
        vocab[token] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[("t", "h"), ("th", "e</w>")])


def save_tiny_clip(directory: Path, legacy_eos: bool = False, seed: int = 0):
    """Write a tiny CLIPModel, its tokenizer and its image processor to ``directory``; returns the
    model. ``legacy_eos``: text eos_token_id 2, as OpenAI's configs (pooling at the largest id)."""
    from transformers import CLIPConfig, CLIPModel

    tok = tiny_clip_tokenizer()
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=TEXT_LENGTH, bos_token_id=tok.bos_token_id,
                pad_token_id=tok.pad_token_id, eos_token_id=2 if legacy_eos else tok.eos_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=IMAGE_SIZE, patch_size=8)
    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=24)).eval()
    with torch.no_grad():
        model.logit_scale.fill_(2.5)
    model.save_pretrained(str(directory), safe_serialization=True)
    tok.save_pretrained(str(directory))
    # what CLIPImageProcessor.save_pretrained writes (that class wants torchvision, which nclip avoids)
    (Path(directory) / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": IMAGE_SIZE},
        "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "image_mean": TINY_MEAN, "image_std": TINY_STD}))
    return model


def hf_pixels(raw: torch.Tensor) -> torch.Tensor:
    """raw RGB in [0, 1], [B, 3, H, W] → the tiny model's normalisation."""
    return (raw - torch.tensor(TINY_MEAN).view(1, 3, 1, 1)) / torch.tensor(TINY_STD).view(1, 3, 1, 1)


def nclip_pixels(raw: torch.Tensor) -> torch.Tensor:
    """raw RGB in [0, 1] → CLIP's normalisation, what nclip's data layer gives its towers."""
    from nclip.data.transforms import CLIP_MEAN, CLIP_STD

    return (raw - torch.from_numpy(CLIP_MEAN).view(1, 3, 1, 1)) / torch.from_numpy(CLIP_STD).view(1, 3, 1, 1)


def features(out) -> torch.Tensor:
    """get_image_features / get_text_features return a tensor or, in newer transformers, an output."""
    return out if torch.is_tensor(out) else out.pooler_output
