"""Evaluation while training, ``train.eval_every`` (docs/runs.md): every N optimizer steps rank 0
scores the model on a fixed set of held-out images and writes the figures on that step's row of
metrics.jsonl (``eval/...`` keys), in TensorBoard (``train.tensorboard``) and on the progress line.

What is evaluated, on ``train.eval_samples`` images of each dataset (an evenly spaced subset of
its test split, the same images every time):

- objectives with a zero-shot score (``Objective.zero_shot``): zero-shot top-1 per label kind
  (``eval/zeroshot/<dataset>-<kind>/top1``, the prompt ensembles of ``nclip eval``) and, where the
  captions describe the images, image–text retrieval (``eval/retrieval/<dataset>/{i2t,t2i}@{1,5}``,
  ``.../mean_recall``), scored with the objective's score as the end-of-run evaluation;
- image-only objectives (no zero-shot head: CMSF, xent): weighted k-NN top-1 on the probed image
  features (``eval.probe_features``), with ``train.eval_samples`` images of the dataset's train
  split as the reference set (``eval/knn/<dataset>-<kind>/top1``).

The datasets are ``train.eval_datasets`` (any spec ``nclip eval --dataset`` accepts, built by
:func:`nclip.eval.datasets.build`), or, when none is given, the held-out split of the run's built-in
source (synthetic, digits); a run on its own data without ``train.eval_datasets`` is not evaluated
while training (the start-up block says so). The images are loaded once, when the run starts; the
model's features are extracted anew at every evaluation (the model changes: nothing is cached).

The rules that keep it out of the training's way:

- the training trajectory is the same with and without it, bitwise on the CPU: the model runs in
  eval mode (no BatchNorm statistics move, no dropout), every module's train/eval mode is put back
  afterwards, and the RNG states (torch, CUDA, NumPy, Python) are saved before and restored after;
- rank 0 evaluates while the other ranks wait at a barrier (under FSDP every rank first takes part
  in gathering the whole weights, as for a checkpoint);
- its time, ``eval_s`` on the row, is left out of the row's ``samples_per_s``, and the towers
  encode under the run's autocast (``train.precision``), as they train; the scores are float32;
- an evaluation belongs to its step: a run resumed from a checkpoint at step k does not repeat the
  evaluation of step k (it was written before the checkpoint), and one killed after evaluating a
  step but before its checkpoint redoes it, its row replacing the lost one.

:meth:`PeriodicEval.evaluate` takes the model as an argument, so that other weights of the same
run (an EMA of the weights) can be scored beside the raw ones under their own key prefix.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nclip.config import RunConfig
from nclip.data.types import LabelKind, Sample
from nclip.defaults import BUILTIN_SOURCES
from nclip.errors import NclipError
from nclip.eval import datasets as eval_data
from nclip.eval import probe, retrieval, zeroshot
from nclip.eval.features import class_text_outputs, extract, similarity
from nclip.heads import probe_output
from nclip.objectives import plan_for
from nclip.precision import autocast_dtype
from nclip.train.checkpoint import rng_state, set_rng_state
from nclip.train.ema import swapped_to_ema

PREFIX = "eval"  # the raw weights' keys: eval/<task>/<dataset>/<metric>


@dataclass(frozen=True)
class EvalSet:
    """One dataset's fixed share of every evaluation: its images, not the model's features."""

    name: str
    test: list[Sample]
    reference: list[Sample]  # k-NN's labelled reference images (image-only objectives), else []
    label_kinds: dict[str, LabelKind]  # the kinds the samples carry a label of
    retrieval: bool  # score image–text retrieval on the test captions


def _subset(split, n: int) -> list[Sample]:
    """``n`` evenly spaced samples of ``split`` (all of a smaller one), in order: every class of a
    class-sorted folder is represented, and no RNG is drawn."""
    total = len(split) if split is not None else 0
    picks = range(total) if total <= n else (i * total // n for i in range(n))
    return [split[i] for i in picks]


def data_sources(cfg: RunConfig) -> list[str]:
    """The dataset specs evaluated while training: ``train.eval_datasets``, else the run's built-in
    source (its held-out split), else none."""
    if cfg.train.eval_datasets:
        return list(cfg.train.eval_datasets)
    return [cfg.data.source] if cfg.data.source in BUILTIN_SOURCES else []


def build_sets(cfg: RunConfig) -> list[EvalSet]:
    """The evaluation data, built once (rank 0); a dataset with nothing to evaluate for this
    objective, or two datasets whose result keys would collide, is a one-line error."""
    n, head = cfg.train.eval_samples, plan_for(cfg).zero_shot
    sets: list[EvalSet] = []
    for spec in data_sources(cfg):
        built = eval_data.build(spec, image_size=cfg.data.image_size, max_objects=cfg.data.max_objects,
                                seed=cfg.seed, test_samples=n, train_samples=n, sts_pairs=0,
                                run_keys=cfg.data.caption_keys())
        for data in built:
            test = _subset(data.splits.get("test"), n)
            labelled = test[0].labels if test else {}
            spaces = {k: v for k, v in data.label_kinds.items() if k in labelled}
            reference = _subset(data.splits.get("train"), n) if head is None else []
            s = EvalSet(data.name, test, reference, spaces, bool(data.retrieval and head is not None and test))
            if not (s.retrieval or (s.label_kinds and (head is not None or s.reference))):
                need = "labelled test and train images (k-NN)" if head is None else "class labels or captions"
                raise NclipError(f"train.eval_datasets: {spec} has nothing to evaluate while training "
                                 f"{cfg.objective.name}: it needs {need}")
            if any(other.name == s.name for other in sets):
                raise NclipError(f"train.eval_datasets: two datasets are named {s.name!r}; their "
                                 "eval/ keys would collide (rename a folder)")
            sets.append(s)
    return sets


@contextmanager
def untouched(model: torch.nn.Module):
    """Run the block without a trace on the training: every module's train/eval mode and the RNG
    states (torch, CUDA, NumPy, Python) as they were before it."""
    modes = [(m, m.training) for m in model.modules()]
    rngs = rng_state()
    try:
        yield
    finally:
        set_rng_state(rngs)
        for m, training in modes:
            m.training = training


class PeriodicEval:
    """The run's evaluation while training: when (:meth:`due`), on what (its :class:`EvalSet`\\ s,
    on rank 0) and the loop's hook (:meth:`at_step`)."""

    def __init__(self, cfg: RunConfig, device: torch.device, sets: list[EvalSet]):
        objective = plan_for(cfg)
        self.every, self.sets, self.device = cfg.train.eval_every, sets, device
        self.score = objective.zero_shot  # with the run's eval.nclip_score
        self.autocast = autocast_dtype(cfg.train.precision, device)  # the towers' precision in training
        self.image_size, self.batch_size = cfg.data.image_size, cfg.eval.batch_size
        self.probe_key = probe_output(cfg.eval.probe_features or objective.probe_features)

    @classmethod
    def for_run(cls, cfg: RunConfig, ctx) -> PeriodicEval | None:
        """The run's evaluation, or None when it has none (``train.eval_every`` 0, or no data). The
        data is built on rank 0 before the run writes anything; its failure is raised on every
        rank (one line), so that no rank waits for the others at a collective."""
        if not cfg.train.eval_every or not data_sources(cfg):
            return None
        sets, error = [], None
        if ctx.is_main:
            try:
                sets = build_sets(cfg)
            except NclipError as e:
                error = str(e)
        if ctx.distributed:
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error is not None:
            raise NclipError(error)
        return cls(cfg, ctx.device, sets)

    def due(self, step: int) -> bool:
        """Whether the step just taken (1-based, as logged) is evaluated; a pure function of the
        step, so that every rank and a resumed run agree."""
        return step % self.every == 0

    def at_step(self, info, learner) -> dict:
        """The hook of the training loop, on every rank at a :meth:`due` step: rank 0 evaluates the
        run's model (whole again under FSDP), the others wait. Returns rank 0's row entries (the
        ``eval/`` figures and ``eval_s``), {} on the other ranks. ``info``: the run's
        :class:`nclip.train.rundir.RunInfo`; ``learner``: its :class:`nclip.train.step.Learner`."""
        from nclip.train.launch import full_state_dict, is_fsdp

        start = time.perf_counter()
        row: dict = {}
        with untouched(learner.model):
            model = learner.model
            if is_fsdp(learner.module):  # the sharded model cannot run on one rank: gather it, a collective
                weights = full_state_dict(learner.module)
                model = _whole_model(info.cfg, weights, info.ctx.device) if info.ctx.is_main else None
            if info.ctx.is_main:
                row = self.evaluate(model)
                if learner.ema is not None:  # train.ema: the averaged weights beside the raw ones (not under FSDP)
                    with swapped_to_ema(model, learner.ema):
                        row.update(self.evaluate(model, prefix=f"ema/{PREFIX}"))
        if info.ctx.is_main:
            row["eval_s"] = time.perf_counter() - start
        if info.ctx.distributed:
            dist.barrier()  # the other ranks wait for rank 0 (the time stays in their samples_per_s window)
        return row

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, prefix: str = PREFIX) -> dict[str, float]:
        """``model``'s figures on every set, keyed ``<prefix>/<task>/<dataset>/<metric>``; leaves
        ``model`` in eval mode (:func:`untouched` puts the modes back)."""
        out: dict[str, float] = {}
        for s in self.sets:
            if self.score is None:
                out.update(self._knn(model, s, prefix))
                continue
            feats = extract(model, s.test, self.image_size, self.device, self.batch_size, texts=s.retrieval,
                            autocast=self.autocast)
            for kind, space in s.label_kinds.items():
                classes = class_text_outputs(model, space, self.device, self.score, self.autocast)
                metrics, _ = zeroshot.evaluate(zeroshot.scores(feats.image, classes, self.score),
                                               feats.labels[kind])
                out[f"{prefix}/zeroshot/{s.name}-{kind}/top1"] = metrics["top1"]
            if s.retrieval and feats.text:
                sim = similarity(feats.image, feats.text, self.score)
                for k, v in retrieval.evaluate(sim, feats.text_to_image, ks=(1, 5)).items():
                    out[f"{prefix}/retrieval/{s.name}/{k}"] = v
        return out

    def _knn(self, model, s: EvalSet, prefix: str) -> dict[str, float]:
        """Weighted k-NN top-1 per label kind on the probed features (image-only objectives)."""
        ref, test = (extract(model, samples, self.image_size, self.device, self.batch_size, texts=False,
                             autocast=self.autocast) for samples in (s.reference, s.test))
        key = self.probe_key
        return {f"{prefix}/knn/{s.name}-{kind}/top1":
                probe.knn(ref.image[key], ref.labels[kind], test.image[key], test.labels[kind], len(space))["top1"]
                for kind, space in s.label_kinds.items() if kind in ref.labels}


def _whole_model(cfg: RunConfig, weights: dict, device) -> torch.nn.Module:
    """The model rebuilt whole from the gathered FSDP weights (rank 0), as the final model is."""
    from nclip.models import build_model

    model = build_model(cfg, pretrained_text=False)
    model.load_state_dict({k[len("model."):]: v for k, v in weights.items() if k.startswith("model.")})
    return model.to(device)


def describe(cfg: RunConfig, periodic: PeriodicEval | None) -> str:
    """The start-up block's line: what is evaluated while training, and how often."""
    t = cfg.train
    if not t.eval_every:
        return "off (train.eval_every 0)"
    if not data_sources(cfg):
        return (f"off: data.source {cfg.data.source} has no built-in held-out data (set train.eval_datasets, "
                "as nclip eval --dataset)")
    score = plan_for(cfg).zero_shot
    tasks = "k-NN" if score is None else f"zero-shot and retrieval ({score.name} head)"
    names = ", ".join(data_sources(cfg))
    return f"every {t.eval_every} steps: {tasks} on {t.eval_samples} images of {names}"


def headline(row: dict, most: int = 3) -> list[tuple[str, float]]:
    """The evaluation's figures worth the progress line, (short key, value): the first top-1
    accuracies and retrieval's mean recall, without the ``eval/`` prefix and the ``/top1``."""
    ours = [(k[len(PREFIX) + 1:], v) for k, v in row.items() if k.startswith(PREFIX + "/")]
    recall = [(k, v) for k, v in ours if k.endswith("/mean_recall")][:1]
    top1 = [(k.removesuffix("/top1"), v) for k, v in ours if k.endswith("/top1")]
    return top1[:most - len(recall)] + recall
