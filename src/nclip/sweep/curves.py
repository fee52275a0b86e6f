"""DIR/curves.png: the nCLIP-head statistics of every run over training, as xCLIP Appendix Fig. B1."""

from __future__ import annotations

import math
from pathlib import Path

from nclip.sweep.grid import format_value
from nclip.sweep.verdicts import finite

# (a) and (b) of Fig. B1 for both the probabilities P (B.1 defines the stds on P) and the logits (its
# caption's "Std converges to 1 ... due to Batch Normalization" holds for the logits, not for P)
FIG_B1_PANELS = (("col_std", "(a) Column std of P"), ("logit_col_std", "(a) Column std of logits (BN: 1)"),
                 ("row_std", "(b) Row std of P"), ("logit_row_std", "(b) Row std of logits"),
                 ("L_KL", "(c) L_KL"), ("L_EH", "(d) L_EH"), ("L_HE", "(e) L_HE"))


def plot_curves(path: Path, rows: list[dict]) -> None:
    """Fig. B1 of the xCLIP appendix for every run: column and row std (of P and of the logits),
    L_KL, L_EH, L_HE vs step
    (``rows`` from :func:`nclip.sweep.tables.collect`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(19, 8), constrained_layout=True)
    flat = axes.ravel()
    handles = []
    for row in rows:
        metrics = row["metrics"]
        prefix = row["stats_prefix"]
        if prefix is None or not any(f"{prefix}/L_HE" in m for m in metrics):
            continue
        label = _label(row)
        for ax, (key, _) in zip(flat, FIG_B1_PANELS):
            pts = [(m["step"], m.get(f"{prefix}/{key}")) for m in metrics]
            xs = [s for s, y in pts if y is not None]
            ys = [float(y) if finite(y) else math.nan for _, y in pts if y is not None]
            (line,) = ax.plot(xs, ys, lw=1.2)
            if ax is flat[0]:
                handles.append((line, label))
    ks = {row["k"] for row in rows if row["stats_prefix"] and any(f"{row['stats_prefix']}/L_HE" in m
                                                                  for m in row["metrics"])}
    for ax, (key, title) in zip(flat, FIG_B1_PANELS):
        if key in ("L_EH", "L_HE") and len(ks) == 1:  # the uniform-collapse level of both entropies
            ax.axhline(math.log(next(iter(ks))), color="gray", ls="--", lw=0.8)
            ax.text(0.99, 0.98, "ln K", transform=ax.transAxes, ha="right", va="top", color="gray", fontsize=8)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    legend = flat[len(FIG_B1_PANELS)]
    legend.axis("off")
    if handles:
        legend.legend([h for h, _ in handles], [lab for _, lab in handles], loc="center", fontsize=9, frameon=False)
    else:
        legend.text(0.5, 0.5, "no nCLIP-head terms logged", ha="center", va="center")
    fig.suptitle("nCLIP-head statistics over training (xCLIP Appendix Fig. B1)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _label(row: dict) -> str:
    """A run in the legend: its setting's name or else its grid values, and its state unless ok."""
    values = "" if row["name"] else ", ".join(f"{k.rsplit('.', 1)[-1]}={format_value(v)}"
                                              for k, v in row["values"].items())
    state = "" if row["state"] == "ok" else f" [{row['state']}]"
    return f"{row['name'] + ' ' if row['name'] else ''}{values}{state}".strip() or row["slug"]
