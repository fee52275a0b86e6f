"""CLIP's BPE tokenizer (nclip.data.clip_bpe) gives open_clip's SimpleTokenizer ids."""

from __future__ import annotations

import gzip
import random

import pytest

from nclip.data import clip_bpe
from nclip.data.tokenization import CaptionTokenizer
from nclip.errors import NclipError

from openclip_refs import open_clip

WORDS = ("a photo of the cat dog on red blue green circle square left right two three big small running "
         "tree house sky water car bicycle person woman man child playing with ball grass beach sunset").split()
ODD = [
    "", " ", "\t\n  \r", "!!!", "...", "?!?!", "—", "-- -- --", "()[]{}<>", "😀", "😀😀 🐈‍⬛ 👍🏽",
    "<end_of_text>", "<START_OF_TEXT> hi", "!<end_of_text>", "a<end_of_text>b", "<|endoftext|>",
    "Café déjà vu, naïve façade", "İstanbul ŞEHİR", "straße STRASSE", "東京タワーの写真", "中文字幕，标点。",
    "한국어 문장입니다", "مرحبا بالعالم", "שלום עולם", "Привет, МИР!", "Ελληνικά ΚΕΙΜΕΝΑ", "हिन्दी पाठ",
    "ｆｕｌｌｗｉｄｔｈ　ＴＥＸＴ", "ﬁne ﬂower ligatures", "cafÃ© mojibake â€œquotedâ€\x9d", "“curly” ‘quotes’",
    "&amp; &lt;b&gt; &amp;amp; &#39;", "it's don't WE'LL they've I'm you'd she'S", "123,456.78 and 3.14159",
    "x\u200by zero\u200dwidth", "non\u00a0breaking\u2003space", "ctrl\x07chars\x1b[31m", "e\u0301 combining",
    "tab\tseparated\tcolumns", "line\nbreaks\r\nhere", "UPPER lower MiXeD", "#hashtag @user http://x.y/z?q=1",
    "a" * 300, "supercalifragilisticexpialidocious " * 40, "ÿ þ ð æ ø å œ",
]


def captions(n: int = 520) -> list[str]:
    """ODD ones and random ones: plain, long, with Unicode and punctuation mixed in."""
    rng = random.Random(0)
    extra = [s for s in ODD if s.strip()]
    out = list(ODD)
    while len(out) < n:
        words = [rng.choice(WORDS) for _ in range(rng.choice([1, 3, 8, 20, 90]))]
        if rng.random() < 0.4:
            words.insert(rng.randrange(len(words) + 1), rng.choice(extra))
        sep = rng.choice([" ", "  ", ", ", " - "])
        text = sep.join(words)
        out.append(text.capitalize() + rng.choice(["", ".", "!", " ?", "..."]))
    return out


@pytest.fixture(scope="module")
def vocab():
    open_clip()  # the test compares with open_clip, which ships the vocabulary
    path = clip_bpe.packaged_bpe()
    assert path is not None and path.is_file()
    return path


@pytest.mark.parametrize("length", [77, 16])
def test_ids_are_open_clips(vocab, length):
    oc = open_clip()
    texts = captions()
    assert len(texts) >= 500
    want = oc.tokenizer.SimpleTokenizer(context_length=length)(texts)
    ids, mask = CaptionTokenizer(length, vocab)(texts)
    bad = [(t, ids[i].tolist(), want[i].tolist()) for i, t in enumerate(texts) if not ids[i].equal(want[i])]
    assert not bad, bad[:3]
    last = length - 1 - (ids == 49407).flip(1).int().argmax(1)  # the mask covers start to the last end-of-text
    assert mask.sum(1).tolist() == (last + 1).tolist()
    assert ((ids == 49407).any(1) & (ids[:, 0] == 49406)).all()


def test_tokenizer_attributes_and_a_directory_holding_the_vocabulary(vocab, tmp_path):
    (tmp_path / clip_bpe.BPE_FILE).write_bytes(vocab.read_bytes())
    tok = CaptionTokenizer(77, tmp_path)
    assert (tok.vocab_size, tok.pad_id, tok.cls_id, tok.eos_id) == (49408, 0, 49406, 49407)
    assert tok.same_vocabulary(CaptionTokenizer(77, vocab))
    assert not tok.same_vocabulary(CaptionTokenizer(77))


def test_a_broken_vocabulary_is_one_line(tmp_path):
    bad = tmp_path / "bpe_simple_vocab_16e6.txt.gz"
    bad.write_bytes(b"not gzip")
    with pytest.raises(NclipError, match="cannot read the CLIP BPE vocabulary") as e:
        CaptionTokenizer(77, bad)
    assert "\n" not in str(e.value)
    short = tmp_path / "short.txt.gz"
    with gzip.open(short, "wt") as fh:
        fh.write("#version: 0.2\nt h\n")
    with pytest.raises(NclipError, match="is not CLIP's BPE vocabulary"):
        CaptionTokenizer(77, short)
    with pytest.raises(NclipError, match="tokenizer file not found"):
        CaptionTokenizer(77, tmp_path / "missing.txt.gz")
