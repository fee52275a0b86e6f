"""Step 2 of a ProtoCLIP episode (:func:`nclip.train.episodic.build_prototypes`) on hand-made
clusters: which prototypes the soft targets of Eq. 5 come from, and "w/o K-Means" (kmeans_iters 0)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nclip.objectives import functional
from nclip.objectives.protoclip import ProtoclipConfig
from nclip.train import kmeans as km
from nclip.train.episodic import build_prototypes


def _clusters(centres: torch.Tensor, per: int, noise: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[K·per, d] normalised points around ``centres`` [K, d], and their true cluster."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.arange(centres.shape[0]).repeat_interleave(per)
    x = centres[truth] + noise * torch.randn(len(truth), centres.shape[1], generator=g)
    return F.normalize(x, dim=-1), truth


def _same_partition(a: torch.Tensor, b: torch.Tensor) -> bool:
    pairs = set(zip(a.tolist(), b.tolist()))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


def test_default_soft_targets_come_from_the_teachers_own_centroids():
    # 3 well-separated clusters; the image and text spaces differ (a modality gap), so the teacher's
    # centroids C^T and the PBT-translated ones C_PBT→I are far apart
    k, per = 3, 10
    eye = torch.eye(4)
    h_i, truth = _clusters(eye[:3], per, 0.05, seed=0)
    h_t, _ = _clusters(torch.stack([eye[3] + eye[0], eye[3] + eye[1], eye[3] + eye[2]]), per, 0.05, seed=1)
    oc = ProtoclipConfig(episode_size=len(h_i), clusters=k, w_ext=0)
    assert oc.soft_targets_from == "teacher"  # the default: Eq. 5
    state, stats = build_prototypes(oc, h_i, h_t, None, seed=0)
    lab_i, lab_t = state["labels"][:, 0], state["labels"][:, 1]
    assert _same_partition(lab_i, truth) and _same_partition(lab_t, truth)
    assert stats["empty_image"] == stats["empty_text"] == 0
    # the classifier: PBT (Algorithm 1); the targets: the teacher's own K-Means prototypes (Eq. 5)
    torch.testing.assert_close(state["i2t_centroids"], functional.pbt(h_i, lab_t, k))
    torch.testing.assert_close(state["t2i_centroids"], functional.pbt(h_t, lab_i, k))
    mean_t = torch.stack([h_t[lab_t == c].mean(0) for c in range(k)])  # converged K-Means: the cluster means
    mean_i = torch.stack([h_i[lab_i == c].mean(0) for c in range(k)])
    torch.testing.assert_close(state["i2t_targets"], mean_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state["t2i_targets"], mean_i, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(state["i2t_targets"], state["i2t_centroids"], atol=0.1)
    # Algorithm 1's reading: no target entries, the objective falls back to the translated centroids
    alg1, _ = build_prototypes(oc.model_copy(update={"soft_targets_from": "translated"}), h_i, h_t, None, seed=0)
    assert not any(name.endswith("_targets") for name in alg1)
    # and the targets the loss sees differ: softmax(C^T[label]·C^Tᵀ/τ_y) vs the translated ones (at a
    # τ_y where these well-separated clusters do not make both one-hot)
    y_teacher = F.softmax(mean_t[lab_t] @ mean_t.T / 0.5, 1)
    c = state["i2t_centroids"]
    y_alg1 = F.softmax(c[lab_t] @ c.T / 0.5, 1)
    assert not torch.allclose(y_teacher, y_alg1, atol=1e-3)


def test_external_teacher_targets_and_translation():
    eye = torch.eye(4)
    h_i, truth = _clusters(eye[:2], 8, 0.05, seed=2)
    h_t, _ = _clusters(eye[2:], 8, 0.05, seed=3)
    teacher, _ = _clusters(torch.eye(6)[:2] * 3, 8, 0.05, seed=4)
    oc = ProtoclipConfig(episode_size=len(h_i), clusters=2, ext_clusters=2)
    state, stats = build_prototypes(oc, h_i, h_t, teacher, seed=1)
    lab_e = state["labels"][:, 2]
    assert _same_partition(lab_e, truth) and "kmeans_obj_ext" in stats
    torch.testing.assert_close(state["i2e_centroids"], functional.pbt(h_i, lab_e, 2))
    mean_e = torch.stack([teacher[lab_e == c].mean(0) for c in range(2)])
    torch.testing.assert_close(state["i2e_targets"], mean_e, rtol=1e-5, atol=1e-5)
    assert state["t2e_targets"] is state["i2e_targets"]


def test_kmeans_iters_0_keeps_random_training_points_as_centroids():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((200, 5)).astype(np.float32)
    for method in ("auto", "flat", "two_level"):
        r = km.kmeans(x, 12, niter=0, seed=3, method=method)
        assert r.method == "random" and r.centroids.shape == (12, 5)
        rows = [int(np.flatnonzero((x == c.numpy()).all(1))[0]) for c in r.centroids]  # each one a training point
        assert len(set(rows)) == 12
        d = torch.cdist(torch.from_numpy(x), r.centroids)
        torch.testing.assert_close(r.labels, d.argmin(1))  # exact nearest-centroid assignment
        assert r.objective == pytest.approx(float((d.min(1).values ** 2).sum()), rel=1e-4)
    # seeded, and nredo keeps the best of its draws
    assert torch.equal(km.kmeans(x, 12, niter=0, seed=3).centroids, km.kmeans(x, 12, niter=0, seed=3).centroids)
    assert km.kmeans(x, 12, niter=0, nredo=5, seed=3).objective <= km.kmeans(x, 12, niter=0, seed=3).objective
    assert km.kmeans(x, 12, niter=0).objective > km.kmeans(x, 12, niter=10).objective  # Lloyd does improve it
    with pytest.raises(ValueError, match="niter"):
        km.kmeans(x, 12, niter=-1)


def test_w_o_kmeans_episode_prototypes_are_episode_samples():
    h_i, _ = _clusters(torch.eye(4)[:3], 10, 0.3, seed=5)
    h_t, _ = _clusters(torch.eye(4)[1:], 10, 0.3, seed=6)
    oc = ProtoclipConfig(episode_size=len(h_i), clusters=4, w_ext=0, kmeans_iters=0)
    state, stats = build_prototypes(oc, h_i, h_t, None, seed=0)
    assert stats["kmeans_method"] == "random"
    for targets, feats in ((state["i2t_targets"], h_t), (state["t2i_targets"], h_i)):
        assert all(bool((feats == c).all(1).any()) for c in targets)  # C^T, C^I: episode samples
    with pytest.raises(ValueError):
        ProtoclipConfig(kmeans_iters=-1)
