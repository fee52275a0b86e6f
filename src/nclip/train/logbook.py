"""What a training run tells its user while it runs (rank 0): the start-up block, metrics.jsonl,
one line per log step (with ``--no-progress``) or the progress bar, the collapse monitor's
warnings, the figures of the evaluation while training (``train.eval_every``:
:mod:`nclip.train.periodic_eval`), RUN/curves.png (:mod:`nclip.train.curves_png`), and optionally the
same scalars in TensorBoard and W&B (``train.report_to``: :mod:`nclip.train.report_to`).

The start-up block and the log lines go to stderr, like the progress bar and the warnings: stdout
holds only the end-of-run summary, which scripts read.
"""

from __future__ import annotations

import json
import sys
import time

from tqdm.auto import tqdm

from nclip.jsonio import writing
from nclip.train.curves_png import CurvesPng
from nclip.train.monitors import CollapseMonitor
from nclip.train.periodic_eval import describe, headline
from nclip.train.report_to import reporters

METRICS = "metrics.jsonl"
# metrics.jsonl's wall-clock fields: they differ between runs of the same steps (resume tests drop them)
WALL_CLOCK = ("samples_per_s", "data_wait_s", "eval_s")  # eval_s: only on the rows of evaluated steps


def _count(module) -> str:
    """Parameters of a module, as "1.23M params"."""
    n = sum(p.numel() for p in module.parameters()) if module is not None else 0
    return f"{n / 1e6:.2f}M params" if n >= 1e4 else f"{n} params"


def _weights(objective_cfg) -> str:
    """The objective's named weights and settings: every field with a paper symbol (its ``title``,
    e.g. λ1, λ_CLIP), as the sweep tables name them."""
    fields = type(objective_cfg).model_fields
    shown = [f"{f.title}={getattr(objective_cfg, name)}" for name, f in fields.items() if f.title]
    return f" ({', '.join(shown)})" if shown else ""


def _tower(kind: str, cfg_section, module) -> str:
    size = ""
    if kind == "vit":
        size = f", width {cfg_section.width}, {cfg_section.layers} layers, patch {cfg_section.patch_size}"
    elif kind == "groupvit":
        size = (f", width {cfg_section.width}, depths {list(cfg_section.depths)}, groups "
                f"{list(cfg_section.output_groups)}, patch {cfg_section.patch_size}")
    elif kind in ("resnet", "convnet", "clip_resnet"):
        size = f", stages {list(cfg_section.hidden_sizes)}"
    elif kind == "transformer":
        size = f", width {cfg_section.width}, {cfg_section.layers} layers"
    elif kind == "pretrained":
        size = f", {cfg_section.path or 'bundled MiniLM'}"
    return f"{kind}{size} ({_count(module)})"


def _data(cfg, size: int | None) -> str:
    d = cfg.data
    where = {"csv": d.csv, "folder": d.folder, "webdataset": d.shards}.get(d.source)
    rows = f", {size} samples" if size is not None else " (streamed)" if d.source == "webdataset" else ""
    return f"{d.source}{f' {where}' if where else ''}{rows}, {d.image_size} px, {d.text_length} tokens"


def startup_block(info, model, data, periodic, preset: str | None) -> str:
    """What is about to be trained, printed before the first step: preset, objective and its
    weights, the towers with parameter counts, the data and its size, device and precision, steps,
    batch, evaluation while training (``periodic``) and the output folder. ``info``: the run's
    :class:`nclip.train.rundir.RunInfo`."""
    cfg, ctx = info.cfg, info.ctx
    t, m = cfg.train, cfg.model
    text = model.text if getattr(model, "uses_text", True) else None
    heads = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("vision.", "text.")))
    import torch

    from nclip.precision import autocast_dtype
    from nclip.train import threads

    dtype = autocast_dtype(t.precision, ctx.device)
    autocast = {torch.bfloat16: "bf16 autocast", torch.float16: "fp16 autocast, loss scaling"}.get(dtype, "fp32")
    precision = f"{t.precision} ({autocast}; objectives in fp32)"
    steps = f"{t.steps}" + (f" (from step {info.start})" if info.start else "")
    rows = [
        ("preset", preset or "(a config object)"),
        ("objective", f"{cfg.objective.name}{_weights(cfg.objective)}"),
        ("image tower", _tower(m.vision.kind, m.vision, model.vision)),
        ("text tower", _tower(m.text.kind, m.text, text) if text is not None else "none (no text-side head)"),
        *_lora(cfg, model),
        ("heads", f"{', '.join(sorted(model.heads))} ({heads / 1e6:.2f}M params)"),
        ("data", _data(cfg, getattr(data, "size", None)) + _gave_way(preset, cfg)),
        *_text(cfg, getattr(data, "text_counts", {})),
        ("device", f"{ctx.device}, {ctx.world_size} rank{'s' * (ctx.world_size > 1)}, {precision}"),
        ("threads", threads.describe(t.threads)),
        ("steps", f"{steps}, lr {t.lr:g} ({t.warmup_steps} warm-up, cosine to {t.min_lr:g}), log every "
                  f"{t.log_every}, checkpoint every {t.checkpoint_every}"),
        ("batch", f"{t.batch_size} {'pairs' if text is not None else 'images'} per step"
                  + (f" in {t.accumulation} micro-batches ({t.accumulation_mode})" if t.accumulation > 1 else "")),
        ("eval", describe(cfg, periodic)),
        ("output", str(info.run_dir)),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["nclip train"] + [f"  {k:<{width}}  {v}" for k, v in rows])


def _text(cfg, counts: dict) -> list[tuple[str, str]]:
    """The start-up block's row on an image's texts, where the run has several captions per image or
    hard negatives: which caption a step takes, the negatives' source and slots, and, for a CSV/JSONL
    file, how many of each its rows hold (``counts``: :attr:`nclip.data.loader.TrainData.text_counts`)."""
    d = cfg.data

    def spread(key: str) -> str:
        c = counts.get(key)
        return f", {c['min']}–{c['max']} per image (mean {c['mean']})" if c else ""

    several = d.caption_choice != "random" or (counts.get("captions") or {}).get("max", 1) > 1
    parts = [f"captions: {d.caption_choice}" + (f", {d.captions_per_image} slots" if d.captions_per_image else "")
             + spread("captions")] if several else []
    if d.hard_negatives == "swap":
        parts.append("hard negatives: a swap of the caption (1 slot)")
    elif d.hard_negative_key is not None:
        slots = f", {d.negatives_per_image} slots" if d.negatives_per_image else ""
        parts.append(f"hard negatives: {d.hard_negative_key!r}{slots}{spread('negatives')}")
    return [("texts", "; ".join(parts))] if parts else []


def _lora(cfg, model) -> list[tuple[str, str]]:
    """The LoRA row of the start-up block, when the run has one (nclip.models.lora)."""
    if cfg.model.lora is None:
        return []
    from nclip.models.lora import describe

    return [("lora", describe(model, cfg))]


def _gave_way(preset: str | None, cfg) -> str:
    """The preset's synthetic-scene settings set back for the run's own data source, if any
    (:func:`nclip.config_files.synthetic_settings_give_way`)."""
    from nclip.config import load_preset
    from nclip.config_files import gave_way
    from nclip.errors import NclipError

    try:
        changed = gave_way(load_preset(preset), cfg) if preset else []
    except NclipError:  # a config file that has gone since: nothing to compare with
        return ""
    return f" (the preset's synthetic-scene {', '.join(changed)} for {cfg.data.source})" if changed else ""


def main_terms(row: dict) -> list[str]:
    """The objective's terms worth a line: its losses (``*/loss``, ``*/L_*``), not its statistics."""
    return [k for k in row if "/" in k and (k.endswith("/loss") or k.rsplit("/", 1)[1].startswith("L_"))]


def step_line(row: dict, total: int) -> str:
    """One log step as one line: step, loss, the objective's main terms, lr, samples/s, data wait."""
    terms = "  ".join(f"{k} {row[k]:.4f}" for k in main_terms(row)[:8])
    wait = f"  data wait {row['data_wait_s'] * 1e3:.1f} ms/step" if "data_wait_s" in row else ""
    evals = "".join(f"  {k} {v:.3f}" for k, v in headline(row))
    took = f" (eval {row['eval_s']:.1f} s)" if "eval_s" in row else ""
    return (f"step {row['step']}/{total}  loss {row.get('loss', float('nan')):.4f}" + (f"  {terms}" if terms else "")
            + f"  lr {row['lr']:.3g}  {row['samples_per_s']:.0f} samples/s" + took + wait + evals)


class Log:
    """metrics.jsonl (rank 0), the collapse monitor's warnings, the progress bar or one line per log
    step, RUN/curves.png, and the scalars of ``train.report_to`` (rank 0)."""

    def __init__(self, info, data, counters: dict[str, int], progress: bool):
        # info: the run's nclip.train.rundir.RunInfo; data: its batches (their wait and size); counters:
        # the loop's skipped-step counters, read at each row
        self.info, self.data, self.counters = info, data, counters
        self.window_t, self.window_samples, self.last = time.perf_counter(), 0, {}
        self.last_eval: dict = {}  # the row of the last evaluation (train.eval_every), for the progress bar
        main, cfg, run_dir = info.ctx.is_main, info.cfg, info.run_dir
        self.lines = main and not progress  # --no-progress: a line per log step instead of the bar
        self.monitor = CollapseMonitor.for_run(cfg)
        self.bar = tqdm(total=cfg.train.steps, initial=info.start, unit="step",
                        disable=not (progress and main), dynamic_ncols=True)
        with writing(run_dir / METRICS):
            self.file = (run_dir / METRICS).open("a") if main else None
        self.reporters = reporters(run_dir, cfg, info.start > 0) if main else []  # train.report_to
        self.curves = (CurvesPng(run_dir, run_dir / METRICS, cfg.train.checkpoint_every,
                                 cfg.train.steps, info.start) if main and info.save else None)

    def step(self, done: int, result, evaluation: dict | None = None) -> None:
        """Count the step; write a row when the loop read one (``result``: its log steps, every
        ``train.log_every`` steps, the last, the step that stops a run and the evaluated steps),
        with ``evaluation``'s entries (``eval/...`` and ``eval_s``, rank 0) on it."""
        self.window_samples += self.info.cfg.train.batch_size
        if result is not None:
            self._write(done, result, evaluation or {})
        if self.curves is not None:
            self.curves.after_step(done, result is not None)
        self.bar.update(1)

    def _write(self, done: int, result, evaluation: dict) -> None:
        now = time.perf_counter()
        training_s = now - self.window_t - evaluation.get("eval_s", 0.0)  # samples/s of training only
        row = {"step": done, "lr": result.lr, **result.terms, "grad_norm": result.grad_norm,
               "nonfinite_steps": self.counters["nonfinite_total"], "data/skipped": result.skipped_samples,
               "samples_per_s": self.window_samples / max(training_s, 1e-9), **evaluation}
        if hasattr(self.data, "pop_wait"):  # this rank's host wait for its batches, per step
            waited, steps = self.data.pop_wait()
            row["data_wait_s"] = waited / max(steps, 1)
        if self.monitor is not None and self.info.ctx.is_main:
            for warning in self.monitor.update(done, row):
                row.setdefault("monitor/warnings", []).append(warning)
                tqdm.write(f"nclip: warning: {warning}", file=sys.stderr)
        if self.file is not None:
            with writing(self.file.name):
                self.file.write(json.dumps(row) + "\n")
                self.file.flush()
        for reporter in self.reporters:  # the same scalars as metrics.jsonl, at the same step
            reporter.log(row, done)
        if self.lines:
            print(step_line(row, self.info.cfg.train.steps), file=sys.stderr, flush=True)
        self.window_t, self.window_samples, self.last = now, 0, row
        wait = {"data_wait_ms": f"{row['data_wait_s'] * 1e3:.1f}"} if "data_wait_s" in row else {}
        if "eval_s" in row:
            self.last_eval = row
        shown = headline(self.last_eval)[:1]  # the last evaluation's headline stays on the bar
        evals = {"eval": f"{shown[0][1]:.3f}"} if shown else {}
        self.bar.set_postfix(loss=f"{row.get('loss', float('nan')):.3f}", samples_s=f"{row['samples_per_s']:.0f}",
                             **wait, **evals, refresh=False)

    def close(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
            except OSError:  # the flush of a row that failed to write: already said
                pass
        if self.curves is not None:
            self.curves.close()
        for reporter in self.reporters:
            reporter.close()
        self.bar.close()
