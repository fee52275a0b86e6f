"""The papers' SGD linear-probe recipes, one table (``SGD_RECIPES``): the probe
(:mod:`nclip.eval.metrics.sgd_linear`) trains by it, and the eval settings' choices, the CLI's
``--probe-recipe`` choices and help, and results.json's record are made from it. Imports no torch,
so that building the CLI parser stays fast. The recipes, each as its paper states it:

* ``xclip`` -- xCLIP Sec. 4.2 "Linear probing" (after MAE / iBOT): SGD *without* momentum, no
  weight decay, 100 epochs, [CLS] features; "we sweep a set of different learning rates by adding
  multiple classification heads over a shared frozen backbone, each with its own optimizer and
  scheduler" (iBOT's multi-head sweep). The paper gives neither the grid, the batch size nor the
  schedule: nclip sweeps a 1-2-5 grid from 1e-3 to 5 with iBOT's cosine schedule and batch 256.
* ``cmsf`` -- CMSF Sec. 4 "Linear IN-1k" (after CompRess): features L2-normalised, then standardised
  per dimension; SGD lr 0.01, momentum 0.9, weight decay 1e-4, batch 256, 40 epochs, lr x0.1 at
  epochs 15 and 30. (The paper trains with ImageNet augmentations; on frozen, pre-extracted features
  nclip has none -- as for every other probe.)
* ``protoclip`` -- ProtoCLIP App. B "Linear Probing" for ImageNet (after MoCo / SwAV / SLIP): z
  "before normalization", SGD lr 0.3, momentum 0.9, weight decay 1e-6, batch 256, 100 epochs, cosine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

_XCLIP_GRID = tuple(m * 10.0 ** e for e in range(-3, 1) for m in (1, 2, 5))


@dataclass(frozen=True)
class SgdRecipe:
    """One paper's linear-probe optimisation (recorded in results.json); ``gist`` is its few words
    of help text."""

    paper: str
    gist: str
    lrs: tuple[float, ...]  # more than one: a head per learning rate, chosen on a validation split
    momentum: float
    weight_decay: float
    epochs: int
    batch_size: int
    schedule: str  # "cosine" (to 0 over the epochs) or "steps" (x0.1 at each milestone)
    milestones: tuple[int, ...] = ()
    normalise: bool = False  # L2-normalise, then standardise with the training set's statistics

    def summary(self, epochs: int | None = None) -> dict:
        record = {**asdict(self), "epochs": epochs or self.epochs, "lrs": list(self.lrs),
                  "milestones": list(self.milestones)}
        del record["gist"]  # help text, not a setting: results.json records what it recorded before
        return record


SGD_RECIPES = {
    "xclip": SgdRecipe("xCLIP Sec. 4.2 (MAE / iBOT multi-head sweep)", "Sec. 4.2, lr sweep, no momentum", _XCLIP_GRID,
                       momentum=0.0, weight_decay=0.0, epochs=100, batch_size=256, schedule="cosine"),
    "cmsf": SgdRecipe("CMSF Sec. 4, Linear IN-1k (CompRess)", "CompRess: lr 0.01, steps at 15/30 of 40 epochs",
                      (0.01,), momentum=0.9, weight_decay=1e-4, epochs=40, batch_size=256, schedule="steps",
                      milestones=(15, 30), normalise=True),
    "protoclip": SgdRecipe("ProtoCLIP App. B, ImageNet linear probing (MoCo / SwAV / SLIP)",
                           "App. B: lr 0.3, cosine, 100 epochs", (0.3,), momentum=0.9, weight_decay=1e-6, epochs=100,
                           batch_size=256, schedule="cosine"),
}


def recipes_help() -> str:
    """Every recipe's name and gist, for the CLI's help."""
    return ", ".join(f"{name} ({recipe.gist})" for name, recipe in SGD_RECIPES.items())
