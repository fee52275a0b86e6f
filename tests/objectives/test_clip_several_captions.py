"""CLIP's InfoNCE with several captions per image (data.caption_choice all): every caption a positive of
its image, the image's target uniform over its captions, a caption's its one image. Checked against a
float64 transcription of that definition (values and gradients), on 2 gloo ranks against one process,
and through the model under exact accumulation (k micro-batches against the whole batch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from float64_steps import assert_micro_batches_equal_whole, float64_step
from nclip.objectives import functional

from distributed_utils import combine_ranks, loss_and_grads, run_ranks

B, C, D = 6, 3, 5


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    valid = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return {"img": torch.randn(B, D, generator=g, dtype=torch.float64),
            "txt": torch.randn(B, C, D, generator=g, dtype=torch.float64),
            "scale": torch.tensor(4.0, dtype=torch.float64), "valid": valid}


def _reference(img, txt, valid, scale, reduction="mean"):
    """The definition, one term at a time, in float64: ℓ_i = −(1/|P_i|) Σ_{j∈P_i} log softmax over every
    caption; a caption's cross-entropy over the images; the means over images and over captions."""
    u = img / img.norm(dim=1, keepdim=True)
    v = txt / txt.norm(dim=2, keepdim=True)
    captions = [(b, c) for b in range(img.shape[0]) for c in range(txt.shape[1]) if valid[b, c]]

    def s(i, caption):
        return scale * torch.dot(u[i], v[caption])

    image_terms = []
    for i in range(img.shape[0]):
        log_z = torch.logsumexp(torch.stack([s(i, k) for k in captions]), 0)
        mine = [k for k in captions if k[0] == i]
        image_terms.append(sum(log_z - s(i, k) for k in mine) / len(mine))
    caption_terms = []
    for k in captions:
        log_z = torch.logsumexp(torch.stack([s(i, k) for i in range(img.shape[0])]), 0)
        caption_terms.append(log_z - s(k[0], k))
    loss = torch.stack(image_terms).mean() + torch.stack(caption_terms).mean()
    return loss / 2 if reduction == "mean" else loss


def _loss(x, reduction="mean", global_batch=True):
    return functional.clip_terms(x["img"], x["txt"], x["scale"], caption_valid=x["valid"], reduction=reduction,
                                 global_batch=global_batch)["loss"]


def _leaves(x):
    return {k: (v.clone().requires_grad_() if k != "valid" else v.clone()) for k, v in x.items()}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_loss_and_its_gradients_are_the_definitions(reduction):
    x, ref = _leaves(_inputs()), _leaves(_inputs())
    loss = _loss(x, reduction)
    want = _reference(ref["img"], ref["txt"], ref["valid"], ref["scale"], reduction)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    loss.backward()
    want.backward()
    for key in ("img", "txt", "scale"):
        torch.testing.assert_close(x[key].grad, ref[key].grad, rtol=1e-10, atol=1e-12, msg=key)
    assert x["txt"].grad[~x["valid"]].abs().max() == 0  # padding slots get nothing
    assert x["txt"].grad[x["valid"]].abs().min() > 0


def test_padding_slots_change_nothing_and_one_caption_each_is_plain_infonce():
    x = _inputs()
    moved = dict(x, txt=torch.where(x["valid"][..., None], x["txt"], 100 * torch.randn_like(x["txt"])))
    torch.testing.assert_close(_loss(moved), _loss(x), rtol=0, atol=1e-14)
    one = dict(x, txt=x["txt"][:, :1], valid=torch.ones(B, 1, dtype=torch.bool))
    plain = functional.clip_terms(x["img"], x["txt"][:, 0], x["scale"])
    several = functional.clip_terms(one["img"], one["txt"], one["scale"], caption_valid=one["valid"])
    for key in ("loss", "acc_i2t", "acc_t2i", "logit_pos", "logit_neg"):
        torch.testing.assert_close(several[key], plain[key], rtol=1e-12, atol=1e-12, msg=key)


def test_the_diagnostics_count_own_captions_as_right():
    x = _inputs()
    img = x["txt"][torch.arange(B), torch.tensor([2, 0, 1, 0, 1, 1])]  # each image on one of its captions
    terms = functional.clip_terms(img, x["txt"], torch.tensor(50.0, dtype=torch.float64), caption_valid=x["valid"])
    assert terms["acc_i2t"] == 1 and terms["logit_pos"] > terms["logit_neg"]
    with pytest.raises(ValueError, match=r"caption_valid \[B, C\] expected"):
        functional.clip_terms(x["img"], x["txt"], x["scale"])


def _rank(rank: int, world: int):
    x = _inputs()
    n = B // world
    local = {k: (v[rank * n:(rank + 1) * n] if k != "scale" else v) for k, v in x.items()}
    return loss_and_grads(_loss, _leaves(local))


@pytest.mark.slow
def test_two_ranks_with_half_the_images_each_give_the_whole_batchs_loss_and_gradients():
    per_rank = run_ranks(_rank, world_size=2)
    loss, grads = combine_ranks([(loss, {k: g for k, g in grads.items() if k != "valid"}) for loss, grads in per_rank],
                                ("img", "txt"))
    want, want_grads = loss_and_grads(_loss, _leaves(_inputs()))
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    for key in ("img", "txt", "scale"):
        torch.testing.assert_close(grads[key], want_grads[key], rtol=1e-9, atol=1e-12, msg=key)


# ---------------------------------------------------------------------------------------------
# through the model: the batch's caption slots, exact accumulation
# ---------------------------------------------------------------------------------------------


def _csv(root) -> str:
    rng = np.random.default_rng(0)
    (root / "img").mkdir()
    rows = ["filepath,title"]
    for i in range(16):
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(root / "img" / f"{i}.png")
        rows.append(f"img/{i}.png," + "|".join(f"picture {i} line {c}" for c in range(1 + i % 3)))
    (root / "pairs.csv").write_text("\n".join(rows) + "\n")
    return str(root / "pairs.csv")


def _overrides(path: str) -> list[str]:
    return ["objective.name=clip", "train.batch_size=8", "data.source=csv", f"data.csv={path}",
            'data.caption_separator="|"', "data.caption_choice=all"]


def test_the_model_encodes_every_caption_and_k_micro_batches_equal_the_whole_batch(tmp_path):
    path = _csv(tmp_path)
    _, step, batch = float64_step(_overrides(path))
    assert batch.ids.shape[:2] == (8, 3) and batch.caption_valid.sum() < 24
    step.model.eval()  # no dropout: the two encodings compare
    out = step.model(batch.pixels, batch.ids, batch.mask)
    assert out.text["clip"].shape == (8, 3, out.image["clip"].shape[1])
    single = step.model.encode_text(batch.ids[:, 1], batch.mask[:, 1])["clip"]  # the slots are the captions' own
    torch.testing.assert_close(out.text["clip"][:, 1], single, rtol=1e-12, atol=1e-12)
    assert_micro_batches_equal_whole(_overrides(path), 4)
