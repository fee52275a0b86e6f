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
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from nclip.errors import NclipError
from nclip.eval import datasets as D
from nclip.eval import diagnostics, masks, multilabel, probe, realms, retrieval, sts, zeroshot
from nclip.eval.cache import FeatureCache, file_sha256
from nclip.eval.probe import threads as _threads
from nclip.eval.features import encode_texts, ensemble, extract, prompt_outputs, similarity
from nclip.eval.settings import HEADS, TASKS, EvalSettings
from nclip.jsonio import jsonable, read_json

RESULTS_VERSION = 1
TEXT_TASKS = ("zeroshot", "retrieval", "multilabel", "diagnostics")  # need a text-aligned head


# ---------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    path: Path  # as given
    weights: Path  # model.safetensors
    run_dir: Path | None  # where metrics.jsonl lives, if known
    cfg: object  # RunConfig
    sha256: str = ""

    def load(self, device):
        from safetensors.torch import load_file

        from nclip.models.dual_encoder import build_model

        model = build_model(self.cfg, pretrained_text=False)
        try:
            state = load_file(str(self.weights), device="cpu")
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise NclipError(f"cannot read {self.weights}: {e}") from None
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise NclipError(f"{self.weights} does not match its config: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
        return model.to(device).eval()


def resolve_checkpoint(path: str | Path) -> Checkpoint:
    """A run directory (RUN/model/), a model directory (model.safetensors + config.json) or a
    training checkpoint (RUN/checkpoints/step_N/, config from RUN/config.yaml)."""
    import yaml

    from nclip.config import validate
    from nclip.models.io import CONFIG, WEIGHTS, read_config

    p = Path(path).expanduser()
    if (p / "model" / CONFIG).is_file():
        model_dir, run_dir = p / "model", p
    elif (p / CONFIG).is_file():
        model_dir, run_dir = p, p.parent
    elif (p / WEIGHTS).is_file() and (p.parent.parent / "config.yaml").is_file():
        run_dir = p.parent.parent
        try:
            cfg = validate(yaml.safe_load((run_dir / "config.yaml").read_text()) or {})
        except yaml.YAMLError as e:
            raise NclipError(f"{run_dir / 'config.yaml'}: {str(e).splitlines()[0]}") from None
        return Checkpoint(p, p / WEIGHTS, run_dir, cfg, file_sha256(p / WEIGHTS))
    else:
        raise NclipError(f"no nclip checkpoint in {p} (expected RUN_DIR/model/{CONFIG}, a model directory "
                         f"with {CONFIG} and {WEIGHTS}, or RUN_DIR/checkpoints/step_N)")
    weights = model_dir / WEIGHTS
    if not weights.is_file():
        raise NclipError(f"missing weights file: {weights}")
    cfg = read_config(model_dir)
    return Checkpoint(p, weights, run_dir if (run_dir / "metrics.jsonl").is_file() else None, cfg,
                      file_sha256(weights))


# ---------------------------------------------------------------------------------------------
# the evaluation
# ---------------------------------------------------------------------------------------------


@dataclass
class _State:
    ck: Checkpoint
    settings: EvalSettings
    head: str
    cache: FeatureCache
    device: torch.device
    log: Callable[[str], None]
    results: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)  # task -> one-line reason it has no results
    artifacts: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)
    extract_threads: int | None = None  # thread count for model forward passes
    memo: dict = field(default_factory=dict)  # features already loaded in this run
    _model: object = None

    @property
    def model(self):
        if self._model is None:
            t = time.perf_counter()
            with _threads(self.extract_threads):
                self._model = self.ck.load(self.device)
            self.timing["load_model_s"] = time.perf_counter() - t
        return self._model

    @property
    def image_size(self) -> int:
        return self.ck.cfg.data.image_size

    def put(self, task: str, dataset: str, metrics: dict) -> None:
        for k, v in metrics.items():
            self.results[f"{task}/{dataset}/{k}"] = float(v)


def _features(st: _State, data: D.EvalData, split: str, texts: bool) -> dict[str, torch.Tensor]:
    samples = data.splits[split]
    identity = {"data": data.identity, "split": split, "texts": texts, "image_size": st.image_size,
                "text_length": st.ck.cfg.data.text_length, "n": len(samples)}

    def compute():
        st.log(f"extracting {data.name}/{split}: {len(samples)} images" + (" + captions" if texts else ""))
        with _threads(st.extract_threads):
            f = extract(st.model, samples, st.image_size, st.device, st.settings.batch_size, texts=texts)
        out = {f"image.{k}": v for k, v in f.image.items()}
        out.update({f"text.{k}": v for k, v in f.text.items()})
        out["text_to_image"] = f.text_to_image
        out.update({f"label.{k}": v for k, v in f.labels.items()})
        out.update({f"multilabel.{k}": v for k, v in f.multilabels.items()})
        return out

    memo_key = json.dumps([data.name, identity], sort_keys=True, default=str)
    if memo_key not in st.memo:
        st.memo[memo_key] = st.cache.get(f"{data.name}-{split}", identity, compute)
    return st.memo[memo_key]


def _group(flat: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) + 1:]: v for k, v in flat.items() if k.startswith(prefix + ".")}


def _prompts(st: _State, data: D.EvalData, kind: str) -> dict[str, torch.Tensor]:
    space = data.label_spaces[kind]
    identity = {"names": space.names, "templates": space.templates, "text_length": st.ck.cfg.data.text_length}
    return st.cache.get(f"{data.name}-prompts-{kind}", identity, lambda: prompt_outputs(st.model, space, st.device))


def _check_head(st: _State, outputs: dict[str, torch.Tensor]) -> None:
    if st.head is None:  # image-only objective: no head is scored
        return
    need = {"clip": "emb", "nclip": "logits"}[st.head]
    if need not in outputs:
        raise NclipError(f"head {st.head!r} is not in this checkpoint (objective {st.ck.cfg.objective.name})")


def _eval_dataset(st: _State, data: D.EvalData) -> None:
    tasks = set(st.settings.tasks)
    s = st.settings
    if data.sts is not None:
        if "sts" in tasks:
            _eval_sts(st, data)
        return
    needs_text = data.retrieval and st.head is not None  # always: one cache entry serves every task list
    test = _features(st, data, "test", texts=needs_text)
    image = _group(test, "image")
    _check_head(st, image)
    kinds = list(data.label_spaces)

    class_scores: dict[str, torch.Tensor] = {}
    if tasks & {"zeroshot", "multilabel"}:
        for kind in kinds if "zeroshot" in tasks else [k for k in kinds if k in data.multilabel_kinds]:
            prompts = _prompts(st, data, kind)
            classes = ensemble(prompts, len(data.label_spaces[kind]))
            class_scores[kind] = zeroshot.scores(image, classes, st.head)
            if kind == _primary_kind(data):
                st.artifacts.setdefault("tsne", {"dataset": data.name, "kind": kind, "head": st.head,
                                                 "image": image, "labels": test[f"label.{kind}"],
                                                 "prompts": prompts, "classes": classes,
                                                 "names": data.label_spaces[kind].names,
                                                 "templates": len(data.label_spaces[kind].templates)})

    if "zeroshot" in tasks:
        for kind in kinds:
            m, pred = zeroshot.evaluate(class_scores[kind], test[f"label.{kind}"])
            st.put("zeroshot", f"{data.name}-{kind}", m)
            st.artifacts.setdefault("confusion", {})[f"{data.name}-{kind}"] = (
                zeroshot.confusion(pred, test[f"label.{kind}"], len(data.label_spaces[kind])),
                data.label_spaces[kind].names)

    if "multilabel" in tasks:
        for kind in data.multilabel_kinds:
            if kind in class_scores and f"multilabel.{kind}" in test:
                st.put("multilabel", f"{data.name}-{kind}", multilabel.evaluate(class_scores[kind], test[f"multilabel.{kind}"]))

    text = _group(test, "text")
    if "retrieval" in tasks and data.retrieval and text:
        sim = similarity(image, text, st.head)
        st.put("retrieval", data.name, retrieval.evaluate(sim, test["text_to_image"]))
        fails = retrieval.failure_cases(sim, test["text_to_image"], n=6)
        if fails:
            st.artifacts.setdefault("failures", {})[data.name] = (fails, data.splits["test"], test["text_to_image"])

    if tasks & {"linear", "knn"} and "train" in data.splits and kinds:
        train = _features(st, data, "train", texts=False)
        xtr, xte = train["image.features"], image["features"]
        for kind in kinds:
            n_cls = len(data.label_spaces[kind])
            ytr, yte = train[f"label.{kind}"], test[f"label.{kind}"]
            if "linear" in tasks:
                t = time.perf_counter()
                st.put("linear", f"{data.name}-{kind}",
                       probe.linear(xtr, ytr, xte, yte, n_cls, l2_grid=s.l2_grid, seed=s.seed))
                st.timing[f"linear/{data.name}-{kind}_s"] = time.perf_counter() - t
            if "knn" in tasks:
                st.put("knn", f"{data.name}-{kind}",
                       probe.knn(xtr, ytr, xte, yte, n_cls, k=s.knn_k, temperature=s.knn_temperature))

    if "cluster" in tasks:
        for kind in kinds:
            y = test[f"label.{kind}"]
            if torch.unique(y).numel() >= 2:
                st.put("cluster", f"{data.name}-{kind}", probe.cluster(image["features"], y, seed=s.seed))

    if "realms" in tasks and data.realm and "train" in data.splits:
        _eval_realms(st, data, test)

    if "masks" in tasks and data.masks:
        _eval_masks(st, data)

    if "diagnostics" in tasks and text:
        st.put("diagnostics", data.name, diagnostics.evaluate(image, text, test["text_to_image"]))


def _primary_kind(data: D.EvalData) -> str | None:
    for kind in ("shape", "digit", "class"):
        if kind in data.label_spaces:
            return kind
    return next(iter(data.label_spaces), None)


def _eval_realms(st: _State, data: D.EvalData, test: dict) -> None:
    rk, ck = data.realm
    train = _features(st, data, "train", texts=False)
    names = data.label_spaces[rk].names
    per = realms.evaluate(train["image.features"], train[f"label.{rk}"], train[f"label.{ck}"],
                          test["image.features"], test[f"label.{rk}"], test[f"label.{ck}"], names,
                          l2_grid=st.settings.l2_grid, seed=st.settings.seed)
    for name, m in per.items():
        st.put("realms", f"{data.name}-{realms.key(name)}", {"top1": m["top1"], "mean_per_class": m["mean_per_class"]})
    if per:
        st.put("realms", data.name, {"mean_top1": sum(m["top1"] for m in per.values()) / len(per)})
    st.artifacts.setdefault("realms", {})[data.name] = {realms.key(n): m for n, m in per.items()}


def _eval_sts(st: _State, data: D.EvalData) -> None:
    a, b, gold = zip(*data.sts)
    identity = {"data": data.identity, "text_length": st.ck.cfg.data.text_length}

    def compute():
        st.log(f"encoding {data.name} STS: {len(a)} sentence pairs")
        with _threads(st.extract_threads):
            out = {f"a.{k}": v for k, v in encode_texts(st.model, list(a), st.device, st.settings.batch_size).items()}
            out.update({f"b.{k}": v for k, v in encode_texts(st.model, list(b), st.device, st.settings.batch_size).items()})
        return out

    f = st.cache.get(f"{data.name}-sts", identity, compute)
    st.put("sts", data.name, sts.evaluate(_group(f, "a"), _group(f, "b"), gold))


def _eval_masks(st: _State, data: D.EvalData) -> None:
    reason = masks.unsupported(st.ck.cfg.model.vision.kind)
    if reason:
        st.skipped["masks"] = reason
        return
    samples = data.splits["test"]
    n = min(st.settings.mask_samples, len(samples))
    identity = {"data": data.identity, "n": n, "image_size": st.image_size}

    def compute():
        st.log(f"extracting {data.name} [CLS] attention maps: {n} images")
        with _threads(st.extract_threads):
            return masks.extract(st.model, samples[:n], st.image_size, st.device, st.settings.batch_size)

    f = st.cache.get(f"{data.name}-attention", identity, compute)
    r = masks.evaluate(f["attn"], f["masks"], st.settings.mask_threshold)
    metrics = {"jaccard": r["jaccard"], "best_head": r["best_head"], "mean_heads": r["mean_heads"]}
    metrics.update({f"head{h}": float(v) for h, v in enumerate(r["per_head"])})
    st.put("masks", data.name, metrics)
    st.artifacts.setdefault("masks", {})[data.name] = {"attn": f["attn"], "masks": f["masks"], "samples": samples,
                                                       "best_head": r["best_head"],
                                                       "per_sample": r["per_sample"][:, r["best_head"]],
                                                       "threshold": st.settings.mask_threshold,
                                                       "saliency": _vision_tower(st.ck.cfg).saliency}


# what a selected task needs from the data, for the reason it is skipped when no dataset has it
_NEEDS = {
    "zeroshot": "class labels",
    "retrieval": "captions (synthetic, digits, captions:FILE)",
    "multilabel": "multi-label annotations (synthetic)",
    "linear": "class labels and a train split",
    "knn": "class labels and a train split",
    "cluster": "test labels of at least two classes",
    "realms": "realm labels and a train split (synthetic, realms:DIR)",
    "sts": "sentence pairs (synthetic with --sts-pairs > 0, sts:FILE.csv)",
    "masks": "object masks (synthetic)",
    "diagnostics": "captions (synthetic, digits, captions:FILE)",
}


def _explain_missing(st: _State) -> None:
    """Give every selected task without results and without a reason yet the data-side reason."""
    done = {key.split("/")[0] for key in st.results}
    for task in st.settings.tasks:
        if task not in done and task not in st.skipped:
            st.skipped[task] = f"none of the selected datasets has {_NEEDS[task]}"


def _vision_tower(cfg):
    """The image tower class of ``cfg`` (its ``feature`` and ``saliency`` descriptions)."""
    from nclip.models.towers import VISION_TOWERS

    return VISION_TOWERS[cfg.model.vision.kind]


# ---------------------------------------------------------------------------------------------
# baseline for relative realm accuracy
# ---------------------------------------------------------------------------------------------


def _baseline_results(st: _State) -> tuple[dict, str]:
    """(flat results, description) of the baseline: read from a results.json, or evaluated."""
    p = Path(st.settings.baseline).expanduser()
    for candidate in (p, p / "results.json"):
        if candidate.is_file() and candidate.suffix == ".json":
            return load_results(candidate)["results"], str(candidate)
    settings = replace(st.settings, tasks=("realms",), baseline=None)
    st.log(f"evaluating baseline {p} (realms)")
    doc = run_eval(p, out=None, settings=settings, report=False, log=st.log)
    return doc["results"], f"{p} (weights {doc['checkpoint']['weights_sha256'][:12]})"


def _add_relative(st: _State) -> None:
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
# entry point
# ---------------------------------------------------------------------------------------------


def _device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise NclipError("device 'cuda' requested but no CUDA device is available")
    return torch.device("cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu")


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
    settings = settings or EvalSettings()
    over = {k: v for k, v in (("tasks", tasks), ("datasets", datasets), ("head", head), ("baseline", baseline))
            if v is not None}
    if "tasks" in over:
        over["tasks"] = tuple(over["tasks"])
    if "datasets" in over:
        over["datasets"] = tuple(over["datasets"])
    if cache_dir == "default":
        cache_dir = settings.cache_dir if settings.cache_dir else (
            str(Path(out).expanduser().resolve().parent / ".nclip-cache") if out is not None else None)
    over["cache_dir"] = str(cache_dir) if cache_dir is not None else None
    settings = replace(settings, **over).validate()

    ck = resolve_checkpoint(checkpoint)
    from nclip.objectives import REGISTRY

    objective = REGISTRY[ck.cfg.objective.name][1]
    model_heads = sorted(objective.heads)
    head_name = settings.head or objective.zero_shot_head
    text_skipped = {}
    if head_name is None:  # no text-aligned head (CMSF, xent): the image-only protocols alone
        why = f"objective {ck.cfg.objective.name!r} trains no text-aligned head (image-only: see linear, knn)"
        text_skipped = {t: why for t in settings.tasks if t in TEXT_TASKS}
        settings = replace(settings, tasks=tuple(t for t in settings.tasks if t not in TEXT_TASKS))
    elif head_name not in model_heads:
        raise NclipError(f"head {head_name!r} is not in this checkpoint: objective {ck.cfg.objective.name!r} "
                         f"has {', '.join(model_heads)}")
    st = _State(ck, settings, head_name, FeatureCache(settings.cache_dir, ck.sha256), _device(settings.device),
                log or (lambda msg: None))
    st.skipped.update(text_skipped)

    cfg = ck.cfg
    data_seed = settings.seed
    all_data: list[D.EvalData] = []
    for spec in settings.datasets:
        kind, _ = D.parse_spec(spec)
        # a model trained on digits must be tested on its own held-out split
        seed = cfg.seed if kind == "digits" and cfg.data.source == "digits" else data_seed
        all_data += D.build(spec, image_size=cfg.data.image_size, max_objects=cfg.data.max_objects, seed=seed,
                            test_samples=settings.test_samples, train_samples=settings.train_samples,
                            sts_pairs=settings.sts_pairs if "sts" in settings.tasks else 0)
    st.extract_threads = torch.get_num_threads()
    with _threads(1):
        for data in all_data:
            t = time.perf_counter()
            _eval_dataset(st, data)
            st.timing[f"dataset/{data.name}{'-sts' if data.sts else ''}_s"] = time.perf_counter() - t
        if settings.baseline and "realms" in settings.tasks:
            _add_relative(st)
    _explain_missing(st)

    st.timing["total_s"] = time.perf_counter() - t0
    doc = {
        "version": RESULTS_VERSION,
        "checkpoint": {"path": str(ck.path), "weights": str(ck.weights), "weights_sha256": ck.sha256,
                       "objective": cfg.objective.name, "heads": model_heads, "head": head_name or "none",
                       "zero_shot_head": objective.zero_shot_head, "image_size": cfg.data.image_size,
                       "vision_tower": cfg.model.vision.kind, "text_tower": cfg.model.text.kind,
                       "run_dir": str(ck.run_dir) if ck.run_dir else None},
        "config": {**asdict(settings),
                   "probe_features": f"image backbone features ({_vision_tower(cfg).feature}, no projection)",
                   "mask_maps": _vision_tower(cfg).saliency,
                   "sts_features": "text backbone features ([EOS]/pooled, no projection)"},
        "results": dict(sorted(st.results.items())),
        "skipped": dict(sorted(st.skipped.items())),
        "timing": st.timing,
        "cache": {"dir": settings.cache_dir, "hits": sorted(st.cache.hits), "misses": sorted(st.cache.misses)},
    }
    if out is not None:
        out = Path(out).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(jsonable(doc, _null), indent=2) + "\n")
        if report:
            from nclip.eval.report import render

            t = time.perf_counter()
            with _threads(1):
                page = render(doc, st.artifacts, ck)
            (out / "report.html").write_text(page, encoding="utf-8")
            doc["timing"]["report_s"] = time.perf_counter() - t
            doc["timing"]["total_s"] = time.perf_counter() - t0
            (out / "results.json").write_text(json.dumps(jsonable(doc, _null), indent=2) + "\n")
    return doc


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


__all__ = ["run_eval", "EvalSettings", "TASKS", "HEADS", "resolve_checkpoint", "load_results"]
