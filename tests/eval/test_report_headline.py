"""The report's headline cards (issue 28.2): each card's number is the named headline metric of its
task (top-1, never the chance level that sorts before it), read back from the HTML of a real
evaluation and compared with results.json."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from PIL import Image

from nclip.eval.headline import HEADLINE, headline_picks
from nclip.eval.report import fmt, split_key


class _Cards(HTMLParser):
    """(number, label, key) of every headline card of a report page."""

    def __init__(self):
        super().__init__()
        self.cards: list[list[str]] = []
        self._field = None

    def handle_starttag(self, tag, attrs):
        cls = dict(attrs).get("class")
        if cls == "card":
            self.cards.append([])
        elif cls in ("big", "lbl", "key") and self.cards:
            self._field = cls

    def handle_endtag(self, tag):
        self._field = None

    def handle_data(self, data):
        if self._field:
            self.cards[-1].append(data.strip())


def cards(page: str) -> list[list[str]]:
    parser = _Cards()
    parser.feed(page)
    return parser.cards


def test_headline_picks_metrics_by_name_not_by_position():
    # results.json sorts keys: chance < mean_per_class < top1, ami < ari, l2 < top1
    results = {"cluster/pets-class/ami": 0.2, "cluster/pets-class/ari": 0.1, "knn/pets-class/mean_per_class": 0.4,
               "knn/pets-class/top1": 0.5, "linear/pets-class/l2": 0.03, "linear/pets-class/top1": 0.9,
               "zeroshot/pets-class/chance": 1 / 3, "zeroshot/pets-class/top1": 1 / 6,
               "diagnostics/synthetic/erank": 3.0}
    picked = {key for _, key in headline_picks(results)}
    assert picked == {"cluster/pets-class/ari", "knn/pets-class/top1", "linear/pets-class/top1",
                      "zeroshot/pets-class/top1"}


def test_headline_prefers_the_synthetic_shape_labels_and_the_realms_mean():
    results = {"zeroshot/digits-digit/top1": 0.4, "zeroshot/synthetic-colour/top1": 0.9,
               "zeroshot/synthetic-shape/top1": 0.3, "realms/synthetic-animals/top1": 0.8,
               "realms/synthetic/mean_top1": 0.6, "finetune/digits-digit/chance": 0.1,
               "finetune/digits-digit/top1": 0.7}
    assert dict((k.split("/")[0], k) for _, k in headline_picks(results)) == {
        "zeroshot": "zeroshot/synthetic-shape/top1", "realms": "realms/synthetic/mean_top1",
        "finetune": "finetune/digits-digit/top1"}


def _folder(root, classes, n):
    for c, name in enumerate(classes):
        for i in range(n):
            path = root / name / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((12, 12, 3), (70 * c, 20 * i, 10), np.uint8)).save(path)
    return root


@pytest.mark.slow
def test_every_card_of_a_real_report_is_its_tasks_headline_value_in_results_json(tmp_path, one_thread):
    from nclip.config import resolve
    from nclip.eval.runner import run_eval
    from nclip.eval.settings import EvalSettings
    from nclip.models import build_model
    from nclip.models.io import save_model

    from conftest import micro_sizes

    cfg = resolve("micro", micro_sizes() + ["objective.name=clip"])
    torch.manual_seed(0)
    model = save_model(build_model(cfg, pretrained_text=False), cfg, tmp_path / "model")  # untrained: any number
    folder = _folder(tmp_path / "pets", ("bird", "cat", "dog"), n=8)
    settings = EvalSettings(datasets=(f"folder:{folder}",), tasks=("zeroshot", "linear", "knn", "cluster"),
                            tsne_iters=250, device="cpu")
    run_eval(model, tmp_path / "out", settings=settings, cache_dir=None, log=lambda _: None)
    results = json.loads((tmp_path / "out" / "results.json").read_text())["results"]
    shown = cards((tmp_path / "out" / "report.html").read_text(encoding="utf-8"))

    assert sorted(key.split("/")[0] for _, _, key in shown) == ["cluster", "knn", "linear", "zeroshot"]
    for number, label, key in shown:
        task, _, metric = split_key(key)
        assert metric == HEADLINE[task][0], (key, label)  # zeroshot: top1, never chance
        assert number == fmt(metric, results[key]), (key, number, results[key])
        assert abs(float(number) - 100 * results[key]) <= 0.05, key
    zeroshot = next(card for card in shown if card[2].startswith("zeroshot/"))
    assert zeroshot[1] == "zero-shot top-1"
