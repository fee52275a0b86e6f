"""``run_eval``: every evaluation protocol of the papers, on one checkpoint, in one call.

    checkpoint → (cached) features per dataset and split → protocols → results.json + report.html

Result keys are flat and stable, ``task/dataset/metric``: e.g. ``zeroshot/synthetic-shape/top1``,
``retrieval/synthetic/i2t@1``, ``linear/digits-digit/top1``, ``realms/synthetic-symbol/top1``,
``sts/synthetic/spearman``, ``masks/synthetic/jaccard``, ``diagnostics/synthetic/erank_image_emb``.
For classification tasks the dataset part is ``<dataset>-<label kind>``. Values are fractions in
[0, 1] for accuracies and recalls (the report shows percentages). A selected task that yields no
result -- this image tower has no attention map to probe, no selected dataset has what the task
needs -- is listed under ``skipped`` with a one-line reason instead.

Features are extracted once per (checkpoint weights, dataset, split) and cached on disk
(:mod:`nclip.eval.cache`), so a second evaluation of the same checkpoint -- another head, another
task list, a re-rendered report -- only runs the protocols.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from nclip.errors import NclipError
from nclip.eval import datasets as eval_data
from nclip.eval import realms
from nclip.eval.cache import FeatureCache
from nclip.eval.checkpoint import resolve_checkpoint
from nclip.eval.dispatch import EvalState, eval_dataset, explain_missing
from nclip.eval.probe import threads as _threads
from nclip.eval.settings import TASKS, TEXT_TASKS, EvalSettings
from nclip.heads import probe_description
from nclip.jsonio import jsonable, read_json, write_text_atomic
from nclip.objectives.scores import Score, score_named

RESULTS_VERSION = 1


def run_eval(checkpoint: str | Path, out: str | Path | None = None, *, tasks=None, datasets=None, head=None,
             baseline=None, cache_dir: str | Path | None = "default", settings: EvalSettings | None = None,
             report: bool = True, log: Callable[[str], None] | None = None) -> dict:
    """Evaluate ``checkpoint`` with the selected protocols; write ``out``/results.json (+ report.html).

    A task that cannot run here (see the module docstring) is skipped with its reason, never an error.

    Args:
        checkpoint: run directory, model directory or RUN/checkpoints/step_N.
        out: output directory (None: nothing is written, the results are only returned).
        tasks, datasets, head, baseline: shortcuts overriding the fields of ``settings``.
        cache_dir: feature cache folder; "default" = ``<out>/../.nclip-cache`` (no cache without
            ``out``), None = no cache.
        settings: everything else (:class:`EvalSettings`).
        report: also render report.html.
        log: progress messages (default: silent).

    Returns:
        the results.json document: ``{"results": {key: value}, "skipped": {task: reason},
        "checkpoint": {...}, "config": {...}, "timing": {...}, "cache": {...}}``.
    """
    t0 = time.perf_counter()
    settings = _resolve_settings(settings or EvalSettings(), out, cache_dir,
                                 tasks=tasks, datasets=datasets, head=head, baseline=baseline)
    st, objective = start(checkpoint, settings, log)
    all_data = build_datasets(st.ck.cfg, st.settings)
    if "realms" in st.settings.tasks:
        realms.attach_hierarchies(all_data, st.settings.hierarchy)
    with _threads(1):
        for data in all_data:
            evaluate(st, data)
        if st.settings.baseline and "realms" in st.settings.tasks:
            _add_relative(st)
    return finish(st, objective, out, report, t0)


def start(checkpoint: str | Path, settings: EvalSettings, log: Callable[[str], None] | None = None):
    """(the evaluation state, the objective's plan) of ``checkpoint`` under resolved ``settings``: the
    zero-shot score chosen and checked, the text tasks of an image-only objective skipped with their
    reason, the probe features and SGD recipe resolved (the model loads on first use)."""
    ck = resolve_checkpoint(checkpoint, settings.arch)
    if log and Path(ck.path) != Path(checkpoint).expanduser():  # a run without model/: its newest checkpoint
        log(f"{checkpoint} has no model/ (training did not finish): evaluating its newest checkpoint, {ck.path}")
    from nclip.objectives import plan_for

    objective = plan_for(ck.cfg)
    score = zero_shot_score(settings, objective)
    text_skipped = {}
    if score is None:  # no text-aligned head (CMSF, xent): the image-only protocols alone
        why = f"objective {ck.cfg.objective.name!r} trains no text-aligned head (image-only: see linear, knn)"
        text_skipped = {t: why for t in settings.tasks if t in TEXT_TASKS}
        settings = settings.updated(tasks=tuple(t for t in settings.tasks if t not in TEXT_TASKS))
    settings = settings.updated(features=probe_features(settings.features, ck.cfg.objective))
    if settings.probe == "sgd" and settings.probe_recipe is None:  # the objective's paper recipe
        settings = settings.updated(probe_recipe=objective.sgd_probe_recipe)
    st = EvalState(ck, settings, score, FeatureCache(settings.cache_dir, ck.sha256), _device(settings.device),
                   log or (lambda msg: None))
    st.skipped.update(text_skipped)
    st.extract_threads = torch.get_num_threads()
    return st, objective


def evaluate(st: EvalState, data: eval_data.EvalData) -> None:
    """Every selected task on one dataset, timed (call under ``_threads(1)``: the probes' threads)."""
    from nclip.eval.overlap import overlap_warning

    if warning := overlap_warning(data, st.trained_paths):
        print(f"nclip: warning: {warning}", file=sys.stderr, flush=True)
    t = time.perf_counter()
    eval_dataset(st, data)
    st.timing[f"dataset/{data.name}{'-sts' if data.sts else ''}_s"] = time.perf_counter() - t


def finish(st: EvalState, objective, out, report: bool, t0: float, extra: dict | None = None) -> dict:
    """The results document of a finished evaluation (with ``extra`` sections, e.g. a suite's),
    written to ``out`` (results.json, report.html with ``report``) unless ``out`` is None."""
    explain_missing(st)

    st.timing["total_s"] = time.perf_counter() - t0
    doc = {**_document(st, objective), **(extra or {})}
    if out is not None:
        _write(Path(out).expanduser(), doc, st, report, t0)
    return doc


def zero_shot_score(settings: EvalSettings, objective) -> Score | None:
    """The score of an evaluation: the one ``settings.head`` names (``nclip eval --head``), or (None)
    the objective's plan's, with the evaluation's options (``--nclip-score``); None for an image-only
    objective. A one-line error for an unknown score, or one whose head the checkpoint lacks."""
    score = objective.zero_shot
    if settings.head is not None:
        try:
            score = score_named(settings.head)
        except ValueError as e:
            raise NclipError(f"--head: {e}") from None
    if score is None:
        return None
    if score.head not in objective.heads:
        raise NclipError(f"head {score.head!r} is not in this checkpoint (the {score.name!r} score reads it): "
                         f"objective {objective.name!r} has {', '.join(sorted(objective.heads))}")
    return score.configured(settings)


def probe_features(features: str | None, objective_cfg) -> str:
    """The image features the probes read: ``features``, or (None) the objective's paper default
    (``Objective.probe_features``: ProtoCLIP's z per its App. B, the backbone for the others);
    a one-line error when the objective (config ``objective_cfg``) has no such features (no such
    head, or a head that offers none)."""
    from nclip.objectives import plan_of

    objective = plan_of(objective_cfg)
    features = features or objective.probe_features
    if problem := objective.probe_problem(features):
        raise NclipError(f"features {features!r}: {problem}")
    return features


def _resolve_settings(settings: EvalSettings, out, cache_dir, **shortcuts) -> EvalSettings:
    """``settings`` with the shortcut arguments of :func:`run_eval` that were given, and the feature
    cache folder resolved ("default": ``<out>/../.nclip-cache``, none without ``out``); validated."""
    over = {k: tuple(v) if k in ("tasks", "datasets") else v for k, v in shortcuts.items() if v is not None}
    if cache_dir == "default":
        cache_dir = settings.cache_dir if settings.cache_dir else (
            str(Path(out).expanduser().resolve().parent / ".nclip-cache") if out is not None else None)
    over["cache_dir"] = str(cache_dir) if cache_dir is not None else None
    return settings.updated(**over)


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise NclipError("device 'cuda' requested but no CUDA device is available")
    return torch.device("cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu")


def build_datasets(cfg, settings: EvalSettings) -> list[eval_data.EvalData]:
    """The evaluation data of every selected dataset spec, at the checkpoint's image size."""
    all_data: list[eval_data.EvalData] = []
    for spec in settings.datasets:
        kind, _ = eval_data.parse_spec(spec)
        # a model trained on digits must be tested on its own held-out split
        seed = cfg.seed if kind == "digits" and cfg.data.source == "digits" else settings.seed
        all_data += eval_data.build(spec, image_size=cfg.data.image_size, max_objects=cfg.data.max_objects, seed=seed,
                                    test_samples=settings.test_samples, train_samples=settings.train_samples,
                                    sts_pairs=settings.sts_pairs if "sts" in settings.tasks else 0,
                                    classnames=settings.classnames, templates=settings.templates,
                                    image_key=settings.image_key, caption_key=settings.caption_key,
                                    run_keys=cfg.data.caption_keys(),
                                    voc_classnames=settings.voc_classnames)
    return all_data


# ---------------------------------------------------------------------------------------------
# baseline for relative realm accuracy
# ---------------------------------------------------------------------------------------------


def _baseline_results(st: EvalState) -> tuple[dict, str]:
    """(flat results, description) of the baseline: read from a results.json, or evaluated."""
    p = Path(st.settings.baseline).expanduser()
    for candidate in (p, p / "results.json"):
        if candidate.is_file() and candidate.suffix == ".json":
            return load_results(candidate)["results"], str(candidate)
    settings = st.settings.updated(tasks=("realms",), baseline=None)
    st.log(f"evaluating baseline {p} (realms)")
    doc = run_eval(p, out=None, settings=settings, report=False, log=st.log)
    return doc["results"], f"{p} (weights {doc['checkpoint']['weights_sha256'][:12]})"


def _add_relative(st: EvalState) -> None:
    base, desc = _baseline_results(st)
    rel = {}
    for key, value in list(st.results.items()):
        if key.startswith("realms/") and key.endswith(("/top1", "/mean_top1")) and key in base:
            task, ds, metric = key.split("/")
            rel[f"{task}/{ds}/{metric.replace('top1', 'relative')}"] = value - base[key]
    if not rel:
        raise NclipError(f"the baseline {desc} has no realm accuracies matching this evaluation")
    st.results.update(rel)
    st.artifacts["baseline"] = {"source": desc, "results": {k: v for k, v in base.items() if k.startswith("realms/")}}


# ---------------------------------------------------------------------------------------------
# results.json and report.html
# ---------------------------------------------------------------------------------------------


def _document(st: EvalState, objective) -> dict:
    """The results.json document of a finished evaluation."""
    tower = st.ck.vision_tower
    return {
        "version": RESULTS_VERSION,
        "checkpoint": checkpoint_info(st.ck, objective, st.score.name if st.score is not None else None),
        "config": {**st.settings.model_dump(),
                   "probe_features": f"{st.settings.features}: "
                                     + probe_description(st.settings.features, tower.feature),
                   "linear_probe": linear_protocol(st.settings),
                   "mask_maps": tower.saliency,
                   "sts_features": "text backbone features ([EOS]/pooled, no projection)"},
        "results": dict(sorted(st.results.items())),
        "skipped": dict(sorted(st.skipped.items())),
        "timing": st.timing,
        "cache": {"dir": st.settings.cache_dir, "hits": sorted(st.cache.hits), "misses": sorted(st.cache.misses)},
    }


def linear_protocol(settings: EvalSettings) -> dict:
    """How the linear probe was trained (results.json ``config.linear_probe``)."""
    if settings.probe == "lbfgs":
        return {"optimizer": "L-BFGS (CLIP App. A.3)", "l2_grid": list(settings.l2_grid), "val_fraction": 0.2}
    from nclip.eval.sgd_recipes import SGD_RECIPES

    return {"optimizer": "SGD", "recipe": settings.probe_recipe,
            **SGD_RECIPES[settings.probe_recipe].summary(settings.probe_epochs)}


def checkpoint_info(ck, objective, head: str | None) -> dict:
    """The ``checkpoint`` section of a results document (also ``nclip finetune``'s): ``head`` the name
    of the score evaluated, ``zero_shot_head`` the objective's (the plan's ``zero_shot``)."""
    cfg = ck.cfg
    own = objective.zero_shot
    return {"path": str(ck.path), "format": ck.format, "weights": str(ck.weights),
            "weights_sha256": ck.sha256, "objective": cfg.objective.name,
            "heads": sorted(objective.heads), "head": head or "none",
            "zero_shot_head": own.name if own is not None else None, "image_size": cfg.data.image_size,
            "vision_tower": cfg.model.vision.kind, "text_tower": cfg.model.text.kind,
            "train_steps": _trained_steps(ck), "data_source": cfg.data.source,
            "run_dir": str(ck.run_dir) if ck.run_dir else None}


def _trained_steps(ck) -> int:
    """The optimizer steps behind the weights: N of a RUN/checkpoints/step_N directory, else the
    run's train.steps (a finished run's model)."""
    from nclip.models.io import checkpoint_step

    step = checkpoint_step(ck.path)
    return ck.cfg.train.steps if step is None else step


def _write(out: Path, doc: dict, st: EvalState, report: bool, t0: float) -> None:
    """results.json, then (with ``report``) report.html and results.json again with the report's time."""
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "results.json", json.dumps(jsonable(doc, _null), indent=2) + "\n")
    if report:
        from nclip.eval.report import render

        t = time.perf_counter()
        with _threads(1):
            page = render(doc, st.artifacts, st.ck)
        write_text_atomic(out / "report.html", page)
        doc["timing"]["report_s"] = time.perf_counter() - t
        doc["timing"]["total_s"] = time.perf_counter() - t0
        write_text_atomic(out / "results.json", json.dumps(jsonable(doc, _null), indent=2) + "\n")


def _null(_: float) -> None:
    return None  # JSON has no NaN; a collapsed model's undefined correlation reads as null


def load_results(path: str | Path) -> dict:
    """A results.json document (also accepts the directory holding it, or a trainer's eval.json)."""
    p = Path(path).expanduser()
    if p.is_dir():
        for name in ("results.json", "eval/results.json", "eval.json"):
            if (p / name).is_file():
                p = p / name
                break
        else:
            raise NclipError(f"no results.json (or eval.json) in {p}")
    if not p.is_file():
        raise NclipError(f"results file not found: {p}")
    doc = read_json(p)
    if not isinstance(doc, dict):
        raise NclipError(f"{p}: not a results document")
    if "results" not in doc:  # the trainer's flat eval.json
        doc = {"results": {k: v for k, v in doc.items() if isinstance(v, (int, float))}, "checkpoint": {}}
    doc["source"] = str(p)
    return doc


__all__ = ["run_eval", "EvalSettings", "TASKS", "resolve_checkpoint", "load_results"]
