"""The figures of report.html, each a base64 PNG (or, for retrieval failures, HTML cards of images):
the zero-shot confusion matrix; t-SNE of image and text class embeddings (xCLIP Figs. G3-G6, by the
zero-shot score's distance: cosine distance for the CLIP head, symmetrised cross-entropy -- i.e. KL --
for the nCLIP head);
retrieval failure cases (Fig. 5 / D2); mask probing examples; realm-wise accuracies; and the
training curves of a run's metrics.jsonl, one unit per panel (:mod:`nclip.eval.curve_panels`).
:mod:`nclip.eval.report` lays them out on the page.
"""

from __future__ import annotations

import base64
import html
import io
import math

import numpy as np
import torch
import torch.nn.functional as F

from nclip.eval.settings import TSNE_ITERS
from nclip.objectives.scores import Score

DPI = 110  # of every PNG


def png(fig) -> str:
    """A matplotlib figure as base64 PNG (the figure is closed)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def img_tag(b64: str, alt: str, cls: str = "") -> str:
    """An inline <img> of a base64 PNG (the page stays self-contained)."""
    return f'<img class="{cls}" alt="{html.escape(alt)}" src="data:image/png;base64,{b64}">'


def _image_png(image: np.ndarray, size: int = 128) -> str:
    from PIL import Image

    from nclip.data.transforms import rgb_array

    im = Image.fromarray(np.asarray(rgb_array(image), dtype=np.uint8))
    scale = max(1, size // max(im.size))
    im = im.resize((im.width * scale, im.height * scale), Image.NEAREST)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


# how wide report.html shows a confusion matrix of n classes (its img classes "fig small", 560 px,
# and "fig", the page's width): many classes get the whole page so that their cells stay legible
def confusion_width_px(n: int) -> int:
    return 560 if n <= 10 else 1120


READABLE_PX = 10  # the smallest count worth printing in a cell, in pixels as the page shows it


def cell_font_size(n: int, fig_width_in: float, axes_width_in: float, max_count: int) -> float | None:
    """Font size (pt) of the counts in the cells of an n-class matrix: as large as a cell holds
    (at most 12 pt), or None where the page, shrinking the figure to
    :func:`confusion_width_px`, would show it under :data:`READABLE_PX` pixels (a fixed 6 pt was too
    small to read on a shrunk figure)."""
    digits = max(2, len(str(int(max_count))))
    cell_pt = axes_width_in / n * 72
    size = min(12.0, 0.85 * cell_pt / (0.6 * digits))  # a digit is about 0.6 em wide
    shown = size * DPI / 72 * min(1.0, confusion_width_px(n) / (fig_width_in * DPI))
    return size if shown >= READABLE_PX else None


def confusion_figure(cm: torch.Tensor, names) -> str:
    import matplotlib.pyplot as plt

    cm = cm.double()
    norm = cm / cm.sum(dim=1, keepdim=True).clamp_min(1)
    n = len(names)
    size = max(3.5, 0.3 * n + 1.6)
    fig, ax = plt.subplots(figsize=(size + 1.0, size))
    im = ax.imshow(norm.numpy(), cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(n), names, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(n), names, fontsize=8)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    ax.apply_aspect()  # square cells: the axes' drawn width, which the n cells share
    fontsize = cell_font_size(n, fig.get_figwidth(), ax.get_position().width * fig.get_figwidth(), cm.max())
    if fontsize is not None:
        for i in range(n):
            for j in range(n):
                if cm[i, j] > 0:
                    ax.text(j, i, f"{int(cm[i, j])}", ha="center", va="center", fontsize=fontsize,
                            color="white" if norm[i, j] > 0.5 else "#333")
    return png(fig)


def pairwise_distance(x: torch.Tensor, score: Score) -> np.ndarray:
    """[N, N] distances for t-SNE by the zero-shot score's own (:meth:`Score.distance`: cosine
    distance for the CLIP head, the symmetrised KL between the softmax distributions for the nCLIP
    head), clamped at 0 with a zero diagonal."""
    d = score.distance(x).double().clamp_min(0)
    d.fill_diagonal_(0)
    return d.numpy()


def tsne_2d(dist: np.ndarray, seed: int = 0, max_iter: int = TSNE_ITERS) -> np.ndarray:
    """2-d t-SNE of an [N, N] distance matrix with App. G's settings (perplexity 20, learning rate
    200, ``max_iter`` iterations: the paper's 5,000 by default, ``nclip eval --tsne-iters``)."""
    from sklearn.manifold import TSNE

    n = dist.shape[0]
    # the paper's 20, capped for few points (scikit-learn needs perplexity < n)
    perplexity = float(min(20.0, max(2.0, (n - 1) / 3), n - 1))
    return TSNE(n_components=2, perplexity=perplexity, metric="precomputed", init="random",
                learning_rate=200.0, max_iter=max_iter, random_state=seed).fit_transform(dist)


def tsne_figure(t: dict, max_images: int = 500, max_iter: int = TSNE_ITERS) -> str:
    import matplotlib.pyplot as plt

    score = t["score"]
    key = score.head
    names = list(t["names"])
    n_cls = len(names)
    g = torch.Generator().manual_seed(0)
    labels = t["labels"].long()
    idx = torch.randperm(labels.numel(), generator=g)[:max_images]
    img, lab = t["image"][key][idx], labels[idx]
    prompts = t["prompts"][key]
    per_class = prompts.shape[0] // n_cls
    cmap = plt.get_cmap("tab20" if n_cls > 10 else "tab10")
    colour = [cmap(c % cmap.N) for c in range(n_cls)]

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.6))
    pts = tsne_2d(pairwise_distance(img, score), max_iter=max_iter)
    ax = axes[0]
    for c in range(n_cls):
        m = (lab == c).numpy()
        if m.any():
            ax.scatter(pts[m, 0], pts[m, 1], s=10, color=colour[c], alpha=0.6, linewidths=0)
            cen = pts[m].mean(axis=0)  # where the class sits in the map
            ax.scatter(*cen, s=80, color=colour[c], edgecolor="black", linewidths=1.0, zorder=3)
    ax.set_title(f"image embeddings ({len(idx)} test images; ● centre of each class)", fontsize=10)

    xy = tsne_2d(pairwise_distance(torch.cat([prompts.double(), t["classes"][key].double()]), score),
                 max_iter=max_iter)
    pts, cen = xy[: prompts.shape[0]], xy[prompts.shape[0]:]
    ax = axes[1]
    for c in range(n_cls):
        sl = slice(c * per_class, (c + 1) * per_class)
        ax.scatter(pts[sl, 0], pts[sl, 1], s=14, color=colour[c], alpha=0.6, linewidths=0)
        ax.scatter(*cen[c], s=90, color=colour[c], edgecolor="black", linewidths=1.0, zorder=3,
                   label=names[c] if n_cls <= 40 else None)
    ax.set_title(f"text embeddings ({per_class} prompts per class; ● prompt ensemble)", fontsize=10)
    for ax in axes:  # t-SNE coordinates have no unit: only distances between points mean anything
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_xlabel("t-SNE dimension 1 (no unit)", fontsize=8)
        ax.set_ylabel("t-SNE dimension 2 (no unit)", fontsize=8)
    if n_cls <= 40:  # class names in one legend beside the maps, not at the centroids where they overlap
        fig.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, title="class (colour)",
                   title_fontsize=8, ncols=1 + n_cls // 20, frameon=False)
    fig.suptitle(f"t-SNE of {t['dataset']} {t['kind']} classes, {score.name} head ({score.distance_name})",
                 fontsize=11)
    fig.tight_layout()
    return png(fig)


def _caption_text(samples, text_to_image: torch.Tensor, j: int) -> str:
    img = int(text_to_image[j])
    first = int(torch.nonzero(text_to_image == img)[0])
    caps = samples.captions[img] if hasattr(samples, "captions") and isinstance(samples.captions, list) \
        else samples[img].captions
    return caps[j - first]


def failures_html(name: str, fails, samples, text_to_image) -> str:
    cards = []
    for f in fails:
        wrong = _caption_text(samples, text_to_image, f.wrong)
        right = _caption_text(samples, text_to_image, f.right)
        owner = int(text_to_image[f.wrong])
        image = samples[f.image].image
        other = samples[owner].image
        cards.append(
            '<div class="fail">'
            f'<div class="pics"><figure>{img_tag(_image_png(image), "query image", "thumb")}'
            f'<figcaption>query #{f.image}</figcaption></figure>'
            f'<figure>{img_tag(_image_png(other), "image of the wrong caption", "thumb dim")}'
            f'<figcaption>owner of the retrieved caption (#{owner})</figcaption></figure></div>'
            f'<p class="bad"><span class="tag">retrieved</span> {html.escape(wrong)}</p>'
            f'<p class="good"><span class="tag">correct</span> {html.escape(right)} '
            f'<span class="rank">(rank {f.rank + 1}, margin {f.margin:.3g})</span></p></div>')
    return f'<h3>{html.escape(name)}</h3><div class="fails">{"".join(cards)}</div>'


def masks_figure(name: str, m: dict, n: int = 6) -> str:
    import matplotlib.pyplot as plt

    from nclip.data.transforms import resize_center_crop
    from nclip.eval.masks import predicted_mask

    per = m["per_sample"]
    order = per.argsort(descending=True)
    picks = [int(i) for i in order[: n // 2]] + [int(i) for i in order.flip(0)[: n - n // 2]]
    head = m["best_head"]
    fig, axes = plt.subplots(3, len(picks), figsize=(1.9 * len(picks), 6.0))
    axes = np.atleast_2d(axes)
    for col, i in enumerate(picks):
        gt = m["masks"][i].numpy()
        size = gt.shape[0]
        image = resize_center_crop(m["samples"][i].image, size)  # the model's view, which the masks were fitted to
        att = m["attn"][i, head]
        pred = predicted_mask(att, size, m["threshold"]).numpy()
        up = F.interpolate(att[None, None], size=(size, size), mode="nearest")[0, 0].numpy()
        axes[0, col].imshow(image, interpolation="nearest")
        axes[0, col].contour(gt, levels=[0.5], colors="lime", linewidths=1.0)
        axes[0, col].set_title(f"#{i}  J={float(per[i]):.2f}", fontsize=8)
        axes[1, col].imshow(up, cmap="inferno", interpolation="nearest")
        axes[2, col].imshow(image, interpolation="nearest")
        axes[2, col].imshow(np.ma.masked_where(~pred, pred), cmap="autumn", alpha=0.55, interpolation="nearest")
        for r in range(3):
            axes[r, col].set_xticks([])
            axes[r, col].set_yticks([])
    axes[0, 0].set_ylabel("image + true mask", fontsize=8)
    axes[1, 0].set_ylabel(f"{m.get('saliency') or '[CLS] attention'}, head {head}", fontsize=8)
    axes[2, 0].set_ylabel(f"top {int(100 * m['threshold'])}% mass", fontsize=8)
    fig.suptitle(f"{name}: best and worst scenes for the best head ({head})", fontsize=10)
    fig.tight_layout()
    return png(fig)


def segmentation_figure(name: str, m: dict, n: int = 6) -> str:
    """The first ``n`` scenes: the image, the true class map and the predicted one, side by side
    (one colour per class, black for background), with the classes named in a legend."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from nclip.data.transforms import resize_center_crop

    classes = m["classes"]
    colours = ListedColormap([(0, 0, 0)] + [plt.get_cmap("tab20")(k % 20) for k in range(len(classes) - 1)])
    picks = range(min(n, len(m["truth"])))
    fig, axes = plt.subplots(3, len(picks), figsize=(1.9 * len(picks), 6.4), squeeze=False)
    seen: set[int] = set()
    for col, i in enumerate(picks):
        truth, pred = m["truth"][i].numpy(), m["pred"][i].numpy()
        seen |= set(np.unique(truth).tolist()) | set(np.unique(pred).tolist())
        axes[0, col].imshow(resize_center_crop(m["samples"][i].image, truth.shape[0]), interpolation="nearest")
        for row, labels in ((1, truth), (2, pred)):
            axes[row, col].imshow(labels, cmap=colours, vmin=0, vmax=len(classes) - 1, interpolation="nearest")
        for r in range(3):
            axes[r, col].set_xticks([])
            axes[r, col].set_yticks([])
    for row, label in enumerate(("image", "true classes", "predicted")):
        axes[row, 0].set_ylabel(label, fontsize=8)
    handles = [Patch(color=colours(k), label=classes[k]) for k in sorted(seen)]
    fig.legend(handles=handles, loc="lower center", ncol=min(6, len(handles)), fontsize=7, frameon=False)
    fig.suptitle(f"{name}: zero-shot segmentation by GroupViT's groups", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return png(fig)


def realms_figure(per: dict[str, dict], baseline: dict[str, float] | None, dataset: str) -> str:
    import matplotlib.pyplot as plt

    names = list(per)
    acc = [100 * per[r]["top1"] for r in names]
    fig, ax = plt.subplots(figsize=(max(3.6, 0.9 * len(names) + 1.6), 3.0))
    x = np.arange(len(names))
    width = 0.38 if baseline else 0.6
    ax.bar(x - (width / 2 if baseline else 0), acc, width, label="this model", color="#3b6fb6")
    if baseline:
        base = [100 * baseline.get(f"realms/{dataset}-{r}/top1", float("nan")) for r in names]
        ax.bar(x + width / 2, base, width, label="baseline", color="#bbbbbb")
        ax.legend(fontsize=8)
    for xi, a in zip(x, acc):
        ax.text(xi - (width / 2 if baseline else 0), a + 1, f"{a:.1f}", ha="center", fontsize=8)
    chance = [100 / per[r]["classes"] for r in names]
    ax.scatter(x, chance, marker="_", s=400, color="crimson", label="chance", zorder=3)
    ax.set_xticks(x, [n.replace("_", " ") for n in names])
    ax.set_xlabel("realm")
    ax.set_ylabel("top-1 (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"{dataset}: linear probe per realm (red: chance)", fontsize=10)
    fig.tight_layout()
    return png(fig)


def curves_figure(rows: list[dict], panels: list) -> str:
    """The training curves of metrics.jsonl ``rows`` as a base64 PNG (see :func:`curves_plot`)."""
    return png(curves_plot(rows, panels))


def series_label(key: str, keys: list[str]) -> str:
    """A series' name in its panel's legend: its key without the "/"-segments every key of the
    panel shares ("eval/zeroshot/synthetic-shape/top1" beside other zero-shot keys:
    "synthetic-shape/top1"); a panel's only series drops its first segment ("clip/loss": "loss")."""
    parts = [k.split("/") for k in keys]
    shared = 0
    while all(len(p) > shared + 1 and p[shared] == parts[0][shared] for p in parts):
        shared += 1
    if len(keys) == 1:
        shared = min(1, len(parts[0]) - 1)
    return "/".join(key.split("/")[shared:])


def curves_plot(rows: list[dict], panels: list, cols: int = 3, title: str | None = None, tight: bool = True):
    """The training curves of metrics.jsonl ``rows``: one subplot per
    :class:`nclip.eval.curve_panels.Panel`, under its title and unit, every series named in a
    legend. A bare matplotlib ``Figure`` (Agg when saved): no pyplot state, no backend switched.
    ``tight=False``: fixed margins instead of ``tight_layout``, which measures every label and
    takes about a third of the drawing (RUN/curves.png, redrawn while a run trains)."""
    from matplotlib.figure import Figure

    cols = max(1, min(cols, len(panels)))
    nrows = max(1, math.ceil(len(panels) / cols))
    fig = Figure(figsize=(4 * cols, 2.7 * nrows + 0.4 * bool(title)))
    if title:
        fig.suptitle(title, fontsize=10)
    axes = fig.subplots(nrows, cols, squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for i, k in enumerate(panel.keys):
            pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])]
            if pts:
                xs, ys = zip(*pts)
                label = panel.labels[i] if getattr(panel, "labels", None) else series_label(k, panel.keys)
                ax.plot(xs, ys, marker="." if len(xs) < 30 else None, lw=1.4, label=label)
        ax.set_title(panel.title, fontsize=9)
        ax.set_xlabel("step (optimizer steps)", fontsize=8)
        ax.set_ylabel(panel.ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if tight:
        fig.tight_layout()
    else:  # in inches: 0.45 below each row for the x label, 0.3 above for the title, 0.6 left for the y label
        height = fig.get_figheight()
        fig.subplots_adjust(left=0.6 / fig.get_figwidth() * cols / 1.2, right=0.98, bottom=0.5 / height,
                            top=1 - (0.3 + 0.4 * bool(title)) / height, wspace=0.35, hspace=0.8 / 1.95)
    return fig
