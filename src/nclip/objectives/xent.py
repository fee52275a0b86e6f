"""``xent``: the supervised baseline of the CMSF paper's Fig. 3 ("Xent"), a linear classifier on the
image features trained by cross-entropy on the (possibly noisy, ``label_noise``) training labels. It
takes its label settings from CMSF's (:class:`~nclip.objectives.cmsf.LabelFields`) and is probed as
CMSF is (``sgd_probe_recipe``); the model builds its "xent" head (:class:`nclip.heads.builtin.XentHead`).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from nclip.batch import Batch
from nclip.defaults import has_labels, unlabelled_reason
from nclip.objectives import functional
from nclip.objectives.base import EncoderOutput, LabelRequest, Objective, every_row_labelled
from nclip.objectives.cmsf import LabelFields


class XentConfig(LabelFields):
    """The supervised baseline ("Xent" of Fig. 3): a linear classifier on the image features."""

    name: Literal["xent"] = "xent"


class XentObjective(Objective):
    """Cross-entropy of the "xent" head's class logits against the (possibly noisy) training labels;
    one view per image (``data.augment``). Logs ``xent/acc`` against the training labels and
    ``xent/clean_acc`` against the clean ones."""

    heads = frozenset({"xent"})
    sgd_probe_recipe = "cmsf"  # the CMSF paper's baseline, probed as CMSF is
    zero_shot = None

    def __init__(self, cfg: XentConfig):
        super().__init__()
        self.cfg = cfg

    @classmethod
    def check_run(cls, run_cfg) -> None:
        if not has_labels(run_cfg.data):
            raise ValueError(f"objective xent needs labelled data, but {unlabelled_reason(run_cfg.data)}")

    @classmethod
    def label_request(cls, run_cfg) -> LabelRequest | None:
        return every_row_labelled(run_cfg)

    def forward(self, out: EncoderOutput, batch: Batch) -> dict[str, torch.Tensor]:
        if "xent" not in out.image or batch.labels is None:
            raise ValueError("xent needs the 'xent' head's class logits and the batch's labels")
        logits = out.image["xent"]  # [B, C]
        loss = F.cross_entropy(logits, batch.labels)
        accuracies = functional.class_accuracies(logits.argmax(1), batch.labels, batch.true_labels)
        return {"loss": loss, "xent/loss": loss.detach(), **{f"xent/{k}": v for k, v in accuracies.items()}}
