"""CLIP's byte-pair-encoding tokenizer (Radford et al. 2021), as OpenAI's and OpenCLIP's
``SimpleTokenizer`` tokenize: the same ids, read from the same ``bpe_simple_vocab_16e6.txt.gz``.

A caption is cleaned as ``SimpleTokenizer``'s default ("lower") does -- ftfy's ``fix_text``, HTML
entities unescaped twice, runs of whitespace collapsed, lower-cased -- then split into words by
its regular expression (with the ``regex`` package and flags it uses), in Python: those two steps
are the only ones ``tokenizers`` cannot express exactly (it has no ftfy, and its regular-expression
engine is another). Each word's bytes are merged by ``tokenizers``' BPE model, built in memory
from the merges file: the byte-to-character table, the ``</w>`` end-of-word suffix and the vocabulary
order (256 bytes, the same with ``</w>``, the 48,894 merges, ``<start_of_text>``, ``<end_of_text>``)
are ``SimpleTokenizer``'s. A caption becomes ``<start_of_text> words <end_of_text>`` padded with id
0 to the text length; a longer one is cut to length − 2 words' tokens and keeps its end-of-text token
(``SimpleTokenizer``'s truncation). Ids equal to open_clip's are tested on 500+ captions.

ftfy and regex come with the optional extra ``nclip[openclip]``; the vocabulary file is the one
``open_clip_torch`` ships (found without importing it) or any path to it.
"""

from __future__ import annotations

import gzip
import html
import importlib.util
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.processors import TemplateProcessing

from nclip.errors import NclipError

BPE_FILE = "bpe_simple_vocab_16e6.txt.gz"
SOT, EOT = "<start_of_text>", "<end_of_text>"
PAD_ID = 0  # SimpleTokenizer pads with zeros (the id of "!")
MERGES = 49152 - 256 - 2  # the merges SimpleTokenizer reads: lines 1 to 48,894 of the file
WORDS = SOT + "|" + EOT + r"""|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
EXTRA = "nclip[openclip]"


def bpe_file(path: Path) -> Path | None:
    """The CLIP vocabulary ``path`` names: a ``*.txt.gz`` file, or a directory holding
    ``bpe_simple_vocab_16e6.txt.gz`` (a run's copy); None for anything else."""
    if path.name.endswith(".txt.gz"):
        return path
    return path / BPE_FILE if path.is_dir() and (path / BPE_FILE).is_file() else None


def packaged_bpe() -> Path | None:
    """The vocabulary file ``open_clip_torch`` ships, found without importing the package (which
    imports torchvision); None where it is not installed."""
    try:
        spec = importlib.util.find_spec("open_clip")
    except (ImportError, ValueError):
        return None
    for where in (spec.submodule_search_locations or []) if spec else []:
        if (Path(where) / BPE_FILE).is_file():
            return Path(where) / BPE_FILE
    return None


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes to printable characters, in SimpleTokenizer's order
    (the order of the first 512 vocabulary entries)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


@lru_cache(maxsize=4)
def load(path: str, length: int) -> Tokenizer:
    """The BPE model of the merges file ``path``, with the start/end tokens added around each
    caption, truncation to ``length`` keeping them, and padding with id 0."""
    try:
        with gzip.open(path) as fh:
            lines = fh.read().decode("utf-8").split("\n")
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise NclipError(f"cannot read the CLIP BPE vocabulary {path}: {e}") from None
    merges = [tuple(line.split()) for line in lines[1 : MERGES + 1]]
    if len(merges) != MERGES or any(len(m) != 2 for m in merges):
        raise NclipError(f"{path} is not CLIP's BPE vocabulary ({BPE_FILE}: a header line and {MERGES} merges "
                         "of two symbols)")
    chars = list(bytes_to_unicode().values())
    vocab = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges] + [SOT, EOT]
    ids = {token: i for i, token in enumerate(vocab)}
    tok = Tokenizer(BPE(ids, merges, end_of_word_suffix="</w>", continuing_subword_prefix=""))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)  # bytes → characters
    tok.add_special_tokens([SOT, EOT])  # a word that is one of them maps to its id, as in SimpleTokenizer
    tok.post_processor = TemplateProcessing(single=f"{SOT} $A {EOT}", special_tokens=[(SOT, ids[SOT]), (EOT, ids[EOT])])
    tok.enable_truncation(max_length=length)  # the content is cut, the start/end tokens stay
    tok.enable_padding(length=length, pad_id=PAD_ID, pad_token=vocab[PAD_ID])
    return tok


class Splitter:
    """Caption → SimpleTokenizer's words (ftfy, HTML unescaping, whitespace, lower case, its regex)."""

    def __init__(self):
        try:
            import ftfy
            import regex
        except ImportError as e:
            raise NclipError(f"CLIP's BPE tokenizer needs {e.name}: pip install '{EXTRA}'") from None
        self._fix = ftfy.fix_text
        self._words = regex.compile(WORDS, regex.IGNORECASE)

    def __call__(self, text: str) -> list[str]:
        text = html.unescape(html.unescape(self._fix(text))).strip()
        return self._words.findall(" ".join(text.split()).strip().lower())

    def __reduce__(self):  # data-loader workers rebuild it (compiled patterns and functions travel badly)
        return (Splitter, ())
