"""Hard negative captions (NegCLIP): CLIP's InfoNCE with every image's negatives as more text candidates
of the image → text direction, the text → image direction unchanged; SigLIP's extra pairs with label −1.
Checked against float64 transcriptions of NegCLIP's loss (values and gradients), on 2 gloo ranks against
one process, and through the model under exact accumulation (k micro-batches against the whole batch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from float64_steps import assert_micro_batches_equal_whole, float64_step
from nclip.objectives import functional

from distributed_utils import combine_ranks, loss_and_grads, run_ranks

B, C, N, D = 6, 3, 2, 5


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    neg_valid = torch.tensor([[1, 1], [1, 0], [0, 0], [1, 0], [1, 1], [0, 1]], dtype=torch.bool)
    cap_valid = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return {"img": torch.randn(B, D, generator=g, dtype=torch.float64),
            "txt": torch.randn(B, D, generator=g, dtype=torch.float64),
            "caps": torch.randn(B, C, D, generator=g, dtype=torch.float64),
            "neg": torch.randn(B, N, D, generator=g, dtype=torch.float64),
            "scale": torch.tensor(4.0, dtype=torch.float64), "bias": torch.tensor(-1.5, dtype=torch.float64),
            "neg_valid": neg_valid, "cap_valid": cap_valid}


MASKS = ("neg_valid", "cap_valid")


def _leaves(x):
    return {k: (v.clone() if k in MASKS else v.clone().requires_grad_()) for k, v in x.items()}


def _negclip_reference(img, txt, neg, neg_valid, scale, reduction="mean"):
    """NegCLIP's loss as its training code computes it, in float64: the texts are the batch's captions
    followed by the batch's hard negatives; logits_per_image = scale · images · textsᵀ over all of
    them, logits_per_text the captions' rows only; cross-entropy with target i both ways."""
    u = F.normalize(img, dim=1)
    texts = torch.cat([F.normalize(txt, dim=1), F.normalize(neg, dim=2)[neg_valid]])  # captions, then negatives
    logits_per_image = scale * u @ texts.T  # [B, B + negatives]
    logits_per_text = logits_per_image[:, : img.shape[0]].T
    target = torch.arange(img.shape[0])
    loss = F.cross_entropy(logits_per_image, target) + F.cross_entropy(logits_per_text, target)
    return loss / 2 if reduction == "mean" else loss


def _several_reference(img, caps, cap_valid, neg, neg_valid, scale):
    """With several captions per image: image i's target uniform over its captions, its softmax over
    every caption and every negative; a caption's cross-entropy over the images; term by term."""
    u, v, w = F.normalize(img, dim=1), F.normalize(caps, dim=2), F.normalize(neg, dim=2)
    captions = [(b, c) for b in range(B) for c in range(C) if cap_valid[b, c]]
    negatives = [w[b, n] for b in range(B) for n in range(N) if neg_valid[b, n]]
    image_terms = []
    for i in range(B):
        logits = [scale * u[i] @ v[k] for k in captions] + [scale * u[i] @ x for x in negatives]
        log_z = torch.logsumexp(torch.stack(logits), 0)
        mine = [k for k in captions if k[0] == i]
        image_terms.append(sum(log_z - scale * u[i] @ v[k] for k in mine) / len(mine))
    caption_terms = [torch.logsumexp(torch.stack([scale * u[i] @ v[k] for i in range(B)]), 0) - scale * u[k[0]] @ v[k]
                     for k in captions]
    return (torch.stack(image_terms).mean() + torch.stack(caption_terms).mean()) / 2


def _siglip_reference(img, txt, neg, neg_valid, scale, bias):
    """SigLIP over the captions (z = +1 on the diagonal, −1 elsewhere) plus every image with every hard
    negative (z = −1), summed and divided by the images."""
    u, v = F.normalize(img, dim=1), F.normalize(txt, dim=1)
    w = F.normalize(neg, dim=2)[neg_valid]
    z = 2 * torch.eye(B, dtype=img.dtype) - 1
    pairs = -F.logsigmoid(z * (scale * u @ v.T + bias)).sum()
    hard = -F.logsigmoid(-(scale * u @ w.T + bias)).sum()
    return (pairs + hard) / B


def _clip(x, reduction="mean", global_batch=True):
    return functional.clip_terms(x["img"], x["txt"], x["scale"], negatives=x["neg"], negative_valid=x["neg_valid"],
                                 reduction=reduction, global_batch=global_batch)["loss"]


def _several(x, global_batch=True):
    return functional.clip_terms(x["img"], x["caps"], x["scale"], caption_valid=x["cap_valid"], negatives=x["neg"],
                                 negative_valid=x["neg_valid"], global_batch=global_batch)["loss"]


def _siglip(x, global_batch=True):
    return functional.siglip_terms(x["img"], x["txt"], x["scale"], x["bias"], negatives=x["neg"],
                                   negative_valid=x["neg_valid"], global_batch=global_batch)["loss"]


REFERENCES = {
    "clip": (_clip, lambda x: _negclip_reference(x["img"], x["txt"], x["neg"], x["neg_valid"], x["scale"])),
    "clip_sum": (lambda x: _clip(x, "sum"),
                 lambda x: _negclip_reference(x["img"], x["txt"], x["neg"], x["neg_valid"], x["scale"], "sum")),
    "several": (_several, lambda x: _several_reference(x["img"], x["caps"], x["cap_valid"], x["neg"], x["neg_valid"],
                                                       x["scale"])),
    "siglip": (_siglip, lambda x: _siglip_reference(x["img"], x["txt"], x["neg"], x["neg_valid"], x["scale"],
                                                    x["bias"])),
}


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_the_loss_and_its_gradients_are_negclips(name):
    ours, reference = REFERENCES[name]
    x, ref = _leaves(_inputs()), _leaves(_inputs())
    loss, want = ours(x), reference(ref)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    loss.backward()
    want.backward()
    used = [k for k in ("img", "txt", "caps", "neg", "scale", "bias") if ref[k].grad is not None]
    assert "neg" in used
    for key in used:
        torch.testing.assert_close(x[key].grad, ref[key].grad, rtol=1e-10, atol=1e-12, msg=key)
    assert x["neg"].grad[~x["neg_valid"]].abs().max() == 0  # empty slots get nothing
    assert x["neg"].grad[x["neg_valid"]].abs().min() > 0


def test_negatives_raise_the_loss_and_empty_slots_change_nothing():
    x = _inputs()
    plain = functional.clip_terms(x["img"], x["txt"], x["scale"])
    none = dict(x, neg_valid=torch.zeros(B, N, dtype=torch.bool))
    torch.testing.assert_close(_clip(none), plain["loss"], rtol=1e-12, atol=1e-12)
    assert _clip(x) > plain["loss"]
    moved = dict(x, neg=torch.where(x["neg_valid"][..., None], x["neg"], 100 * torch.randn_like(x["neg"])))
    torch.testing.assert_close(_clip(moved), _clip(x), rtol=0, atol=1e-14)
    sig_plain = functional.siglip_terms(x["img"], x["txt"], x["scale"], x["bias"])["loss"]
    torch.testing.assert_close(_siglip(none), sig_plain, rtol=1e-12, atol=1e-12)


def test_the_diagnostics_count_a_negative_above_the_caption_as_wrong():
    x = _inputs()
    img = x["txt"].clone()  # every image on its own caption
    neg = x["neg"].clone()
    neg[0, 0] = 2 * img[0] + 0.0  # image 0's first negative points where its caption does, scaled: a tie
    neg[0, 0] = img[0] + 0.3 * img[1]  # ... now a little off: below the caption
    terms = functional.clip_terms(img, x["txt"], torch.tensor(50.0, dtype=torch.float64), negatives=neg,
                                  negative_valid=x["neg_valid"])
    assert terms["acc_hard"] == 1
    neg[4, 1] = img[4]  # a negative equal to the caption: not above every negative
    terms = functional.clip_terms(img, x["txt"], torch.tensor(50.0, dtype=torch.float64), negatives=neg,
                                  negative_valid=x["neg_valid"])
    assert terms["acc_hard"] == pytest.approx(5 / 6)
    with pytest.raises(ValueError, match=r"negative_valid \[B, N\] expected"):
        functional.clip_terms(x["img"], x["txt"], x["scale"], negatives=x["neg"])


def _rank(rank: int, world: int, name: str):
    x = _inputs()
    n = B // world
    local = {k: (v[rank * n:(rank + 1) * n] if v.ndim else v) for k, v in x.items()}
    return loss_and_grads(REFERENCES[name][0], _leaves(local))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["clip", "several", "siglip"])
def test_two_ranks_with_half_the_images_each_give_the_whole_batchs_loss_and_gradients(name):
    per_rank = run_ranks(_rank, world_size=2, args=(name,))
    loss, grads = combine_ranks([(loss, {k: g for k, g in grads.items() if k not in MASKS})
                                 for loss, grads in per_rank], ("img", "txt", "caps", "neg"))
    want, want_grads = loss_and_grads(REFERENCES[name][0], _leaves(_inputs()))
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    for key in ("img", "txt", "caps", "neg", "scale", "bias"):
        torch.testing.assert_close(grads[key], want_grads[key], rtol=1e-9, atol=1e-12, msg=key)
    assert grads["neg"].abs().max() > 0


# ---------------------------------------------------------------------------------------------
# through the model: the batch's negative slots, exact accumulation
# ---------------------------------------------------------------------------------------------


def _csv(root) -> str:
    rng = np.random.default_rng(0)
    (root / "img").mkdir()
    rows = ["filepath\ttitle\tnegatives"]
    for i in range(16):
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(root / "img" / f"{i}.png")
        negatives = "|".join(f"not picture {i} but {c}" for c in range(i % 3))  # 0, 1 or 2 negatives
        rows.append(f"img/{i}.png\tpicture {i}\t{negatives}")
    (root / "pairs.tsv").write_text("\n".join(rows) + "\n")
    return str(root / "pairs.tsv")


def _overrides(path: str, objective: str) -> list[str]:
    return [f"objective.name={objective}", "train.batch_size=8", "data.source=csv", f"data.csv={path}",
            'data.caption_separator="|"', "data.hard_negative_key=negatives"]


@pytest.mark.parametrize("objective", ["clip", "siglip"])
def test_the_model_encodes_every_negative_and_k_micro_batches_equal_the_whole_batch(tmp_path, objective):
    path = _csv(tmp_path)
    _, step, batch = float64_step(_overrides(path, objective))
    assert batch.ids.shape[:2] == (8, 3) and batch.negative_valid.shape == (8, 2)
    assert 0 < batch.negative_valid.sum() < 16 and batch.caption_valid is None
    step.model.eval()  # no dropout: the two encodings compare
    out = step.model(batch.pixels, batch.ids, batch.mask)
    single = step.model.encode_text(batch.ids[:, 1], batch.mask[:, 1])["clip"]  # the slots are the negatives' own
    torch.testing.assert_close(out.text["clip"][:, 1], single, rtol=1e-12, atol=1e-12)
    assert_micro_batches_equal_whole(_overrides(path, objective), 2)
