"""Pure evaluation metrics: tensors in, Python numbers / dicts / tensors out.

Nothing here knows about models, datasets or the trainer. Every function validates its inputs and
raises :class:`ValueError` naming the argument and the mismatch. Inputs may be float32 or float64
tensors (anything :func:`torch.as_tensor` accepts is converted); integer label tensors of any integer
dtype are accepted and used as ``int64``.

One module per family (and the protocol each follows); everything public is re-exported here, so
``from nclip.eval.metrics import recall_at_k`` works for every family:

* :mod:`~nclip.eval.metrics.retrieval` -- :func:`recall_at_k` (CLIP / xCLIP Tab. 2 zero-shot
  image-text retrieval).
* :mod:`~nclip.eval.metrics.classification` -- :func:`topk_accuracy`, :func:`confusion_matrix`,
  :func:`mean_per_class_recall`, :func:`zero_shot_classifier` (CLIP prompt ensemble, xCLIP appendix
  "zero-shot classification").
* :mod:`~nclip.eval.metrics.knn` -- :func:`knn_predict` (InstDisc / DINO weighted k-NN).
* :mod:`~nclip.eval.metrics.linear` -- :func:`linear_probe` (CLIP linear probe: L-BFGS multinomial
  logistic regression with a validated L2 strength), :func:`stratified_split`.
* :mod:`~nclip.eval.metrics.sgd_linear` -- :func:`sgd_linear_probe` (the papers' SGD probes:
  xCLIP, CMSF / CompRess, ProtoCLIP App. B; ``SGD_RECIPES``).
* :mod:`~nclip.eval.metrics.multilabel` (xCLIP Tab. 3) -- :func:`mean_average_precision`,
  :func:`precision_recall_f1_at_k`, :func:`f1_at_k`.
* :mod:`~nclip.eval.metrics.clustering` (ProtoCLIP Tab. A.12c) -- :func:`cluster_scores`.
* :mod:`~nclip.eval.metrics.representation` (diagnostics) -- :func:`effective_rank`,
  :func:`alignment`, :func:`uniformity`, :func:`prototype_usage`, :func:`probability_std` (xCLIP
  appendix Fig. B1).
* :mod:`~nclip.eval.metrics.correlation` (text similarity) -- :func:`spearman`.
* :mod:`~nclip.eval.metrics.mask_probing` (xCLIP Sec. 4.2.1 / Tab. D3, after DINO) --
  :func:`attention_mask_jaccard`, and DINO's attention-mass rule :func:`mass_threshold`.

The input checks and the pessimistic rank shared by the families live in ``_common``.

Ranking convention. Where a metric ranks candidates (:func:`recall_at_k`, :func:`topk_accuracy`),
ties are counted *against* the query: a wrong candidate that scores exactly as high as the right one
is ranked ahead of it. This makes the metrics deterministic (no dependence on ``torch.topk``'s tie
order) and stops a collapsed model that gives every candidate the same score from reporting
perfect recall -- exactly the failure mode the non-contrastive objectives must be watched for.
"""

from nclip.eval.metrics.classification import (
    confusion_matrix,
    mean_per_class_recall,
    topk_accuracy,
    zero_shot_classifier,
)
from nclip.eval.metrics.clustering import cluster_scores
from nclip.eval.metrics.correlation import spearman
from nclip.eval.metrics.knn import knn_predict
from nclip.eval.metrics.linear import linear_probe, stratified_split
from nclip.eval.metrics.mask_probing import attention_mask_jaccard, mass_threshold
from nclip.eval.metrics.multilabel import f1_at_k, mean_average_precision, precision_recall_f1_at_k
from nclip.eval.metrics.representation import alignment, effective_rank, probability_std, prototype_usage, uniformity
from nclip.eval.metrics.retrieval import recall_at_k
from nclip.eval.metrics.sgd_linear import SGD_RECIPES, sgd_linear_probe

__all__ = [
    "recall_at_k",
    "topk_accuracy",
    "confusion_matrix",
    "mean_per_class_recall",
    "zero_shot_classifier",
    "knn_predict",
    "linear_probe",
    "sgd_linear_probe",
    "SGD_RECIPES",
    "stratified_split",
    "mean_average_precision",
    "precision_recall_f1_at_k",
    "f1_at_k",
    "cluster_scores",
    "effective_rank",
    "alignment",
    "uniformity",
    "prototype_usage",
    "probability_std",
    "spearman",
    "attention_mask_jaccard",
    "mass_threshold",
]
