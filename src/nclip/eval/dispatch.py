"""Every selected protocol on one dataset: :func:`eval_dataset` gets (cached) features and runs the
tasks the dataset has what they need for, writing results, skip reasons and the report's artifacts
into the evaluation's :class:`EvalState`. :func:`explain_missing` then gives every selected task
without results the data-side reason.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, NamedTuple

import torch

from nclip.data.transforms import model_resize
from nclip.errors import NclipError
from nclip.eval import classifier, diagnostics, masks, multilabel, probe, realms, retrieval, segmentation, sts, zeroshot
from nclip.eval.cache import FeatureCache
from nclip.eval.checkpoint import Checkpoint
from nclip.eval.datasets import EvalData
from nclip.eval.features import encode_texts, ensemble, extract, prompt_outputs, similarity
from nclip.eval.hardneg import evaluate as hard_negative_accuracy
from nclip.eval.probe import threads as _threads
from nclip.eval.settings import TASK_TABLE, EvalSettings
from nclip.heads import probe_output
from nclip.objectives.scores import ClipScore, Score
from nclip.precision import autocast_dtype


@dataclass
class EvalState:
    """One evaluation in progress: its inputs, the model (loaded on first use) and what it found."""

    ck: Checkpoint
    settings: EvalSettings
    score: Score | None  # the zero-shot score; None: an image-only objective (no text task runs)
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

    @cached_property
    def trained_paths(self) -> tuple[set[str], str] | None:
        """The run's training images, read once per evaluation (:mod:`nclip.eval.overlap`)."""
        from nclip.eval.overlap import trained_paths

        return trained_paths(self.ck.cfg)

    @property
    def autocast(self) -> torch.dtype | None:
        """The towers' autocast dtype in the checkpoint's run (``train.precision``) on this device:
        they encode in it, the scores are float32 (:mod:`nclip.eval.features`)."""
        return autocast_dtype(self.ck.cfg.train.precision, self.device)

    def identity(self, **what) -> dict:
        """A cache entry's identity: ``what``, and the encoding precision when it is not float32
        (float32 entries keep the identity they had before evaluation followed the run's)."""
        return {**what, "autocast": str(self.autocast)} if self.autocast is not None else what

    @property
    def probe_key(self) -> str:
        """The key of the probed image features in the extracted outputs (settings.features)."""
        return probe_output(self.settings.features or "backbone")

    def put(self, task: str, dataset: str, metrics: dict) -> None:
        for k, v in metrics.items():
            self.results[f"{task}/{dataset}/{k}"] = float(v)


# ---------------------------------------------------------------------------------------------
# features
# ---------------------------------------------------------------------------------------------


def _features(st: EvalState, data: EvalData, split: str, texts: bool) -> dict[str, torch.Tensor]:
    samples = data.splits[split]
    identity = st.identity(data=data.identity, split=split, texts=texts, image_size=st.image_size,
                           text_length=st.ck.cfg.data.text_length, n=len(samples))

    def compute():
        where = f" ({data.split_dirs[split]})" if split in data.split_dirs else ""  # imagefolder: val/ is "test"
        st.log(f"extracting {data.name}/{split}{where}: {len(samples)} images" + (" + captions" if texts else ""))
        with _threads(st.extract_threads):
            f = extract(st.model, samples, st.image_size, st.device, st.settings.batch_size, texts=texts,
                        autocast=st.autocast)
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


def _prompts(st: EvalState, data: EvalData, kind: str) -> dict[str, torch.Tensor]:
    space = data.label_kinds[kind]
    identity = st.identity(names=space.names, templates=space.templates, text_length=st.ck.cfg.data.text_length)
    return st.cache.get(f"{data.name}-prompts-{kind}", identity,
                        lambda: prompt_outputs(st.model, space, st.device, st.autocast))


def _check_head(st: EvalState, outputs: dict[str, torch.Tensor]) -> None:
    if st.probe_key not in outputs:
        raise NclipError(f"features {st.settings.features!r} are not in this checkpoint's outputs "
                         f"(objective {st.ck.cfg.objective.name})")
    if st.score is None:  # image-only objective: no head is scored
        return
    if st.score.head not in outputs:
        raise NclipError(f"head {st.score.head!r} is not in this checkpoint (objective {st.ck.cfg.objective.name})")


# ---------------------------------------------------------------------------------------------
# the tasks
# ---------------------------------------------------------------------------------------------


class _Test(NamedTuple):
    """One dataset's test split as the runners read it: every extracted tensor (``flat``: labels,
    ``text_to_image``, ...), and the image and text outputs by key."""

    flat: dict[str, torch.Tensor]
    image: dict[str, torch.Tensor]
    text: dict[str, torch.Tensor]


def eval_dataset(st: EvalState, data: EvalData) -> None:
    """Every selected task that ``data`` has what it needs for, in the order of :data:`_RUNNERS`."""
    tasks = set(st.settings.tasks)
    if data.sts is not None:  # sentence pairs: no images
        for task, runner in _SENTENCE_RUNNERS.items():
            if task in tasks:
                runner(st, data)
        return
    # always: one cache entry serves every task list
    needs_text = (data.retrieval or data.hard_negatives is not None) and st.score is not None
    flat = _features(st, data, "test", texts=needs_text)
    test = _Test(flat, _group(flat, "image"), _group(flat, "text"))
    _check_head(st, test.image)
    for served, runner in _RUNNERS:
        if tasks & set(served):
            runner(st, data, test, tasks)


def _eval_zero_shot(st: EvalState, data: EvalData, t: _Test, tasks: set[str]) -> None:
    """Zero-shot classification of every label kind and multi-label scores, from the same class
    scores (prompt ensembles); the primary kind's embeddings are kept for the report's t-SNE."""
    test, image = t.flat, t.image
    kinds = _single_label_kinds(data, test)
    scored = [k for k in data.label_kinds
              if ("zeroshot" in tasks and k in kinds) or ("multilabel" in tasks and k in data.multilabel_kinds)]
    class_scores: dict[str, torch.Tensor] = {}
    for kind in scored:
        prompts = _prompts(st, data, kind)
        classes = ensemble(prompts, len(data.label_kinds[kind]), st.score)
        class_scores[kind] = zeroshot.scores(image, classes, st.score)
        if kind == realms.class_kind(data.label_kinds) and kind in kinds:
            st.artifacts.setdefault("tsne", {"dataset": data.name, "kind": kind, "score": st.score,
                                             "image": image, "labels": test[f"label.{kind}"],
                                             "prompts": prompts, "classes": classes,
                                             "names": data.label_kinds[kind].names,
                                             "templates": len(data.label_kinds[kind].templates)})

    if "zeroshot" in tasks:
        for kind in kinds:
            m, pred = zeroshot.evaluate(class_scores[kind], test[f"label.{kind}"])
            st.put("zeroshot", f"{data.name}-{kind}", m)
            st.artifacts.setdefault("confusion", {})[f"{data.name}-{kind}"] = (
                zeroshot.confusion(pred, test[f"label.{kind}"], len(data.label_kinds[kind])),
                data.label_kinds[kind].names)

    if "multilabel" in tasks:
        for kind in data.multilabel_kinds:
            if kind in class_scores and f"multilabel.{kind}" in test:
                st.put("multilabel", f"{data.name}-{kind}",
                       multilabel.evaluate(class_scores[kind], test[f"multilabel.{kind}"],
                                           st.settings.multilabel_topk))


def _single_label_kinds(data: EvalData, test: dict) -> list[str]:
    """The label kinds with a class index per image (a ``multilabel:`` file's kind has targets only)."""
    return [k for k in data.label_kinds if f"label.{k}" in test]


def _eval_retrieval(st: EvalState, data: EvalData, t: _Test, tasks: set[str]) -> None:
    if data.hard_negatives is not None and t.text:
        _eval_hard_negatives(st, data, t)
    if not (data.retrieval and t.text):
        return
    sim = similarity(t.image, t.text, st.score)
    st.put("retrieval", data.name, retrieval.evaluate(sim, t.flat["text_to_image"]))
    fails = retrieval.failure_cases(sim, t.flat["text_to_image"], n=6)
    if fails:
        st.artifacts.setdefault("failures", {})[data.name] = (fails, data.splits["test"], t.flat["text_to_image"])


def _eval_hard_negatives(st: EvalState, data: EvalData, t: _Test) -> None:
    """A ``hardneg:`` file's rows: each true caption against the row's negatives (:mod:`nclip.eval.hardneg`)."""
    flat = [text for negatives in data.hard_negatives for text in negatives]
    owner = torch.tensor([row for row, negatives in enumerate(data.hard_negatives) for _ in negatives])
    identity = st.identity(data=data.identity, negatives=len(flat), text_length=st.ck.cfg.data.text_length)

    def compute():
        st.log(f"encoding {data.name}'s hard negatives: {len(flat)} captions")
        with _threads(st.extract_threads):
            return encode_texts(st.model, flat, st.device, st.settings.batch_size, st.autocast)

    negatives = st.cache.get(f"{data.name}-hardneg", identity, compute)
    st.put("retrieval", data.name, hard_negative_accuracy(t.image[st.score.head], t.text[st.score.head],
                                                          t.flat["text_to_image"], negatives[st.score.head], owner,
                                                          st.score))


def _eval_probes(st: EvalState, data: EvalData, t: _Test, tasks: set[str]) -> None:
    """Linear probe and k-NN on frozen image features (``settings.features``), per label kind (train
    split -> test split). The linear probe reads them as they are (ProtoCLIP App. B: z "before
    normalization"), k-NN L2-normalises them (cosine neighbours)."""
    if "train" not in data.splits or not data.label_kinds:
        return
    test, image = t.flat, t.image
    s = st.settings
    train = _features(st, data, "train", texts=False)
    xtr, xte = train[f"image.{st.probe_key}"], image[st.probe_key]
    for kind in data.label_kinds:
        n_cls = len(data.label_kinds[kind])
        ytr, yte = train[f"label.{kind}"], test[f"label.{kind}"]
        if "linear" in tasks and probe.selects(s) and not probe.can_validate(ytr):
            st.skipped[f"linear/{data.name}-{kind}"] = (
                f"every class has fewer than 3 training images ({len(ytr)} in all): no validation split to "
                f"choose the probe's {'learning rate' if s.probe == 'sgd' else 'L2 strength'}")
        elif "linear" in tasks:
            t = time.perf_counter()
            if s.probe == "sgd":
                r = probe.sgd_linear(xtr, ytr, xte, yte, n_cls, s.probe_recipe, epochs=s.probe_epochs, seed=s.seed)
            else:
                r = probe.linear(xtr, ytr, xte, yte, n_cls, l2_grid=s.l2_grid, seed=s.seed)
            st.put("linear", f"{data.name}-{kind}", r)
            st.timing[f"linear/{data.name}-{kind}_s"] = time.perf_counter() - t
        if "knn" in tasks:
            st.put("knn", f"{data.name}-{kind}",
                   probe.knn(xtr, ytr, xte, yte, n_cls, k=s.knn_k, temperature=s.knn_temperature))


def _eval_classifier(st: EvalState, data: EvalData, t: _Test, tasks: set[str]) -> None:
    """The pre-training classifier on the test split (:mod:`nclip.eval.classifier`), per label kind
    with the classifier's class count."""
    test = t.flat
    scores = classifier.class_scores(t.image, st.ck.cfg)
    if isinstance(scores, str):
        st.skipped["classifier"] = scores
        return
    for kind in _single_label_kinds(data, test):
        if len(data.label_kinds[kind]) == scores.shape[1]:
            st.put("classifier", f"{data.name}-{kind}", classifier.top1(scores, test[f"label.{kind}"]))


def _eval_cluster(st: EvalState, data: EvalData, t: _Test, tasks: set[str]) -> None:
    """K-Means clustering of the probed features against each label kind with two classes or more."""
    for kind in _single_label_kinds(data, t.flat):
        y = t.flat[f"label.{kind}"]
        if torch.unique(y).numel() >= 2:
            st.put("cluster", f"{data.name}-{kind}", probe.cluster(t.image[st.probe_key], y, seed=st.settings.seed))


def _eval_realms(st: EvalState, data: EvalData, t: _Test, tasks: set[str]) -> None:
    """Realm-wise linear probing; the realm labels are the data's own, or those of the class
    hierarchy named by ``--hierarchy`` (``data.realm_hierarchy``), derived from the class labels."""
    if not (data.realm or data.realm_hierarchy) or "train" not in data.splits:
        return
    test = t.flat
    train = _features(st, data, "train", texts=False)
    if data.realm_hierarchy is not None:
        ck, hierarchy = data.realm_hierarchy
        classes = data.label_kinds[ck].names
        realm_train, names = realms.from_hierarchy(hierarchy, classes, train[f"label.{ck}"])
        realm_test, _ = realms.from_hierarchy(hierarchy, classes, test[f"label.{ck}"])
    else:
        rk, ck = data.realm
        names = data.label_kinds[rk].names
        realm_train, realm_test = train[f"label.{rk}"], test[f"label.{rk}"]
    key = st.probe_key
    per = realms.evaluate(train[f"image.{key}"], realm_train, train[f"label.{ck}"],
                          test[f"image.{key}"], realm_test, test[f"label.{ck}"], names,
                          l2_grid=st.settings.l2_grid, seed=st.settings.seed)
    for name, m in per.items():
        st.put("realms", f"{data.name}-{realms.key(name)}", {"top1": m["top1"], "mean_per_class": m["mean_per_class"]})
    if per:
        st.put("realms", data.name, {"mean_top1": sum(m["top1"] for m in per.values()) / len(per)})
    st.artifacts.setdefault("realms", {})[data.name] = {realms.key(n): m for n, m in per.items()}


def _eval_sts(st: EvalState, data: EvalData) -> None:
    a, b, gold = zip(*data.sts)
    identity = st.identity(data=data.identity, text_length=st.ck.cfg.data.text_length)

    def compute():
        st.log(f"encoding {data.name} STS: {len(a)} sentence pairs")
        with _threads(st.extract_threads):
            out = {f"{side}.{k}": v for side, texts in (("a", a), ("b", b))
                   for k, v in encode_texts(st.model, list(texts), st.device, st.settings.batch_size,
                                            st.autocast).items()}
        return out

    f = st.cache.get(f"{data.name}-sts", identity, compute)
    st.put("sts", data.name, sts.evaluate(_group(f, "a"), _group(f, "b"), gold))


def _eval_masks(st: EvalState, data: EvalData, t: _Test, tasks: set[str]) -> None:
    if not data.masks:
        return
    reason = masks.unsupported(st.ck.cfg.model.vision.kind)
    if reason:
        st.skipped["masks"] = reason
        return
    samples = data.splits["test"]
    n = min(st.settings.mask_samples, len(samples))
    # the preprocessing: the masks take the images' geometry (entries without it rounded the long side)
    identity = {"data": data.identity, "n": n, "image_size": st.image_size, "preprocess": list(model_resize(st.model))}

    def compute():
        st.log(f"extracting {data.name} [CLS] attention maps: {n} images")
        with _threads(st.extract_threads):
            return masks.extract(st.model, samples[:n], st.image_size, st.device, st.settings.batch_size)

    f = st.cache.get(f"{data.name}-attention", identity, compute)
    r = masks.evaluate(f["attn"], f["masks"], st.settings.mask_threshold, f.get("ignore"))
    metrics = {"jaccard": r["jaccard"], "best_head": r["best_head"], "mean_heads": r["mean_heads"]}
    metrics.update({f"head{h}": float(v) for h, v in enumerate(r["per_head"])})
    st.put("masks", data.name, metrics)
    st.artifacts.setdefault("masks", {})[data.name] = {"attn": f["attn"], "masks": f["masks"], "samples": samples,
                                                       "best_head": r["best_head"],
                                                       "per_sample": r["per_sample"][:, r["best_head"]],
                                                       "threshold": st.settings.mask_threshold,
                                                       "saliency": st.ck.vision_tower.saliency}


def _eval_segmentation(st: EvalState, data: EvalData, t: _Test, tasks: set[str]) -> None:
    """Zero-shot segmentation by GroupViT's groups (:mod:`nclip.eval.segmentation`) over the classes of
    ``data.segment_space`` (synthetic: the shapes; masks:DIR: VOC's 20)."""
    if data.segment_space is None:
        return
    reason = segmentation.unsupported(st.ck.cfg.model.vision.kind, st.model.heads)
    if reason:
        st.skipped["segmentation"] = reason
        return
    samples = data.splits["test"]
    n = min(st.settings.mask_samples, len(samples))
    # the preprocessing, as for the masks task; entries without it also lack the pooled "image_emb"
    identity = {"data": data.identity, "n": n, "image_size": st.image_size, "classes": len(data.segment_space),
                "preprocess": list(model_resize(st.model))}

    def compute():
        st.log(f"extracting {data.name} GroupViT groups: {n} images")
        with _threads(st.extract_threads):
            return segmentation.extract(st.model, samples[:n], st.image_size, st.device, len(data.segment_space),
                                        st.settings.batch_size)

    f = st.cache.get(f"{data.name}-groups", identity, compute)
    space = data.segment_space
    identity = st.identity(names=space.names, templates=space.templates, text_length=st.ck.cfg.data.text_length)
    prompts = st.cache.get(f"{data.name}-prompts-segmentation", identity,
                           lambda: prompt_outputs(st.model, space, st.device, st.autocast))
    classes = ensemble(prompts, len(space), ClipScore())["clip"]  # GroupViT's readout: CLIP's cosine
    r = segmentation.evaluate(f, classes, float(st.model.scale().detach()), st.settings.segment_threshold)
    st.put("segmentation", data.name, {"miou": r["miou"], "macc": r["macc"]})
    st.artifacts.setdefault("segmentation", {})[data.name] = {
        "samples": samples, "pred": r["pred"], "truth": f["truth"], "classes": ["background", *space.names]}


def _eval_diagnostics(st: EvalState, data: EvalData, t: _Test, tasks: set[str]) -> None:
    """The representation diagnostics of image and caption outputs (:mod:`nclip.eval.diagnostics`)."""
    if t.text:
        st.put("diagnostics", data.name, diagnostics.evaluate(t.image, t.text, t.flat["text_to_image"]))


# the runner of every task of nclip.eval.settings.TASK_TABLE (checked below), in the order they run:
# on image data, a runner serves the selected tasks that share its work (zero-shot and multi-label
# score the same prompts; the linear probe and k-NN the same training features); on sentence pairs, one each
_RUNNERS: tuple[tuple[tuple[str, ...], Callable[[EvalState, EvalData, _Test, set[str]], None]], ...] = (
    (("zeroshot", "multilabel"), _eval_zero_shot),
    (("retrieval",), _eval_retrieval),
    (("linear", "knn"), _eval_probes),
    (("cluster",), _eval_cluster),
    (("realms",), _eval_realms),
    (("masks",), _eval_masks),
    (("segmentation",), _eval_segmentation),
    (("classifier",), _eval_classifier),
    (("diagnostics",), _eval_diagnostics),
)
_SENTENCE_RUNNERS: dict[str, Callable[[EvalState, EvalData], None]] = {"sts": _eval_sts}
_RUN = sorted([task for served, _ in _RUNNERS for task in served] + list(_SENTENCE_RUNNERS))
if _RUN != sorted(TASK_TABLE):  # a task added to the table needs its runner here
    raise ImportError(f"nclip.eval.dispatch runs {_RUN}, the task table has {sorted(TASK_TABLE)}")


def explain_missing(st: EvalState) -> None:
    """Give every selected task without results and without a reason yet the data-side reason."""
    done = {key.split("/")[0] for key in st.results}
    for task in st.settings.tasks:
        if task not in done and task not in st.skipped:
            st.skipped[task] = f"none of the selected datasets has {TASK_TABLE[task].needs}"
