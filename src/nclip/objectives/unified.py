"""The unified non-contrastive objective of Appendix A (its Algorithm 1) as a trainer objective.

Algorithm 1 (xCLIP paper, Appendix A; Algorithm 2 in the main-text appendix) casts the
non-contrastive objectives of visual SSL as one cross-entropy between a target p and a prediction q
of the other modality, with two knobs for *sharpness* (the temperature ratio τ/τ_s, λ1·L_EH) and two
for *smoothness* (an explicit ``uniform(·)`` of the target, λ2·L_HE):

    p = uniform(softmax(f / τ_s)),  q = softmax(f / τ)
    L = (L_CE + λ1·L_EH − λ2·L_HE) / 2   (terms summed over the two modalities)

The formulas live in :func:`nclip.objectives.functional.unified_terms`; this module holds the DINO
centering state (running mean and running variance of each modality's logits, and the learnable
scale parameters of App. A) and logs the terms.

Tab. A1 rows as config overrides (:data:`TABLE_A1_SETTINGS`; ZS/LN: the paper's top-1 zero-shot
and linear-probing accuracy, ViT-B/16 on CC12M, 25 epochs):

    ============  =========  ====  ==============  ====  =====  =====
    row           τ / τ_s    λ1    uniform(·)      λ2    ZS     LN
    ============  =========  ====  ==============  ====  =====  =====
    CE            1          0     none            0     NaN
    SwAV          1 / 0.25   0     sinkhorn        1*    27.9   70.3
    SCSF          1 / 0.5    0     batch_softmax   0     26.5   70.0
    DINO          1 / 0.7    0     centering†      0     22.9   69.1
    MSN           1 / 0.8    0     none            1     NaN
    MSN_0.7       1 / 0.7    0     none            1     37.4   70.8
    nCLIP_0.8     1 / 0.8    0.2   none            1.2   37.4   70.0
    nCLIP         1          0.5   none            1.5   37.5   71.0
    ============  =========  ====  ==============  ====  =====  =====

    * SwAV's original λ2 is 0; the paper needs λ2 = 1 to avoid collapse (so L_HE must carry a
      gradient: see ``stop_grad_target`` below). † centering is applied to the logits before the
      softmax, with a running variance and scale parameters in addition to DINO's running mean
      (App. A: "For Centering, we use additional running variance and scale parameters to uniform
      the target probability"): p = softmax(γ ⊙ (f − μ) / sqrt(v + ε) / τ_s).

The appendix's table prints the sixth row without a name (the main text's copy labels it MSN) and
the last two under "nCLIP"; we name them MSN_0.7 and nCLIP_0.8 after their target temperature.

Choices where the paper is silent or ambiguous (each documented at the function that implements it):

- No stop-gradient on the target: Algorithm 1 detaches nothing and Sec. 3.1 says "the target and
  prediction branch are backpropagated at the same time". ``stop_grad_target=True`` detaches it.
- The CE is cross-modal (p_I·log q_T + p_T·log q_I), as in the main text's copy of the algorithm;
  the appendix copy prints p_I·log q_I.
- ``uniform`` acts on the softmax output (Algorithm 1, lines 29-30), except centering (footnote †).
  Sinkhorn iterates on detached targets with the per-rank sums reduced without gradient; its
  output keeps the softmax's gradient with the Sinkhorn scalings held constant.
- Centering keeps separate statistics per modality (images and texts have different encoders),
  computes them over the global batch, normalises with the statistics from *before* this batch
  (as DINO updates its center after the loss), starts at mean 0 / variance 1 (identity), and updates
  only in training mode with C ← m·C + (1 − m)·batch statistic.
- Centering's "scale parameters" (App. A; the paper gives no formula) are read as a BatchNorm
  affine weight without the shift (the centering removes the shift): one learnable γ_k per
  prototype and modality, initialised to 1 (BatchNorm's default), trained by the optimizer with
  the rest of the model (not weight-decayed: 1-D) through the target, which Algorithm 1 does not
  detach. The nCLIP head ends in BatchNorm without affine (Sec. 3.2), so its logits have batch mean
  0 and variance 1 and the running statistics alone would leave the target unchanged: at γ = 1 the
  row is plain sharpening by τ_s, and γ is what makes it DINO's row. With ``stop_grad_target`` no
  gradient reaches γ and it is frozen at 1.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from nclip.batch import Batch
from nclip.objectives import functional
from nclip.objectives.base import HEAD_STAT_KEYS, EncoderOutput, EntropyWeights, Objective

# Tab. A1, one entry per row: overrides of UnifiedConfig's fields.
TABLE_A1_SETTINGS: dict[str, dict[str, Any]] = {
    "CE": {"tau": 1.0, "tau_s": 1.0, "lambda1": 0.0, "uniform": "none", "lambda2": 0.0},
    "SwAV": {"tau": 1.0, "tau_s": 0.25, "lambda1": 0.0, "uniform": "sinkhorn", "lambda2": 1.0},
    "SCSF": {"tau": 1.0, "tau_s": 0.5, "lambda1": 0.0, "uniform": "batch_softmax", "lambda2": 0.0},
    "DINO": {"tau": 1.0, "tau_s": 0.7, "lambda1": 0.0, "uniform": "centering", "lambda2": 0.0},
    "MSN": {"tau": 1.0, "tau_s": 0.8, "lambda1": 0.0, "uniform": "none", "lambda2": 1.0},
    "MSN_0.7": {"tau": 1.0, "tau_s": 0.7, "lambda1": 0.0, "uniform": "none", "lambda2": 1.0},
    "nCLIP_0.8": {"tau": 1.0, "tau_s": 0.8, "lambda1": 0.2, "uniform": "none", "lambda2": 1.2},
    "nCLIP": {"tau": 1.0, "tau_s": 1.0, "lambda1": 0.5, "uniform": "none", "lambda2": 1.5},
}


class UnifiedConfig(EntropyWeights):
    """Typed config of Algorithm 1 (defaults: the nCLIP row, i.e. exactly nCLIP's Eq. 4)."""

    name: Literal["unified"] = "unified"
    tau_s: float = Field(1.0, gt=0, title="τ_s", description="target temperature τ_s")
    tau: float = Field(1.0, gt=0, title="τ", description="prediction temperature τ")
    uniform: Literal["none", "sinkhorn", "batch_softmax", "centering"] = Field("none", title="uniform(·)")
    sinkhorn_iters: int = Field(3, ge=1, le=100, description="Sinkhorn iterations (SwAV: 3)")
    center_momentum: float = Field(0.9, ge=0, le=1, description="EMA momentum of the centering statistics (DINO: 0.9)")
    center_eps: float = Field(1e-5, gt=0, description="added to the running variance before the rsqrt")
    stop_grad_target: bool = Field(False, description="detach p (Algorithm 1 does not)")

    @classmethod
    def from_table_a1(cls, row: str, **overrides: Any) -> "UnifiedConfig":
        """The config of one Tab. A1 row (a key of TABLE_A1_SETTINGS), with extra overrides."""
        if row not in TABLE_A1_SETTINGS:
            raise ValueError(f"unknown Tab. A1 row {row!r}; rows: {', '.join(TABLE_A1_SETTINGS)}")
        return cls(**{**TABLE_A1_SETTINGS[row], **overrides})


_CENTER_BUFFERS = ("center_mean_image", "center_var_image", "center_mean_text", "center_var_text")
_CENTER_SCALES = ("center_scale_image", "center_scale_text")


class UnifiedObjective(Objective):
    """Algorithm 1 on the nCLIP head; holds the centering state when uniform='centering'.

    The centering buffers (running mean 0 and variance 1 at the start) and scale parameters
    (γ = 1 at the start) are [K]. With ``num_prototypes`` (the trainer builds the objective with
    ``model.nclip_dim``) they exist from construction, so γ is in the optimizer; without it they are
    created on the first batch (a module used alone, as in the tests), and restored from checkpoints
    whatever their size.
    """

    heads = frozenset({"nclip"})
    zero_shot = "nclip"
    head_stats_prefix = "unified"

    def __init__(self, cfg: UnifiedConfig, num_prototypes: int | None = None):
        super().__init__()
        self.cfg = cfg
        if cfg.uniform == "centering":
            for name in _CENTER_BUFFERS:
                self.register_buffer(name, torch.zeros(0))
            for name in _CENTER_SCALES:
                self.register_parameter(name, nn.Parameter(torch.zeros(0), requires_grad=not cfg.stop_grad_target))
            if num_prototypes is not None:
                self._make_centers(num_prototypes, torch.float32, None)

    @classmethod
    def build(cls, cfg: UnifiedConfig, run_cfg=None) -> "UnifiedObjective":
        """Sized from ``model.nclip_dim`` when the whole run config is given (the trainer), so that
        the centering scales exist before the optimizer is built."""
        return cls(cfg, None if run_cfg is None else run_cfg.model.nclip_dim)

    def _make_centers(self, k: int, dtype: torch.dtype, device) -> None:
        for name in _CENTER_BUFFERS:
            init = torch.zeros if name.startswith("center_mean") else torch.ones
            setattr(self, name, init(k, dtype=dtype, device=device))
        for name in _CENTER_SCALES:
            old = getattr(self, name)
            old.data = torch.ones(k, dtype=dtype, device=device)  # γ = 1; the same Parameter object

    def _ensure_centers(self, logits: torch.Tensor) -> None:
        k = logits.shape[1]
        if self.center_mean_image.numel() == k:
            return
        if self.center_mean_image.numel() != 0:
            raise ValueError(f"centering statistics are for K={self.center_mean_image.numel()}, got logits with K={k}")
        self._make_centers(k, torch.promote_types(logits.dtype, torch.float32), logits.device)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # lazily sized buffers and scales: take the checkpoint's shape before the strict shape check
        for name in _CENTER_BUFFERS:
            key = prefix + name
            if key in state_dict and name in self._buffers and self._buffers[name].shape != state_dict[key].shape:
                self._buffers[name] = torch.empty_like(state_dict[key], device=self._buffers[name].device)
        for name in _CENTER_SCALES:
            key, param = prefix + name, self._parameters.get(name)
            if key in state_dict and param is not None and param.shape != state_dict[key].shape:
                param.data = torch.empty_like(state_dict[key], device=param.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @torch.no_grad()
    def _update_centers(self, image_logits: torch.Tensor, text_logits: torch.Tensor) -> None:
        m = self.cfg.center_momentum
        for side, logits in (("image", image_logits), ("text", text_logits)):
            mean, var = getattr(self, f"center_mean_{side}"), getattr(self, f"center_var_{side}")
            b_mean, b_var = functional.batch_moments(logits.to(mean.dtype), global_batch=self.cfg.global_batch)
            new_mean, new_var = functional.ema_moments(mean, var, b_mean, b_var, m)
            mean.copy_(new_mean)
            var.copy_(new_var)

    def forward(self, out: EncoderOutput, batch: Batch | None = None) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        centers: dict[str, Any] = {}
        if cfg.uniform == "centering":
            self._ensure_centers(out.image["nclip"])
            # clones: the loss uses this batch's pre-update statistics (DINO updates after the loss)
            centers = {
                f"{side}_center": (getattr(self, f"center_mean_{side}").clone(),
                                   getattr(self, f"center_var_{side}").clone(),
                                   getattr(self, f"center_scale_{side}"))
                for side in ("image", "text")
            }
        terms = functional.unified_terms(
            out.image["nclip"],
            out.text["nclip"],
            cfg.tau_s,
            cfg.tau,
            cfg.lambda1,
            cfg.lambda2,
            uniform=cfg.uniform,
            sinkhorn_iters=cfg.sinkhorn_iters,
            center_eps=cfg.center_eps,
            stop_grad_target=cfg.stop_grad_target,
            global_batch=cfg.global_batch,
            **centers,
        )
        if cfg.uniform == "centering" and self.training:
            self._update_centers(out.image["nclip"], out.text["nclip"])
        named = {"L_CE": terms["ce"], "L_EH": terms["eh"], "L_HE": terms["he"], "L_KL": terms["kl"]}
        named.update({k: terms[k] for k in HEAD_STAT_KEYS})
        # + 0·s: the logit scale gets a zero gradient, as DDP needs (see NclipObjective.forward)
        return {"loss": terms["loss"] + 0.0 * out.logit_scale, **{f"unified/{k}": v for k, v in named.items()}}
