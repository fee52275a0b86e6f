"""A tiny transformers SiglipModel saved with save_pretrained (random weights, a SentencePiece tokenizer
trained here on a few hundred words, SigLIP's 0.5/0.5 pixel statistics): the file layout of a
pretrained SigLIP directory, built in a test without downloading anything."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import torch

IMAGE_SIZE, TEXT_LENGTH = 32, 16
SIGLIP_MEAN, SIGLIP_STD = [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]
LOGIT_SCALE = math.log(117.33)  # above nclip's default cap ln 100, as SigLIP's released models
LOGIT_BIAS = -12.93
WORDS = ("a photo of the red green blue small large cat dog bird car tree house circle square triangle "
         "left right above below near far one two three many shape scene picture drawing painting sky "
         "water grass road city forest mountain river boat plane train person child woman man").split()


def sentencepiece_model() -> bytes:
    """A unigram SentencePiece model of SigLIP's special ids (pad 0, eos 1, unk 2, no bos)."""
    import sentencepiece as spm

    sentences = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(8)) for i in range(300)]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=out, vocab_size=120,
                                   hard_vocab_limit=False, model_type="unigram",
                                   pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>",
                                   minloglevel=2)
    return out.getvalue()


def save_tiny_siglip(directory: Path, seed: int = 0, bin_weights: bool = False, image_size: int = IMAGE_SIZE):
    """Write a tiny SiglipModel, its tokenizer and its image processor config to ``directory``;
    returns (model, tokenizer). ``bin_weights``: pytorch_model.bin instead of model.safetensors;
    ``image_size`` need not be a multiple of the patch size 8 (SigLIP's patch convolution drops the rest)."""
    from transformers import SiglipConfig, SiglipModel, SiglipTokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "spiece.model").write_bytes(sentencepiece_model())
    tok = SiglipTokenizer(vocab_file=str(directory / "spiece.model"), model_max_length=TEXT_LENGTH)
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=TEXT_LENGTH, pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id, bos_token_id=None)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=image_size, patch_size=8)
    torch.manual_seed(seed)
    model = SiglipModel(SiglipConfig(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():
        model.logit_scale.fill_(LOGIT_SCALE)
        model.logit_bias.fill_(LOGIT_BIAS)
        for p in model.parameters():  # transformers initialises some tensors to constants: make them vary
            if p.ndim >= 1 and p.numel() > 1 and p.std() == 0:
                p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(str(directory))
    if bin_weights:  # transformers 5 writes safetensors only: the older layout, as its torch.save wrote it
        from safetensors.torch import load_file

        torch.save(load_file(str(directory / "model.safetensors")), directory / "pytorch_model.bin")
        (directory / "model.safetensors").unlink()
    tok.save_pretrained(str(directory))
    (directory / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "SiglipImageProcessor", "size": {"height": image_size, "width": image_size},
        "resample": 3, "image_mean": SIGLIP_MEAN, "image_std": SIGLIP_STD}))
    return model, tok


def hf_pixels(raw: torch.Tensor) -> torch.Tensor:
    """raw RGB in [0, 1], [B, 3, H, W] → SigLIP's normalisation."""
    return (raw - 0.5) / 0.5
