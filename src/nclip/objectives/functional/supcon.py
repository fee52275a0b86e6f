"""SupCon, PaCo and ReCo: supervised contrastive losses over a multi-view batch ("OmniBenchmark:
Towards Omni-vision Representation", Sec. 4.1–4.3, Eq. 1–7).

Notation of the OmniBenchmark paper, Sec. 4.1: N images, two augmented views each, form the 2N
multi-view batch I; z_i is the ℓ2-normalised embedding of view i (an *anchor*), A(i) = I \\ {i} its
candidates and P(i) = {p ∈ A(i) : ỹ_p = ỹ_i} its positives. With the temperature τ (Khosla et al.
write z_i·z_k/τ; the OmniBenchmark equations write no τ):

    Eq. (2), SupCon:  L_i = −1/|P(i)| Σ_{p∈P(i)} log [exp(z_i·z_p/τ) / Σ_{k∈A(i)} exp(z_i·z_k/τ)]
    Eq. (3), PaCo:    positives P(i) ∪ {c_ỹi}, candidates A(i) ∪ C, C the learnable class centres
    Eq. (5), ReCo:    A_select(i) = {z_k ∈ A(i) kept by a Bernoulli trial with P = 1 − s(ỹ_i, ỹ_k)}
    Eq. (6), ReCo:    Eq. (2) with A(i) replaced by A_select(i)
    Eq. (7):          L = L_SupCon/PaCo + α·L_ReCo, α = 1 ("We empirically set α = 1")

Normalisation: Eq. (2) and (6) as printed in the OmniBenchmark paper sum over P(i) without the
1/|P(i)| of Khosla et al.'s L^sup_out ("Supervised Contrastive Learning", NeurIPS 2020, Eq. 2), which
Eq. (2) cites. We use L^sup_out's 1/|P(i)| in both (the same per-anchor factor, so Eq. 7's balance
of the two terms is unchanged) and average L_i over the anchors that have at least one positive; an
anchor without one (a single view whose class is alone in the batch) contributes nothing. With two
views every anchor has a positive: its other view.

Unlabelled rows (label :data:`~nclip.objectives.functional.cmsf.UNLABELLED`, -1): their positives
are the other views of the same image (Eq. 1, SimCLR's j(i)); they have no class centre, and ReCo
keeps every negative of theirs (no similarity is known).

Feature layout: ``features`` is [B, V, D] (V views of each of B images, every view an anchor) or
[B, D] (V = 1). Rows are flattened image-major: view v of image b is row b·V + v.

Distributed: with ``global_batch=True`` under a process group, every rank's features are gathered
(with gradient, :func:`nclip.distributed.gather_with_grad`) and labels (without) in rank order, so
the candidates A(i) are the global multi-view batch; each rank returns the sum of its own anchors'
losses divided by the global number of anchors with positives and multiplied by the world size, so
that the mean of the per-rank losses (DDP's convention) is the single-process loss. Masks that cover
the global batch (``keep``) are [N_g, C_g] over the *global* rows, identical on every rank; each
rank reads its own rows.

Everything computes in the dtype of the inputs (float32 in training, float64 in the tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nclip import distributed as collectives
from nclip.objectives.functional.cmsf import UNLABELLED

SUPCON_TEMPERATURE = 0.1  # Khosla et al., Sec. 4 / their code's --temp 0.1 (the OmniBenchmark paper gives none)
# PaCo (Cui et al., "Parametric Contrastive Learning", ICCV 2021): the authors' training scripts for
# ResNet-50 on full ImageNet and on ImageNet-LT (PaCo/Full-ImageNet/sh/train_resnet50.sh,
# PaCo/LT/sh/ImageNetLT_train_R50.sh in dvlab-research/Parametric-Contrastive-Learning) pass
# --alpha 0.05 --beta 1.0 --gamma 1.0 --moco-t 0.2. The OmniBenchmark paper (Sec. 5.3) reproduces PaCo
# but states none of these values.
PACO_ALPHA, PACO_BETA, PACO_TEMPERATURE = 0.05, 1.0, 0.2


def _views(features: torch.Tensor) -> torch.Tensor:
    if features.ndim == 2:
        return features[:, None]
    if features.ndim != 3 or features.shape[0] == 0 or features.shape[1] == 0:
        raise ValueError(f"features must be [B, V, D] or [B, D] with B, V > 0, got {tuple(features.shape)}")
    return features


def _check_labels(labels: torch.Tensor, b: int, name: str = "labels") -> None:
    if labels.ndim != 1 or labels.shape[0] != b:
        raise ValueError(f"{name} must be [B={b}], got {tuple(labels.shape)}")


def _distributed(global_batch: bool) -> bool:
    return global_batch and collectives.is_distributed()


def multiview_labels(labels: torch.Tensor, views: int, *, global_batch: bool = True) -> torch.Tensor:
    """The labels of the global multi-view batch, [W·B·V] (image-major rows, ranks in order), without
    gradient: what :func:`reco_keep_mask` needs for its rows and, with a queue's labels appended, columns."""
    lab = collectives.all_gather_no_grad(labels.detach()) if _distributed(global_batch) else labels.detach()
    return lab.repeat_interleave(views)


@torch.no_grad()
def _pair_masks(lab, lab_c, sample, sample_c, keep, queue_valid) -> tuple[torch.Tensor, torch.Tensor]:
    """Positives P(i) and denominator D(i) (without the centres) of every global anchor i, bool [N_g, C_g]
    over the candidates (the global multi-view batch, then the queue): labels [N_g] and [C_g], image
    indices [N_g] and [C_g] (-1 for queue rows)."""
    n_g, c_g = lab.shape[0], lab_c.shape[0]
    labelled = lab != UNLABELLED  # [N_g]
    pos = ((lab[:, None] == lab_c[None]) & labelled[:, None]) | (sample[:, None] == sample_c[None])
    pos.diagonal().fill_(False)  # P(i) ⊆ A(i) = I \ {i}; a fill: no index tensor made from host data
    den = torch.ones(n_g, c_g, dtype=torch.bool, device=lab.device)  # A(i)
    den.diagonal().fill_(False)
    if queue_valid is not None:  # a queue row not written yet is no candidate (nor, labelled -1, a positive)
        if queue_valid.dtype != torch.bool or tuple(queue_valid.shape) != (c_g - n_g,):
            raise ValueError(f"queue_valid must be bool [Q={c_g - n_g}], got {queue_valid.dtype} "
                             f"{tuple(queue_valid.shape)}")
        den[:, n_g:].logical_and_(queue_valid.to(lab.device)[None])
        pos[:, n_g:].logical_and_(queue_valid.to(lab.device)[None])
    if keep is not None:
        if keep.dtype != torch.bool or keep.ndim != 2 or keep.shape[0] != n_g or keep.shape[1] not in (n_g, c_g):
            raise ValueError(f"keep must be bool [N={n_g}, {n_g} or {c_g}] over the global multi-view batch "
                             f"(and queue), got {keep.dtype} {tuple(keep.shape)}")
        kept = keep.to(lab.device)
        if kept.shape[1] < c_g:
            kept = torch.cat([kept, kept.new_ones(n_g, c_g - kept.shape[1])], 1)
        den &= kept | pos  # keep selects negatives; positives stay in the denominator
    return pos, den


def _contrast(features, labels, *, temperature, keep, queue, queue_labels, centers, alpha, beta, global_batch,
              queue_valid=None, check_labels=True) -> dict[str, torch.Tensor]:
    """The weighted supervised contrastive loss that Eq. (2), (3) and (6) are instances of.

    Per anchor i with log-probabilities log p_ik = z_i·x_k/τ − log Σ_{k' ∈ D(i)} exp(z_i·x_k'/τ) over
    its denominator set D(i) = (A(i) ∩ keep_i) ∪ queue ∪ C (positives always kept):
        L_i = −(α Σ_{p∈P(i)} log p_ip + β log p_{i,c_ỹi}) / (α|P(i)| + β·[ỹ_i labelled, C given]).
    """
    z = F.normalize(_views(features), dim=-1)  # [B, V, D]
    b, v, d = z.shape
    _check_labels(labels, b)
    dist = _distributed(global_batch)
    world = collectives.world_size() if dist else 1
    offset = collectives.rank() * b * v if dist else 0
    zg = collectives.gather_with_grad(z) if dist else z  # [W·B, V, D]
    cand = zg.reshape(-1, d)  # [N_g, D]: the global multi-view batch, image-major
    n_g = cand.shape[0]
    lab = multiview_labels(labels, v, global_batch=global_batch)  # [N_g]
    sample = torch.arange(n_g, device=z.device) // v  # [N_g]: which image a row is a view of
    q = 0
    if queue is not None:
        if queue_labels is None or queue.ndim != 2 or queue.shape[1] != d or queue_labels.shape != queue.shape[:1]:
            raise ValueError(f"queue must be [Q, D={d}] with queue_labels [Q], got {tuple(queue.shape)} and "
                             f"{None if queue_labels is None else tuple(queue_labels.shape)}")
        q = queue.shape[0]
        cand = torch.cat([cand, F.normalize(queue.detach().to(z.dtype), dim=-1)])  # [N_g + Q, D]
        lab_c = torch.cat([lab, queue_labels.to(lab)])
        sample_c = torch.cat([sample, torch.full((q,), -1, dtype=sample.dtype, device=sample.device)])
    else:
        lab_c, sample_c = lab, sample
    with torch.no_grad():
        labelled = lab != UNLABELLED  # [N_g]
        pos, den = _pair_masks(lab, lab_c, sample, sample_c, keep, queue_valid)  # [N_g, C_g]: P(i), D(i) ∩ batch
        centre_pos = labelled if centers is not None and beta > 0 else torch.zeros_like(labelled)
        weight_sum = alpha * pos.sum(1).to(z.dtype) + beta * centre_pos.to(z.dtype)  # [N_g]
        has_pos = weight_sum > 0
        count = has_pos.sum()
    rows = slice(offset, offset + b * v)
    anchors = z.reshape(-1, d)  # [B·V, D]: this rank's anchors
    logits = anchors @ cand.T / temperature  # [B·V, C_g]
    pos_r, den_r = pos[rows], den[rows]
    parts = [logits.masked_fill(~den_r, float("-inf"))]
    if centers is not None:
        if centers.ndim != 2 or centers.shape[1] != d:
            raise ValueError(f"centers must be [K, D={d}], got {tuple(centers.shape)}")
        if check_labels and bool((lab >= centers.shape[0]).any()):  # reads the labels on the host
            raise ValueError(f"labels must be < K={centers.shape[0]} (the number of centres)")
        c_logits = anchors @ F.normalize(centers.to(z.dtype), dim=-1).T / temperature  # [B·V, K]
        parts.append(c_logits)
    masked = torch.cat(parts, 1)
    any_den = torch.isfinite(masked).any(1, keepdim=True)  # an anchor alone with nothing to contrast
    lse = torch.logsumexp(torch.where(any_den, masked, torch.zeros_like(masked)), 1)  # [B·V]
    log_p = logits - lse[:, None]  # [B·V, C_g]
    total = alpha * torch.where(pos_r, log_p, torch.zeros_like(log_p)).sum(1)  # [B·V]
    if centers is not None and beta > 0:
        lab_r = lab[rows]
        own = c_logits.gather(1, lab_r.clamp(min=0)[:, None]).squeeze(1) - lse  # log p_{i, c_ỹi}
        total = total + beta * torch.where(centre_pos[rows], own, torch.zeros_like(own))
    w = weight_sum[rows]
    row_loss = torch.where(has_pos[rows], -total / w.clamp(min=1e-12), torch.zeros_like(total))  # [B·V]
    loss = row_loss.sum() * world / count.clamp(min=1).to(z.dtype)
    with torch.no_grad():
        negatives = (den & ~pos).sum(1).to(z.dtype)  # [N_g]: kept negatives per anchor
        stats = {"anchors_with_positives": has_pos.to(z.dtype).mean(),
                 "positives": pos.sum(1).to(z.dtype).mean(),
                 "negatives": negatives.mean()}
    return {"loss": loss, **stats}


def supcon_terms(
    features: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = SUPCON_TEMPERATURE,
    keep: torch.Tensor | None = None,
    queue: torch.Tensor | None = None,
    queue_labels: torch.Tensor | None = None,
    queue_valid: torch.Tensor | None = None,
    global_batch: bool = True,
) -> dict[str, torch.Tensor]:
    """SupCon, Eq. (2) (Khosla et al.'s L^sup_out), with detached diagnostics.

    Args:
        features: [B, V, D] (V views per image, every view an anchor) or [B, D]; ℓ2-normalised here.
        labels: [B] class per image (-1: unlabelled, positives = its other views only).
        temperature: τ (default 0.1, Khosla et al.; the OmniBenchmark paper writes none).
        keep: optional bool [N_g, N_g] or [N_g, N_g + Q] over the global multi-view batch (and the
            queue): False removes a *negative* candidate from anchor i's denominator (ReCo's A_select,
            Eq. 5); positives are always kept. Rows as in the module doc, identical on every rank.
        queue, queue_labels: optional [Q, D] past embeddings (detached, ℓ2-normalised here) and their
            labels [Q]: extra candidates, positives when they share the anchor's label (MoCo-style, as
            PaCo's code uses). Never anchors.
        queue_valid: optional bool [Q], False for a queue row not written yet (no candidate): the
            queue's fixed shape, :meth:`~nclip.objectives.cmsf_bank.MemoryBank.rows`; the result is the
            one of the valid rows alone.
        global_batch: contrast against the rows of every rank when running distributed.

    Returns ``loss`` (mean of L_i over the anchors with a positive; 0 when none has one) and
    ``anchors_with_positives`` (share), ``positives`` (mean |P(i)|), ``negatives`` (mean number of
    negatives kept), over the global batch.
    """
    return _contrast(features, labels, temperature=temperature, keep=keep, queue=queue, queue_labels=queue_labels,
                     centers=None, alpha=1.0, beta=0.0, global_batch=global_batch, queue_valid=queue_valid)


def paco_terms(
    features: torch.Tensor,
    labels: torch.Tensor,
    centers: torch.Tensor,
    *,
    alpha: float = PACO_ALPHA,
    beta: float = PACO_BETA,
    temperature: float = PACO_TEMPERATURE,
    keep: torch.Tensor | None = None,
    queue: torch.Tensor | None = None,
    queue_labels: torch.Tensor | None = None,
    queue_valid: torch.Tensor | None = None,
    global_batch: bool = True,
    check_labels: bool = True,
) -> dict[str, torch.Tensor]:
    """PaCo, Eq. (3): the class centres C = {c_1..c_K} are extra candidates of every anchor and c_ỹi an
    extra positive of anchor i, weighted as in Cui et al. (their Eq. 9 and code):

        L_i = −(α Σ_{p∈P(i)} log p_ip + β log p_{i,c_ỹi}) / (α|P(i)| + β),
        p_ik = exp(z_i·x_k/τ) / Σ_{x ∈ A(i) ∪ queue ∪ C} exp(z_i·x/τ).

    α = β = 1 is Eq. (3) as the OmniBenchmark paper prints it (with the 1/(|P(i)| + 1) normaliser).
    Defaults α = 0.05, β = 1.0, τ = 0.2: the PaCo authors' ResNet-50 scripts for ImageNet and
    ImageNet-LT (see :data:`PACO_ALPHA`); their γ (weight of the samples in the denominator) is 1
    there, which is what this function computes. Where the authors' code scores the centres with a
    linear classifier on the backbone features (logits/supt, supt = 1), Eq. (3) writes z_i·c like
    z_i·z_k, which we follow: the centres are ℓ2-normalised and share τ.

    centers: [K, D] learnable (normalised here, receives a gradient); labels must be < K (-1:
    unlabelled, no centre term), a ValueError otherwise when ``check_labels`` (which reads the labels on
    the host, a device sync: the objectives, whose labels come from a label space of at most K
    classes, turn it off). Other arguments as :func:`supcon_terms`; every labelled anchor has a
    positive (its centre) when β > 0.
    """
    if alpha < 0 or beta < 0:
        raise ValueError(f"alpha and beta must be >= 0, got {alpha} and {beta}")
    return _contrast(features, labels, temperature=temperature, keep=keep, queue=queue, queue_labels=queue_labels,
                     centers=centers, alpha=alpha, beta=beta, global_batch=global_batch, queue_valid=queue_valid,
                     check_labels=check_labels)


@torch.no_grad()
def reco_keep_mask(
    labels: torch.Tensor,
    similarity: torch.Tensor,
    generator: torch.Generator,
    *,
    candidate_labels: torch.Tensor | None = None,
    check_labels: bool = True,
) -> torch.Tensor:
    """ReCo's negative selection, Eq. (5): keep[i, k] ~ Bernoulli(1 − s(ỹ_i, ỹ_k)), [N, M] bool.

    labels: [N] the anchors' labels (the global multi-view batch, :func:`multiview_labels`);
    candidate_labels: [M] the candidates' (default: ``labels``; append a queue's labels for a queue);
    similarity: [C, C] s, the normalised class similarity of Eq. (4) in [0, 1] (s = 1: never a
    negative, s = 0: always); generator: the draws' source, on the labels' device, seeded identically
    on every rank (the trainer's (seed, draw) stream), so every rank draws the same global mask.

    Same-label pairs are kept (they are positives, not negatives; Eq. 6's numerators stay in its
    denominator), and so is every pair with an unlabelled (-1) side. One uniform draw per pair, in
    row-major order over [N, M], whatever the labels: the mask is a function of the generator's state.
    Labels must be < C: ``check_labels`` raises a ValueError otherwise, reading them on the host (a
    device sync; the objective, whose labels and s come from one label space, turns it off).
    """
    cand = labels if candidate_labels is None else candidate_labels
    if labels.ndim != 1 or cand.ndim != 1:
        raise ValueError(f"labels [N] and candidate_labels [M] must be 1-D, got {tuple(labels.shape)} and "
                         f"{tuple(cand.shape)}")
    c = similarity.shape[0]
    if similarity.ndim != 2 or similarity.shape[1] != c:
        raise ValueError(f"similarity must be [C, C], got {tuple(similarity.shape)}")
    if check_labels and (bool((labels >= c).any()) or bool((cand >= c).any())):
        raise ValueError(f"labels must be < C={c} (the similarity's classes)")
    u = torch.rand(labels.shape[0], cand.shape[0], generator=generator, device=labels.device)  # [N, M]
    known = (labels[:, None] != UNLABELLED) & (cand[None] != UNLABELLED)
    s = similarity.to(labels.device, torch.float64)[labels.clamp(min=0)[:, None], cand.clamp(min=0)[None]]  # [N, M]
    accept = u.double() < (1 - s).clamp(0, 1)
    return accept | ~known | (labels[:, None] == cand[None])


def reco_terms(
    features: torch.Tensor,
    labels: torch.Tensor,
    keep: torch.Tensor,
    *,
    alpha: float = 1.0,
    temperature: float = SUPCON_TEMPERATURE,
    centers: torch.Tensor | None = None,
    paco_alpha: float = PACO_ALPHA,
    paco_beta: float = PACO_BETA,
    paco_temperature: float = PACO_TEMPERATURE,
    queue: torch.Tensor | None = None,
    queue_labels: torch.Tensor | None = None,
    queue_valid: torch.Tensor | None = None,
    global_batch: bool = True,
    check_labels: bool = True,
) -> dict[str, torch.Tensor]:
    """ReCo, Eq. (7): L = L_base + α·L_ReCo, L_base = SupCon (Eq. 2; ``centers`` None) or PaCo (Eq. 3,
    with ``centers`` and the ``paco_*`` weights), L_ReCo = Eq. (6): SupCon's form over the sampled
    negatives A_select(i) (``keep``, from :func:`reco_keep_mask`), with τ = ``temperature`` (SupCon's
    0.1: Eq. 6 writes no temperature). Eq. (6) has no centres: L_ReCo contrasts samples only.

    With s ≡ 0 every negative is kept, L_ReCo = L_SupCon at the same τ, and L = (1 + α)·L_SupCon for
    the SupCon base. Returns ``loss``, ``base``, ``reco`` (both detached) and ``kept`` (the share of
    the negative candidates kept, over the global batch).
    """
    q = {"queue": queue, "queue_labels": queue_labels, "queue_valid": queue_valid}
    if centers is None:
        base = supcon_terms(features, labels, temperature=temperature, global_batch=global_batch, **q)
    else:
        base = paco_terms(features, labels, centers, alpha=paco_alpha, beta=paco_beta, temperature=paco_temperature,
                          global_batch=global_batch, check_labels=check_labels, **q)
    reco = supcon_terms(features, labels, temperature=temperature, keep=keep, global_batch=global_batch, **q)
    kept = reco["negatives"] / base["negatives"].clamp(min=1)  # both over the same global batch
    return {"loss": base["loss"] + alpha * reco["loss"], "base": base["loss"].detach(),
            "reco": reco["loss"].detach(), "kept": kept}


