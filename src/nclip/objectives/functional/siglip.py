"""SigLIP: pairwise sigmoid loss with a learnable bias (Zhai et al. 2023)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nclip.objectives.functional._common import check_pair, global_rows, pair_logit_stats

# ============================================================================================
# SigLIP: pairwise sigmoid loss with a learnable bias (Zhai et al. 2023, Eq. 1 / Algorithm 1)
# ============================================================================================


def siglip_terms(
    image_emb: torch.Tensor,
    text_emb: torch.Tensor,
    logit_scale: torch.Tensor | float,
    logit_bias: torch.Tensor | float,
    *,
    global_batch: bool = True,
) -> dict[str, torch.Tensor]:
    """SigLIP: −(1/B) Σ_i Σ_j log σ(z_ij·(t·x_i·y_j + b)), z_ij = +1 for i = j, −1 otherwise.

    Args:
        image_emb: [B, D] image embeddings (L2-normalised inside, x_i).
        text_emb: [B, D] text embeddings (normalised inside, y_j).
        logit_scale: t, the multiplier, already exponentiated (SigLIP's t = exp(t')).
        logit_bias: b, a learnable scalar (SigLIP initialises it to −10).
        global_batch: every rank scores its local images against the texts of all ranks.

    Distributed: texts are gathered with gradient and each rank sums the loss of its B_local
    local image rows over all W·B_local texts, divided by the LOCAL batch size B_local. The mean
    over ranks of these per-rank losses is then (1/W)·Σ_r (1/B_local)·Σ_{i∈r} Σ_j ℓ_ij =
    (1/B_global)·Σ_i Σ_j ℓ_ij, the single-process loss on the whole batch, and under DDP's gradient
    averaging (plus the gather's summed backward) the gradients match as well.

    Returns ``loss`` and detached diagnostics ``acc_i2t`` (argmax over texts is the pair),
    ``logit_pos`` and ``logit_neg`` (mean positive and negative logits t·x·y + b).
    """
    check_pair(image_emb, text_emb, "image_emb", "text_emb")
    x = F.normalize(image_emb, dim=-1)  # [B, D]
    y = F.normalize(text_emb, dim=-1)  # [B, D]
    batch = x.shape[0]
    (all_y,), offset = global_rows(y, global_batch=global_batch)  # [W·B, D]
    logits = logit_scale * x @ all_y.T + logit_bias  # [B, W·B]
    targets = torch.arange(offset, offset + batch, device=x.device)
    signs = -torch.ones_like(logits)
    signs.diagonal(offset).fill_(1.0)  # z_ij = +1 at (i, offset + i): a fill, no index tensor made from host data
    loss = -F.logsigmoid(signs * logits).sum() / batch
    return {"loss": loss, **pair_logit_stats(logits, targets)}


