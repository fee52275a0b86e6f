"""CMSF: Constrained Mean Shift ("Constrained Mean Shift for Representation Learning", Sec. 2, Eq. 1).

Notation of the paper's Fig. 1 and Sec. 2: an image is augmented twice; the momentum (target)
encoder f gives u = f(T1(x)) / ||f(T1(x))|| and the online encoder g with its predictor h gives
v = h(g(T2(x))) / ||·||. The memory bank M holds the targets u of recent batches. For each query the
candidates are narrowed to a constrained set M̂ ⊆ M — rows with the query's label (supervised,
Sec. 2 and 2.2), rows among the query's n nearest neighbours in a frozen second embedding
(cross-modal, Sec. 2.3), or no constraint for unlabelled rows (semi-supervised, Sec. 2.1.5/A.2) —
and S = {z_1..z_k} are the k members of M̂ nearest to u, u itself included. The loss pulls v towards
them:

    Eq. (1), in MSF's form:   L = 1/k Σ_{i=1..k} ||v − z_i||² = 2 − 2/k Σ_i vᵀz_i   (unit vectors)

with gradient to v only (u and the bank are targets). k = 1 is BYOL's loss (S = {u}); M̂ = M is
MSF (Koohpayegani et al., 2021); k = |M̂| is the paper's "top-all" (``k=None`` here).

The paper adds u to M *before* the search (Sec. 2: "We add u to the memory bank M ... Then, we find
top-k neighbors of u in M̂ including u itself"), and so does the authors' code. Here ``bank`` is M
before this batch is enqueued and the batch's targets are prepended to it, so the candidates of
every query are [every target of the (global) batch, every bank row]: C = W·B + N columns, in that
order, with W·B = B on one process. The caller enqueues the batch into its
:class:`~nclip.objectives.cmsf_bank.MemoryBank` after the loss.

Distributed: with ``global_batch=True`` and a process group, the batch part of the candidates is the
targets of all ranks (rank order, gathered without gradient through :mod:`nclip.distributed`), so
every rank searches the same candidates as one process with the whole batch; each rank returns the
mean over its own rows, and since row b's loss depends on v_b alone no gradient crosses ranks: the
mean of the per-rank losses and DDP's averaged gradients equal the single-process ones. Every rank
must hold the same number of rows.

Baselines of Sec. 2.1.1 (Tab. 1): :func:`protonw_terms` (Prototypical Networks: the softmax over the
cosines to the class means of the same candidates, τ = 0.1) and :func:`frzproto_terms` (regression
onto frozen random class prototypes, :func:`frozen_prototypes`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nclip import distributed as collectives
from nclip.objectives.functional._common import check_pair, class_accuracies

UNLABELLED = -1  # label of a row without one (semi-supervised setting, Sec. 2.1.5 and App. A.2)


def cmsf_candidates(batch_rows: torch.Tensor, bank_rows: torch.Tensor, *, global_batch: bool = True) -> torch.Tensor:
    """The candidate rows of every query: [W·B + N, ...] = every rank's ``batch_rows`` [B, ...] (rank
    order, no gradient) followed by ``bank_rows`` [N, ...].

    The column order of :func:`cmsf_terms`'s ``constraint_mask``; use it to lay out per-candidate
    data (labels, the frozen embeddings of :func:`topk_constraint`) the same way."""
    rows = batch_rows.detach()
    if global_batch and collectives.is_distributed():
        rows = collectives.all_gather_no_grad(rows)
    return torch.cat([rows, bank_rows.detach().to(device=rows.device, dtype=rows.dtype)])


def topk_constraint(query_aux: torch.Tensor, candidate_aux: torch.Tensor, k_prime: int,
                    candidate_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-modal constraint (Sec. 2.3): [B, C] bool, True for the min(k', C) candidates most
    cosine-similar to each query in a frozen second embedding c(.) (the paper's n nearest
    neighbours of u_c in M_c, whose indices select M̂ from M).

    query_aux: [B, Da] c(x_c) of the batch; candidate_aux: [C, Da] the same embedding of every
    candidate, laid out as :func:`cmsf_candidates` (the batch's, gathered over ranks, then the bank's):
    e.g. ``topk_constraint(a, cmsf_candidates(a, bank.view().aux), n)``, or, as the trainer does,
    rows of a table of the frozen embedding indexed by the candidates' dataset indices. The query's own row
    has cosine 1 and is among its neighbours, as in the paper, where u_c is in M_c. Ties are broken by
    :func:`torch.topk`. candidate_valid: optional [C] bool, False for a candidate that is no neighbour
    (a bank row not written yet, :meth:`~nclip.objectives.cmsf_bank.MemoryBank.rows`): the neighbours
    are the min(k', |valid|) nearest valid candidates.
    """
    _check_positive_k(k_prime, "k_prime", allow_none=False)
    if query_aux.ndim != 2 or candidate_aux.ndim != 2 or query_aux.shape[1] != candidate_aux.shape[1]:
        raise ValueError(f"query_aux [B, Da] and candidate_aux [C, Da] must share Da, got {tuple(query_aux.shape)} "
                         f"and {tuple(candidate_aux.shape)}")
    with torch.no_grad():
        q = F.normalize(query_aux.detach(), dim=-1)  # [B, Da]
        c = F.normalize(candidate_aux.detach().to(q.dtype), dim=-1)  # [C, Da]
        sim = q @ c.T  # [B, C]
        if candidate_valid is None:
            idx = sim.topk(min(k_prime, c.shape[0]), dim=1).indices  # [B, k']
            return torch.zeros_like(sim, dtype=torch.bool).scatter_(1, idx, True)
        ok = candidate_valid.to(sim.device)[None].expand_as(sim)  # [B, C]
        return _top_members(sim, ok, k_prime)


def semi_supervised_constraint(
    query_labels: torch.Tensor,
    labelled_bank_labels: torch.Tensor,
    unlabelled_bank_size: int,
    *,
    global_batch: bool = True,
) -> torch.Tensor:
    """Semi-supervised constraint (Sec. 2.1.5, App. A.2) over two equal-size banks: [B, C] bool with
    C = W·B + N_l + N_u, for ``bank = cat([labelled.view().embeddings, unlabelled.view().embeddings])``.

    A labelled query (label ≥ 0) searches the labelled bank and the labelled rows of the batch with
    its label (constrained, the supervised loss); an unlabelled query (:data:`UNLABELLED`) searches
    the unlabelled bank, which holds every sample, and every row of the batch (unconstrained, MSF).
    query_labels: [B]; labelled_bank_labels: [N_l] labels of the labelled bank's rows (its filled
    rows, or all N_l rows of :meth:`~nclip.objectives.cmsf_bank.MemoryBank.rows`, whose unwritten rows
    are labelled ``UNLABELLED`` and so match no query; pass the banks' ``valid`` to :func:`cmsf_terms`
    as ``bank_valid`` for the unlabelled bank's).
    """
    if query_labels.ndim != 1 or labelled_bank_labels.ndim != 1:
        raise ValueError(f"query_labels [B] and labelled_bank_labels [N_l] must be 1-D, got "
                         f"{tuple(query_labels.shape)} and {tuple(labelled_bank_labels.shape)}")
    if unlabelled_bank_size < 0:
        raise ValueError(f"unlabelled_bank_size must be >= 0, got {unlabelled_bank_size}")
    batch_labels = cmsf_candidates(query_labels, query_labels.new_zeros(0), global_batch=global_batch)  # [W·B]
    labelled = query_labels[:, None] != UNLABELLED  # [B, 1]
    same = query_labels[:, None] == torch.cat([batch_labels, labelled_bank_labels.to(query_labels.device)])[None]
    batch_cols = same[:, : batch_labels.shape[0]] | ~labelled  # [B, W·B]
    labelled_cols = same[:, batch_labels.shape[0]:] & labelled  # [B, N_l]
    unlabelled_cols = (~labelled).expand(-1, unlabelled_bank_size)  # [B, N_u]
    return torch.cat([batch_cols, labelled_cols, unlabelled_cols], dim=1)


def _check_positive_k(k, name: str, *, allow_none: bool) -> None:
    if k is None and allow_none:
        return
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise ValueError(f"{name} must be a positive integer{' or None (top-all)' if allow_none else ''}, got {k!r}")


def _check_labels(query, bank, b: int, n: int, names: tuple[str, str]) -> None:
    if (query is None) != (bank is None):
        given = names[0] if query is not None else names[1]
        raise ValueError(f"{names[0]} and {names[1]} must be given together, got only {given}")
    if query is not None and (tuple(query.shape) != (b,) or tuple(bank.shape) != (n,)):
        raise ValueError(f"{names[0]} must be [B={b}] and {names[1]} [N={n}], got {tuple(query.shape)} and "
                         f"{tuple(bank.shape)}")


def _top_members(sim: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """[B, C] bool: per row, the min(k, |allowed|) allowed columns of highest ``sim`` (fixed shapes:
    the top min(k, C) of the masked scores, of which the disallowed ones are dropped)."""
    idx = sim.masked_fill(~allowed, float("-inf")).topk(min(k, sim.shape[1]), dim=1).indices  # [B, min(k, C)]
    return torch.zeros_like(allowed).scatter_(1, idx, allowed.gather(1, idx))


@torch.no_grad()
def _nearest(u: torch.Tensor, cand: torch.Tensor, allowed: torch.Tensor, offset: int, k: int | None) -> torch.Tensor:
    """S_b as a [B, C] bool mask: the min(k, |M̂_b|) members of M̂_b (``allowed``) most cosine-similar to
    u_b (column offset + b), u_b itself first when allowed; every member for k = None (top-all)."""
    if k is None:
        return allowed
    sim = u @ cand.T  # [B, C]: cos(u_b, candidate), the search is on the target u (Sec. 2)
    sim.diagonal(offset).fill_(2.0)  # above every cosine: u_b is S_b's first member even against a duplicate row
    return _top_members(sim, allowed, k)


# Over 80 lines only through its docstring, which documents every constraint in one place.
def cmsf_terms(
    pred: torch.Tensor,
    target: torch.Tensor,
    bank: torch.Tensor,
    *,
    k: int | None = 10,
    query_labels: torch.Tensor | None = None,
    bank_labels: torch.Tensor | None = None,
    include_target: bool = True,
    constraint_mask: torch.Tensor | None = None,
    true_query_labels: torch.Tensor | None = None,
    true_bank_labels: torch.Tensor | None = None,
    bank_valid: torch.Tensor | None = None,
    global_batch: bool = True,
) -> dict[str, torch.Tensor]:
    """Constrained mean shift, Eq. (1), with detached diagnostics.

    Args:
        pred: [B, D] v before normalisation: online encoder g followed by the predictor h (the only
            input that receives a gradient).
        target: [B, D] u before normalisation: the momentum encoder f on the other view (detached).
        bank: [N, D] the memory bank M *before* this batch's targets are enqueued (N may be 0);
            detached. Candidates are [the (global) batch's targets, the bank's rows] (module doc).
        k: the number of neighbours (default 10, Sec. 2.1.2); ``None`` means top-all, every member
            of the constrained set (Tab. 2d). When a query has fewer than k candidates (warm-up,
            rare classes) it uses the ones there are: S_b has min(k, |M̂_b|) rows. (The authors'
            code instead pads S_b with the nearest rows of *other* labels.)
        query_labels, bank_labels: [B] and [N] labels (possibly noisy, Sec. 2.2); given together.
            A candidate is in M̂_b only if its label equals the query's (Sec. 2 "Supervised-setting").
        include_target: S_b always contains u_b itself (the paper's default) — it is selected first
            even if an identical row exists; False removes u_b from M̂_b (Tab. 2e, "target not in
            top-10"). A query whose M̂_b is then empty contributes 0 to the mean over the batch.
        constraint_mask: optional [B, C] bool, C = W·B + N (columns as :func:`cmsf_candidates`);
            False removes a candidate from M̂_b. Combined (AND) with the label constraint. Built e.g.
            by :func:`topk_constraint` (cross-modal, Sec. 2.3) or :func:`semi_supervised_constraint`.
            Its entry for u_b itself is overridden by ``include_target``.
        true_query_labels, true_bank_labels: [B] and [N] clean labels, given together, for the NN
            purity diagnostic only (never used by the loss).
        bank_valid: optional [N] bool, False for a bank row that is no candidate (not written yet:
            :meth:`~nclip.objectives.cmsf_bank.MemoryBank.rows` gives the bank's fixed shape with this
            mask, so the step reads nothing on the host); the result is the one of ``bank[bank_valid]``.
        global_batch: search the targets of all ranks' rows when running distributed.

    Returns a dict with ``loss`` = 1/B Σ_b 1/|S_b| Σ_{z ∈ S_b} ||v_b − z||² (Eq. 1 in MSF's form) and
    detached diagnostics: ``constrained_size`` (mean |M̂_b|), ``neighbours`` (mean |S_b|) and, when
    true labels are given, ``purity``: the share of all selected neighbours (u_b included when
    selected, as in the authors' purity) whose true label is the query's true label — the paper's
    argument for top-k over top-all under label noise (Fig. 2, Sec. 2.2).
    """
    check_pair(pred, target, "pred", "target")
    _check_positive_k(k, "k", allow_none=True)
    b, d = pred.shape
    if bank.ndim != 2 or bank.shape[1] != d:
        raise ValueError(f"bank must be [N, D={d}] like pred's rows, got {tuple(bank.shape)}")
    n = bank.shape[0]
    _check_labels(query_labels, bank_labels, b, n, ("query_labels", "bank_labels"))
    _check_labels(true_query_labels, true_bank_labels, b, n, ("true_query_labels", "true_bank_labels"))

    v = F.normalize(pred, dim=-1)  # [B, D]
    u = F.normalize(target.detach(), dim=-1)  # [B, D]
    cand = cmsf_candidates(u, F.normalize(bank.detach().to(u.dtype), dim=-1), global_batch=global_batch)  # [C, D]
    c = cand.shape[0]
    offset = collectives.rank() * b if global_batch else 0
    if constraint_mask is not None and (tuple(constraint_mask.shape) != (b, c) or constraint_mask.dtype != torch.bool):
        raise ValueError(f"constraint_mask must be bool [B={b}, C={c}] (batch rows of all ranks, then the bank), got "
                         f"{constraint_mask.dtype} {tuple(constraint_mask.shape)}")
    if bank_valid is not None and (tuple(bank_valid.shape) != (n,) or bank_valid.dtype != torch.bool):
        raise ValueError(f"bank_valid must be bool [N={n}], got {bank_valid.dtype} {tuple(bank_valid.shape)}")

    with torch.no_grad():  # u_b's column among the candidates is offset + b: the diagonal at ``offset``
        allowed = torch.ones(b, c, dtype=torch.bool, device=u.device)  # [B, C]: M̂_b
        if query_labels is not None:
            cand_labels = cmsf_candidates(query_labels, bank_labels, global_batch=global_batch)  # [C]
            allowed &= query_labels[:, None] == cand_labels[None]
        if constraint_mask is not None:
            allowed &= constraint_mask.to(u.device)
        if bank_valid is not None:
            allowed[:, c - n:].logical_and_(bank_valid.to(u.device)[None])
        allowed.diagonal(offset).fill_(include_target)
        chosen = _nearest(u, cand, allowed, offset, k)  # [B, C]: S_b
        used = chosen.sum(1)  # [B]: |S_b|
        mean_z = (chosen.to(cand.dtype) / used.clamp(min=1)[:, None]) @ cand  # [B, D]: 1/|S_b| Σ_{z∈S_b} z

    # Eq. (1): 1/|S| Σ_z ||v − z||² = 2 − 2 v·(1/|S| Σ_z z) for unit v, z
    row_loss = (2 - 2 * (v * mean_z.to(v.dtype)).sum(1)) * (used > 0)  # [B]
    terms = {"loss": row_loss.mean()}
    with torch.no_grad():
        terms["constrained_size"] = allowed.sum(1).float().mean()
        terms["neighbours"] = used.float().mean()
        if true_query_labels is not None:
            true_cand = cmsf_candidates(true_query_labels, true_bank_labels, global_batch=global_batch)  # [C]
            pure = (chosen & (true_query_labels[:, None] == true_cand[None])).sum()
            terms["purity"] = pure.float() / used.sum().clamp(min=1).float()
    return terms


# ---------------------------------------------------------------------------------------------
# The baselines of Sec. 2.1.1 (Tab. 1 and Tab. 2c): ProtoNW and FrzProto
# ---------------------------------------------------------------------------------------------

PROTONW_TEMPERATURE = 0.1  # App. A.1: "For both SupCon and ProtoNW, the temperature is 0.1"


def protonw_terms(
    pred: torch.Tensor,
    target: torch.Tensor,
    bank: torch.Tensor,
    query_labels: torch.Tensor,
    bank_labels: torch.Tensor,
    *,
    num_classes: int | None = None,
    temperature: float = PROTONW_TEMPERATURE,
    true_query_labels: torch.Tensor | None = None,
    bank_valid: torch.Tensor | None = None,
    global_batch: bool = True,
    batch_in_prototypes: bool = False,
) -> dict[str, torch.Tensor]:
    """Prototypical Networks (ProtoNW), Sec. 2.1.1: "the contrastive version of our top-all variation".

    "We calculate a prototype for each class by averaging all its instances in the memory bank. Then,
    similar to prototypical networks (Snell et al., 2017), we compare the input with all prototypes by
    passing their temperature-scaled cosine distance through a SoftMax layer to get probabilities.
    Finally, we minimize the cross-entropy loss." With CMSF's notation (module doc):

        p_c = 1/|M_c| Σ_{z ∈ M_c} z          M_c: the instances of label c in the memory bank M
        L   = −1/B Σ_{b: M_{y_b} ≠ ∅} log softmax_c(cos(v_b, p_c) / τ)[y_b]   over the classes c with M_c ≠ ∅

    Top-all CMSF (Eq. 1 with S_b = M̂_b) regresses v_b onto the same mean p_{y_b}; ProtoNW instead
    contrasts it with every other class's mean (the softmax). The softmax of the cosine distance
    1 − cos over −τ is the softmax of cos/τ. A class with no instance has no prototype (left out of
    the softmax), and a row whose own class has none yet (a bank still filling) adds nothing; the sum
    is over B all the same, so that 2 ranks equal one process. ``batch_in_prototypes`` (an option,
    not the paper's text) adds the batch's targets u to the candidates first, as CMSF's search does
    (u is in M before it), so that the query's own class always has a prototype. Gradient to v only;
    the targets and the bank are detached. Every row's loss depends on its own v_b and the
    prototypes, computed from the bank and, with the batch, every rank's targets (``global_batch``),
    so DDP's averaged gradients equal one process's.

    Args:
        pred: [B, D] v before normalisation (online encoder + predictor, strong view).
        target: [B, D] u before normalisation (momentum encoder, weak view).
        bank: [N, D] M before this batch is enqueued (N may be 0).
        query_labels, bank_labels: [B] and [N] training labels in [0, num_classes); a candidate with
            another value (e.g. ``UNLABELLED``) belongs to no prototype.
        num_classes: C, the number of classes; None reads max label + 1 on the host (a device sync:
            the trainer passes the run's label space).
        temperature: τ (App. A.1: 0.1).
        true_query_labels: [B] clean labels, for the ``clean_acc`` diagnostic only.
        bank_valid: optional [N] bool, False for a bank row not written yet (as :func:`cmsf_terms`).
        batch_in_prototypes: the batch's targets count as instances too (the paper: the bank alone).

    Returns ``loss`` and detached diagnostics: ``acc`` (the nearest prototype's class is the
    training label), ``clean_acc`` (… is the clean label, with ``true_query_labels``) and ``classes``
    (the number of classes with a prototype).
    """
    check_pair(pred, target, "pred", "target")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    b, d = pred.shape
    if bank.ndim != 2 or bank.shape[1] != d:
        raise ValueError(f"bank must be [N, D={d}] like pred's rows, got {tuple(bank.shape)}")
    _check_labels(query_labels, bank_labels, b, bank.shape[0], ("query_labels", "bank_labels"))
    v = F.normalize(pred, dim=-1)  # [B, D]
    u = F.normalize(target.detach(), dim=-1)
    with torch.no_grad():
        m = F.normalize(bank.detach().to(u.dtype), dim=-1)
        if batch_in_prototypes:
            cand = cmsf_candidates(u, m, global_batch=global_batch)  # [C', D]: the batch's targets, then M
            cand_labels = cmsf_candidates(query_labels, bank_labels, global_batch=global_batch)  # [C']
        else:
            cand, cand_labels = m, bank_labels
        if num_classes is None:  # a host read: the trainer passes the run's label space
            c = int(torch.cat([cand_labels, query_labels]).max()) + 1
        else:
            c = int(num_classes)
        valid = (cand_labels >= 0) & (cand_labels < c)  # no boolean indexing: no host sync on the step
        if bank_valid is not None:
            valid[valid.shape[0] - bank.shape[0]:].logical_and_(bank_valid.to(valid.device))
        slot = cand_labels.clamp(0, c - 1)
        sums = cand.new_zeros(c, d).index_add_(0, slot, cand * valid[:, None])  # [C, D]
        counts = cand.new_zeros(c).index_add_(0, slot, valid.to(cand.dtype))  # [C]: |M_c|
        present = counts > 0
        protos = F.normalize(sums / counts.clamp(min=1)[:, None], dim=-1)  # [C, D]: p_c / ||p_c||
    logits = (v @ protos.to(v.dtype).T / temperature).masked_fill(~present, float("-inf"))  # [B, C]
    has_proto = present[query_labels.clamp(0, c - 1)] & (query_labels >= 0) & (query_labels < c)  # [B]
    safe = logits.masked_fill(~has_proto[:, None], 0.0)  # a row without its prototype: no -inf target
    loss = (F.cross_entropy(safe, query_labels.clamp(0, c - 1), reduction="none") * has_proto).sum() / b
    terms = {"loss": loss, **class_accuracies(logits.argmax(1), query_labels, true_query_labels)}
    terms["classes"] = present.sum().float()
    return terms


def frzproto_terms(
    emb: torch.Tensor,
    prototypes: torch.Tensor,
    labels: torch.Tensor,
    *,
    true_labels: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Frozen Prototype (FrzProto), Sec. 2.1.1: "We randomly initialize a set of prototype embeddings
    for each class and freeze them throughout training. The prototypes are used as targets for
    regressing the output embeddings from the backbone network using Cosine similarity loss"
    (noise-as-targets, Bojanowski & Joulin 2017), with an MLP after the backbone (Tab. 2c, App. A.1):

        L = 1/B Σ_b ||ẑ_b − p̂_{y_b}||² = 2 − 2/B Σ_b cos(z_b, p_{y_b})

    in Eq. (1)'s form, i.e. CMSF with S_b = {p_{y_b}} (the cosine loss up to the constant 2 and the
    factor 2 of MSF/BYOL's regression loss). Gradient to z only; the prototypes are detached. No
    batch statistic: each row's loss is its own, so DDP needs no gather.

    Args:
        emb: [B, D] z, the MLP's output before normalisation.
        prototypes: [C, D] the frozen class embeddings (normalised here).
        labels: [B] training labels in [0, C).
        true_labels: [B] clean labels, for ``clean_acc`` only.

    Returns ``loss`` and detached diagnostics: ``acc`` — the frozen prototypes as the classifier the
    paper evaluates FrzProto with (Sec. 2.1.3: "for Xent and FrzProto, we use the linear classifier
    trained during pre-training"), argmax_c cos(z, p_c) against the training labels — and
    ``clean_acc`` against the clean ones.
    """
    if emb.ndim != 2 or prototypes.ndim != 2 or emb.shape[1] != prototypes.shape[1]:
        raise ValueError(f"emb [B, D] and prototypes [C, D] must share D, got {tuple(emb.shape)} and "
                         f"{tuple(prototypes.shape)}")
    if tuple(labels.shape) != (emb.shape[0],):
        raise ValueError(f"labels must be [B={emb.shape[0]}], got {tuple(labels.shape)}")
    z = F.normalize(emb, dim=-1)  # [B, D]
    p = F.normalize(prototypes.detach().to(z.dtype), dim=-1)  # [C, D]
    cos = z @ p.T  # [B, C]
    loss = (2 - 2 * cos.gather(1, labels[:, None]).squeeze(1)).mean()
    return {"loss": loss, **class_accuracies(cos.argmax(1), labels, true_labels)}


def frozen_prototypes(num_classes: int, dim: int, seed: int = 0) -> torch.Tensor:
    """FrzProto's random class embeddings: [C, D] drawn uniformly on the unit sphere (normalised
    standard normals, as noise-as-targets draws its targets) from a CPU generator seeded by ``seed``,
    so every rank draws the same ones."""
    if num_classes <= 0 or dim <= 0:
        raise ValueError(f"num_classes and dim must be positive, got {num_classes} and {dim}")
    g = torch.Generator().manual_seed(int(seed))
    return F.normalize(torch.randn(num_classes, dim, generator=g), dim=-1)
