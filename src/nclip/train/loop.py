"""The training loop: config → data + model → objective → optimizer steps → checkpoints → eval.

The loop never knows which objective it runs: it gets a loss and a dict of named terms, logs
them, and steps. One optimizer step consumes one global batch (``train.batch_size`` pairs), split
into ``train.accumulation`` micro-batches; each micro-batch is its own contrastive batch.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from nclip.config import RunConfig, to_yaml
from nclip.data.loader import train_loader
from nclip.errors import NclipError
from nclip.models import build_model
from nclip.models.io import save_model
from nclip.objectives import build_objective
from nclip.train.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from nclip.train.optim import build_optimizer, lr_at

MAX_NONFINITE_IN_A_ROW = 10


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    metrics: dict = field(default_factory=dict)  # last logged metrics
    eval: dict = field(default_factory=dict)


def pick_device(cfg: RunConfig) -> torch.device:
    want = cfg.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise NclipError("train.device is 'cuda' but no CUDA device is available")
    return torch.device("cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu")


def autocast_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype | None:
    if cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def train(cfg: RunConfig, run_dir: str | Path, resume: bool = False, progress: bool = True,
          evaluate: bool = True) -> RunResult:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg)
    amp = autocast_dtype(cfg, device)

    model = build_model(cfg).to(device)
    objective = build_objective(cfg.objective).to(device)
    optimizer = build_optimizer([model, objective], cfg.train)

    start, nonfinite_total = 0, 0
    metrics_path = run_dir / "metrics.jsonl"
    if resume and (ckpts := list_checkpoints(run_dir)):
        state = load_checkpoint(ckpts[-1], model, objective, optimizer)
        start, nonfinite_total = int(state["step"]), int(state.get("nonfinite_total", 0))
        _truncate_metrics(metrics_path, start)
    elif metrics_path.exists():
        metrics_path.unlink()
    if start >= cfg.train.steps:
        raise NclipError(f"{run_dir} has already finished its {cfg.train.steps} steps")

    loader = train_loader(cfg, model.tokenizer, start_step=start)
    accum = cfg.train.accumulation
    bar = tqdm(total=cfg.train.steps, initial=start, unit="step", disable=not progress, dynamic_ncols=True)
    window_t, window_samples, nonfinite_row, last = time.perf_counter(), 0, 0, {}
    model.train()
    objective.train()
    with metrics_path.open("a") as log:
        for step, (pixels, ids, mask) in enumerate(loader, start=start):
            lr = lr_at(step, cfg.train)
            for group in optimizer.param_groups:
                group["lr"] = lr
            terms_sum: dict[str, float] = {}
            finite = True
            for p_mb, i_mb, m_mb in zip(pixels.chunk(accum), ids.chunk(accum), mask.chunk(accum)):
                with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                    out = model(p_mb.to(device, non_blocking=True), i_mb.to(device), m_mb.to(device))
                terms = objective(out)
                loss = terms["loss"]
                if not torch.isfinite(loss):
                    finite = False
                    break
                (loss / accum).backward()
                for k, v in terms.items():
                    terms_sum[k] = terms_sum.get(k, 0.0) + float(v.detach()) / accum
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for g in optimizer.param_groups for p in g["params"]],
                cfg.train.grad_clip if cfg.train.grad_clip else math.inf,
            )
            if finite and torch.isfinite(grad_norm):
                optimizer.step()
                nonfinite_row = 0
            else:  # skip the step, keep the weights; give up after too many in a row
                nonfinite_total += 1
                nonfinite_row += 1
                if nonfinite_row >= MAX_NONFINITE_IN_A_ROW:
                    raise NclipError(
                        f"{nonfinite_row} steps in a row had a non-finite loss or gradient (step {step + 1}); "
                        f"the last good checkpoint is kept in {run_dir / 'checkpoints'}"
                    )
            optimizer.zero_grad(set_to_none=True)

            done = step + 1
            window_samples += pixels.shape[0]
            if done % cfg.train.log_every == 0 or done == cfg.train.steps:
                now = time.perf_counter()
                last = {
                    "step": done,
                    "lr": lr,
                    **terms_sum,
                    "logit_scale": float(model.scale().detach()),
                    "grad_norm": float(grad_norm),
                    "nonfinite_steps": nonfinite_total,
                    "samples_per_s": window_samples / max(now - window_t, 1e-9),
                }
                log.write(json.dumps(last) + "\n")
                log.flush()
                window_t, window_samples = now, 0
                bar.set_postfix(loss=f"{last.get('loss', float('nan')):.3f}",
                                samples_s=f"{last['samples_per_s']:.0f}", refresh=False)
            if done % cfg.train.checkpoint_every == 0 or done == cfg.train.steps:
                save_checkpoint(run_dir, done, model, objective, optimizer,
                                {"nonfinite_total": nonfinite_total}, cfg.train.keep_checkpoints)
            bar.update(1)
    bar.close()

    model.eval()
    save_model(model, cfg, run_dir / "model")
    result = RunResult(run_dir, cfg.train.steps, metrics=last)
    if evaluate:
        from nclip.eval.quick import evaluate_run

        result.eval = evaluate_run(model, cfg, device)
        (run_dir / "eval.json").write_text(json.dumps(result.eval, indent=2, sort_keys=True))
    return result


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop log lines written after the checkpoint we resume from (they will be written again)."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))
