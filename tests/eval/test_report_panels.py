"""The report's panels (issue 28.13): one title per training-curve panel (no "nCLIP terms" beside
"nclip terms"), one kind of quantity per panel under its unit (no accuracies or standard deviations
under "nats"), no panel zero at every step, and confusion-matrix counts readable on the page or left out."""

from __future__ import annotations

import json

import matplotlib
import pytest

from nclip.eval import figures
from nclip.eval.curve_panels import KINDS, curve_panels, series_kind

matplotlib.use("Agg", force=True)

# the series of a micro xclip run's metrics.jsonl, as logged (values of step 2)
XCLIP_ROW = {"lr": 0.002, "loss": 0.856, "clip/loss": 3.02, "clip/acc_i2t": 0.0625, "clip/logit_pos": -0.49,
             "clip/logit_neg": -0.48, "clip/acc_t2i": 0.0, "nclip/loss": 0.25, "nclip/L_CE": 5.31,
             "nclip/L_EH": 4.43, "nclip/L_HE": 4.85, "nclip/L_KL": 0.88, "nclip/acc_nC": 0.0, "nclip/row_std": 0.0083,
             "nclip/col_std": 0.0080, "nclip/usage": 0.125, "nclip/logit_row_std": 0.98, "nclip/logit_col_std": 1.0,
             "nclip/lambda": 1.0, "logit_scale": 14.27, "grad_norm": 3.76, "nonfinite_steps": 0, "data/skipped": 0,
             "samples_per_s": 169.3, "data_wait_s": 0.057, "monitor/warnings": ["a warning"]}
OWN = {"total loss", "logit scale 1/σ", "learning rate", "gradient norm"}


@pytest.fixture
def captured(monkeypatch):
    figs = []
    monkeypatch.setattr(figures, "png", lambda fig: figs.append(fig) or "")
    return figs


def _rows(row, steps=(2, 4, 6)):
    return [{"step": s, **{k: (v * s if isinstance(v, float) else v) for k, v in row.items()}} for s in steps]


def _drawn(rows, captured):
    """{title: (y-axis label, {series name: y values})} of the curves figure drawn for ``rows``."""
    figures.curves_figure(rows, curve_panels(rows)[0])
    return {ax.get_title(): (ax.get_ylabel(), {line.get_label(): list(line.get_ydata()) for line in ax.lines})
            for ax in captured[-1].axes if ax.axison}


def _check(drawn):
    titles = [t.lower() for t in drawn]
    assert len(set(titles)) == len(titles), titles
    for title, (ylabel, lines) in drawn.items():
        assert lines, title
        assert any(y != 0 for ys in lines.values() for y in ys), f"{title}: zero at every step"
        if title not in OWN:
            kinds = {series_kind(name) for name in lines}
            assert len(kinds) == 1, (title, {n: series_kind(n) for n in lines})
            assert ylabel == KINDS[kinds.pop()][0], (title, ylabel)
            if "nats" in ylabel:
                assert all(series_kind(name) == "loss" for name in lines), (title, list(lines))


def test_every_panel_has_one_title_one_kind_of_quantity_and_something_to_show(captured):
    drawn = _drawn(_rows(XCLIP_ROW), captured)
    _check(drawn)
    assert drawn["nCLIP terms"][0] == "loss (nats)" and set(drawn["nCLIP terms"][1]) == {"L_CE", "L_EH", "L_HE",
                                                                                          "L_KL"}
    assert drawn["nCLIP head: row / column std of P"][0] == "std of probabilities"
    assert drawn["nCLIP head: accuracy and prototype usage"][0] == "fraction (0 to 1)"
    assert not any("data" in t or "skipped" in t for t in drawn)  # data/skipped: 0 throughout


def test_zero_series_are_named_and_a_count_that_moves_is_drawn():
    panels, zero = curve_panels(_rows(XCLIP_ROW))
    assert zero == ["data/skipped"]
    assert "skipped data samples" not in [p.title for p in panels]
    panels, zero = curve_panels([{"step": 2, **XCLIP_ROW, "data/skipped": 3}])
    assert zero == [] and ("skipped data samples", ["data/skipped"], "count") in [p[:3] for p in panels]


def test_other_objectives_get_panels_by_kind(captured):
    row = {"loss": 1.0, "lr": 1e-3, "cmsf/loss": 0.5, "cmsf/purity": 0.4, "cmsf/bank_fill": 0.5,
           "cmsf/momentum": 0.99, "cmsf/neighbours": 5.0, "xent/acc": 0.3, "siglip/L_SigLIP": 0.7,
           "siglip/logit_bias": -10.0, "proto/L_proto": 2.0, "proto/t_proto": 0.05}
    drawn = _drawn(_rows(row), captured)
    _check(drawn)
    assert {"CMSF terms", "CMSF accuracies and shares", "CMSF coefficients", "CMSF counts", "classifier "
            "accuracies and shares", "SigLIP terms", "SigLIP logits", "ProtoCLIP terms", "ProtoCLIP coefficients"} \
        <= set(drawn)


@pytest.mark.slow
def test_a_real_runs_curves(tmp_path, captured, one_thread, micro_overrides):
    from nclip.config import resolve
    from nclip.train.loop import train

    train(resolve("micro", [*micro_overrides, "train.steps=4", "train.threads=1"]), tmp_path / "run",
          progress=False, evaluate=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {k for r in rows for k in r} <= set(XCLIP_ROW) | {"step"}  # XCLIP_ROW above is what a run logs
    _check(_drawn(rows, captured))


def _shown_px(fig, fontsize, n):
    """A cell's number in pixels as report.html shows the figure (560 px wide at most for few
    classes, the page's width for many)."""
    width_px = 560 if n <= 10 else 1120
    return fontsize * 110 / 72 * min(1.0, width_px / (fig.get_figwidth() * 110))


@pytest.mark.parametrize("n", [2, 6, 10, 20, 40, 100])
def test_confusion_numbers_are_readable_on_the_page_or_left_out(captured, n):
    import torch

    cm = torch.eye(n, dtype=torch.long) * 97 + 1  # three-digit counts on the diagonal
    figures.confusion_figure(cm, [f"class {i}" for i in range(n)])
    fig = captured[-1]
    texts = fig.axes[0].texts
    assert len(texts) in (0, n * n)
    assert all(_shown_px(fig, t.get_fontsize(), n) >= 10 for t in texts), (n, texts[0].get_fontsize())
    if n <= 20:  # up to 20 classes the cells hold readable numbers
        assert texts
    if n >= 100:  # 10,000 cells: the shading alone
        assert not texts


def test_evaluation_while_training_gets_panels_by_task_with_datasets_named(captured):
    """Issue 36.3: five legend entries read "top1", top-1 and recall shared a "unit unknown" axis, and
    eval_s was an unlabelled "other other series"."""
    import re

    row = {"loss": 1.0, "lr": 1e-3, **{f"eval/zeroshot/synthetic-{kind}/top1": 0.2
                                       for kind in ("shape", "colour", "count", "realm", "size")},
           **{f"eval/retrieval/synthetic/{m}": 0.3 for m in ("i2t@1", "i2t@5", "t2i@1", "t2i@5", "mean_recall")},
           "eval/knn/digits-digit/top1": 0.5, "eval_s": 1.5}
    drawn = _drawn(_rows(row), captured)
    assert drawn["eval while training: zero-shot top-1"] == (
        "top-1 accuracy (0 to 1)", {f"synthetic-{k}": [0.4, 0.8, 1.2000000000000002]
                                    for k in ("shape", "colour", "count", "realm", "size")})
    ylabel, lines = drawn["eval while training: retrieval recall@k"]
    assert ylabel == "recall (0 to 1)" and set(lines) == {f"synthetic {m}" for m in
                                                          ("i2t@1", "i2t@5", "t2i@1", "t2i@5", "mean_recall")}
    assert drawn["eval while training: k-NN top-1"][1].keys() == {"digits-digit"}
    assert drawn["time spent evaluating"] == ("seconds per evaluation", {"evaluation while training": [3.0, 6.0, 9.0]})
    every_text = " ".join([*drawn, *(y for y, _ in drawn.values()), *(n for _, ls in drawn.values() for n in ls)])
    assert "unknown" not in every_text and not re.search(r"\bother other\b", every_text)
    assert "value, as logged" == KINDS["value"][0] and "other series" in _drawn(_rows({"loss": 1.0, "odd": 2.0}),
                                                                                captured)


@pytest.mark.slow
def test_a_run_that_evaluates_while_training_has_no_unknown_panel(tmp_path, captured, one_thread, micro_overrides):
    from nclip.config import resolve
    from nclip.train.loop import train

    train(resolve("micro", [*micro_overrides, "train.steps=4", "train.threads=1", "train.eval_every=2",
                            "train.eval_samples=32"]), tmp_path / "run", progress=False, evaluate=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    drawn = _drawn(rows, captured)
    assert "eval while training: zero-shot top-1" in drawn and "time spent evaluating" in drawn
    labels = [n for _, lines in drawn.values() for n in lines]
    assert "top1" not in labels and not any("unknown" in y for y, _ in drawn.values())
