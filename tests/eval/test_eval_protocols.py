"""Each evaluation protocol on hand-made inputs: known answers, or an independent reference
(scikit-learn, scipy, straight loops)."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nclip.eval import diagnostics, masks, multilabel, probe, realms, retrieval, sts, zeroshot
from nclip.eval.features import ensemble, similarity
from nclip.eval.settings import EvalSettings
from nclip.objectives.scores import ClipScore, NclipScore, YclipScore, score_named


def _blobs(n_per, centres, noise=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = torch.as_tensor(centres, dtype=torch.float32)
    x = torch.cat([c[k] + noise * torch.randn(n_per, c.shape[1], generator=g) for k in range(len(c))])
    y = torch.arange(len(c)).repeat_interleave(n_per)
    return x, y


# ---------------------------------------------------------------- 1. zero-shot classification


def test_zeroshot_known_answer_and_sklearn():
    from sklearn.metrics import balanced_accuracy_score, top_k_accuracy_score

    # 3 classes on the axes; image i points at class i % 3 except image 5 (points at class 0)
    classes = {"clip": torch.eye(3, 8)}
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    dirs = torch.tensor([0, 1, 2, 0, 1, 0])
    image = {"clip": torch.eye(3, 8)[dirs] * 3.0 + 0.01}
    s = zeroshot.scores(image, classes, ClipScore())
    m, pred = zeroshot.evaluate(s, labels)
    assert pred.tolist() == dirs.tolist()
    assert m["top1"] == pytest.approx(5 / 6)
    assert m["mean_per_class"] == pytest.approx(balanced_accuracy_score(labels, pred))
    assert m["chance"] == pytest.approx(1 / 3)
    assert "top5" not in m  # only 3 classes

    g = torch.Generator().manual_seed(1)
    s = torch.randn(200, 12, generator=g)
    y = torch.randint(0, 12, (200,), generator=g)
    m, _ = zeroshot.evaluate(s, y)
    assert m["top1"] == pytest.approx(top_k_accuracy_score(y, s, k=1, labels=range(12)))
    assert m["top5"] == pytest.approx(top_k_accuracy_score(y, s, k=5, labels=range(12)))
    cm = zeroshot.confusion(s.argmax(1), y, 12)
    from sklearn.metrics import confusion_matrix

    assert cm.tolist() == confusion_matrix(y, s.argmax(1), labels=range(12)).tolist()


def test_prompt_ensemble_clip_and_nclip():
    g = torch.Generator().manual_seed(0)
    n_cls, n_tpl = 4, 3
    emb = torch.randn(n_cls * n_tpl, 6, generator=g)
    logits = torch.randn(n_cls * n_tpl, 10, generator=g)
    feats = torch.randn(n_cls * n_tpl, 5, generator=g)
    prompts = {"clip": emb, "nclip": logits, "features": feats}
    clip, nclip, yclip = (ensemble(prompts, n_cls, score) for score in (ClipScore(), NclipScore(), YclipScore()))
    assert list(clip) == ["clip"] and list(nclip) == list(yclip) == ["nclip"]  # the score's head alone
    assert torch.equal(nclip["nclip"], yclip["nclip"])  # both read the nCLIP head's distributions
    for c in range(n_cls):
        rows = slice(c * n_tpl, (c + 1) * n_tpl)
        ref = F.normalize(F.normalize(emb[rows], dim=1).mean(0), dim=0)  # CLIP: mean of unit vectors, renormalised
        assert torch.allclose(clip["clip"][c], ref, atol=1e-6)
        p = F.softmax(logits[rows], dim=1).mean(0)  # nCLIP: mean of the prompts' distributions
        assert torch.allclose(F.softmax(nclip["nclip"][c], dim=0), p, atol=1e-6)


def _minus_ce_loops(img, cls, symmetric):
    p, q = F.softmax(img.double(), 1), F.softmax(cls.double(), 1)
    ce = lambda a, b: -float((a * b.log()).sum())  # noqa: E731  Eq. 2: CE(a, b) = −aᵀ log b
    return torch.tensor([[-(ce(p[i], q[j]) + ce(q[j], p[i])) / 2 if symmetric else -ce(p[i], q[j])
                          for j in range(len(q))] for i in range(len(p))], dtype=torch.float64)


def test_zeroshot_nclip_head_scores_are_minus_cross_entropy():
    g = torch.Generator().manual_seed(2)
    img, cls = 2 * torch.randn(30, 7, generator=g), 2 * torch.randn(4, 7, generator=g)
    # default: −L_CE symmetrised (xCLIP Sec. 3.1, Eq. 2); image_to_text: the one direction
    s = zeroshot.scores({"nclip": img}, {"nclip": cls}, score_named("nclip"))
    assert s.dtype == torch.float32
    assert torch.allclose(s.double(), _minus_ce_loops(img, cls, True), atol=1e-5)
    image_to_text = score_named("nclip").configured(EvalSettings(nclip_score="image_to_text"))
    assert image_to_text.options() == {"nclip_score": "image_to_text"}
    one = zeroshot.scores({"nclip": img}, {"nclip": cls}, image_to_text)
    assert torch.allclose(one.double(), _minus_ce_loops(img, cls, False), atol=1e-5)
    assert (s.argmax(1) != one.argmax(1)).any()
    # retrieval scores the same way
    assert torch.equal(similarity({"nclip": img}, {"nclip": cls}, NclipScore()), s)


def test_yclip_is_scored_with_its_own_s():
    from nclip.config import resolve
    from nclip.objectives import plan_for

    g = torch.Generator().manual_seed(3)
    img, txt = 2 * torch.randn(6, 9, generator=g), 2 * torch.randn(5, 9, generator=g)
    score = plan_for(resolve("micro", ["objective.name=yclip", "eval.nclip_score=image_to_text"])).zero_shot
    assert score.name == "yclip" and score.head == "nclip"  # S reads the nCLIP head's logits
    assert score.options() == {} and not score.normalised  # nclip_score is nCLIP's, not yCLIP's
    p, q = F.softmax(img.double(), 1), F.softmax(txt.double(), 1)
    s_ref = p @ q.log().T + p.log() @ q.T  # App. B.2 Eq. 2: S_ij = p_i·log q_j + log p_i·q_j
    image, text = {"nclip": img}, {"nclip": txt}
    for sim in (similarity(image, text, score), zeroshot.scores(image, text, score)):
        assert torch.allclose(sim.double(), s_ref, atol=1e-5)


# ---------------------------------------------------------------- 2. retrieval


def _recall_loops(sim, t2i, k):
    n_img, n_txt = len(sim), len(sim[0])
    i2t = []
    for i in range(n_img):
        own = [j for j in range(n_txt) if t2i[j] == i]
        if not own:
            continue
        order = sorted(range(n_txt), key=lambda j: -sim[i][j])
        i2t.append(any(j in own for j in order[:k]))
    t2i_hits = []
    for j in range(n_txt):
        order = sorted(range(n_img), key=lambda i: -sim[i][j])
        t2i_hits.append(t2i[j] in order[:k])
    return sum(i2t) / len(i2t), sum(t2i_hits) / len(t2i_hits)


def test_retrieval_against_loops_with_several_captions():
    g = torch.Generator().manual_seed(3)
    t2i = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3, 4, 5, 5, 6])
    sim = torch.randn(7, len(t2i), generator=g)  # continuous: no ties
    r = retrieval.evaluate(sim, t2i)
    for k in (1, 5, 10):
        a, b = _recall_loops(sim.tolist(), t2i.tolist(), k)
        assert r[f"i2t@{k}"] == pytest.approx(a)
        assert r[f"t2i@{k}"] == pytest.approx(b)
    assert r["mean_recall"] == pytest.approx(np.mean([r[f"{d}@{k}"] for d in ("i2t", "t2i") for k in (1, 5, 10)]))


def test_retrieval_failure_cases():
    t2i = torch.tensor([0, 1, 2, 2])
    sim = torch.tensor([[0.9, 0.1, 0.0, 0.0],   # image 0: right
                        [0.2, 0.3, 0.8, 0.1],   # image 1: caption 2 (image 2) wins by 0.5
                        [0.0, 0.7, 0.1, 0.6]])  # image 2: caption 1 wins by 0.1 over caption 3
    fails = retrieval.failure_cases(sim, t2i, n=5)
    assert [(f.image, f.wrong, f.right) for f in fails] == [(1, 2, 1), (2, 1, 3)]
    assert fails[0].margin == pytest.approx(0.5) and fails[0].rank == 1
    assert fails[1].rank == 1


# ---------------------------------------------------------------- 3. multi-label


def test_multilabel_against_sklearn():
    from sklearn.metrics import average_precision_score

    g = torch.Generator().manual_seed(4)
    targets = torch.rand(60, 8, generator=g) < 0.3
    targets[0] = True
    scores = torch.randn(60, 8, generator=g) + 1.5 * targets
    r = multilabel.evaluate(scores, targets)  # default k: the paper's 3, 5, 10, 20; 10 and 20 > 8 classes
    ref = np.mean([average_precision_score(targets[:, c], scores[:, c]) for c in range(8) if targets[:, c].any()])
    assert r["mAP"] == pytest.approx(ref)
    assert "f1@10" not in r and "f1@20" not in r and "f1@1" not in r
    for k in (3, 5):
        top = scores.topk(k, dim=1).indices
        tp = int(targets.gather(1, top).sum())
        p, rec = tp / (60 * k), tp / int(targets.sum())
        assert r[f"f1@{k}"] == pytest.approx(2 * p * rec / (p + rec))


def test_multilabel_perfect_scores():
    targets = torch.tensor([[1, 0, 1], [0, 1, 0]], dtype=torch.bool)
    r = multilabel.evaluate(targets.float(), targets, ks=(1,))
    assert r["mAP"] == 1.0 and r["precision@1"] == 1.0


# ---------------------------------------------------------------- 4-6. probes


def test_linear_probe_separable_and_against_sklearn():
    from sklearn.linear_model import LogisticRegression

    x, y = _blobs(40, [[3, 0, 0, 0], [0, 3, 0, 0], [0, 0, 3, 0]], noise=0.3)
    xt, yt = _blobs(20, [[3, 0, 0, 0], [0, 3, 0, 0], [0, 0, 3, 0]], noise=0.3, seed=1)
    r = probe.linear(x, y, xt, yt, 3)
    assert r["top1"] == 1.0 and r["mean_per_class"] == 1.0 and r["l2"] in probe.L2_GRID

    # overlapping classes, single L2: the same minimiser as sklearn's LogisticRegression(C = 1 / (l2 n))
    x, y = _blobs(60, [[1, 0], [0, 1], [0.5, 0.5]], noise=0.6, seed=2)
    xt, yt = _blobs(60, [[1, 0], [0, 1], [0.5, 0.5]], noise=0.6, seed=3)
    l2 = 1e-2
    r = probe.linear(x.double(), y, xt.double(), yt, 3, l2_grid=(l2,), max_iter=1000)
    mu, sd = x.double().mean(0), x.double().std(0, correction=0)
    clf = LogisticRegression(C=1 / (l2 * len(x)), tol=1e-10, max_iter=10000).fit((x - mu) / sd, y)
    ref = float((clf.predict((xt.double() - mu) / sd) == yt.numpy()).mean())
    assert r["top1"] == pytest.approx(ref, abs=1 / len(xt))


def _knn_reference(xtr, ytr, xte, k, t, n_cls):
    a = xtr / np.linalg.norm(xtr, axis=1, keepdims=True)
    b = xte / np.linalg.norm(xte, axis=1, keepdims=True)
    pred = []
    for row in b @ a.T:
        top = np.argsort(-row)[:k]
        votes = np.zeros(n_cls)
        for j in top:
            votes[ytr[j]] += math.exp(row[j] / t)
        pred.append(int(np.argmax(votes)))
    return np.array(pred)


def test_knn_against_loop():
    g = torch.Generator().manual_seed(5)
    xtr, ytr = torch.randn(80, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (80,), generator=g)
    xte, yte = torch.randn(30, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (30,), generator=g)
    r = probe.knn(xtr, ytr, xte, yte, 4, k=20, temperature=0.07)
    pred = _knn_reference(xtr.numpy(), ytr.numpy(), xte.numpy(), 20, 0.07, 4)
    assert r["top1"] == pytest.approx(float((pred == yte.numpy()).mean()))


def test_cluster_perfect_and_random():
    x, y = _blobs(30, [[5, 0, 0], [0, 5, 0], [0, 0, 5]], noise=0.1)
    r = probe.cluster(x, y)
    assert r["ari"] == pytest.approx(1.0) and r["ami"] == pytest.approx(1.0)
    g = torch.Generator().manual_seed(6)
    r = probe.cluster(torch.randn(300, 4, generator=g), torch.randint(0, 3, (300,), generator=g))
    assert abs(r["ari"]) < 0.05


# ---------------------------------------------------------------- 7. realms


def test_realm_probe_per_realm_and_relative():
    # realm 0: classes 0, 1 separable; realm 1: classes 2, 3, 4 with identical features (chance);
    # realm 2: one class only (skipped: nothing to tell apart)
    g = torch.Generator().manual_seed(7)

    def make(n, seed):
        gg = torch.Generator().manual_seed(seed)
        cls = torch.cat([torch.tensor([0, 1]).repeat(n), torch.tensor([2, 3, 4]).repeat(n), torch.full((n,), 5)])
        realm = torch.tensor([0, 0, 1, 1, 1, 2])[cls]
        x = torch.randn(len(cls), 3, generator=gg) * 0.1
        x[cls == 1, 0] += 3.0  # realm 0's classes differ along dimension 0
        return x, realm, cls

    xtr, rtr, ctr = make(30, 1)
    xte, rte, cte = make(20, 2)
    names = ("a", "b", "c")
    per = realms.evaluate(xtr, rtr, ctr, xte, rte, cte, names)
    assert set(per) == {"a", "b"}
    assert per["a"]["top1"] == 1.0 and per["a"]["classes"] == 2 and per["a"]["test"] == 40
    assert per["b"]["classes"] == 3 and per["b"]["top1"] < 0.7
    rel = realms.relative({"a": 0.9, "b": 0.5}, {"a": 0.8, "c": 0.1})
    assert rel == {"a": pytest.approx(0.1)}
    assert realms.key("curved shape") == "curved_shape"
    del g


# ---------------------------------------------------------------- 8. STS


def test_sts_against_scipy():
    from scipy.stats import spearmanr

    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(50, 16, generator=g), torch.randn(50, 16, generator=g)
    gold = torch.rand(50, generator=g) * 5
    r = sts.evaluate({"features": a, "clip": a[:, :4]}, {"features": b, "clip": b[:, :4]}, gold)
    cos = (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))
    assert r["spearman"] == pytest.approx(spearmanr(cos.numpy(), gold.numpy()).statistic, abs=1e-9)
    cos4 = F.cosine_similarity(a[:, :4], b[:, :4])
    assert r["spearman_emb"] == pytest.approx(spearmanr(cos4.numpy(), gold.numpy()).statistic, abs=1e-6)
    assert r["pairs"] == 50
    # a perfect model
    r = sts.evaluate({"features": a}, {"features": a}, torch.ones(50) * 5 - torch.arange(50) * 0)
    assert math.isnan(r["spearman"])  # constant gold: undefined, as scipy


# ---------------------------------------------------------------- 9. mask probing


def test_mask_probe_picks_the_head_that_sees_the_object():
    n, heads, side = 4, 3, 4
    gt = torch.zeros(n, 8, 8, dtype=torch.bool)
    gt[:, 0:4, 0:4] = True  # the object fills the top-left patch quadrant
    attn = torch.full((n, heads, side, side), 0.01)
    attn[:, 1, 0:2, 0:2] = 1.0  # head 1 attends to exactly the object's patches
    attn[:, 2, 2:4, 2:4] = 1.0  # head 2 to the opposite corner
    r = masks.evaluate(attn, gt)
    assert r["best_head"] == 1 and r["jaccard"] == pytest.approx(1.0)
    assert r["per_head"][2] == pytest.approx(0.0)
    pred = masks.predicted_mask(attn[0, 1], 8)
    assert torch.equal(pred, gt[0])


def test_mask_fit_keeps_geometry():
    m = np.zeros((8, 8), bool)
    m[2:4, 2:4] = True
    out = masks.fit_mask(m, 16)
    assert out.shape == (16, 16) and out[4:8, 4:8].all() and out.sum() == 16


def test_cls_attention_switches_to_eager_and_back():
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from nclip.models.towers import cls_attention, eager_attention

    cfg = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                           image_size=16, patch_size=4, attn_implementation="sdpa")
    model = CLIPVisionModel(cfg).eval()
    pixels = torch.randn(3, 3, 16, 16)
    att = cls_attention(model, pixels)
    assert att.shape == (3, 2, 4, 4) and bool((att >= 0).all())
    assert model.config._attn_implementation == "sdpa"  # restored
    # independent check: the [CLS] row of the full eager attention (self weight included) sums to 1
    with eager_attention(model):
        full = model(pixel_values=pixels, output_attentions=True).attentions[-1]
    assert torch.allclose(full[:, :, 0].sum(-1), torch.ones(3, 2), atol=1e-5)
    assert torch.allclose(att.flatten(2), full[:, :, 0, 1:], atol=1e-6)
    # and the pooled output did not change by switching implementations
    with torch.no_grad():
        a = model(pixel_values=pixels).pooler_output
        with eager_attention(model):
            b = model(pixel_values=pixels).pooler_output
    assert torch.allclose(a, b, atol=1e-5)


# ---------------------------------------------------------------- 10. diagnostics


def test_diagnostics_collapsed_and_spread():
    t2i = torch.tensor([0, 0, 1, 2, 2, 3])
    assert diagnostics.first_caption(t2i, 5).tolist() == [0, 2, 3, 5, -1]
    n = 4
    collapsed = {"features": torch.ones(n, 5), "clip": torch.ones(n, 3), "nclip": torch.zeros(n, 6)}
    text = {"clip": torch.ones(6, 3), "nclip": torch.zeros(6, 6)}
    r = diagnostics.evaluate(collapsed, text, t2i)
    assert r["erank_image_features"] == pytest.approx(1.0)
    assert r["uniformity_image_emb"] == pytest.approx(0.0, abs=1e-6)
    assert r["alignment_emb"] == pytest.approx(0.0, abs=1e-6)
    assert r["proto_used_image"] == 1 and r["row_std_image"] == pytest.approx(0.0)
    spread = {"features": torch.eye(n, 5), "clip": torch.eye(n, 4), "nclip": 20 * torch.eye(n, 6)}
    text = {"clip": torch.eye(6, 4)[[0, 0, 1, 2, 2, 3]], "nclip": torch.zeros(6, 6)}
    r = diagnostics.evaluate(spread, text, t2i)
    assert r["erank_image_features"] == pytest.approx(4.0)
    assert r["alignment_emb"] == pytest.approx(0.0, abs=1e-6)  # every image equals its first caption
    assert r["proto_used_image"] == 4 and r["proto_perplexity_image"] == pytest.approx(4.0)
