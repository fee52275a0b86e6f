"""ProtoCLIP's prototype functions: Prototype Back Translation and the prototypical loss.

Notation of "Prototypical Contrastive Language Image Pretraining" (Chen et al. 2022), Sec. 3 and
Algorithm 1: h^I, h^T are the L2-normalised projection-head outputs [*, d_h]; C^I, C^T the K-Means
prototypes of an episode [K, d_h]; label^I, label^T the episode samples' cluster assignments;
C_PBT→I (C_PBT→T) the teacher's clusters translated into the image (text) space by PBT.

Both functions are pure and per-sample: :func:`proto_terms` has no batch statistic, so under DDP
each rank returns the mean over its own rows and DDP's gradient averaging makes the result the
global-batch loss (equal local batches, as nclip's loaders give). The prototypes themselves are
built once per episode, on rank 0, and broadcast (:mod:`nclip.train.episodic`).

Re-exported by :mod:`nclip.objectives.functional`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["pbt", "proto_terms"]


def pbt(
    features: torch.Tensor,
    labels: torch.Tensor,
    num_clusters: int,
    *,
    return_mask: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Prototype Back Translation (Sec. 3.2, Fig. 3(c); Algorithm 1's ``PBT``).

    For every teacher cluster k, the mean of the *student*-modality features of the samples the
    teacher assigned to k: C_PBT[k] = mean{ features[i] : labels[i] = k }. One ``index_add_`` and
    one ``bincount``, O(M·d + K·d) — footnote 7's O(M + K) version, no loop over clusters.

    Args:
        features: [M, d] student features of the episode (e.g. h^I for C_PBT→I).
        labels: [M] int64 teacher assignments in [0, num_clusters) (e.g. label^T).
        num_clusters: K.
        return_mask: also return the bool [K] mask of non-empty clusters.

    Empty clusters (no sample assigned; K-Means can leave some): the row is **zero**, as in the
    authors' code, which initialises the translated centroids with zeros. A zero row would still
    compete in the softmax of Eq. 3 with a logit of exactly 0, so ProtoCLIP passes the mask to
    :func:`proto_terms` (``valid=``), which drops empty clusters from the classifier and from the
    soft targets. No label can point to an empty cluster, since the labels define the clusters.

    The centroids are means of unit vectors and are *not* renormalised (Algorithm 1 and the
    authors' code do not renormalise them either). Differentiable in ``features``.
    """
    if features.ndim != 2:
        raise ValueError(f"features must be 2-D [M, d], got shape {tuple(features.shape)}")
    if labels.ndim != 1 or labels.shape[0] != features.shape[0]:
        raise ValueError(f"labels must be 1-D with {features.shape[0]} entries, got shape {tuple(labels.shape)}")
    if num_clusters < 1:
        raise ValueError(f"num_clusters must be >= 1, got {num_clusters}")
    labels = labels.long()
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_clusters):
        raise ValueError(f"labels must lie in [0, {num_clusters}), got [{int(labels.min())}, {int(labels.max())}]")
    sums = features.new_zeros(num_clusters, features.shape[1]).index_add(0, labels, features)  # [K, d]
    counts = torch.bincount(labels, minlength=num_clusters)  # [K]
    centroids = sums / counts.clamp_min(1).unsqueeze(1).to(features.dtype)  # empty rows stay 0
    if return_mask:
        return centroids, counts > 0
    return centroids


def proto_terms(
    features: torch.Tensor,
    target_centroids: torch.Tensor,
    labels: torch.Tensor,
    t_proto: torch.Tensor | float,
    t_target: float,
    *,
    valid: torch.Tensor | None = None,
    teacher_centroids: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """One direction of L_Proto (Eq. 3-5; Algorithm 1's ``loss_Proto``) with diagnostics.

    Args:
        features: [B, d] the student's L2-normalised projections (h^I or h^T).
        target_centroids: [K, d] the prototype classifier in the student's space: the teacher's
            prototypes translated by PBT (C_PBT→I for image students), or the teacher's raw
            prototypes C^T when PBT is off (then the two spaces must share d).
        labels: [B] int64 the teacher's cluster assignment of each row (label^T for images).
        t_proto: τ_Proto, scalar (learnable in ProtoCLIP; a tensor carries its gradient).
        t_target: τ_y of Eq. 5. ``> 0``: soft targets
            y = softmax(C[labels] · Cᵀ / τ_y); ``<= 0``: one-hot targets (hard ``labels``).
        valid: optional bool [K], False for empty clusters (see :func:`pbt`); they are removed
            from the classifier and the targets (their scores are masked to −∞, so the shapes stay
            [B, K] and nothing is read on the host; the values are those of the K' valid clusters
            alone). None: every cluster takes part.
        teacher_centroids: the C of the soft targets. None (default): ``target_centroids``, as in
            Algorithm 1 (``target_centroids[label] @ target_centroids.T``). Eq. 5 and the authors'
            code instead use the teacher's own prototypes C^T: pass them here for that reading.

    Returns ``loss`` = −(1/B) Σ_i Σ_k y_ik log softmax(S_i / τ_Proto)_k with S_i = C · h_i (Eq. 3-4),
    and the detached ``acc`` (share of rows whose highest score is their teacher cluster) and
    ``target_entropy`` (mean entropy of the targets; 0 for hard targets).
    """
    if features.ndim != 2 or target_centroids.ndim != 2 or features.shape[1] != target_centroids.shape[1]:
        raise ValueError(
            f"features [B, d] and target_centroids [K, d] must share d, got {tuple(features.shape)} "
            f"and {tuple(target_centroids.shape)}"
        )
    if labels.shape != features.shape[:1]:
        raise ValueError(f"labels must have shape [{features.shape[0]}], got {tuple(labels.shape)}")
    labels = labels.long()
    if valid is not None and valid.shape != target_centroids.shape[:1]:
        raise ValueError(f"valid must have shape [{target_centroids.shape[0]}], got {tuple(valid.shape)}")
    empty = None if valid is None else ~valid.to(torch.bool)  # [K]: clusters out of the softmax
    scores = features @ target_centroids.T / t_proto  # [B, K]: S_i / τ_Proto, Eq. 3
    if empty is not None:
        scores = scores.masked_fill(empty, float("-inf"))
    log_p = F.log_softmax(scores, dim=1)  # [B, K]
    if t_target > 0:
        c = target_centroids if teacher_centroids is None else teacher_centroids
        with torch.no_grad():  # the targets are constants (built from detached prototypes)
            logits = c[labels].detach() @ c.detach().T / t_target  # [B, K], Eq. 5
            y = F.softmax(logits if empty is None else logits.masked_fill(empty, float("-inf")), dim=1)
        if empty is not None:  # y = 0 there; 0·(−∞) would be NaN
            log_p = log_p.masked_fill(empty, 0.0)
        loss = -(y * log_p).sum(1).mean()
        ent = -(y * y.clamp_min(1e-30).log()).sum(1).mean()
    else:
        loss = F.nll_loss(log_p, labels)
        ent = log_p.new_zeros(())
    with torch.no_grad():
        acc = (scores.argmax(1) == labels).float().mean()
    return {"loss": loss, "acc": acc, "target_entropy": ent.detach()}


