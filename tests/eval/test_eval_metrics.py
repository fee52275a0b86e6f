"""Tests for nclip.eval.metrics: hand-made cases with known answers, plus random inputs checked
against independent implementations (scikit-learn, scipy, naive loops written here)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.stats import spearmanr
from sklearn.cluster import KMeans
from sklearn.datasets import make_blobs, make_classification
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import (
    adjusted_mutual_info_score,
    adjusted_rand_score,
    average_precision_score,
    balanced_accuracy_score,
    top_k_accuracy_score,
)
from sklearn.metrics import confusion_matrix as sk_confusion_matrix

from nclip.eval import metrics as M

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ------------------------------------------------------------------------------ retrieval


def _recall_brute(sim, t2i, k):
    """Loop transcription: sort each row/column (ties against the query) and look for a hit."""
    n_img, n_txt = sim.shape
    i2t_hits, t2i_hits = [], []
    for i in range(n_img):
        caps = [j for j in range(n_txt) if t2i[j] == i]
        if not caps:
            continue
        hit = False
        for j in caps:
            rank = sum(1 for jj in range(n_txt) if jj != j and sim[i, jj] >= sim[i, j])
            hit |= rank < k
        i2t_hits.append(hit)
    for j in range(n_txt):
        g = int(t2i[j])
        rank = sum(1 for ii in range(n_img) if ii != g and sim[ii, j] >= sim[g, j])
        t2i_hits.append(rank < k)
    return float(np.mean(i2t_hits)), float(np.mean(t2i_hits))


def test_recall_hand_made():
    # 2 images, 3 captions: captions 0, 1 belong to image 0, caption 2 to image 1.
    sim = torch.tensor([[0.1, 0.9, 0.5], [0.8, 0.2, 0.3]])
    t2i = torch.tensor([0, 0, 1])
    r = M.recall_at_k(sim, t2i, ks=(1, 2))
    # i2t: image 0's top text is caption 1 (its own) -> hit@1. Image 1 ranks 0, 2, 1 -> caption 2
    # is second -> miss@1, hit@2.
    assert r["i2t@1"] == 0.5 and r["i2t@2"] == 1.0
    # t2i: caption 0 prefers image 1 (miss@1), caption 1 image 0 (hit), caption 2 image 0 (miss).
    assert r["t2i@1"] == pytest.approx(1 / 3) and r["t2i@2"] == 1.0
    assert r["mean_recall"] == pytest.approx((0.5 + 1 + 1 / 3 + 1) / 4)


def test_recall_random_vs_bruteforce_multi_caption():
    g = torch.Generator().manual_seed(0)
    n_img = 12
    t2i = torch.cat([torch.arange(n_img).repeat_interleave(3), torch.randint(0, n_img, (7,), generator=g)])
    t2i = t2i[torch.randperm(t2i.numel(), generator=g)]
    sim = torch.randn(n_img, t2i.numel(), generator=g, dtype=torch.float64)
    sim = (sim * 2).round() / 2  # plenty of ties
    ks = (1, 3, 5, 10)
    r = M.recall_at_k(sim, t2i, ks=ks)
    for k in ks:
        i2t, t2i_r = _recall_brute(sim, t2i, k)
        assert r[f"i2t@{k}"] == pytest.approx(i2t)
        assert r[f"t2i@{k}"] == pytest.approx(t2i_r)
    assert r["mean_recall"] == pytest.approx(np.mean([r[f"{d}@{k}"] for d in ("i2t", "t2i") for k in ks]))
    # float32 gives the same answer
    r32 = M.recall_at_k(sim.float(), t2i, ks=ks)
    assert r32 == pytest.approx(r)


def test_recall_ties_count_against_query_and_k_is_clipped():
    sim = torch.zeros(3, 4)  # collapsed model: every candidate tied
    t2i = torch.tensor([0, 0, 1, 1])  # image 2 has no caption: only a text->image distractor
    r = M.recall_at_k(sim, t2i, ks=(1, 2, 3, 4, 100))
    # t2i: the right image ties with 2 others -> pessimistic rank 2 -> hit iff k >= 3
    assert [r[f"t2i@{k}"] for k in (1, 2, 3, 4, 100)] == [0.0, 0.0, 1.0, 1.0, 1.0]
    # i2t: the best caption ties with 3 other texts -> rank 3 -> hit iff k >= 4; image 2 not scored
    assert [r[f"i2t@{k}"] for k in (1, 2, 3, 4, 100)] == [0.0, 0.0, 0.0, 1.0, 1.0]
    # a distractor image that outscores everything only hurts text->image
    sim2 = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 5.0, 0.0, 5.0]])
    r2 = M.recall_at_k(sim2, t2i, ks=(1,))
    assert r2["i2t@1"] == 1.0 and r2["t2i@1"] == 0.5


# ------------------------------------------------------------------------------ classification


def test_topk_and_confusion_vs_sklearn():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(200, 7, generator=g)
    y = torch.randint(0, 7, (200,), generator=g)
    acc = M.topk_accuracy(logits, y, ks=(1, 3, 10))
    assert acc["top1"] == pytest.approx((logits.argmax(1) == y).float().mean().item())
    assert acc["top3"] == pytest.approx(top_k_accuracy_score(y.numpy(), logits.numpy(), k=3, labels=range(7)))
    assert acc["top10"] == 1.0
    pred = logits.argmax(1)
    cm = M.confusion_matrix(pred, y, 7)
    assert cm.dtype == torch.long
    np.testing.assert_array_equal(cm.numpy(), sk_confusion_matrix(y.numpy(), pred.numpy(), labels=range(7)))
    assert M.mean_per_class_recall(pred, y, 7) == pytest.approx(balanced_accuracy_score(y.numpy(), pred.numpy()))


def test_classification_hand_made():
    logits = torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    acc = M.topk_accuracy(logits, torch.tensor([0, 2]), ks=(1, 2))
    assert acc == {"top1": 0.0, "top2": 1.0}  # row 0: tie with class 1 counts against the target
    pred, y = torch.tensor([0, 0, 1, 2]), torch.tensor([0, 1, 1, 1])
    assert M.confusion_matrix(pred, y, 4).tolist() == [[1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert M.mean_per_class_recall(pred, y, 4) == pytest.approx((1.0 + 1 / 3) / 2)  # classes 2, 3 absent


def test_zero_shot_classifier():
    g = torch.Generator().manual_seed(2)
    embs = [torch.randn(p, 16, generator=g) * (c + 1) for c, p in enumerate((1, 3, 5))]
    w = M.zero_shot_classifier(embs)
    assert w.shape == (3, 16)
    torch.testing.assert_close(w.norm(dim=1), torch.ones(3))
    for c, e in enumerate(embs):
        ref = sum(row / row.norm() for row in e) / len(e)
        torch.testing.assert_close(w[c], ref / ref.norm())
    # prompt scale does not matter (each prompt normalised first); tensor form equals list form
    t = torch.randn(4, 3, 8, generator=g, dtype=torch.float64)
    scaled = t * torch.rand(4, 3, 1, generator=g, dtype=torch.float64) * 10
    torch.testing.assert_close(M.zero_shot_classifier(t), M.zero_shot_classifier(scaled))
    torch.testing.assert_close(M.zero_shot_classifier(t), M.zero_shot_classifier(list(t)))
    with pytest.raises(ValueError, match="dimension"):
        M.zero_shot_classifier([torch.randn(2, 8), torch.randn(2, 9)])


def _knn_naive(tr, ytr, te, C, k, T):
    out = []
    for x in te:
        cos = [float(x @ t / (x.norm() * t.norm())) for t in tr]
        order = sorted(range(len(cos)), key=lambda i: -cos[i])[:k]
        votes = [0.0] * C
        for i in order:
            votes[int(ytr[i])] += math.exp(cos[i] / T)
        out.append(max(range(C), key=lambda c: (votes[c], -c)))
    return torch.tensor(out)


def test_knn_vs_naive_loop():
    g = torch.Generator().manual_seed(3)
    tr = torch.randn(60, 8, generator=g, dtype=torch.float64) * 3
    ytr = torch.randint(0, 5, (60,), generator=g)
    te = torch.randn(25, 8, generator=g, dtype=torch.float64)
    for k, T in ((1, 0.07), (7, 0.5), (100, 0.1)):  # k=100 > N_train is clipped
        pred = M.knn_predict(tr, ytr, te, 5, k=k, temperature=T, chunk_size=4)
        assert pred.dtype == torch.long
        torch.testing.assert_close(pred, _knn_naive(tr, ytr, te, 5, k, T))
    # float32 and chunking do not change the answer
    torch.testing.assert_close(M.knn_predict(tr.float(), ytr, te.float(), 5, k=7), M.knn_predict(tr, ytr, te, 5, k=7))


def test_knn_hand_made():
    tr = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
    ytr = torch.tensor([0, 0, 1])
    te = torch.tensor([[2.0, 0.1], [0.0, 5.0]])  # normalisation is done inside
    assert M.knn_predict(tr, ytr, te, 2, k=1).tolist() == [0, 1]
    # k=3, T large -> nearly uniform votes: class 0 has two neighbours and wins everywhere
    assert M.knn_predict(tr, ytr, te, 2, k=3, temperature=100.0).tolist() == [0, 0]


# ------------------------------------------------------------------------------ linear probe


def _split(X, y, n_train):
    t = lambda a, dt=None: torch.tensor(a, dtype=dt)  # noqa: E731
    return t(X[:n_train], torch.float32), t(y[:n_train]), t(X[n_train:], torch.float32), t(y[n_train:])


@pytest.mark.parametrize("n, d, l2", [(3000, 128, 1e-2), (1200, 48, 1e-4)])
def test_linear_probe_matches_sklearn(n, d, l2):
    # first case: the 2,000 x 128, 10-class size the probe is meant to handle in ~1 s
    X, y = make_classification(
        n_samples=n, n_features=d, n_informative=24, n_classes=10, n_clusters_per_class=1, random_state=0
    )
    m = 2 * n // 3
    xtr, ytr, xte, yte = _split(X, y, m)
    r = M.linear_probe(xtr, ytr, xte, yte, 10, l2_grid=(l2,))
    mu, sd = X[:m].mean(0), X[:m].std(0)
    clf = LogisticRegression(C=1.0 / (l2 * m), max_iter=5000).fit((X[:m] - mu) / sd, y[:m])
    sk_pred = clf.predict((X[m:] - mu) / sd)
    assert r["l2"] == l2 and r["val_top1"] == {}
    assert abs(r["top1"] - (sk_pred == y[m:]).mean()) <= 0.005
    assert r["mean_per_class"] == pytest.approx(balanced_accuracy_score(y[m:], sk_pred), abs=0.01)


def test_linear_probe_grid_on_blobs():
    X, y = make_blobs(n_samples=1500, n_features=32, centers=6, cluster_std=4.0, random_state=1)
    xtr, ytr, xte, yte = _split(X, y, 1000)
    grid = (1.0, 1e-2, 1e-4)
    r = M.linear_probe(xtr, ytr, xte, yte, 6, l2_grid=grid, val_fraction=0.25, seed=3)
    assert r["l2"] in grid and set(r["val_top1"]) == set(grid)
    assert r["val_top1"][r["l2"]] == max(r["val_top1"].values())
    clf = LogisticRegression(C=1.0 / (r["l2"] * 1000), max_iter=5000).fit(
        (X[:1000] - X[:1000].mean(0)) / X[:1000].std(0), y[:1000])
    sk = clf.score((X[1000:] - X[:1000].mean(0)) / X[:1000].std(0), y[1000:])
    assert abs(r["top1"] - sk) <= 0.01 and r["top1"] > 0.9
    # deterministic given the seed
    assert M.linear_probe(xtr, ytr, xte, yte, 6, l2_grid=grid, val_fraction=0.25, seed=3) == r


def test_stratified_split():
    y = torch.tensor([0] * 10 + [1] * 5 + [2] * 1)
    tr, va = M.stratified_split(y, 0.2, seed=0)
    assert sorted(torch.cat([tr, va]).tolist()) == list(range(16))
    assert torch.bincount(y[va], minlength=3).tolist() == [2, 1, 0]  # singleton class stays in train
    tr2, va2 = M.stratified_split(y, 0.2, seed=0)
    assert torch.equal(va, va2) and not torch.equal(va, M.stratified_split(y, 0.2, seed=1)[1])


# ------------------------------------------------------------------------------ multi-label


def test_map_vs_sklearn_with_ties_and_empty_classes():
    g = torch.Generator().manual_seed(4)
    scores = (torch.rand(80, 9, generator=g) * 6).round() / 6  # heavy ties
    targets = torch.rand(80, 9, generator=g) < 0.3
    targets[:, 4] = False  # no positive: skipped
    expected = np.mean(
        [average_precision_score(targets[:, c].numpy(), scores[:, c].numpy()) for c in range(9) if c != 4]
    )
    assert M.mean_average_precision(scores, targets) == pytest.approx(expected, abs=1e-12)
    cont = torch.randn(50, 5, generator=g, dtype=torch.float64)
    tgt = torch.rand(50, 5, generator=g) < 0.5
    expected = np.mean([average_precision_score(tgt[:, c].numpy(), cont[:, c].numpy()) for c in range(5)])
    assert M.mean_average_precision(cont, tgt.long()) == pytest.approx(expected, abs=1e-12)


def test_map_hand_made():
    # one class: ranking pos, neg, pos -> AP = (1/2)(1/1) + (1/2)(2/3)
    assert M.mean_average_precision(torch.tensor([[0.9], [0.8], [0.7]]),
                                    torch.tensor([[1], [0], [1]])) == pytest.approx((1 + 2 / 3) / 2)
    # all tied: precision is the positive rate
    assert M.mean_average_precision(torch.zeros(4, 1), torch.tensor([[1], [0], [0], [0]])) == pytest.approx(0.25)


def test_f1_at_k():
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.0], [0.1, 0.2, 0.9, 0.3]])
    targets = torch.tensor([[1, 0, 1, 0], [0, 0, 1, 0]], dtype=torch.bool)
    prf = M.precision_recall_f1_at_k(scores, targets, 2)
    # predicted {0,1} and {2,3}: TP = 2, precision 2/4, recall 2/3
    assert prf["precision"] == pytest.approx(0.5) and prf["recall"] == pytest.approx(2 / 3)
    assert M.f1_at_k(scores, targets, 2) == pytest.approx(2 * 0.5 * (2 / 3) / (0.5 + 2 / 3))
    # random vs a naive loop
    g = torch.Generator().manual_seed(5)
    s = torch.randn(40, 12, generator=g)
    t = torch.rand(40, 12, generator=g) < 0.25
    for k in (1, 3, 5):
        tp = sum(int(t[i, j]) for i in range(40) for j in np.argsort(-s[i].numpy())[:k])
        p, r = tp / (40 * k), tp / int(t.sum())
        assert M.f1_at_k(s, t, k) == pytest.approx(2 * p * r / (p + r))
    with pytest.raises(ValueError, match="exceeds"):
        M.f1_at_k(s, t, 13)


# ------------------------------------------------------------------------------ clustering


def test_cluster_scores():
    X, y = make_blobs(n_samples=300, n_features=16, centers=4, cluster_std=0.5, random_state=0)
    r = M.cluster_scores(torch.tensor(X), torch.tensor(y), seed=0, normalize=False)
    assert r["num_clusters"] == 4 and r["ari"] == pytest.approx(1.0) and r["ami"] == pytest.approx(1.0)
    # wiring: same KMeans, then sklearn's ARI / AMI
    g = torch.Generator().manual_seed(6)
    feats = torch.randn(120, 6, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 3, (120,), generator=g)
    r = M.cluster_scores(feats, labels, num_clusters=5, seed=2)
    km = KMeans(n_clusters=5, n_init=10, random_state=2).fit_predict(F.normalize(feats, dim=1).numpy())
    assert r["ari"] == pytest.approx(adjusted_rand_score(labels.numpy(), km))
    assert r["ami"] == pytest.approx(adjusted_mutual_info_score(labels.numpy(), km))


# ------------------------------------------------------------------------------ diagnostics


def test_effective_rank():
    g = torch.Generator().manual_seed(7)
    q1, _ = torch.linalg.qr(torch.randn(50, 50, generator=g, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(20, 20, generator=g, dtype=torch.float64))
    for r in (1, 3, 8):
        equal = q1[:, :r] @ (5.0 * q2[:, :r].T)  # rank r, r equal singular values
        assert M.effective_rank(equal) == pytest.approx(r)
        rnd = torch.randn(50, r, generator=g) @ torch.randn(r, 20, generator=g)
        assert 1.0 <= M.effective_rank(rnd) <= r + 1e-6
    # a strongly dominant direction pulls it toward 1
    skew = q1[:, :2] @ torch.diag(torch.tensor([100.0, 1.0], dtype=torch.float64)) @ q2[:, :2].T
    assert 1.0 < M.effective_rank(skew) < 1.2
    assert M.effective_rank(torch.zeros(5, 3)) == 0.0
    # center=True removes a shared offset (rank-1 data + constant -> rank 1 after centering)
    x = torch.randn(30, 1, generator=g, dtype=torch.float64) @ torch.randn(1, 6, generator=g, dtype=torch.float64) + 3.0
    assert M.effective_rank(x, center=True) == pytest.approx(1.0)


def test_alignment_uniformity_known_values():
    e = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    assert M.alignment(e, e) == pytest.approx(0.0)
    assert M.alignment(e, -e) == pytest.approx(4.0)  # antipodal: ||x - y||^2 = 4
    assert M.alignment(e, -e, alpha=1) == pytest.approx(2.0)
    assert M.alignment(e[:2] * 7, e[[1, 0]]) == pytest.approx(2.0)  # orthogonal, normalised inside
    assert M.uniformity(torch.ones(5, 3)) == pytest.approx(0.0, abs=1e-6)  # collapsed
    assert M.uniformity(torch.tensor([[1.0, 0.0], [-2.0, 0.0]])) == pytest.approx(-8.0)  # -4t
    # three points at 120 degrees: every squared distance is 3
    tri = torch.tensor([[math.cos(a), math.sin(a)] for a in (0, 2 * math.pi / 3, 4 * math.pi / 3)])
    assert M.uniformity(tri, t=1.5) == pytest.approx(-4.5, abs=1e-5)


def test_uniformity_vs_pdist_reference():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(37, 5, generator=g, dtype=torch.float64)
    ref = torch.pdist(F.normalize(x, dim=1), p=2).pow(2).mul(-2).exp().mean().log().item()  # Wang & Isola code
    assert M.uniformity(x, chunk_size=6) == pytest.approx(ref, abs=1e-10)
    assert M.uniformity(x) == pytest.approx(ref, abs=1e-10)


def test_prototype_usage_and_probability_std():
    probs = torch.tensor([[0.7, 0.2, 0.1, 0.0], [0.6, 0.3, 0.1, 0.0], [0.1, 0.8, 0.1, 0.0], [0.2, 0.7, 0.1, 0.0]])
    u = M.prototype_usage(probs)
    assert u["num_used"] == 2 and u["used_fraction"] == 0.5
    assert u["entropy"] == pytest.approx(math.log(2)) and u["perplexity"] == pytest.approx(2.0)
    one = M.prototype_usage(torch.tensor([[0.0, 1.0]] * 3))
    assert one["entropy"] == 0.0 and one["perplexity"] == 1.0
    uniform = torch.full((6, 5), 0.2)
    s = M.probability_std(uniform)
    assert s["row_std"] == pytest.approx(0.0) and s["col_std"] == pytest.approx(0.0)
    s = M.probability_std(probs)
    assert s["row_std"] == pytest.approx(np.std(probs.numpy(), axis=1).mean())
    assert s["col_std"] == pytest.approx(np.std(probs.numpy(), axis=0).mean())
    onehot = torch.eye(4)
    assert M.probability_std(onehot) == pytest.approx({"row_std": math.sqrt(3) / 4, "col_std": math.sqrt(3) / 4})


def test_spearman_vs_scipy():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(100, generator=g)
    y = x + torch.randn(100, generator=g)
    assert M.spearman(x, y) == pytest.approx(spearmanr(x.numpy(), y.numpy()).statistic, abs=1e-12)
    xt, yt = (x * 2).round(), torch.randint(0, 5, (100,), generator=g)  # many ties
    assert M.spearman(xt, yt.double()) == pytest.approx(spearmanr(xt.numpy(), yt.numpy()).statistic, abs=1e-12)
    assert M.spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([10.0, 20, 25, 100])) == pytest.approx(1.0)
    assert M.spearman(torch.tensor([1.0, 2, 3]), torch.tensor([3.0, 1, 2])) == pytest.approx(-0.5)
    assert math.isnan(M.spearman(torch.ones(5), torch.arange(5.0)))


# ------------------------------------------------------------------------------ mask probing


def test_mask_jaccard_exact_match_and_best_head():
    mask = torch.zeros(2, 16, 16, dtype=torch.bool)
    mask[0, 4:12, 0:8] = True
    mask[1, 0:4, 8:16] = True
    attn = torch.zeros(2, 3, 4, 4)
    # head 1: all its mass on the foreground patches (patch size 4) -> exact match
    attn[:, 1] = F.avg_pool2d(mask[:, None].float(), 4)[:, 0]
    attn[:, 1] /= attn[:, 1].sum(dim=(1, 2), keepdim=True)
    attn[:, 0] = 1.0 / 16  # uniform: keeps everything (all tied) -> J = |fg| / 256
    attn[:, 2, 3, 3] = 1.0  # a single background patch
    r = M.attention_mask_jaccard(attn, mask, threshold=0.6)
    assert r["per_sample"][:, 1].tolist() == [1.0, 1.0]
    assert r["best_head"] == 1 and r["best"] == 1.0
    torch.testing.assert_close(r["per_sample"][:, 0], torch.tensor([64 / 256, 32 / 256], dtype=torch.float64))
    assert r["per_head"][2].item() == 0.0
    # bilinear upsampling of a sharp map still recovers the 8x8 block's interior well
    rb = M.attention_mask_jaccard(attn, mask, threshold=0.9, mode="bilinear")
    assert rb["best_head"] == 1 and rb["best"] > 0.5


def test_mask_threshold_keeps_dino_mass_fraction():
    # patch values 0.5, 0.3, 0.15, 0.05: the top pixels holding 60% of the mass are {0.5, 0.3}
    # (mass above 0.3 is 0.5 < 0.6; mass above 0.15 is 0.8 >= 0.6).
    attn = torch.tensor([0.5, 0.3, 0.15, 0.05]).view(1, 1, 2, 2)
    gt = torch.tensor([[True, True], [False, False]])[None]
    assert M.attention_mask_jaccard(attn, gt, threshold=0.6)["best"] == 1.0
    assert M.attention_mask_jaccard(attn, gt, threshold=0.9)["best"] == pytest.approx(2 / 3)
    # DINO's sort/cumsum transcription on the patch map, then nearest upsample x3, agrees
    g = torch.Generator().manual_seed(10)
    a = torch.rand(5, 2, 4, 4, generator=g)
    gt = torch.rand(5, 12, 12, generator=g) > 0.5
    ref = torch.empty(5, 2, dtype=torch.float64)
    for n in range(5):
        for h in range(2):
            flat = a[n, h].flatten()
            val, idx = torch.sort(flat)
            cum = torch.cumsum(val / val.sum(), 0)
            keep = torch.zeros_like(flat, dtype=torch.bool)
            keep[idx] = cum > 1 - 0.6
            pred = keep.view(4, 4).repeat_interleave(3, 0).repeat_interleave(3, 1)
            ref[n, h] = (pred & gt[n]).sum() / (pred | gt[n]).sum()
    torch.testing.assert_close(M.attention_mask_jaccard(a, gt, chunk_size=2)["per_sample"], ref)


def test_mask_nearest_patch_level_equals_pixel_level_for_any_scale():
    # non-integer scale (5x5 patches -> 13x11 pixels): patches cover unequal pixel counts
    g = torch.Generator().manual_seed(11)
    a = torch.rand(4, 3, 5, 5, generator=g, dtype=torch.float64) ** 3
    gt = torch.rand(4, 13, 11, generator=g) > 0.6
    up = F.interpolate(a, size=(13, 11), mode="nearest")
    for thr in (0.3, 0.6, 0.95):
        flat = up.flatten(2).flatten(0, 1)  # [N * heads, H * W]
        ref = torch.empty(4, 3, dtype=torch.float64)
        for r in range(12):  # pixel-level DINO rule on the upsampled map, one map at a time
            vals = flat[r]
            mass_above = torch.stack([vals[vals > v].sum() for v in vals])
            pred = (mass_above < thr * vals.sum()).view(13, 11)
            n, h = divmod(r, 3)
            ref[n, h] = (pred & gt[n]).sum() / (pred | gt[n]).sum()
        torch.testing.assert_close(M.attention_mask_jaccard(a, gt, threshold=thr)["per_sample"], ref)


def test_mask_ignore_pixels():
    attn = torch.tensor([1.0, 0.0, 0.0, 0.0]).view(1, 1, 2, 2)
    gt = torch.tensor([[True, True], [False, False]])[None]
    assert M.attention_mask_jaccard(attn, gt)["best"] == pytest.approx(0.5)
    ignore = torch.tensor([[False, True], [False, False]])[None]
    assert M.attention_mask_jaccard(attn, gt, ignore=ignore)["best"] == 1.0


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: M.recall_at_k(torch.zeros(3, 4), torch.zeros(5, dtype=torch.long)), "text_to_image"),
        (lambda: M.recall_at_k(torch.zeros(3, 4), torch.tensor([0, 1, 2, 3])), r"\[0, 3\)"),
        (lambda: M.recall_at_k(torch.zeros(3), torch.zeros(3, dtype=torch.long)), "similarity"),
        (lambda: M.recall_at_k(torch.zeros(2, 2), torch.tensor([0, 1]), ks=(0,)), "ks"),
        (lambda: M.topk_accuracy(torch.zeros(4, 3), torch.zeros(5, dtype=torch.long)), "labels"),
        (lambda: M.confusion_matrix(torch.zeros(3, dtype=torch.long), torch.zeros(4, dtype=torch.long), 2), "pred"),
        (lambda: M.knn_predict(torch.zeros(5, 3), torch.zeros(5, dtype=torch.long), torch.zeros(2, 4), 2), "dimension"),
        (lambda: M.knn_predict(torch.zeros(5, 3), torch.zeros(4, dtype=torch.long), torch.zeros(2, 3), 2),
         "train_labels"),
        (lambda: M.knn_predict(torch.zeros(5, 3), torch.zeros(5), torch.zeros(2, 3), 2), "integer"),
        (lambda: M.linear_probe(torch.zeros(5, 3), torch.zeros(5, dtype=torch.long),
                                torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), 2), "dimension"),
        (lambda: M.mean_average_precision(torch.zeros(4, 3), torch.zeros(4, 2, dtype=torch.bool)), "targets"),
        (lambda: M.f1_at_k(torch.zeros(4, 3), torch.ones(3, 3, dtype=torch.bool), 1), "targets"),
        (lambda: M.cluster_scores(torch.zeros(6, 2), torch.zeros(5, dtype=torch.long)), "labels"),
        (lambda: M.effective_rank(torch.zeros(3)), "features"),
        (lambda: M.alignment(torch.ones(3, 2), torch.ones(4, 2)), "shape"),
        (lambda: M.uniformity(torch.ones(1, 2)), "at least 2"),
        (lambda: M.prototype_usage(torch.ones(3)), "probs"),
        (lambda: M.probability_std(torch.ones(2, 2, 2)), "probs"),
        (lambda: M.spearman(torch.ones(3), torch.ones(4)), "entries"),
        (lambda: M.attention_mask_jaccard(torch.ones(2, 1, 2, 2), torch.ones(3, 4, 4, dtype=torch.bool)), "samples"),
        (lambda: M.attention_mask_jaccard(torch.ones(2, 2, 2), torch.ones(2, 4, 4, dtype=torch.bool)), "attn"),
        (lambda: M.attention_mask_jaccard(-torch.ones(1, 1, 2, 2), torch.ones(1, 4, 4, dtype=torch.bool)),
         "non-negative"),
        (lambda: M.zero_shot_classifier(torch.ones(3, 4)), r"\[C, P, d\]"),
        (lambda: M.recall_at_k(torch.tensor([[float("nan")]]), torch.tensor([0])), "NaN"),
    ],
)
def test_shape_errors_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
