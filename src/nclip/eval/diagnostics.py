"""Protocol 10: representation diagnostics on the test pairs.

* effective rank (Roy & Vetterli 2007 / RankMe) of the image backbone features and of every head's
  image output -- a collapsed representation has an effective rank near 1;
* alignment and uniformity (Wang & Isola 2020) of the CLIP-head embeddings of each image and its
  first caption;
* for nCLIP heads, the usage of the K prototypes (how many are anyone's argmax, and the
  perplexity of the assignment histogram) and the row / column std of P (xCLIP App. B, Fig. B1),
  for images and texts. P = softmax of the head logits, as in Algorithm 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nclip.eval.metrics import alignment, effective_rank, probability_std, prototype_usage, uniformity

MAX_ROWS = 2000  # uniformity and SVD are O(N^2) / O(N d^2): a subsample is plenty


def first_caption(text_to_image: torch.Tensor, n_images: int) -> torch.Tensor:
    """Index [n_images] of each image's first caption (-1 for an image without one)."""
    first = torch.full((n_images,), -1, dtype=torch.long)
    idx = torch.arange(text_to_image.numel())
    first.scatter_reduce_(0, text_to_image.long(), idx, reduce="amin", include_self=False)
    return first


def evaluate(image: dict[str, torch.Tensor], text: dict[str, torch.Tensor],
             text_to_image: torch.Tensor) -> dict[str, float]:
    n = image["features"].shape[0]
    first = first_caption(text_to_image, n)
    rows = torch.nonzero(first >= 0).flatten()[:MAX_ROWS]
    pair_t = first[rows]
    out = {"erank_image_features": effective_rank(image["features"][rows])}
    if "clip" in image:
        gi, gt = image["clip"][rows], text["clip"][pair_t]
        out["erank_image_emb"] = effective_rank(gi)
        out["erank_text_emb"] = effective_rank(gt)
        out["alignment_emb"] = alignment(gi, gt)
        out["uniformity_image_emb"] = uniformity(gi)
        out["uniformity_text_emb"] = uniformity(gt)
    if "nclip" in image:
        for side, logits in (("image", image["nclip"][rows]), ("text", text["nclip"][pair_t])):
            p = F.softmax(logits.double(), dim=1)
            usage = prototype_usage(p)
            std = probability_std(p)
            out[f"proto_used_{side}"] = float(usage["num_used"])
            out[f"proto_used_fraction_{side}"] = usage["used_fraction"]
            out[f"proto_perplexity_{side}"] = usage["perplexity"]
            out[f"row_std_{side}"] = std["row_std"]
            out[f"col_std_{side}"] = std["col_std"]
        out["erank_image_probs"] = effective_rank(F.softmax(image["nclip"][rows].double(), dim=1))
    return out
