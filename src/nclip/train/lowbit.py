"""``train.optimizer: adamw8bit``: AdamW whose two moments are stored in 8 bits.

What it is for: xCLIP's two nCLIP heads (ViT-B/16 → 4096 → 32768, about 275 M parameters) carry
16 bytes per parameter in float32 training -- weights 4, gradients 4, AdamW's first and second
moments 4 + 4 -- about 4.4 GB, most of xCLIP's memory over CLIP (docs/performance.md). Storing the
moments block-wise quantised in 8 bits (one uint8 code per value and one float32 scale per block
of 256: about 2.03 bytes for both moments instead of 8) saves about 6 bytes per parameter.

The update is torchao's ``AdamW8bit`` (Dettmers et al., "8-bit Optimizers via Block-wise
Quantization"; dynamic-tree quantisation maps), not ours: the moments are dequantised to float32,
updated with AdamW's equations, and requantised, in a ``torch.compile``-d kernel per parameter
shape (the first step compiles, about a second per distinct shape; on the CPU Inductor needs a C++
compiler). Tensors under 4,096 values (biases, norms, the logit scale) keep float32 moments. The
weights, gradients, the objective and its float32 arithmetic are unchanged.

Checkpoints hold the 8-bit state as it is (torchao's state tensors load with
``torch.load(weights_only=True)``), so resume stays exact. Not with ``train.strategy: fsdp``,
which shards the full optimizer state already (the config refuses the pair).

Skipped steps without a host read: torchao's ``step`` updates every parameter unconditionally, so
the gate (:mod:`nclip.train.gate`) would have to read its skip flag on the host every step. nclip's
subclass takes the flag on the device instead, through the attributes torch's fused optimizers read
(``found_inf``, and ``grad_scale`` under ``train.precision: fp16``): the same equations, compiled
per shape as torchao does, end in ``torch.where(skip, old, new)`` on the parameter, on the 8-bit
codes and block scales of each moment, and on the step count. A skipped step leaves every bit as it
was, at no memory cost (the selects are fused into the update's kernels; no copy of the state is
kept), and the step queues without waiting for the device.
"""

from __future__ import annotations

import functools
import warnings

import torch

from nclip.config import TrainConfig


def adamw8bit(groups: list[dict], cfg: TrainConfig) -> torch.optim.Optimizer:
    """torchao's AdamW8bit over ``groups`` (nclip.train.optim.param_groups: per-group weight decay)
    with the run's betas and eps, its update gated on the device (:func:`gated_adamw8bit`)."""
    return gated_adamw8bit()(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


@functools.cache
def gated_adamw8bit() -> type:
    """torchao's ``AdamW8bit`` whose step reads ``found_inf`` (skip where nonzero) and ``grad_scale``
    (divide the gradients by it) from the optimizer, as torch's fused optimizers do. A class made on
    first use: torchao is an optional dependency."""
    AdamW8bit = _import_adamw8bit()
    from torchao.optim.subclass_8bit import OptimState8bit

    class GatedAdamW8bit(AdamW8bit):
        reads_found_inf = True  # nclip.train.gate: the skip flag goes in on the device

        @torch.no_grad()
        def step(self, closure=None):
            """torchao's ``_AdamBase.step`` (AdamW, no amsgrad, float32 parameters) with every write gated."""
            if closure is not None:
                raise ValueError("GatedAdamW8bit takes no closure")
            skip, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
            update = _compiled_update()
            # as torchao: a fixed number of argument combinations per model, compiled once each
            with torch._dynamo.utils.disable_cache_limit():
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is None:
                            continue
                        state = self._state_of(p, group)
                        if skip is None:
                            skip = torch.zeros((), device=p.device)
                        update(p.detach(), p.grad, state["step"], _parts(state["exp_avg"], OptimState8bit),
                               _parts(state["exp_avg_sq"], OptimState8bit), group["lr"], group["betas"][0],
                               group["betas"][1], group["weight_decay"], group["eps"], skip, grad_scale)

        def _state_of(self, p: torch.Tensor, group: dict) -> dict:
            if group.get("amsgrad") or p.dtype != torch.float32:
                raise ValueError("GatedAdamW8bit updates float32 parameters without amsgrad")
            state = self.state[p]
            if not state:  # torchao's initial state, with the step count on the parameter's device
                state["step"] = torch.zeros((), device=p.device)
                state["exp_avg"] = self._new_buffer(p, True)
                state["exp_avg_sq"] = self._new_buffer(p, False)
            elif state["step"].device != p.device:  # loaded from a checkpoint (on the CPU): once
                state["step"] = state["step"].to(p.device)
            return state

    return GatedAdamW8bit


def _parts(moment: torch.Tensor, quantised: type):
    """A moment as the compiled update takes it: the float32 tensor, or an 8-bit one's
    (codes, block scales, code map) -- plain tensors, written in place."""
    return (moment.codes, moment.scale, moment.qmap) if isinstance(moment, quantised) else moment


@functools.cache
def _compiled_update():
    return torch.compile(_gated_update, fullgraph=True, dynamic=False)


def _gated_update(p, grad, step, exp_avg, exp_avg_sq, lr, beta1: float, beta2: float, weight_decay: float,
                  eps: float, skip, grad_scale) -> None:
    """torchao's ``single_param_adam`` (AdamW; Loshchilov & Hutter, Alg. 2; Dettmers et al.'s 8-bit
    moments), every write a select on ``skip``: a skipped step writes back what it read."""
    keep = skip > 0
    step.add_(1 - keep.float())  # the count of taken steps
    grad_f32 = grad.float() if grad_scale is None else grad.float() / grad_scale
    p_f32 = p.float()
    p_f32 = p_f32 - lr * weight_decay * p_f32  # decoupled weight decay
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    # the moments in float32 for the update; stored rounded to 8 bits (torchao keeps the same split)
    exp_avg_f32 = _load(exp_avg).lerp(grad_f32, 1 - beta1)
    exp_avg_sq_f32 = _load(exp_avg_sq).lerp(grad_f32.square(), 1 - beta2)
    _store(exp_avg, exp_avg_f32, keep)
    _store(exp_avg_sq, exp_avg_sq_f32, keep)
    denom = (exp_avg_sq_f32.sqrt() / bias_correction2.sqrt()) + eps
    p_f32 = p_f32 - lr * (exp_avg_f32 / bias_correction1) / denom
    p.copy_(torch.where(keep, p, p_f32))


def _load(moment) -> torch.Tensor:
    from torchao.optim.quant_utils import dequant_with_qmap

    if isinstance(moment, tuple):
        codes, scale, qmap = moment
        return dequant_with_qmap(codes, qmap, scale)
    return moment.float()


def _store(moment, value: torch.Tensor, keep: torch.Tensor) -> None:
    """``moment`` = ``value`` unless ``keep``; an 8-bit moment is quantised as torchao's ``copy_`` does
    (block-wise absmax scale, nearest code of the dynamic map) and its codes and scales are selected."""
    from torchao.optim.quant_utils import quantize_8bit_with_qmap, scale_tensor

    if isinstance(moment, tuple):
        codes, scale, qmap = moment
        scaled, new_scale = scale_tensor(value, codes.numel() // scale.numel())
        codes.copy_(torch.where(keep, codes, quantize_8bit_with_qmap(scaled, qmap)))
        scale.copy_(torch.where(keep, scale, new_scale))
    else:
        moment.copy_(torch.where(keep, moment, value))


def _import_adamw8bit():
    # torch warns that torchao's state tensors define no cache key for compiled autograd (nclip's
    # logger levels set in nclip/__init__.py quiet torchao's own import warnings)
    warnings.filterwarnings("ignore", message=".*_stable_hash_for_caching.*")
    from torchao.optim import AdamW8bit

    return AdamW8bit
