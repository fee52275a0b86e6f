"""The evaluation config (:class:`EvalSettings`) and the task names -- importable without torch, so
that building the CLI parser stays fast."""

from __future__ import annotations

from dataclasses import dataclass

from nclip.errors import NclipError

TASKS = ("zeroshot", "retrieval", "multilabel", "linear", "knn", "cluster", "realms", "sts", "masks", "diagnostics")
HEADS = ("clip", "nclip")
L2_GRID = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 1e-5, 1e-6)  # linear-probe L2 strengths (validated)
MASK_THRESHOLD = 0.6  # DINO: keep the patches holding 60% of the [CLS] attention mass


@dataclass(frozen=True)
class EvalSettings:
    """The resolved evaluation config (written to results.json)."""

    tasks: tuple[str, ...] = TASKS
    datasets: tuple[str, ...] = ("synthetic", "digits")
    head: str | None = None  # None: the objective's zero_shot_head
    test_samples: int = 1000  # synthetic test scenes
    train_samples: int = 2000  # synthetic scenes for the probes' training split
    sts_pairs: int = 1000  # built-in STS pairs (with the synthetic dataset)
    mask_samples: int = 500  # test scenes for mask probing
    mask_threshold: float = MASK_THRESHOLD
    knn_k: int = 20
    knn_temperature: float = 0.07
    l2_grid: tuple[float, ...] = L2_GRID
    seed: int = 0
    batch_size: int = 256
    device: str = "auto"
    cache_dir: str | None = None  # None: no cache
    baseline: str | None = None  # run dir, eval dir or results.json for relative realm accuracy

    def validate(self) -> "EvalSettings":
        from nclip.eval.datasets import parse_spec

        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise NclipError(f"unknown task {bad[0]!r}; available: {', '.join(TASKS)}" if bad else "no task selected")
        if self.head is not None and self.head not in HEADS:
            raise NclipError(f"unknown head {self.head!r}; available: {', '.join(HEADS)}")
        for name in ("mask_samples", "batch_size", "knn_k"):
            if getattr(self, name) < 1:
                raise NclipError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.test_samples < 10 or self.train_samples < 10:
            raise NclipError("test_samples and train_samples must be >= 10")
        if self.sts_pairs < 0 or (0 < self.sts_pairs < 2):
            raise NclipError(f"sts_pairs must be 0 or >= 2, got {self.sts_pairs}")
        if not 0 < self.mask_threshold <= 1 or not self.knn_temperature > 0:
            raise NclipError("mask_threshold must lie in (0, 1] and knn_temperature be > 0")
        if self.device not in ("auto", "cpu", "cuda"):
            raise NclipError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if not self.datasets:
            raise NclipError("no dataset selected")
        for spec in self.datasets:
            parse_spec(spec)
        return self
