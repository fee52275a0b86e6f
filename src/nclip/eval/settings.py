"""The evaluation config (:class:`EvalSettings`) and the task names -- importable without torch, so
that building the CLI parser stays fast.

:class:`EvalSettings` is typed and checked like the run config (:mod:`nclip.config`): a frozen
pydantic model that forbids unknown keys, ranges as ``Field`` constraints, and a bad value is one
line in the run config's wording (``eval: batch_size: Input should be greater than or equal to 1
(got 0)``) through :func:`validated` / :meth:`EvalSettings.updated`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from nclip.dataset_specs import checked_spec, kinds_taking, parse_spec
from nclip.defaults import DEVICES, EVAL_BATCH_SIZE, NCLIP_SCORES
from nclip.errors import NclipError
from nclip.eval.sgd_recipes import SGD_RECIPES

# t-SNE iterations of the report's figure: the xCLIP paper's App. G (perplexity 20, lr 200, 5,000
# iterations); scikit-learn's own minimum is 250
TSNE_ITERS = 5000


@dataclass(frozen=True)
class Task:
    """One evaluation task: its name on pages and panels (``title``), what it needs from the data
    (``needs``: the reason it is skipped when no selected dataset has it), whether it scores with a
    text-aligned head (``text``: an image-only objective skips it) and whether it runs only when
    named in ``--tasks`` (``optional``). Its runner: :mod:`nclip.eval.dispatch`, keyed by name."""

    name: str
    title: str
    needs: str
    text: bool = False
    optional: bool = False


# every task, in the order they run and are listed: the one table the settings' choices, the CLI's
# help, the skip reasons and the dispatch read
TASK_TABLE: dict[str, Task] = {task.name: task for task in (
    Task("zeroshot", "zero-shot", "class labels", text=True),
    Task("retrieval", "retrieval", "captions (synthetic, digits, captions:FILE, hardneg:FILE)", text=True),
    Task("multilabel", "zero-shot multi-label", "multi-label annotations (synthetic, multilabel:FILE.csv)", text=True),
    Task("linear", "linear probe", "class labels and a train split"),
    Task("knn", "k-NN", "class labels and a train split"),
    Task("cluster", "clustering", "test labels of at least two classes"),
    Task("realms", "realm-wise probing",
         "realm labels and a train split (synthetic, realms:DIR, or class labels with --hierarchy)"),
    Task("sts", "text STS", "sentence pairs (synthetic with --sts-pairs > 0, sts:FILE.csv)"),
    Task("masks", "mask probing", "object masks (synthetic, masks:DIR)"),
    Task("segmentation", "zero-shot segmentation", "object masks with their classes (synthetic, masks:DIR)",
         text=True),
    Task("diagnostics", "representation diagnostics", "captions (synthetic, digits, captions:FILE)", text=True),
    # the pre-training classifier's readout of xent and frzproto (nclip.eval.classifier)
    Task("classifier", "pre-training classifier", "class labels of the training run's classes", optional=True),
)}
TASKS = tuple(name for name, task in TASK_TABLE.items() if not task.optional)  # the default selection
OPTIONAL_TASKS = tuple(name for name, task in TASK_TABLE.items() if task.optional)
TEXT_TASKS = tuple(name for name, task in TASK_TABLE.items() if task.text)  # need a text-aligned head
NclipScore = Literal[NCLIP_SCORES]  # type: ignore[valid-type]
# the linear probe's optimiser: "lbfgs" (CLIP App. A.3, validated L2) or "sgd" (a paper's SGD recipe)
Probe = Literal["lbfgs", "sgd"]
SgdRecipeName = Literal[tuple(SGD_RECIPES)]  # type: ignore[valid-type]
L2_GRID = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 1e-5, 1e-6)  # linear-probe L2 strengths (validated)
MASK_THRESHOLD = 0.6  # DINO: keep the patches holding 60% of the [CLS] attention mass
SEGMENT_THRESHOLD = 0.95  # GroupViT's bg_thresh on VOC (its background cut: min(it, the image's best group score))
MULTILABEL_TOPK = (3, 5, 10, 20)  # xCLIP Tab. 3: F1@3, F1@5 (NUS-WIDE), F1@10, F1@20 (OpenImages)
PROMPT_SETS = ("imagenet80", "simple")  # built-in template sets (nclip.eval.prompts.BUILTIN_TEMPLATES)
# whose names masks: data's VOC classes take in zero-shot segmentation (nclip.eval.mask_folder.VOC_NAMES)
VocClassnames = Literal["voc", "groupvit"]


class EvalSettings(BaseModel):
    """The resolved evaluation config (written to results.json)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tasks: tuple[str, ...] = TASKS
    datasets: tuple[str, ...] = ("synthetic", "digits")
    # the zero-shot score, a registered score's name (nclip.objectives.scores: clip, nclip, yclip or a
    # plugin's), checked against the checkpoint's heads when the evaluation starts; None: the objective's
    head: str | None = None
    # image features of the linear, k-NN, clustering and realm probes: backbone or a head that offers
    # them (nclip.heads.Head.probe), checked against the checkpoint's heads when the evaluation starts;
    # None: the objective's Objective.probe_features (its paper's protocol; results.json records the one used)
    features: str | None = None
    # nCLIP head's −L_CE: "symmetric" = −(CE(p, q) + CE(q, p)) / 2, Eq. 2 symmetrised as in Sec. 3.1;
    # "image_to_text" = −CE(p_image, q_text), one direction only
    nclip_score: NclipScore = "symmetric"
    test_samples: int = Field(1000, ge=10, description="synthetic test scenes")
    train_samples: int = Field(2000, ge=10, description="synthetic scenes for the probes' training split")
    sts_pairs: int = Field(1000, ge=0, description="built-in STS pairs (with the synthetic dataset); 0 or >= 2")
    mask_samples: int = Field(500, ge=1, description="test scenes for mask probing")
    mask_threshold: float = Field(MASK_THRESHOLD, gt=0, le=1)
    # zero-shot segmentation: a group whose best class score is below min(it, the image's best group
    # score) is background (GroupViT's rule, nclip.eval.segmentation)
    segment_threshold: float = Field(SEGMENT_THRESHOLD, ge=0, le=1)
    # zero-shot segmentation of masks: data: VOC's class names, or GroupViT's ("table", "plant", "monitor")
    voc_classnames: VocClassnames = "voc"
    knn_k: int = Field(20, ge=1)
    tsne_iters: int = Field(TSNE_ITERS, ge=250, description="t-SNE iterations of the report's figure (App. G: 5,000)")
    knn_temperature: float = Field(0.07, gt=0)
    l2_grid: tuple[Annotated[float, Field(ge=0, allow_inf_nan=False)], ...] = Field(L2_GRID, min_length=1)
    probe: Probe = "lbfgs"
    # the SGD probe's paper recipe; None: the objective's (Objective.sgd_probe_recipe) under --probe sgd
    probe_recipe: SgdRecipeName | None = None
    probe_epochs: int | None = Field(None, ge=1, description="the SGD probe's epochs (None: the recipe's)")
    seed: int = 0
    batch_size: int = Field(EVAL_BATCH_SIZE, ge=1)  # the same default as the run config's eval.batch_size
    device: Literal[DEVICES] = "auto"  # type: ignore[valid-type]
    cache_dir: str | None = None  # None: no cache
    baseline: str | None = None  # run dir, eval dir or results.json for relative realm accuracy
    # the open_clip config (e.g. ViT-B-32) of a state-dict file given as the checkpoint or the baseline
    arch: str | None = None
    # realm labels for the realms task from each dataset's class labels: "builtin" (the built-in
    # data's own hierarchies, nclip.data.hierarchies) or a JSON/TSV hierarchy file (nclip.data.hierarchy)
    hierarchy: str | None = None
    # the user's zero-shot prompts (nclip.eval.prompts): class names of folder:/multilabel: data (a
    # file: one per line or a JSON map) and templates of folder:/realms:/multilabel: data (a file or
    # a PROMPT_SETS name); files are recorded as absolute paths, the source of the results
    classnames: str | None = None
    templates: str | None = None
    multilabel_topk: tuple[Annotated[int, Field(ge=1)], ...] = Field(MULTILABEL_TOPK, min_length=1)
    # a captions CSV's image and caption columns; None: the run's data.csv_image_key /
    # data.csv_caption_key when the header has them, else image/filepath/... and caption*
    image_key: str | None = None
    caption_key: str | None = None

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, tasks: tuple[str, ...]) -> tuple[str, ...]:
        bad = [t for t in tasks if t not in TASKS + OPTIONAL_TASKS]
        if bad:
            raise ValueError(f"unknown task {bad[0]!r}; available: {', '.join(TASKS + OPTIONAL_TASKS)}")
        if not tasks:
            raise ValueError("no task selected")
        return tasks

    @field_validator("datasets")
    @classmethod
    def _dataset_specs(cls, datasets: tuple[str, ...]) -> tuple[str, ...]:
        if not datasets:
            raise ValueError("no dataset selected")
        return tuple(checked_spec(spec) for spec in datasets)

    @field_validator("sts_pairs")
    @classmethod
    def _pairs(cls, n: int) -> int:
        if n == 1:
            raise ValueError("a Spearman correlation needs 0 (no STS) or at least 2 sentence pairs, got 1")
        return n

    @field_validator("probe_recipe", "probe_epochs")
    @classmethod
    def _sgd_only(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("probe") == "lbfgs":
            raise ValueError("applies to the SGD probe only: add --probe sgd")
        return value

    @field_validator("hierarchy")
    @classmethod
    def _hierarchy(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("give 'builtin' or a hierarchy file (JSON or TSV)")
        return value

    @field_validator("cache_dir", "baseline", "hierarchy", mode="before")
    @classmethod
    def _path_text(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("classnames", "templates", mode="before")
    @classmethod
    def _source_path(cls, value: Any) -> Any:
        if value is None or value in PROMPT_SETS:
            return value
        return str(Path(os.fspath(value)).expanduser().absolute())

    @field_validator("voc_classnames")
    @classmethod
    def _voc_data(cls, value: str, info: ValidationInfo) -> str:
        kinds = {parse_spec(spec)[0] for spec in info.data.get("datasets", ())}
        if value != "voc" and "datasets" in info.data and "masks" not in kinds:
            raise ValueError("applies to masks: datasets (PASCAL VOC's classes) and none is selected")
        return value

    @field_validator("classnames", "templates")
    @classmethod
    def _prompts_have_data(cls, value: str | None, info: ValidationInfo) -> str | None:
        takers = kinds_taking(info.field_name)
        kinds = {parse_spec(spec)[0] for spec in info.data.get("datasets", ())}
        if value is not None and "datasets" in info.data and not kinds & set(takers):
            raise ValueError(f"applies to {', '.join(k + ':' for k in takers)} datasets and none is selected")
        return value

    def updated(self, location_name: Callable[[str], str] | None = None, **changes) -> "EvalSettings":
        """A copy with ``changes``, validated (see :func:`validated`)."""
        return validated({**self.model_dump(), **changes}, location_name)


def validated(fields: dict[str, Any], location_name: Callable[[str], str] | None = None) -> EvalSettings:
    """:class:`EvalSettings` from ``fields``; a bad value raises a one-line :class:`NclipError` in the
    run config's wording, ``eval: <field>: <problem>``. ``location_name`` names a field as the user
    gave it (``nclip eval``: its option, ``test_samples`` → ``--samples``)."""
    try:
        return EvalSettings.model_validate(fields)
    except ValidationError as e:
        from nclip.config import describe_validation_error  # the one formatter (no torch: errors only)

        naming = {"location_name": location_name} if location_name else {}
        raise NclipError(describe_validation_error(e, "eval", **naming)) from None

