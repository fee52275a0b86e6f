"""Collapse monitor: reads the logged nCLIP-head statistics and says when training has collapsed.

Appendix B.1 of the xCLIP paper (Fig. B1) diagnoses the failure modes of the non-contrastive
objective from a handful of logged statistics; this module watches the same ones and turns them
into one readable warning per episode:

- ``uniform`` — constant uniform collapse (B.1, case 1, λ1 = 0): every p_i → 1/K, so the row std of
  P → 0, L_EH ≈ L_HE ≈ ln K, L_KL ≈ 0, and the nCLIP loss sits at its collapsed value
  (1 + λ1 − λ2)·ln K. Fix: λ1 = λ2 − 1 > 0.
- ``dimensional`` — dimensional collapse (B.1, case 2): "several dimensions will not be favored by
  any instance"; seen as a low prototype usage. Fix: increase λ2 (keeping λ1 = λ2 − 1).
- ``one_hot`` — every sample on the same prototype: p̄ one-hot, L_HE → 0. Fix: more weight on L_HE
  (raise λ2 or lower λ1).
- ``nonfinite`` — a watched metric is NaN/inf (the "Nan" rows of Tab. 9a and Tab. A1).

Feed it the metrics dict logged at every logging step (keys like ``nclip/L_EH``, ``nclip/L_HE``,
``nclip/L_KL``, ``nclip/row_std``, ``nclip/usage``; the prefix is the one the run's objective
declares, :meth:`CollapseMonitor.for_run`, or detected from the keys when not given). A signature
must persist for ``window`` consecutive logs before it warns; each kind warns once, and again only
after it has cleared and come back.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from nclip.objectives import plan_for
from nclip.train.checkpoint import list_checkpoints


class CollapseMonitor:
    """Detects collapse of the nCLIP head from logged metrics (Appendix B.1, Fig. B1).

    Args:
        num_prototypes: K, the nCLIP head width.
        prefix: metric namespace (an objective's ``head_stats_prefix``: "nclip", "unified", "yclip");
            None detects it from the keys.
        batch_size: the global batch B. Sets the usage reference to the expected usage of a uniform
            random assignment, 1 − (1 − 1/K)^B (B < K caps usage at B/K). Without it the reference
            is the highest usage seen so far in the stream.
        lambda1, lambda2: the run's λ1, λ2, if known: the warnings then quote the current values and
            the collapsed loss (1 + λ1 − λ2)·ln K.
        window: consecutive logs a signature must persist before it warns.
        uniform_row_cv: uniform collapse needs row_std·K below this (row_std·K is the coefficient
            of variation of p_i over the K prototypes: 0 for uniform rows, ≈ 2.2 for the softmax of
            standard-normal logits).
        entropy_gap: uniform collapse needs ln K − L_EH and ln K − L_HE below this (nats).
        kl_max: uniform collapse needs |L_KL| below this (nats).
        usage_ratio: dimensional collapse when usage < usage_ratio × the usage reference.
        one_hot_he_frac: one-hot collapse when L_HE < one_hot_he_frac × ln K.
    """

    def __init__(
        self,
        num_prototypes: int,
        *,
        prefix: str | None = None,
        batch_size: int | None = None,
        lambda1: float | None = None,
        lambda2: float | None = None,
        window: int = 5,
        uniform_row_cv: float = 0.05,
        entropy_gap: float = 0.01,
        kl_max: float = 0.01,
        usage_ratio: float = 0.25,
        one_hot_he_frac: float = 0.05,
    ):
        if num_prototypes < 2:
            raise ValueError(f"num_prototypes must be >= 2, got {num_prototypes}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for name, value in (("uniform_row_cv", uniform_row_cv), ("entropy_gap", entropy_gap), ("kl_max", kl_max)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not 0 < usage_ratio <= 1:
            raise ValueError(f"usage_ratio must be in (0, 1], got {usage_ratio}")
        if not 0 < one_hot_he_frac < 1:
            raise ValueError(f"one_hot_he_frac must be in (0, 1), got {one_hot_he_frac}")
        self.k = num_prototypes
        self.ln_k = math.log(num_prototypes)
        self.prefix = prefix
        self.lambda1, self.lambda2 = lambda1, lambda2
        self.window = window
        self.uniform_row_cv = uniform_row_cv
        self.entropy_gap = entropy_gap
        self.kl_max = kl_max
        self.usage_ratio = usage_ratio
        self.one_hot_he_frac = one_hot_he_frac
        self.expected_usage = None if batch_size is None else 1 - (1 - 1 / num_prototypes) ** batch_size
        self._peak_usage = 0.0
        self._streak = {"uniform": 0, "dimensional": 0, "one_hot": 0}
        self.active: set[str] = set()  # kinds that have warned and not cleared since
        self.warned: dict[str, int] = {}  # kind -> step of its latest warning

    @classmethod
    def for_run(cls, cfg) -> "CollapseMonitor | None":
        """The monitor of a run (a :class:`nclip.config.RunConfig`): watching what its objective
        declares (:meth:`nclip.objectives.Objective.collapse_watch`), or None when it has no
        nCLIP-style head."""
        watch = plan_for(cfg).collapse_watch
        if watch is None:
            return None
        return cls(cfg.model.nclip_dim, prefix=watch.prefix, batch_size=cfg.train.batch_size,
                   lambda1=watch.lambda1, lambda2=watch.lambda2)

    # -- public -----------------------------------------------------------------------------

    def update(self, step: int, metrics: dict[str, float]) -> list[str]:
        """Feed one logging step's metrics; returns the new warnings (usually none)."""
        prefix = self.prefix or self._detect_prefix(metrics)
        if prefix is None:
            return []
        self.prefix = prefix
        get = lambda name: _as_float(metrics.get(f"{prefix}/{name}"))  # noqa: E731
        eh, he, kl, ce = get("L_EH"), get("L_HE"), get("L_KL"), get("L_CE")
        row_std, usage = get("row_std"), get("usage")
        if kl is None and ce is not None and eh is not None:
            kl = ce - eh
        warnings: list[str] = []

        watched = {"L_EH": eh, "L_HE": he, "L_KL": kl, "row_std": row_std, "usage": usage}
        bad = [name for name, v in watched.items() if v is not None and not math.isfinite(v)]
        loss = _as_float(metrics.get("loss"))
        if loss is not None and not math.isfinite(loss):
            bad.append("loss")
        if self._arm("nonfinite", bool(bad), step, needed=1):
            warnings.append(f"step {step}: non-finite {', '.join(bad)}: training diverged: {self._nonfinite_fix()}")
        if bad:
            return warnings

        uniform = (
            eh is not None
            and he is not None
            and self.ln_k - eh < self.entropy_gap
            and self.ln_k - he < self.entropy_gap
            and (kl is None or abs(kl) < self.kl_max)
            and (row_std is None or row_std * self.k < self.uniform_row_cv)
        )
        one_hot = he is not None and he < self.one_hot_he_frac * self.ln_k
        reference = self.expected_usage
        if usage is not None:
            self._peak_usage = max(self._peak_usage, usage)
            if reference is None:
                reference = self._peak_usage
        # uniform and one-hot collapse also drive usage down; name them, not their symptom
        dimensional = (
            usage is not None and not uniform and not one_hot and usage < self.usage_ratio * reference
        )

        if self._arm("uniform", uniform, step):
            collapsed = ""
            if self.lambda1 is not None and self.lambda2 is not None:
                value = (1 + self.lambda1 - self.lambda2) * self.ln_k
                collapsed = f" at its collapsed value (1 + λ1 − λ2)·ln K = {value:.4f}"
            warnings.append(
                f"step {step}: constant uniform collapse of the '{prefix}' head (Appendix B.1, case 1): for "
                f"{self.window} logs L_EH = {eh:.4f} and L_HE = {he:.4f} ≈ ln K = {self.ln_k:.4f}"
                + (f", L_KL = {kl:.2e}" if kl is not None else "")
                + (f", row std = {row_std:.2e}" if row_std is not None else "")
                + f"; every sample gets the same uniform distribution and the loss is stuck{collapsed}. "
                f"Set λ1 = λ2 − 1 > 0 (e.g. λ1 = 0.5, λ2 = 1.5){self._lambdas()} so L_EH sharpens "
                f"the assignments."
            )
        if self._arm("one_hot", one_hot, step):
            warnings.append(
                f"step {step}: one-hot collapse of the '{prefix}' head: for {self.window} logs L_HE = {he:.4f} "
                f"(< {self.one_hot_he_frac:g}·ln K = {self.one_hot_he_frac * self.ln_k:.4f}): all samples are "
                f"assigned to the same prototype. Put more weight on L_HE: increase λ2 or lower λ1 (so that "
                f"λ2 − λ1 ≥ 1){self._lambdas()}; check that the nCLIP head ends with a BatchNorm without "
                f"affine (Tab. 9c) and consider a lower learning rate."
            )
        if self._arm("dimensional", dimensional, step):
            basis = "a uniform random assignment" if self.expected_usage is not None else "its peak in this run"
            warnings.append(
                f"step {step}: dimensional collapse of the '{prefix}' head (Appendix B.1, case 2): for "
                f"{self.window} logs only {usage:.1%} of the K = {self.k} prototypes are the argmax of any "
                f"sample (reference {reference:.1%}, {basis}); several dimensions are favoured by no "
                f"instance. Increase λ2 (keeping λ1 = λ2 − 1, e.g. λ1 = 1.0, λ2 = 2.0){self._lambdas()}, "
                f"or use a larger global batch so p̄ in L_HE is better estimated (Sec. 4.3)."
            )
        return warnings

    @property
    def healthy(self) -> bool:
        """True when no collapse signature is currently active."""
        return not self.active

    # -- internals --------------------------------------------------------------------------

    def _arm(self, kind: str, condition: bool, step: int, needed: int | None = None) -> bool:
        """Count consecutive logs with ``condition``; True exactly when a warning is due."""
        needed = self.window if needed is None else needed
        if not condition:
            self._streak[kind] = 0
            self.active.discard(kind)
            return False
        self._streak[kind] = self._streak.get(kind, 0) + 1
        if self._streak[kind] >= needed and kind not in self.active:
            self.active.add(kind)
            self.warned[kind] = step
            return True
        return False

    def _nonfinite_fix(self) -> str:
        return nonfinite_fix(self.lambda1, self.lambda2) + "; the changed run starts anew (a new --out, or --force)."

    def _lambdas(self) -> str:
        if self.lambda1 is None or self.lambda2 is None:
            return ""
        return f" (now λ1 = {self.lambda1:g}, λ2 = {self.lambda2:g})"

    @staticmethod
    def _detect_prefix(metrics: dict[str, float]) -> str | None:
        found = sorted(k[: -len("/L_HE")] for k in metrics if k.endswith("/L_HE") and f"{k[:-5]}/L_EH" in metrics)
        return found[0] if found else None


def _as_float(value) -> float | None:
    if value is None:
        return None
    return float(value.item() if hasattr(value, "item") else value)


def nonfinite_fix(lambda1: float | None, lambda2: float | None, cfg=None) -> str:
    """The setting to change after non-finite steps, for the objective being trained: its λ1, λ2
    where they are the cause the xCLIP paper names (the 'Nan' rows of Tab. 9a / Tab. A1: λ1 = 0 or,
    generally, off the stable line λ1 = λ2 − 1 > 0); else the learning rate (and the gradient
    clipping, when off). ``cfg``: the run config, to quote the current values."""
    if lambda1 is not None and lambda2 is not None and (lambda1 <= 0 or abs(lambda1 - (lambda2 - 1)) > 1e-9):
        return (f"objective.lambda1 = {lambda1:g}, objective.lambda2 = {lambda2:g} are off the stable line "
                f"λ1 = λ2 − 1 > 0 (the 'Nan' rows of Tab. 9a and Tab. A1): set e.g. λ1 = 0.5, λ2 = 1.5")
    if cfg is None:
        return "lower train.lr"
    t = cfg.train
    clip = "" if t.grad_clip else " or set train.grad_clip (now off)"
    return f"lower train.lr (now {t.lr:g}){clip}"


def nonfinite_stop(cfg, run_dir: Path, counters: dict[str, int], step: int, main: bool) -> str | None:
    """The line with which the run stops after ``step`` (the counters as just read from the device:
    call at log and checkpoint steps, which include the last), or None to go on.

    It stops after ``train.max_nonfinite_steps`` skipped steps in a row, and at its last step when
    no step of the run was taken (all skipped, however few: the weights are still those it started
    with, and model/ and a last checkpoint would pass them off as trained). A run that ends in a
    shorter streak after taken steps ends as usual, its model that of the last taken step, after a
    warning on rank 0 (``main``) that says so."""
    row, last = counters["nonfinite_row"], step == cfg.train.steps
    if row >= cfg.train.max_nonfinite_steps or (last and row >= step):
        return nonfinite_stop_message(cfg, run_dir, row, step)
    if last and row and main:
        print(f"nclip: warning: the last {row} of the run's {step} steps had a non-finite loss or gradient and were "
              f"skipped: model/ holds the weights of step {step - row}", file=sys.stderr, flush=True)
    return None


def nonfinite_stop_message(cfg, run_dir: Path, in_a_row: int, step: int) -> str:
    """The one line with which a run stops after ``in_a_row`` non-finite steps (last: ``step``):
    the checkpoint that exists, and the setting that applies to the objective being trained."""
    if in_a_row >= step:  # not one step taken: every loss was computed at the starting weights
        fp16 = ("; under train.precision fp16, a longer run lets the loss scale halve past its overflows"
                if cfg.train.precision == "fp16" else "")
        return (f"steps 1 to {step}, every step of the run, had a non-finite loss or gradient, so not one was taken: "
                f"the weights are those it started with, and neither model/ nor a checkpoint is written. The loss "
                f"or gradient is not finite at those weights, so the learning rate is not the cause: check objective "
                f"{cfg.objective.name!r} and the data{fp16}; then train in a new --out (or with --force)")
    watch = plan_for(cfg).collapse_watch
    fix = nonfinite_fix(watch.lambda1 if watch else None, watch.lambda2 if watch else None, cfg)
    kept = list_checkpoints(run_dir)
    where = (f"the last good checkpoint is {kept[-1]} (--resume auto continues from it with the same settings)"
             if kept else f"no checkpoint was written before it (the first is due at step "
                          f"{cfg.train.checkpoint_every})")
    return (f"{in_a_row} steps in a row had a non-finite loss or gradient (last: step {step}); stopping: "
            f"{where}. To train on, {fix}, in a new --out (or with --force)")
