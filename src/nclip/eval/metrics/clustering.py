"""Clustering quality of features against classes (ProtoCLIP App. E, Tab. A.12c)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nclip.eval.metrics._common import as_float, as_labels, positive_int


def cluster_scores(
    features,
    labels,
    num_clusters: int | None = None,
    seed: int = 0,
    normalize: bool = True,
    n_init: int = 10,
) -> dict:
    """K-Means clustering quality against ground-truth classes (ProtoCLIP App. E, Tab. A.12c).

    The features are clustered by K-Means into ``num_clusters`` groups (default: the number of
    distinct classes in ``labels``, as in ProtoCLIP) and the cluster ids are compared with the
    classes by the Adjusted Rand Index and Adjusted Mutual Information (``sklearn.metrics``; AMI
    with the arithmetic-mean normaliser, sklearn's default). NMI is reported as well.

    Why scikit-learn's ``KMeans`` and not ``faiss.Kmeans``: this runs once per evaluation on a test
    split (10^3 - 10^5 rows, tens to hundreds of clusters), where sklearn is fast enough, and it
    gives k-means++ seeding with ``n_init`` restarts and results that depend only on ``seed``.
    faiss (random-sample seeding, thread-count dependent reductions) is the right tool for the
    training-time prototypes (ProtoCLIP's K = 20,000 per episode), not for a reported score.

    Args:
        features: [N, d]. labels: int [N] ground-truth classes (any non-negative ids).
        num_clusters: K; ``None`` = number of distinct labels. Must be <= N.
        seed: K-Means random state. normalize: L2-normalise features first (cosine geometry, how
            CLIP-style embeddings are compared). n_init: K-Means restarts.

    Returns:
        ``{"ari": float, "ami": float, "nmi": float, "num_clusters": int}``.
    """
    from sklearn.cluster import KMeans
    from sklearn.metrics import adjusted_mutual_info_score, adjusted_rand_score, normalized_mutual_info_score

    x = as_float(features, "features", ndim=2)
    y = as_labels(labels, "labels", n=x.shape[0])
    if x.shape[0] < 2:
        raise ValueError(f"features needs at least 2 rows, got {x.shape[0]}")
    if num_clusters is None:
        num_clusters = int(torch.unique(y).numel())
    num_clusters = positive_int(num_clusters, "num_clusters")
    if num_clusters > x.shape[0]:
        raise ValueError(f"num_clusters={num_clusters} exceeds the number of rows {x.shape[0]}")
    if normalize:
        x = F.normalize(x, dim=1)
    km = KMeans(n_clusters=num_clusters, n_init=positive_int(n_init, "n_init"), random_state=seed)
    pred = km.fit_predict(x.double().numpy())
    yn = y.numpy()
    return {
        "ari": float(adjusted_rand_score(yn, pred)),
        "ami": float(adjusted_mutual_info_score(yn, pred)),
        "nmi": float(normalized_mutual_info_score(yn, pred)),
        "num_clusters": num_clusters,
    }
