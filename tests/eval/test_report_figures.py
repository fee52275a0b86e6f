"""The report's figures (axis labels with units on every plot, t-SNE class names in a legend), its
header (image tower, text tower, training steps), and `nclip eval compare` flagging runs that
differ in steps, data or eval settings."""

from __future__ import annotations

import json

import matplotlib
import pytest
import torch

from nclip.cli import main
from nclip.eval import figures
from nclip.eval.curve_panels import curve_panels
from nclip.eval.report import _page
from nclip.objectives.scores import ClipScore

matplotlib.use("Agg", force=True)


@pytest.fixture
def captured(monkeypatch):
    """The matplotlib figures the report functions make, instead of their PNGs."""
    figs = []
    monkeypatch.setattr(figures, "png", lambda fig: figs.append(fig) or "")
    return figs


def _labelled(fig) -> None:
    for ax in fig.axes:
        if ax.axison and ax.get_label() != "<colorbar>":
            assert ax.get_xlabel() and ax.get_ylabel(), (ax.get_title(), ax.get_xlabel(), ax.get_ylabel())


def test_every_plot_has_axis_labels_with_units(captured):
    rows = [{"step": s, "loss": 1.0 / s, "lr": 1e-3, "clip/loss": 2.0, "nclip/L_CE": 5.0, "nclip/L_EH": 4.0,
             "clip/acc_i2t": 0.1, "logit_scale": 14.0, "grad_norm": 1.0, "cmsf/loss": 0.5} for s in (1, 2, 3)]
    figures.curves_figure(rows, curve_panels(rows)[0])
    figures.confusion_figure(torch.tensor([[3, 1], [0, 4]]), ["cat", "dog"])
    figures.realms_figure({"animals": {"top1": 0.5, "classes": 2}}, None, "r")
    for fig in captured:
        _labelled(fig)
    ylabels = {ax.get_title(): ax.get_ylabel() for ax in captured[0].axes if ax.axison}
    assert ylabels["total loss"] == "loss (nats)" and ylabels["learning rate"] == "lr (per step)"
    assert ylabels["CMSF terms"] == "loss (nats)"  # an objective's own panel gets a label too


def test_tsne_names_classes_in_a_legend_not_over_the_points(captured):
    names = [f"class {i}" for i in range(5)]
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(5).repeat(6)  # 30 images
    t = {"score": ClipScore(), "names": names, "labels": labels, "dataset": "synthetic", "kind": "shape",
         "image": {"clip": torch.randn(30, 8, generator=g)}, "prompts": {"clip": torch.randn(15, 8, generator=g)},
         "classes": {"clip": torch.randn(5, 8, generator=g)}}
    figures.tsne_figure(t)
    fig = captured[0]
    _labelled(fig)
    assert not any(ax.texts for ax in fig.axes)  # no names at the centroids, where they cover each other
    assert [text.get_text() for text in fig.legends[0].get_texts()] == names


def test_report_header_names_towers_and_steps():
    doc = {"checkpoint": {"path": "runs/x", "objective": "xclip", "heads": ["clip", "nclip"], "head": "clip",
                          "vision_tower": "convnet", "text_tower": "pretrained", "train_steps": 1234,
                          "weights_sha256": "ab" * 32},
           "results": {}, "cache": {}, "timing": {}}
    page = _page(doc, [])
    assert "image tower <b>convnet</b>" in page and "text tower <b>pretrained</b>" in page
    assert "trained <b>1234</b> steps" in page


def _results(path, steps, samples, source="synthetic"):
    path.mkdir(parents=True)
    doc = {"checkpoint": {"path": str(path), "objective": "clip", "head": "clip", "train_steps": steps,
                          "data_source": source, "image_size": 16},
           "config": {"datasets": ["synthetic"], "test_samples": samples, "seed": 0},
           "results": {"zeroshot/synthetic-shape/top1": 0.5}}
    (path / "results.json").write_text(json.dumps(doc))
    return str(path)


def test_compare_flags_runs_that_differ_in_steps_data_or_eval_settings(tmp_path, capsys):
    a = _results(tmp_path / "a", 100, 1000)
    b = _results(tmp_path / "b", 300, 200, source="csv")
    same = _results(tmp_path / "c", 100, 1000)
    assert main(["eval", "compare", a, same]) == 0
    out = capsys.readouterr()
    assert "differs" not in out.err + out.out

    assert main(["eval", "compare", a, b]) == 0
    out = capsys.readouterr()
    warned = [line for line in out.err.splitlines() if line.startswith("nclip: warning: differs: ")]
    assert [line.split("differs: ")[1].split(" (")[0] for line in warned] == [
        "training steps", "training data", "eval test samples"]
    assert "differs: training steps (a (clip, clip head): 100; b (clip, clip head): 300)" in out.out
    assert "not comparable" in out.out


def test_tsne_runs_the_papers_iterations_by_default_and_the_option_sets_them(monkeypatch):
    """App. G: perplexity 20, learning rate 200, 5,000 iterations (issue 27.7: the figure ran 1,000);
    `nclip eval --tsne-iters N` reaches the figure through EvalSettings.tsne_iters."""
    import argparse

    import numpy as np
    import sklearn.manifold

    from nclip.errors import NclipError
    from nclip.eval.command import _option, add_eval_parser
    from nclip.eval.settings import EvalSettings

    seen = []

    class FakeTSNE:
        def __init__(self, **kw):
            seen.append(kw)

        def fit_transform(self, dist):
            return np.zeros((dist.shape[0], 2))

    monkeypatch.setattr(sklearn.manifold, "TSNE", FakeTSNE)
    dist = np.ones((100, 100)) - np.eye(100)  # enough points for the uncapped perplexity 20
    figures.tsne_2d(dist)
    figures.tsne_2d(dist, max_iter=300)
    assert [s["max_iter"] for s in seen] == [5000, 300]
    assert (seen[0]["perplexity"], seen[0]["learning_rate"]) == (20.0, 200.0)
    assert EvalSettings().tsne_iters == 5000
    sub = argparse.ArgumentParser().add_subparsers()
    parser = add_eval_parser(sub)
    assert parser.parse_args([]).tsne_iters == 5000 and parser.parse_args(["--tsne-iters", "400"]).tsne_iters == 400
    with pytest.raises(NclipError, match="--tsne-iters"):
        EvalSettings().updated(_option, tsne_iters=100)
