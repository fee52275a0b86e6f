"""Pure loss functions: nclip's public, tested objective API, one module per family.

``clip`` (InfoNCE, Eq. 1), ``nclip`` (nCLIP Eq. 2-4, xCLIP Eq. 5, the zero-shot score and head
diagnostics), ``unified`` (Appendix A), ``yclip`` (App. B.2), ``siglip``, ``protoclip`` (PBT and
the prototypical loss), ``cmsf`` (Constrained Mean Shift, Eq. 1 of its own paper, its
constraints and its Sec. 2.1.1 baselines ProtoNW and FrzProto) and ``supcon`` (SupCon, PaCo and
ReCo, OmniBenchmark paper Eq. 2-7); everything
public is re-exported here, so
``from nclip.objectives.functional import clip_terms`` works for every family. Each family has one
function, ``<family>_terms``, returning the loss under ``"loss"`` beside its named terms (no ``_loss``
twin restating its signature); ``xclip_loss`` composes two of them (Eq. 5).

Notation follows "Non-Contrastive Learning Meets Language-Image Pre-Training" (xCLIP paper),
Sec. 3.1 and Algorithm 1: g, h are projected features of the two modalities, u = g/||g||,
p = softmax(g), q = softmax(h); B is the (global) batch size, K the nCLIP head width.

Global batch: when a process group with world size > 1 exists and ``global_batch=True``, every
batch statistic is computed over the union of all ranks' rows (InfoNCE negatives, the batch-mean
distribution p̄ of L_HE) through :mod:`nclip.distributed`, whose collectives give gradients that are
exact under DDP's gradient averaging. Each rank then returns the loss of its own rows, so the mean
of the per-rank losses equals the single-process loss on the whole batch.

Numerics: distributions are handled in log space (``log_softmax``; log p̄ through ``logsumexp``), so
every function is finite in float32 for logits of magnitude 1e4 and for a batch of one.
"""

from nclip.objectives.functional._common import class_accuracies
from nclip.objectives.functional.clip import CLIP_REDUCTIONS, clip_terms
from nclip.objectives.functional.cmsf import (
    PROTONW_TEMPERATURE,
    UNLABELLED,
    cmsf_candidates,
    cmsf_terms,
    frozen_prototypes,
    frzproto_terms,
    protonw_terms,
    semi_supervised_constraint,
    topk_constraint,
)
from nclip.objectives.functional.nclip import (
    NCLIP_SCORES,
    batch_mean_log_prob,
    distribution_diagnostics,
    nclip_similarity,
    nclip_terms,
    xclip_loss,
)
from nclip.objectives.functional.protoclip import pbt, proto_terms
from nclip.objectives.functional.siglip import siglip_terms
from nclip.objectives.functional.supcon import (
    PACO_ALPHA,
    PACO_BETA,
    PACO_TEMPERATURE,
    SUPCON_TEMPERATURE,
    multiview_labels,
    paco_terms,
    reco_keep_mask,
    reco_terms,
    supcon_terms,
)
from nclip.objectives.functional.unified import (
    UNIFORM_CHOICES,
    batch_moments,
    ema_moments,
    sinkhorn,
    unified_target_log_prob,
    unified_terms,
)
from nclip.objectives.functional.yclip import yclip_similarity, yclip_terms

__all__ = [
    "clip_terms", "CLIP_REDUCTIONS",
    "nclip_terms", "xclip_loss", "nclip_similarity", "NCLIP_SCORES", "batch_mean_log_prob",
    "distribution_diagnostics",
    "sinkhorn", "batch_moments", "ema_moments", "unified_target_log_prob", "unified_terms",
    "UNIFORM_CHOICES",
    "yclip_terms", "yclip_similarity",
    "siglip_terms",
    "pbt", "proto_terms",
    "cmsf_terms", "cmsf_candidates", "topk_constraint", "semi_supervised_constraint", "UNLABELLED",
    "protonw_terms", "PROTONW_TEMPERATURE", "frzproto_terms", "frozen_prototypes", "class_accuracies",
    "supcon_terms", "paco_terms", "reco_keep_mask", "reco_terms",
    "multiview_labels", "SUPCON_TEMPERATURE", "PACO_ALPHA", "PACO_BETA", "PACO_TEMPERATURE",
]
