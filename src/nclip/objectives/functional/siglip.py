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
    negatives: torch.Tensor | None = None,
    negative_valid: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """SigLIP: −(1/B) Σ_i Σ_j log σ(z_ij·(t·x_i·y_j + b)), z_ij = +1 for i = j, −1 otherwise.

    Args:
        image_emb: [B, D] image embeddings (L2-normalised inside, x_i).
        text_emb: [B, D] text embeddings (normalised inside, y_j).
        logit_scale: t, the multiplier, already exponentiated (SigLIP's t = exp(t')).
        logit_bias: b, a learnable scalar (SigLIP initialises it to −10).
        global_batch: every rank scores its local images against the texts of all ranks.
        negatives: [B, N, D] hard negative captions (normalised inside), with negative_valid [B, N]
            bool (which slots hold one): each is one more text that every image scores as a pair
            with label z = −1, its own image included; the empty slots are no pair. None: none.

    Distributed: texts are gathered with gradient and each rank sums the loss of its B_local
    local image rows over all W·B_local texts, divided by the LOCAL batch size B_local. The mean
    over ranks of these per-rank losses is then (1/W)·Σ_r (1/B_local)·Σ_{i∈r} Σ_j ℓ_ij =
    (1/B_global)·Σ_i Σ_j ℓ_ij, the single-process loss on the whole batch, and under DDP's gradient
    averaging (plus the gather's summed backward) the gradients match as well.

    Returns ``loss`` and detached diagnostics ``acc_i2t`` (argmax over texts is the pair),
    ``logit_pos`` and ``logit_neg`` (mean positive and negative logits t·x·y + b, of the captions);
    with negatives ``logit_hard``, the mean logit of an image with its own negatives.
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
    if negatives is None:
        loss = -F.logsigmoid(signs * logits).sum() / batch
        return {"loss": loss, **pair_logit_stats(logits, targets)}
    if negative_valid is None or negative_valid.shape != negatives.shape[:2] or negatives.shape[0] != batch:
        raise ValueError(f"negatives [B, N, D] and negative_valid [B, N] expected, got {tuple(negatives.shape)} and "
                         f"{None if negative_valid is None else tuple(negative_valid.shape)}")
    n_valid = negative_valid.to(device=x.device, dtype=x.dtype)
    u_n = F.normalize(negatives, dim=-1)
    (all_n, all_n_valid), _ = global_rows(u_n, n_valid, global_batch=global_batch)  # [W·B, N, D], [W·B, N]
    hard = logit_scale * x @ all_n.flatten(0, 1).T + logit_bias  # [B, W·B·N]
    pairs = -F.logsigmoid(-hard) * all_n_valid.flatten()[None, :]  # z = −1; an empty slot is no pair
    loss = (-F.logsigmoid(signs * logits).sum() + pairs.sum()) / batch
    with torch.no_grad():
        own = logit_scale * (x[:, None, :] * u_n).sum(-1) + logit_bias  # [B, N]
        logit_hard = (own * n_valid).sum() / n_valid.sum().clamp(min=1)
    return {"loss": loss, **pair_logit_stats(logits, targets), "logit_hard": logit_hard}


