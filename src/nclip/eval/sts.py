"""Protocol 8: semantic textual similarity of the text backbone (xCLIP Sec. 4.2.2, Tab. 7).

Each sentence is encoded by the text tower alone -- the [EOS] feature "without any projection" --
and a pair's prediction is the cosine of its two features; the score is the Spearman correlation
of the predictions with the graded gold similarities (SentEval / SimCSE protocol). The cosine of
the CLIP-head embeddings is reported as well when the model has one, for comparison (the paper
finds the unprojected feature better for every model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nclip.eval.metrics import spearman


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine of two [N, d] tensors -> [N]."""
    return (F.normalize(a.double(), dim=1) * F.normalize(b.double(), dim=1)).sum(dim=1)


def evaluate(text_a: dict[str, torch.Tensor], text_b: dict[str, torch.Tensor], gold) -> dict[str, float]:
    """{"spearman": of the backbone features, "spearman_emb": of the CLIP head (if present), "pairs": N}."""
    gold = torch.as_tensor(gold, dtype=torch.float64)
    out = {"spearman": spearman(cosine(text_a["features"], text_b["features"]), gold)}
    if "clip" in text_a:
        out["spearman_emb"] = spearman(cosine(text_a["clip"], text_b["clip"]), gold)
    out["pairs"] = float(gold.numel())
    return out
