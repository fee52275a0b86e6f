"""WiSE-FT after fine-tuning (``nclip finetune --wise 0,0.25,0.5,0.75,1``; Wortsman et al. 2022,
"Robust fine-tuning of zero-shot models"): the weights θ_α = (1 − α)·θ_0 + α·θ_1 of the zero-shot
start network (α = 0) and the fine-tuned one (α = 1), evaluated for every α asked for.

The paper interpolates the whole network, its classification head included, whose zero-shot value
is the text-derived zero-shot classifier (the class names' prompt-ensembled text embeddings) and
whose fine-tuned value is that head after end-to-end fine-tuning, which started from it. nclip's
``cosine`` classifier is exactly that network: at step 0 it is the image tower, the CLIP image head,
the normalised prompt-ensembled class embeddings and the pre-trained logit scale, whose predictions
are zero-shot classification's (:mod:`nclip.finetune.network`). So θ_0 is the state dict of the
network fine-tuning starts from, θ_1 the chosen fine-tuned one, and every floating-point tensor is
mixed by the rule of ``nclip merge`` (:func:`nclip.models.merge.interpolate`: exact at α = 0 and 1),
the cosine classifier's weights and logit scale too. The ``linear`` classifier starts from zeros on
backbone features, where no text-derived classifier exists: its α = 0 would be a constant guess, not
the zero-shot model, so ``--wise`` refuses it in one line (pass ``--classifier cosine``).
"""

from __future__ import annotations

from typing import Callable

import torch

from nclip.errors import NclipError


def check_wise(alphas: tuple[float, ...], classifier: str) -> None:
    if alphas and classifier != "cosine":
        raise NclipError(f"--wise needs the cosine classifier, whose start is the zero-shot model; this run's is "
                         f"{classifier!r} (a zero-initialised head on backbone features): pass --classifier cosine")


def wise_table(make_net: Callable[[], torch.nn.Module], tuned: torch.nn.Module, alphas: tuple[float, ...],
               prep, log: Callable[[str], None] = lambda msg: None) -> list[dict]:
    """Per α of ``alphas``: the test metrics of :func:`nclip.eval.zeroshot.evaluate` (top1, top5,
    mean_per_class, chance) and the validation top-1, of the mix of ``make_net()`` (the start) and
    ``tuned``."""
    from nclip.eval import zeroshot
    from nclip.finetune.loop import predict
    from nclip.models.merge import interpolate

    start = {k: v.detach().cpu() for k, v in make_net().state_dict().items()}
    end = {k: v.detach().cpu() for k, v in tuned.state_dict().items()}
    net = make_net()
    rows = []
    for alpha in alphas:
        net.load_state_dict(interpolate(start, end, alpha))
        metrics, _ = zeroshot.evaluate(predict(net, prep.test_pixels), prep.test_labels)
        val = float((predict(net, prep.labelled.val_pixels).argmax(1) == prep.labelled.val_labels).float().mean())
        rows.append({"alpha": alpha, **metrics, "val_top1": val})
        log(f"WiSE-FT alpha {alpha:g}: test top-1 {100 * metrics['top1']:.1f}%, val top-1 {100 * val:.1f}%")
    return rows


def table_text(rows: list[dict]) -> str:
    """The console table: one line per α, accuracies in percent."""
    cols = [c for c in ("top1", "top5", "mean_per_class", "val_top1") if c in rows[0]]
    head = "WiSE-FT alpha  " + "  ".join(f"{c:>14}" for c in cols)
    lines = [f"{r['alpha']:>13g}  " + "  ".join(f"{100 * r[c]:>14.1f}" for c in cols) for r in rows]
    return "\n".join([head + "   (test, %; val_top1: validation)", *lines])
