"""What every objective sees (EncoderOutput) and returns (a loss plus named terms)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from nclip.batch import Batch
from nclip.defaults import has_labels

# the detached nCLIP-head statistics every objective with such a head logs under its
# head_stats_prefix (functional.distribution_diagnostics): Tab. B2's Acc_nC, Fig. B1's row/column
# std of P and of the logits, prototype usage
HEAD_STAT_KEYS = ("acc_nC", "row_std", "col_std", "logit_row_std", "logit_col_std", "usage")


@dataclass
class EncoderOutput:
    """The dual encoder's outputs for one batch of B pairs.

    image_features, text_features: backbone features f_I [B, d_img], f_T [B, d_txt]; text_features
        is None when the model skipped the text tower (no head of the objective reads it).
    logit_scale: the InfoNCE multiplier 1/σ = exp(s), already clamped (scalar tensor).
    image, text: each side's head outputs keyed by head name (:mod:`nclip.heads`: a head writes its
        output under its name, further outputs under ``<name>_<what>``), only those of the heads the
        model has:
        "clip": CLIP-head outputs g [B, D]; "nclip": nCLIP-head outputs h [B, K];
        "proto": ProtoCLIP projection-head outputs [B, d_h] (not normalised), computed from g;
        image "cmsf_pred", "cmsf_target": CMSF's v = h(g(T2(x))) [B, D] (online projection and
        predictor on the strong view, pixels[:, 0]) and u = f(T1(x)) [B, D] (momentum branch on the
        weak view, pixels[:, 1], no gradient), not normalised, with two views only ("cmsf" is the
        online projection);
        image "xent": [B, C] the linear classifier's logits on f_I (the supervised baseline);
        image "supcon": [B, V, D] the SupCon family's projections of the V views of each image,
        V = 2 for pixels [B, 2, 3, S, S] and 1 otherwise, not normalised.
    """

    image_features: torch.Tensor
    text_features: torch.Tensor | None
    logit_scale: torch.Tensor
    image: dict[str, torch.Tensor] = field(default_factory=dict)
    text: dict[str, torch.Tensor] = field(default_factory=dict)


class ObjectiveConfig(BaseModel):
    """Base of every objective's typed config: unknown keys are errors.

    A field's ``title`` is its symbol in the papers (λ1, τ_s, ...); sweep tables use it as the
    column header.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    global_batch: bool = True  # compute batch statistics over all ranks when distributed


class EntropyWeights(ObjectiveConfig):
    """Mixin: the weights of nCLIP's entropy regularisers, λ1·L_EH − λ2·L_HE (xCLIP paper Eq. 4),
    shared by every objective with an nCLIP-style loss."""

    lambda1: float = Field(0.5, ge=0, title="λ1", description="weight of L_EH (Eq. 4)")
    lambda2: float = Field(1.5, ge=0, title="λ2", description="weight of L_HE (Eq. 4); λ1 = λ2 − 1 is stable")


class ClipReduction(ObjectiveConfig):
    """Mixin of every objective with CLIP's InfoNCE term: how L_CLIP joins its two directions (xCLIP
    paper Sec. 3.1's prose: their mean; Algorithm 1: their sum, twice the weight under Eq. 5's λ_CLIP).
    See :mod:`nclip.objectives.functional.clip`."""

    clip_reduction: Literal["mean", "sum"] = Field(
        "mean", title="L_CLIP reduction", description="InfoNCE's two directions: mean (Sec. 3.1) or sum (Algorithm 1)")


class BranchWeights(ObjectiveConfig):
    """Mixin: λ_CLIP·L_contrastive + λ_nCLIP·L_nCLIP, the two heads of xCLIP (Eq. 5)."""

    w_clip: float = Field(0.2, ge=0, title="λ_CLIP", description="λ_CLIP of Eq. 5: weight of the contrastive head")
    w_nclip: float = Field(1.0, ge=0, title="λ_nCLIP", description="λ_nCLIP of Eq. 5")


@dataclass(frozen=True)
class LabelRequest:
    """The per-row labels an objective wants in its training batches (see
    :meth:`Objective.label_request`): the data layer fills the batch's ``labels`` (the training label:
    corrupted for a ``noise`` share of the rows, -1 = unlabelled outside a ``labelled`` share) and
    ``true_labels`` (the clean label, for diagnostics) (:class:`nclip.batch.Batch`)."""

    key: str | None = None  # label kind of the built-in data ("digit", "shape", ...); None: the source's main one
    noise: float = 0.0  # share of the training labels corrupted, seeded (CMSF Sec. 2.2)
    labelled: float = 1.0  # share of the rows that keep a label (semi-supervised, Sec. 2.1.5)
    # the labels are optional: a source without labels gives rows of -1 (UNLABELLED) instead of an error
    optional: bool = False
    # a frozen embedding of every training sample (CMSF's cross-modal constraint, Sec. 2.3): the data
    # layer then fills the batch's ``index`` (the samples' dataset indices), and the trainer hands the
    # objective the table [N, Da] (:meth:`Objective.attach_frozen_embedding`)
    frozen: FrozenEmbedding | None = None


def every_row_labelled(run_cfg) -> LabelRequest | None:
    """The request of a supervised objective that labels every row: the objective's ``label_key``
    with its ``label_noise``; None on unlabelled data, which the objective's ``check_run`` refuses."""
    if not has_labels(run_cfg.data):
        return None
    cfg = run_cfg.objective
    return LabelRequest(cfg.label_key, cfg.label_noise, 1.0)


@dataclass(frozen=True)
class FrozenEmbedding:
    """Which frozen encoder embeds every training sample: ``encoder`` None = the bundled MiniLM (a
    local ``transformers`` encoder directory, or an nclip run or model directory, otherwise), and
    the ``modality`` it reads ("text": the captions; "image": the un-augmented images, nclip
    checkpoints only)."""

    encoder: str | None = None
    modality: str = "text"


@dataclass(frozen=True)
class LabelSpace:
    """The classes of the labels a run trains on, handed to an objective that declares
    ``needs_label_space`` by a higher layer (the trainer: :func:`nclip.data.labels.label_space_for`),
    since objectives may not import the data layer that knows them.

    classes: the class names in label order (label c is ``classes[c]``);
    similarity: [C, C] the normalised class similarity s of a class hierarchy in [0, 1] (ReCo Eq. 4),
        or None when the objective asked for none.
    """

    classes: tuple[str, ...]
    similarity: torch.Tensor | None = None

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def class_count(cfg, label_space: LabelSpace | None) -> int:
    """The one count of "the run's classes": those an objective with per-class parameters (PaCo's
    centres, ProtoNW, FrzProto's prototypes, the xent head's classifier) is built for, and its
    evaluation reads back. ``cfg.num_classes`` (an objective config's field, where it has one) if set,
    else the run's label space (:func:`nclip.data.labels.run_label_space`); a one-line ValueError when
    neither is known or the config's is below the labels'."""
    configured = getattr(cfg, "num_classes", None)
    known = label_space.num_classes if label_space is not None else None
    if configured is None and known is None:
        raise ValueError(f"objective {cfg.name} needs objective.num_classes or the run's label space")
    if configured is not None and known is not None and configured < known:
        raise ValueError(f"objective.num_classes {configured} is below the {known} classes of the run's labels")
    return configured if configured is not None else known


@dataclass(frozen=True)
class CollapseWatch:
    """What the collapse monitor (App. B.1) reads for an objective with an nCLIP-style head."""

    prefix: str  # namespace of the logged head statistics: prefix/L_EH, prefix/L_HE, prefix/L_KL, ...
    lambda1: float | None = None  # the run's λs, quoted in the monitor's advice
    lambda2: float | None = None


class Objective(nn.Module):
    """A loss module: holds state (queues, centers, learnable biases) and reports named terms.

    ``forward`` returns a dict with the scalar ``loss`` to minimise and any number of other scalar
    terms to log (detached or not; the trainer detaches them). The trainer never knows which
    objective it runs.

    The class attributes tell the rest of nclip what it needs to know, so that nothing outside this
    package names an objective: which heads the model builds, which score it transfers zero-shot
    with, whether the episodic trainer drives it, where its nCLIP-head statistics are logged, how many
    augmented views of each image and which per-row labels the training data must carry; :meth:`check_run`
    refuses a run config it cannot train on, and :meth:`after_step` runs after every optimizer step
    (gated by ``taken``).
    """

    # which projection heads the model must build: clip, nclip, proto, cmsf (online projection,
    # predictor and momentum branch), xent (a linear classifier on the image features)
    heads: ClassVar[frozenset[str]]
    # the name of the score used for zero-shot transfer and retrieval (paper's default), a score kind
    # registered in nclip.objectives.scores: "clip" (cosine, CLIP head), "nclip" (−L_CE, nCLIP head),
    # "yclip" (yCLIP's S, nCLIP head), or a plugin's own; None: the objective trains no text-aligned
    # head, so evaluation reports k-NN / linear probes instead
    zero_shot: ClassVar[str | None]
    # True: trained by nclip.train.episodic (per-episode prototypes; forward takes per-row targets)
    episodic: ClassVar[bool] = False
    # namespace of the logged nCLIP-head statistics (L_CE, L_EH, L_HE, L_KL and HEAD_STAT_KEYS)
    # that the collapse monitor and the sweep's Fig. B1 curves read; None: no such head
    head_stats_prefix: ClassVar[str | None] = None
    # the image features the probes (linear, k-NN, clustering, realms) read by default, as the
    # objective's paper evaluates: backbone (the tower's own feature; xCLIP Sec. 4.2.1 and CMSF probe
    # the frozen backbone), or a head that offers its output as probe features (Head.probe: clip, the
    # CLIP-head embedding z of ProtoCLIP App. B, nclip, proto); `nclip eval --features` and the run
    # config's eval.probe_features override it
    probe_features: ClassVar[str] = "backbone"
    # the SGD linear-probe recipe of the objective's paper (`nclip eval --probe sgd`;
    # nclip.eval.sgd_recipes.SGD_RECIPES): xclip, cmsf, protoclip
    sgd_probe_recipe: ClassVar[str] = "xclip"
    # augmented views per image in a training batch: 1 = pixels [B, 3, S, S]; 2 = [B, 2, 3, S, S],
    # the online (strong) view first and the target (weak) view second (nclip.data.views)
    views: ClassVar[int] = 1
    # True: built with the run's label space (class names, and a class similarity where the config
    # asks for one): ``build(cfg, run_cfg, label_space=...)``, e.g. PaCo's K centres, ReCo's s
    needs_label_space: ClassVar[bool] = False
    # True: takes several positive captions per image (data.caption_choice all): the text-side head
    # outputs are then [B, C, ...], C caption slots per image, of which ``batch.caption_valid`` [B, C]
    # says which hold a caption (the others are padding, to be left out of the loss); False: the run
    # config refuses caption_choice all in one line
    several_captions: ClassVar[bool] = False
    # True: takes hard negative captions (data.hard_negative_key, data.hard_negatives): the text-side
    # head outputs are then [B, C + N, ...], the last N slots an image's negatives, of which
    # ``batch.negative_valid`` [B, N] says which hold one (nclip.objectives.hard_negatives); False: the
    # run config refuses them in one line
    hard_negatives: ClassVar[bool] = False

    @classmethod
    def build(cls, cfg: ObjectiveConfig, run_cfg=None) -> Objective:
        """The objective for ``cfg``; ``run_cfg`` (the whole RunConfig, when the trainer builds it)
        for sizes that live elsewhere in the config, e.g. CMSF's bank width ``model.cmsf_dim``. An
        objective with ``needs_label_space`` also takes ``label_space`` (a :class:`LabelSpace`)."""
        return cls(cfg)

    @classmethod
    def heads_for(cls, cfg: ObjectiveConfig) -> frozenset[str]:
        """The heads the model builds for ``cfg``: :attr:`heads` (every head the objective may use)
        unless the config leaves some unused, which must then not exist (DDP needs every parameter to
        get a gradient), e.g. ``clip_supcon`` on the text side builds no "supcon" head."""
        return cls.heads

    @classmethod
    def hierarchy_request(cls, cfg: ObjectiveConfig) -> str | None:
        """For an objective with ``needs_label_space``: ``"builtin"`` (the source's built-in class
        hierarchy), a path to a hierarchy file, or None (no class similarity wanted)."""
        return None

    @classmethod
    def label_request(cls, run_cfg) -> LabelRequest | None:
        """The per-row labels the training batches must carry for ``run_cfg`` (None: none), read by
        ``forward(out, batch)`` as ``batch.labels`` and ``batch.true_labels``. A method rather than a
        class attribute: whether labels are wanted can depend on the config (a constraint) and the data
        (labelled or not).
        With :attr:`LabelRequest.frozen` the batches also carry the samples' dataset indices,
        ``batch.index``."""
        return None

    @classmethod
    def check_run(cls, run_cfg) -> None:
        """Refuse (ValueError, one line) a run config this objective cannot train on, e.g. a label
        constraint on data without labels. Called by the config's validation; ``run_cfg`` is the
        whole :class:`nclip.config.RunConfig` (duck-typed here: objectives sit below the config)."""

    def before_step(self, step: int, total_steps: int) -> None:
        """Called by the trainer before every optimizer step (taken or later skipped), with the
        0-based step and ``train.steps``, on every rank and on resume: e.g. a loss weight scheduled
        as a pure function of the step (xCLIP's λ_nCLIP warm-up). Default: nothing."""

    def after_step(self, model: nn.Module, step: int, total_steps: int, taken: torch.Tensor) -> None:
        """Called by the trainer after every optimizer step, with the bare model (no DDP wrapper),
        the 0-based step, ``train.steps`` and ``taken``, a 0-d float tensor on the device: 1 if the
        step was taken, 0 if it was skipped (non-finite). The trainer does not read it on the host
        (:mod:`nclip.train.gate`): an update here must be gated by it on the device, e.g. the
        momentum update of a target encoder. Default: nothing."""

    def attach_frozen_embedding(self, table: torch.Tensor) -> None:
        """Receive the frozen embedding [N, Da] of every training sample (row i = dataset index i)
        asked for by :attr:`LabelRequest.frozen`; called by the trainer before the first step, on
        every start (the table is derived data: it is not checkpointed). Default: refuse."""
        raise NotImplementedError(f"{type(self).__name__} asked for no frozen embedding")

    @classmethod
    def collapse_watch(cls, cfg: ObjectiveConfig) -> CollapseWatch | None:
        """What the collapse monitor watches for a run with this objective and ``cfg`` (None: nothing)."""
        if cls.head_stats_prefix is None:
            return None
        if isinstance(cfg, EntropyWeights):
            return CollapseWatch(cls.head_stats_prefix, cfg.lambda1, cfg.lambda2)
        return CollapseWatch(cls.head_stats_prefix)

    def forward(self, out: EncoderOutput, batch: Batch | None = None) -> dict[str, torch.Tensor]:  # pragma: no cover
        """The loss and named terms of one batch: the model's outputs ``out`` and the
        :class:`~nclip.batch.Batch` whose per-row tensors (``labels``, ``true_labels``, ``index``,
        ``episode``) the objective asked for."""
        raise NotImplementedError
