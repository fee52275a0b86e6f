"""The rows of ``nclip bench``, in stages (:data:`STAGES`, and :data:`COMPARE` for ``--compare``): a
stage is a function that adds its rows to the :class:`~nclip.bench.context.Bench`, the names of those
rows for when it is skipped, and an estimate of its seconds. What each row measures:
:mod:`nclip.bench.runner`'s docstring. A new row: one function ``_stage_x(b)`` and one line in
:data:`STAGES`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

from nclip.bench.context import Bench, OutOfBudget, Stage, models_seconds
from nclip.errors import NclipError


def _objective_step(b: Bench, name: str, extra: tuple[str, ...] = (), what: str | None = None) -> dict:
    """One objective's step time and peak memory (with ``extra`` overrides), measured in a subprocess
    of its own (:mod:`nclip.bench.objective_cost`); ``what`` names it in messages."""
    what = what or name
    arg = json.dumps({"preset": b.preset, "overrides": [*b.overrides, *extra], "objective": name,
                      "steps": b.sizes.objective_steps, "warmup": b.sizes.objective_warmup,
                      "repeats": b.sizes.objective_repeats, "deadline": b.budget.wall_deadline()})
    left, t0 = b.budget.left(), time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-m", "nclip.bench.objective_cost", arg], capture_output=True,
                             text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                             timeout=left if math.isfinite(left) else None)
    except subprocess.TimeoutExpired:
        raise OutOfBudget(f"skipped: the {b.budget.limit_s:.0f} s budget ran out in the {what} step") from None
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise NclipError(f"bench: the {what} step failed: {last}")
    run = json.loads(out.stdout.strip().splitlines()[-1])
    run["process_s"] = time.perf_counter() - t0 - run["run_s"]  # start and imports
    b.add_child_models(run)
    b.log(f"bench: {what} step {run['step_s']:.4f} s ({len(run['windows_s'])} windows)")
    return run


def _stage_objectives(b: Bench) -> None:
    """Each objective's step time and peak memory: one subprocess per objective."""
    runs = {name: _objective_step(b, name) for name in ("clip", "xclip")}
    b.costs = runs
    clip, xclip = runs["clip"], runs["xclip"]
    b.headline["xclip_over_clip_time"] = xclip["step_s"] / clip["step_s"]
    b.headline["xclip_over_clip_memory"] = xclip["peak_mib"] / max(clip["peak_mib"], 1e-9)
    b.rep.add("xclip / clip step time", b.headline["xclip_over_clip_time"],
              f"clip {clip['step_s']:.4f} s, xclip {xclip['step_s']:.4f} s (paper: 1.3x)")
    b.rep.add("xclip / clip peak memory", b.headline["xclip_over_clip_memory"],
              f"clip {clip['peak_mib']:.1f} MiB, xclip {xclip['peak_mib']:.1f} MiB (paper: 1.27x)")
    b.details["objectives"] = runs


LORA_ROWS = ("lora / full step time", "lora / full peak memory")
LORA_RANK = 8  # the bench's adapter where the run sets none (peft's default rank)


def _stage_lora(b: Bench) -> None:
    """CLIP's step with LoRA on the towers (the run's model.lora, else rank 8 on the default targets)
    against full training of the same model, each in its own subprocess; the full side is the CLIP
    objective row's where the run has no LoRA of its own."""
    import importlib.util

    from nclip.models.lora import DEFAULT_TARGETS

    lora = b.cfg.model.lora
    if importlib.util.find_spec("peft") is None:
        raise OutOfBudget("skipped: peft is not installed (pip install 'nclip[lora]')")
    if lora is None and not DEFAULT_TARGETS[b.cfg.model.vision.kind]:
        raise OutOfBudget(f"skipped: LoRA has no default targets in a {b.cfg.model.vision.kind} image tower")
    full = b.costs.get("clip") if b.costs and lora is None else None
    if full is None:
        full = _objective_step(b, "clip", ("model.lora=null",), "clip (full)")
    adapted = _objective_step(b, "clip", () if lora else (f"model.lora.rank={LORA_RANK}",), "clip (LoRA)")
    rank = lora.rank if lora else LORA_RANK
    time_ratio, memory_ratio = adapted["step_s"] / full["step_s"], adapted["peak_mib"] / max(full["peak_mib"], 1e-9)
    b.headline.update(lora_over_full_time=time_ratio, lora_over_full_memory=memory_ratio)
    trained = f"{adapted['trained_m']:.3f}M of {adapted['params_m']:.2f}M params trained, rank {rank}"
    b.rep.add(LORA_ROWS[0], time_ratio, f"full {full['step_s']:.4f} s, lora {adapted['step_s']:.4f} s; {trained}")
    b.rep.add(LORA_ROWS[1], memory_ratio, f"full {full['peak_mib']:.1f} MiB, lora {adapted['peak_mib']:.1f} MiB "
              f"({'allocated' if adapted['device'] == 'cuda' else 'peak RSS growth'})")
    b.details["lora"] = {"full": full, "lora": adapted}


def _lora_estimate(b: Bench) -> float | None:
    """One CLIP subprocess (two where the run has LoRA of its own), as long as the CLIP row's took."""
    clip = (b.costs or {}).get("clip")
    return None if clip is None else (1 + (b.cfg.model.lora is not None)) * (clip["process_s"] + clip["run_s"])


def _stage_loop(b: Bench) -> None:
    from nclip.bench import loop_overhead

    loop = loop_overhead.trainer_over_hand(b.cfg, repeats=b.sizes.loop_repeats, window_s=b.sizes.loop_window_s,
                                           deadline=b.budget.deadline(), keep_hand=True, count_flops=True)
    b.hand = loop.pop("hand")
    if b.cfg.train.compile:  # the hand loop's warm-up window less its steps: a compilation and autotune
        b.compile_s = max(0.0, b.hand.start_s - b.hand.warmup * loop["hand_step_s"])
    b.loop = loop
    b.add_ratio("trainer_over_hand_loop", "trainer / hand loop speed", loop,
                f"{loop['clock']} time; step {loop['hand_step_s'] * 1e3:.1f} ms hand, "
                f"{loop['trainer_step_s'] * 1e3:.1f} ms trainer (wall); {loop['steps']} steps x {loop['repeats']}",
                "loop")


def _stage_mfu(b: Bench) -> None:
    from nclip.bench import parts
    from nclip.precision import autocast_dtype

    if b.loop is None:
        raise OutOfBudget("skipped: needs the trainer / hand loop row, which did not run")
    flops = b.loop["flops"]
    peak = parts.device_peak(b.device, autocast_dtype(b.cfg.train.precision, b.device))
    achieved = flops / b.loop["trainer_step_s"]
    b.headline["mfu"] = achieved / peak["peak_flops"]
    b.rep.add("MFU", b.headline["mfu"], f"{flops / 1e9:.2f} GFLOP/step, {achieved / 1e12:.4f} TFLOP/s over "
              f"{peak['peak_flops'] / 1e12:.3f} ({peak['source']})")
    b.details.update(flops_per_step=flops, peak=peak)


def _stage_train_path(b: Bench) -> None:
    from nclip.bench.train_path import train_path_over_hand

    steps = b.loop["steps"] if b.loop else 5
    r = train_path_over_hand(b.cfg, steps=steps, repeats=b.sizes.loop_repeats, hand=b.hand)
    b.hand = None  # the trainer row's model: not needed after this row
    b.add_ratio("train_path_over_hand_loop", "nclip train path / hand loop samples/s", r,
                f"{r['train_samples_per_s']:.1f} vs {r['hand_samples_per_s']:.1f} samples/s (wall), real loader with "
                f"data.num_workers={r['num_workers']}; {r['steps']} steps x {len(r['train_windows'])} (target 0.97)",
                "train_path")


def _stage_data(b: Bench) -> None:
    from nclip.bench import parts

    data = {s: parts.data_rate(s, n) for s, n in ((64, b.sizes.data_64), (224, b.sizes.data_224))}
    for s, d in data.items():
        b.rep.add(f"data {s} px samples/s/core", d["samples_per_s_per_core"],
                  f"{d['over_target']:.2f}x the {parts.DATA_TARGET:.0f}/s target (CPU time, {d['samples']} samples)")
    b.details["data"] = data


def _stage_loader(b: Bench) -> None:
    from nclip.bench.loader_rate import loader_over_generator, views_over_one  # rates per worker, same config

    feed = loader_over_generator(b.cfg, b.sizes.data_64, workers=1)
    b.rep.add("generator / loader per worker", feed["ratio"],
              f"generator {feed['generator_samples_per_s_per_core']:.0f}/s/core, loader "
              f"{feed['samples_per_s_per_worker']:.0f}/s per worker (CPU time; target <= 1.5)")
    b.details["loader"] = feed
    views = b.details["loader_views"] = views_over_one(b.cfg, b.sizes.data_224, workers=1)  # 224 px
    b.rep.add("one / two views loader per worker", views["ratio"], views["detail"])


def _stage_kmeans(b: Bench) -> None:
    from nclip.bench import parts

    n, k, iters = b.sizes.kmeans
    km = parts.kmeans_and_pbt(n, k, iters=iters)
    b.rep.add("K-Means s", km["kmeans_s"], f"{n} x 128 -> {k}, {iters} iterations, {km['method']}; "
              f"{b.sizes.kmeans_note}")
    b.rep.add("PBT s", km["pbt_s"],
              f"same scale; Algorithm 1's loop over clusters ~{km['pbt_loop_over_pbt']:.0f}x slower")
    b.details.update(kmeans_pbt=km, kmeans_scale=b.sizes.kmeans_note)


def _stage_eval(b: Bench) -> None:
    from nclip.bench import parts

    ev = parts.eval_rate(b.cfg, b.sizes.eval_images, b.device)
    b.rep.add("eval features images/s", ev["images_per_s"], f"{ev['images']} images, batch {ev['batch_size']}")
    b.details["eval"] = ev
    from nclip.bench.embed_rate import embed_over_forward

    r = b.details["embed"] = embed_over_forward(b.cfg, b.sizes.eval_images, b.device)
    b.rep.add("embed images/s / bare forward", r["ratio"], r["detail"])


OPEN_CLIP_ROW = "nclip clip / open_clip samples/s (same towers)"


def _stage_open_clip(b: Bench) -> None:
    import importlib.util

    if importlib.util.find_spec("open_clip") is None:
        b.details["open_clip"] = None
        b.rep.skip(OPEN_CLIP_ROW, "skipped: open_clip not installed")
        b.log("bench: --compare open_clip skipped: open_clip is not installed")
        return
    from nclip.bench.objective_cost import config_with_objective
    from nclip.bench.open_clip_step import nclip_over_open_clip, open_clip_towers

    cfg = config_with_objective(b.preset, b.overrides, "clip")
    towers = open_clip_towers(cfg)
    if isinstance(towers, str):
        b.details["open_clip"] = None
        b.rep.skip(OPEN_CLIP_ROW, f"skipped: {towers}")
        b.log(f"bench: --compare open_clip skipped: {towers}")
        return
    r = nclip_over_open_clip(cfg, towers, repeats=b.sizes.loop_repeats, window_s=b.sizes.loop_window_s,
                             deadline=b.budget.deadline())
    b.add_ratio("nclip_over_open_clip", OPEN_CLIP_ROW, r,
                f"nclip {r['nclip_samples_per_s']:.1f}, open_clip {r['open_clip_samples_per_s']:.1f} samples/s at "
                f"batch {r['batch_size']} ({r['clock']} time; nclip's CLIP trainer step, both on the run's ViT and "
                f"text transformer, {cfg.data.image_size} px; target 1.1)", "open_clip")


BATCH_ROWS = {"none": "largest batch (plain)", "grad checkpointing": "largest batch (grad checkpointing)",
              "exact accumulation": "largest batch (exact accumulation)"}


def _memory_points(b: Bench) -> tuple[list, int]:
    from nclip.bench.batch_memory import plan

    n = b.cfg.train.batch_size
    sizes = b.sizes.mem_batches or tuple(sorted({max(1, n // 4), max(2, n // 2), n}))
    m0 = b.sizes.mem_micro or max(1, n // 8)
    return plan(sizes, m0, b.sizes.mem_ks), m0


def _stage_batch_memory(b: Bench) -> None:
    """The largest global batch under a memory limit per setting: a linear fit of measured steps."""
    from nclip.bench import batch_memory as bm

    points, m0 = _memory_points(b)
    limit, source = bm.limit_bytes(b.device, b.memory_gib)
    left = b.budget.left()
    try:
        measured, models = bm.run(b.preset, b.overrides, b.device, points, left if math.isfinite(left) else None)
    except subprocess.TimeoutExpired:
        raise OutOfBudget(f"skipped: the {b.budget.limit_s:.0f} s budget ran out in the memory steps") from None
    b.add_child_models(models)
    fits = bm.largest_batches(measured, m0, limit)
    mib, gib = 2**20, 2**30
    for setting, row in BATCH_ROWS.items():
        f = fits[setting]
        at = ",".join(str(n) for n, _, _ in f["points"])
        if f["batch"] is None:
            b.rep.skip(row, f"no figure: the measured peak does not grow with the batch (steps at B={at})")
            continue
        if setting == "exact accumulation":
            how = (f"micro-batch {f['micro']} (k={f['batch'] // max(f['micro'], 1)}): "
                   f"{f['per_sample'] / mib:.4f} MiB/sample of the batch + {f['tower_per_sample'] / mib:.4f} "
                   f"of the micro-batch + {f['fixed'] / gib:.3f} GiB; steps at micro {m0}, B={at}")
        else:
            how = f"{f['b'] / mib:.4f} MiB/sample + {f['a'] / gib:.3f} GiB fixed; steps at B={at}"
        b.rep.add(row, f["batch"], f"{how} (residual {f['residual']:.1%}); under {source}; "
                  "a linear fit of measured steps, not a run at that batch")
    b.details["batch_memory"] = {"limit_bytes": limit, "limit": source, "fits": fits, "micro": m0,
                                 "memory": "allocated (CUDA)" if b.device.type == "cuda" else "peak RSS growth"}


PATCH_ROWS = ("trainer samples/s at patch dropout 0", "patch dropout 0.5 / 0 samples/s",
              "patch dropout 0.75 / 0 samples/s")


def _stage_patch_dropout(b: Bench) -> None:
    from nclip.bench.loop_overhead import steps_for
    from nclip.bench.patch_dropout_rate import samples_per_s

    if b.cfg.model.vision.kind != "vit":
        why = f"skipped: patch dropout needs a ViT tower (model.vision.kind is {b.cfg.model.vision.kind})"
        for row in PATCH_ROWS:
            b.rep.skip(row, why)
        b.details["patch_dropout"] = None
        return
    c = b.step_costs()
    steps = steps_for(b.loop["trainer_step_s"] if b.loop else (c.step_s if c else 0.05), b.sizes.loop_window_s)
    r = samples_per_s(b.cfg, steps, b.sizes.loop_repeats, deadline=b.budget.deadline())
    rate = r["samples_per_s"]
    where = f"batch {r['batch_size']}, {r['clock']} time, {r['steps']} steps x {r['repeats']}"
    b.rep.add(PATCH_ROWS[0], rate[0.0], f"samples/s at p = 0; {where}")
    for row, p in zip(PATCH_ROWS[1:], (0.5, 0.75)):
        target = " (GPU target at ViT-B/16: 1.6)" if p == 0.5 else ""
        b.rep.add(row, r["over_p0"][p], f"{rate[p]:.1f} vs {rate[0.0]:.1f} samples/s{target}; {where}")
    b.details["patch_dropout"] = r


def _memory_estimate(b: Bench) -> float | None:
    """Every memory point: a copy of its model (built once per model config: in the subprocess on the
    CPU, where this process has none on CUDA), compiled with ``train.compile``, a first and a second
    step at its batch (a step's cost scaled by the batch), one discarded point, and on the CPU the
    subprocess's start (as long as an objective subprocess's start and imports took)."""
    from nclip.bench.batch_memory import point_config
    from nclip.bench.shared_models import model_key

    c = b.step_costs()
    if c is None:
        return None
    points, _ = _memory_points(b)
    keys = {model_key(point_config(b.preset, b.overrides, *p)) for p in points}
    builds = len(keys) if b.device.type != "cuda" else sum(k not in b.models.templates for k in keys)
    runs = [points[0], *points]
    scale = sum(max(1.0, n / b.cfg.train.batch_size) for _, n, _ in runs)
    start = 0 if b.device.type == "cuda" else max(r["process_s"] for r in b.costs.values())
    # compile_s is 0 without train.compile
    return start + builds * c.build_s + len(runs) * (c.copy_s + c.compile_s) + (c.first_s + c.step_s) * scale


STAGES = [
    Stage("objectives", ("xclip / clip step time", "xclip / clip peak memory"), _stage_objectives),
    Stage("lora", LORA_ROWS, _stage_lora, _lora_estimate),
    Stage("loop", ("trainer / hand loop speed",), _stage_loop, lambda b: models_seconds(b, 2, 2)),
    Stage("mfu", ("MFU",), _stage_mfu),
    Stage("train_path", ("nclip train path / hand loop samples/s",), _stage_train_path,
          lambda b: models_seconds(b, 1, 3)),
    Stage("data", ("data 64 px samples/s/core", "data 224 px samples/s/core"), _stage_data),
    Stage("loader", ("generator / loader per worker", "one / two views loader per worker"), _stage_loader),
    Stage("kmeans", ("K-Means s", "PBT s"), _stage_kmeans),
    Stage("eval", ("eval features images/s", "embed images/s / bare forward"), _stage_eval,
          lambda b: models_seconds(b, 2, 0)),
    Stage("batch_memory", tuple(BATCH_ROWS.values()), _stage_batch_memory, _memory_estimate),
    Stage("patch_dropout", PATCH_ROWS, _stage_patch_dropout,
          lambda b: models_seconds(b, 1, 3) if b.cfg.model.vision.kind == "vit" else 0.0),  # else skipped at once
]


def _open_clip_estimate(b: Bench) -> float | None:
    """nclip's CLIP model (another config than the run's) and OpenCLIP's (a build, never compiled)."""
    from nclip.bench.objective_cost import config_with_objective

    ours = models_seconds(b, 1, 2, cfg=config_with_objective(b.preset, b.overrides, "clip"))
    return None if ours is None else ours + models_seconds(b, 1, 2, builds=1, compiled=False)


COMPARE = {"open_clip": Stage("open_clip", (OPEN_CLIP_ROW,), _stage_open_clip, _open_clip_estimate)}
