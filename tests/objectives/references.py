"""Float64 transcriptions of the papers' equations, written independently of nclip's code (explicit
loops where it helps), and the helpers that compare a loss with them: the references every
objective test and the registry-wide tests check against."""

import torch

from nclip.objectives import EncoderOutput


def ref_infonce(u, v, scale):
    """Eq. (1): -1/B Σ_i log exp(u_i·v_i/σ) / Σ_j exp(u_i·v_j/σ)."""
    b = u.shape[0]
    total = 0.0
    for i in range(b):
        logits = torch.stack([scale * (u[i] * v[j]).sum() for j in range(b)])
        total = total - (logits[i] - torch.log(torch.exp(logits - logits.max()).sum()) - logits.max())
    return total / b


def ref_clip(g_i, g_t, scale):
    u = g_i / g_i.norm(dim=1, keepdim=True)
    v = g_t / g_t.norm(dim=1, keepdim=True)
    return (ref_infonce(u, v, scale) + ref_infonce(v, u, scale)) / 2


def ref_clip_algorithm1(f_i, f_t, scale):
    """The xCLIP paper's Algorithm 1 L_CLIP, literally: u = normalize(f, p=2, dim=1) per modality,
    L = INCE(U_IᵀU_T/σ) + INCE(U_TᵀU_I/σ) with INCE Eq. (1), returned without halving (Sec. 3.1's
    prose averages the two; ``clip_reduction: sum``)."""
    u_i = f_i / torch.sqrt((f_i * f_i).sum(dim=1, keepdim=True))
    u_t = f_t / torch.sqrt((f_t * f_t).sum(dim=1, keepdim=True))
    b = u_i.shape[0]
    loss = 0.0
    for query, keys in ((u_i, u_t), (u_t, u_i)):  # U_IᵀU_T/σ, then U_TᵀU_I/σ
        for i in range(b):
            row = torch.stack([scale * (query[i] * keys[j]).sum() for j in range(b)])
            loss = loss - torch.log(torch.exp(row[i]) / torch.exp(row).sum()) / b
    return loss


def ref_nclip(h_i, h_t, lam1, lam2):
    """Algorithm 1, literally: sums over modalities, L / 2."""
    p_i = torch.softmax(h_i, dim=1)
    p_t = torch.softmax(h_t, dim=1)
    l_ce = -(p_i * torch.log(p_t) + p_t * torch.log(p_i)).sum(dim=1).mean(dim=0)
    l_eh = -(p_i * torch.log(p_i) + p_t * torch.log(p_t)).sum(dim=1).mean(dim=0)
    pb_i, pb_t = p_i.mean(dim=0), p_t.mean(dim=0)
    l_he = -(pb_i * torch.log(pb_i) + pb_t * torch.log(pb_t)).sum()
    return (l_ce + lam1 * l_eh - lam2 * l_he) / 2


def ref_cross_entropy(a, b):
    """Eq. (2) for one pair of distributions: CE(a, b) = −aᵀ log b, an explicit sum over k."""
    return -sum(a[k] * torch.log(b[k]) for k in range(a.shape[0]))


def ref_nclip_score(h_i, h_t, score="symmetric"):
    """nCLIP's zero-shot score −L_CE (Sec. 3.1) for every image i and text j, pair by pair:
    symmetric (Eq. 2 "symmetrized as L_CLIP"): −(CE(p_i, q_j) + CE(q_j, p_i)) / 2;
    image_to_text: −CE(p_i, q_j)."""
    p, q = torch.softmax(h_i, 1), torch.softmax(h_t, 1)
    rows = []
    for i in range(p.shape[0]):
        row = []
        for j in range(q.shape[0]):
            if score == "symmetric":
                row.append(-(ref_cross_entropy(p[i], q[j]) + ref_cross_entropy(q[j], p[i])) / 2)
            else:
                row.append(-ref_cross_entropy(p[i], q[j]))
        rows.append(torch.stack(row))
    return torch.stack(rows)


def ref_yclip_score(h_i, h_t):
    """yCLIP's S of App. B.2 Eq. 2: S_ij = p_i·log q_j + log p_i·q_j."""
    p, q = torch.softmax(h_i, 1), torch.softmax(h_t, 1)
    return torch.stack([torch.stack([(p[i] * q[j].log()).sum() + (p[i].log() * q[j]).sum()
                                     for j in range(q.shape[0])]) for i in range(p.shape[0])])


def ref_swav_sinkhorn(out, epsilon, n_iters):
    """SwAV's distributed_sinkhorn (single process), line by line, in the probability domain."""
    with torch.no_grad():
        q = torch.exp(out / epsilon).t()  # K x B
        b, k = q.shape[1], q.shape[0]
        q /= q.sum()
        for _ in range(n_iters):
            q /= q.sum(dim=1, keepdim=True)
            q /= k
            q /= q.sum(dim=0, keepdim=True)
            q /= b
        q *= b
        return q.t()


def ref_target(f, tau_s, uniform, iters=3, center=None, eps=1e-5):
    """p = uniform(softmax(f / τ_s)) of Algorithm 1. Centering (Tab. A1 †: before the softmax; App. A:
    running mean, "additional running variance and scale parameters"), element by element:
    z_bk = γ_k (f_bk − μ_k) / sqrt(v_k + ε), with μ, v constants and γ learnable."""
    if uniform == "centering":
        mean, var, scale = center
        mean, var = mean.detach(), var.detach()
        f = torch.stack([torch.stack([scale[k] * (f[b, k] - mean[k]) / torch.sqrt(var[k] + eps)
                                      for k in range(f.shape[1])]) for b in range(f.shape[0])])
    p = torch.softmax(f / tau_s, dim=1)
    if uniform == "sinkhorn":  # Sinkhorn's scalings as constants: p = P·(Q/P) with Q/P detached
        q = ref_swav_sinkhorn(torch.log(p.detach()), 1.0, iters)
        p = p * (q / p.detach())
    elif uniform == "batch_softmax":  # softmax over the batch of log P, then over prototypes
        col = p / p.sum(dim=0, keepdim=True)
        p = col / col.sum(dim=1, keepdim=True)
    return p


def ref_unified(f_i, f_t, tau_s, tau, lam1, lam2, uniform="none", **kw):
    """Algorithm 1 (Appendix A) literally, with the cross-modal CE of the main text's copy."""
    p_i, p_t = ref_target(f_i, tau_s, uniform, center=kw.get("ci"), iters=kw.get("iters", 3)), ref_target(
        f_t, tau_s, uniform, center=kw.get("ct"), iters=kw.get("iters", 3)
    )
    q_i, q_t = torch.softmax(f_i / tau, dim=1), torch.softmax(f_t / tau, dim=1)
    l_ce = -(p_i * torch.log(q_t) + p_t * torch.log(q_i)).sum(dim=1).mean(dim=0)
    l_eh = -(p_i * torch.log(p_i) + p_t * torch.log(p_t)).sum(dim=1).mean(dim=0)
    pb_i, pb_t = p_i.mean(dim=0), p_t.mean(dim=0)
    l_he = -(pb_i * torch.log(pb_i) + pb_t * torch.log(pb_t)).sum()
    return (l_ce + lam1 * l_eh - lam2 * l_he) / 2


def ref_yclip(h_i, h_t, scale, lam1, lam2):
    """App. B.2 Eq. 2-3 with explicit sums: S_ij = p_i·log q_j + log p_i·q_j, symmetric InfoNCE."""
    p, q = torch.softmax(h_i, 1), torch.softmax(h_t, 1)
    b = p.shape[0]
    s = torch.stack([torch.stack([(p[i] * q[j].log()).sum() + (p[i].log() * q[j]).sum() for j in range(b)])
                     for i in range(b)])
    z = scale * s
    i2t = -sum(z[i, i] - torch.logsumexp(z[i, :], 0) for i in range(b)) / b
    t2i = -sum(z[i, i] - torch.logsumexp(z[:, i], 0) for i in range(b)) / b
    l_eh = -((p * p.log()).sum(1) + (q * q.log()).sum(1)).mean() / 2
    pb, qb = p.mean(0), q.mean(0)
    l_he = -((pb * pb.log()).sum() + (qb * qb.log()).sum()) / 2
    return (i2t + t2i) / 2 + lam1 * l_eh - lam2 * l_he


def ref_siglip(x, y, t, b):
    """Zhai et al. 2023: -1/|B| Σ_i Σ_j log 1/(1 + exp(z_ij(-t x_i·y_j - b)))."""
    x = x / x.norm(dim=1, keepdim=True)
    y = y / y.norm(dim=1, keepdim=True)
    n = x.shape[0]
    total = 0.0
    for i in range(n):
        for j in range(n):
            z = 1.0 if i == j else -1.0
            total = total - torch.log(1 / (1 + torch.exp(z * (-t * (x[i] * y[j]).sum() - b))))
    return total / n


def ref_cmsf(v, u, bank, k, query_labels=None, bank_labels=None, include_target=True, mask=None):
    """CMSF Sec. 2, Eq. (1), one query at a time: u is enqueued into M before the search, so row b's
    candidates are every target of the batch and every bank row (column j of ``mask``), kept when
    their label equals the query's; u_b itself comes first (if included), then the others by
    decreasing cos(u_b, z); S_b = the first min(k, all) of them; L = mean_b mean_{z ∈ S_b} ||v_b − z||²
    on unit vectors, no gradient through u or M. An empty S_b contributes 0."""
    v = v / v.norm(dim=1, keepdim=True)
    u = u.detach() / u.detach().norm(dim=1, keepdim=True)
    m = bank.detach() / bank.detach().norm(dim=1, keepdim=True)
    b = v.shape[0]
    cands = [u[j] for j in range(b)] + [m[i] for i in range(m.shape[0])]
    labels = None if query_labels is None else [int(x) for x in query_labels] + [int(x) for x in bank_labels]
    total = v.new_zeros(())
    for q in range(b):
        others = []
        for j, z in enumerate(cands):
            if j == q:
                continue
            if labels is not None and labels[j] != labels[q]:
                continue
            if mask is not None and not bool(mask[q, j]):
                continue
            others.append((float((u[q] * z).sum()), j))
        others.sort(key=lambda t: -t[0])
        pool = ([q] if include_target else []) + [j for _, j in others]
        chosen = pool if k is None else pool[:k]
        if chosen:
            total = total + sum(((v[q] - cands[j]) ** 2).sum() for j in chosen) / len(chosen)
    return total / b



def ref_protonw(v, u, bank, query_labels, bank_labels, tau, with_batch=False):
    """CMSF Sec. 2.1.1, ProtoNW, one query at a time: "a prototype for each class by averaging all
    its instances in the memory bank", then the cross-entropy of the SoftMax over the
    temperature-scaled cosines between the input v and every prototype (τ = 0.1, App. A.1), summed
    over the queries whose class has a prototype, over B. ``with_batch``: u is in M before the
    search (Sec. 2's CMSF), so the batch's targets are instances too. No gradient through u or M;
    classes without an instance have no prototype."""
    v = v / v.norm(dim=1, keepdim=True)
    u = u.detach() / u.detach().norm(dim=1, keepdim=True)
    m = bank.detach() / bank.detach().norm(dim=1, keepdim=True)
    cands = ([u[j] for j in range(u.shape[0])] if with_batch else []) + [m[i] for i in range(m.shape[0])]
    labels = ([int(x) for x in query_labels] if with_batch else []) + [int(x) for x in bank_labels]
    classes = sorted(set(labels))
    protos = {}
    for c in classes:
        members = [z for z, y in zip(cands, labels) if y == c]
        protos[c] = sum(members) / len(members)
    total = v.new_zeros(())
    for q in range(v.shape[0]):
        if int(query_labels[q]) not in protos:  # its class has no instance yet: no term
            continue
        cos = {c: (v[q] * protos[c]).sum() / protos[c].norm() for c in classes}
        log_den = torch.log(sum(torch.exp(cos[c] / tau) for c in classes))
        total = total - (cos[int(query_labels[q])] / tau - log_den)
    return total / v.shape[0]


def ref_frzproto(z, prototypes, labels):
    """CMSF Sec. 2.1.1, FrzProto: the output embedding regressed onto its class's frozen random
    prototype with the cosine loss, in Eq. (1)'s form ||ẑ − p̂_y||² (= 2 − 2 cos), mean over the batch;
    no gradient to the prototypes."""
    total = z.new_zeros(())
    for b in range(z.shape[0]):
        zb = z[b] / z[b].norm()
        p = prototypes[int(labels[b])].detach()
        p = p / p.norm()
        total = total + ((zb - p) ** 2).sum()
    return total / z.shape[0]


def _multiview(features, labels):
    """The 2N multi-view batch of Sec. 4.1 as lists: z_i (unit vectors), ỹ_i and the source image of i."""
    f = features if features.ndim == 3 else features[:, None]
    zs, ys, src = [], [], []
    for b in range(f.shape[0]):
        for v in range(f.shape[1]):
            zs.append(f[b, v] / f[b, v].norm())
            ys.append(int(labels[b]))
            src.append(b)
    return zs, ys, src


def _ref_contrast(features, labels, tau, keep=None, queue=None, queue_labels=None, centers=None, alpha=1.0,
                  beta=0.0):
    """One anchor at a time: L_i = −(α Σ_{p∈P(i)} log p_ip + β log p_{i,c_ỹi}) / (α|P(i)| + β), p over the
    kept members of A(i) (positives always kept), the queue and the centres; mean over anchors that have a
    positive. Unlabelled (-1) anchors: P(i) = the other views of their image, no centre."""
    zs, ys, src = _multiview(features, labels)
    cands = [(z, y, s) for z, y, s in zip(zs, ys, src)]
    if queue is not None:
        cands += [(queue[j] / queue[j].norm(), int(queue_labels[j]), None) for j in range(queue.shape[0])]
    cs = [] if centers is None else [centers[k] / centers[k].norm() for k in range(centers.shape[0])]
    total, count = zs[0].new_zeros(()), 0
    for i, (zi, yi, si) in enumerate(zip(zs, ys, src)):
        positives, denominator = [], []
        for k, (zk, yk, sk) in enumerate(cands):
            if k == i:
                continue
            is_pos = (yk == yi and yi != -1) or sk == si
            if is_pos:
                positives.append(zk)
            if is_pos or keep is None or k >= keep.shape[1] or bool(keep[i, k]):
                denominator.append(torch.exp((zi * zk).sum() / tau))
        for c in cs:
            denominator.append(torch.exp((zi * c).sum() / tau))
        own = cs[yi] if (cs and yi != -1 and beta > 0) else None
        weight = alpha * len(positives) + (beta if own is not None else 0.0)
        if weight == 0:
            continue
        log_den = torch.log(sum(denominator))
        acc = sum(alpha * ((zi * zp).sum() / tau - log_den) for zp in positives) if positives else 0.0
        if own is not None:
            acc = acc + beta * ((zi * own).sum() / tau - log_den)
        total = total - acc / weight
        count += 1
    return total / max(count, 1)


def ref_supcon(features, labels, tau=0.1, keep=None, queue=None, queue_labels=None):
    """OmniBenchmark Eq. (2) with Khosla et al.'s 1/|P(i)| (L^sup_out), over the multi-view batch
    (features [B, V, D] or [B, D]); ``keep`` [N, N(+Q)] drops negatives from A(i)."""
    return _ref_contrast(features, labels, tau, keep, queue, queue_labels)


def ref_paco(features, labels, centers, alpha, beta, tau, queue=None, queue_labels=None):
    """Eq. (3) with PaCo's weights: positives P(i) (weight α) and c_ỹi (weight β), candidates A(i) ∪ C."""
    return _ref_contrast(features, labels, tau, None, queue, queue_labels, centers, alpha, beta)


def ref_reco(features, labels, keep, alpha=1.0, tau=0.1, centers=None, paco=(0.05, 1.0, 0.2)):
    """Eq. (7): L_SupCon (or L_PaCo with ``centers``) + α·L_ReCo, L_ReCo = Eq. (6): Eq. (2) over A_select."""
    base = ref_supcon(features, labels, tau) if centers is None else ref_paco(features, labels, centers, *paco)
    return base + alpha * ref_supcon(features, labels, tau, keep)


def leaves(*shapes, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(*s, generator=g, dtype=torch.float64)).requires_grad_() for s in shapes]


def assert_value_and_grads(ours, ref, leaves, rtol=1e-9, atol=1e-11):
    torch.testing.assert_close(ours, ref, rtol=rtol, atol=atol)
    for a, r in zip(torch.autograd.grad(ours, leaves), torch.autograd.grad(ref, leaves)):
        torch.testing.assert_close(a, r, rtol=rtol, atol=atol)


def assert_loss_and_grads_close(ours, theirs, a: dict, b: dict, keys, msg: str = "", rtol=1e-9, atol=1e-11):
    """Loss values equal, and gradients w.r.t. ``a[k]`` / ``b[k]`` equal for every k in ``keys`` (an
    input a loss does not use has gradient 0). Returns our gradients (None where unused)."""
    torch.testing.assert_close(ours, theirs, rtol=rtol, atol=atol)
    ga = torch.autograd.grad(ours, [a[k] for k in keys], allow_unused=True)
    gb = torch.autograd.grad(theirs, [b[k] for k in keys], allow_unused=True)
    for k, p, q in zip(keys, ga, gb):
        zero = torch.zeros_like(a[k])
        torch.testing.assert_close(zero if p is None else p, zero if q is None else q, rtol=rtol, atol=atol,
                                   msg=f"{msg}: d/d{k}")
    return ga


def encoder_output(h_i=None, h_t=None, g_i=None, g_t=None, scale=14.0):
    some = next(x for x in (h_i, g_i) if x is not None)
    def side(g, h):  # the heads given, keyed by name
        return {k: v for k, v in (("clip", g), ("nclip", h)) if v is not None}

    return EncoderOutput(image_features=some, text_features=some, logit_scale=torch.tensor(scale, dtype=some.dtype),
                         image=side(g_i, h_i), text=side(g_t, h_t))


def ref_proto_loss(h, c, labels, t_proto, t_target, c_target=None):
    """Algorithm 1's loss_Proto: cross_entropy(h @ Cᵀ / τ, softmax(C[label] @ Cᵀ / τ_y)); hard
    labels for τ_y <= 0. Targets are constants (built from detached prototypes)."""
    c_target = c if c_target is None else c_target
    total = 0.0
    for i in range(h.shape[0]):
        scores = torch.stack([(h[i] * c[k]).sum() / t_proto for k in range(c.shape[0])])
        log_p = scores - torch.logsumexp(scores, 0)
        if t_target > 0:
            with torch.no_grad():
                s_y = torch.stack([(c_target[labels[i]] * c_target[k]).sum() / t_target for k in range(c.shape[0])])
                y = torch.softmax(s_y, 0)
            total = total - (y * log_p).sum()
        else:
            total = total - log_p[labels[i]]
    return total / h.shape[0]
