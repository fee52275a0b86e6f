"""ProtoCLIP (Chen et al. 2022, "Prototypical Contrastive Language Image Pretraining") as a trainer
objective: w_clip·L_CLIP + w_proto·L_Proto (+ w_ext·L_Proto^external), Eq. 1-6 and Sec. 3.2.

L_CLIP (Eq. 1) acts on the CLIP-head embeddings z; the prototype losses act on the L2-normalised
outputs h of the ProtoCLIP projection heads (the model's "proto" head, on top of z, Fig. 2). The
prototypes are built once per *episode* (Sec. 3.3) by :mod:`nclip.train.episodic`, which hands them
to :meth:`ProtoclipObjective.set_episode`; every batch then carries the episode positions of its
rows (``Batch.episode``), from which the objective looks up the teacher cluster of each row.

Directions (Algorithm 1, lines 38-49): the image student is scored against the *text* prototypes
translated into image space by PBT, C_PBT→I = PBT(h^I, label^T), with targets from label^T; the
text student against C_PBT→T = PBT(h^T, label^I) with label^I. Without PBT (``pbt: false``, the
"w/o PBT" ablation of Tab. 1(a)) the students are scored against the teacher's own prototypes C^T,
C^I. The external teacher's prototypes (K-Means of its PCA-reduced caption features) are always
PBT-translated into both spaces (they live in another space), L_ext = (L_I→E + L_T→E) / 2.

Choices where the paper is ambiguous (each one a config key):

- Soft targets (Eq. 5): Eq. 5 (S_k = C^T · c_k^T) and the authors' code compute them from the
  teacher's own K-Means prototypes; Algorithm 1's pseudocode (line 58) from the *translated*
  centroids (``target_centroids[label] @ target_centroids.T``). Default ``soft_targets_from:
  teacher`` (Eq. 5); ``translated`` gives Algorithm 1's reading.
- "w/o K-Means" (Tab. 1(a)): ``kmeans_iters: 0`` keeps K randomly drawn episode samples as the
  prototypes (K-Means' initialisation, no Lloyd iteration); see :mod:`nclip.train.kmeans`.
- The external term uses hard targets by default (``t_target_ext: 0``), as the authors' code does
  (``teacher_temperature=-1``); the paper only says "in a similar way of Eq. 4".
- Locked-image tuning (App. A.1): from ``lit_episode`` on the image tower and the image heads are
  locked (``nclip.models.locking``, applied by the episodic driver) and, as in the authors' code, the loss is
  L_CLIP alone (no clustering is done in those episodes).
- InfoNCE-only warm-up episodes (Tab. A.3: 40): ``warmup_episodes``, L_CLIP alone, as the
  authors' code.
- Empty clusters are dropped from the prototype classifier (see :func:`functional.pbt`).
- τ_Proto is learnable, initialised to 0.07 and clamped at 1/100 like CLIP's (App. A.1), stored
  as s = ln(1/τ) in this objective (the trainer optimises objective parameters too).

Distributed: the prototype losses are per-row means with no batch statistic (DDP's averaging makes
them global); the prototypes are identical on every rank (rank 0 clusters and broadcasts); L_CLIP
uses the global batch as CLIP does.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from nclip.batch import Batch
from nclip.objectives import functional
from nclip.objectives.base import ClipReduction, EncoderOutput, Objective

LOG_SCALE_MAX = math.log(100.0)


class ProtoclipConfig(ClipReduction):
    name: Literal["protoclip"] = "protoclip"
    # loss weights, Eq. 6 and Sec. 3.2 (the authors' code: w_clip, w_proto, w_proto_external)
    w_clip: float = Field(1.0, ge=0, description="weight of L_CLIP (Eq. 1)")
    w_proto: float = Field(1.0, ge=0, description="weight of L_Proto (Eq. 4)")
    w_ext: float = Field(1.0, ge=0, description="weight of L_Proto^external; 0 = no external teacher")
    # prototype loss (Eq. 3-5)
    t_proto_init: float = Field(0.07, gt=0, le=1, description="initial learnable τ_Proto (App. A.1)")
    t_target: float = Field(0.01, description="τ_y of Eq. 5 (Fig. 4(b): 0.01); <= 0: hard targets")
    t_target_ext: float = Field(0.0, description="τ_y of the external term; <= 0: hard (authors' code)")
    # C of Eq. 5's soft targets: the teacher's own prototypes (Eq. 5, authors' code) | the translated
    # PBT centroids the student is scored against (Algorithm 1's pseudocode, line 58)
    soft_targets_from: Literal["teacher", "translated"] = "teacher"
    pbt: bool = True  # Prototype Back Translation (Sec. 3.2); false: the "w/o PBT" ablation
    # episodes (Sec. 3.3, Tab. A.3)
    episode_size: int = Field(200_000, ge=2, description="m: pairs sampled (with replacement) per episode")
    clusters: int = Field(20_000, ge=2, description="K: prototypes per modality (10 pairs per prototype)")
    ext_clusters: int | None = Field(None, ge=2, description="K of the external teacher (None: clusters)")
    # Lloyd iterations (App. A.1: 20); 0: K random episode samples as the prototypes (Tab. 1(a) "w/o K-Means")
    kmeans_iters: int = Field(20, ge=0, description="K-Means iterations; 0: random samples, no K-Means")
    kmeans_nredo: int = Field(1, ge=1, description="K-Means restarts (the best objective is kept)")
    kmeans_method: Literal["auto", "flat", "two_level"] = "auto"  # see nclip.train.kmeans
    extract_batch_size: int | None = Field(None, ge=1, description="feature-extraction batch (None: train)")
    warmup_episodes: int = Field(0, ge=0, description="InfoNCE-only episodes first (Tab. A.3: 40)")
    lit_episode: int | None = Field(None, ge=0, description="locked-image tuning from this episode on")
    # external teacher (Sec. 3.2; App. A.1: RoBERTa-large, PCA to 64)
    ext_encoder: str | None = None  # a local transformers encoder directory; None: the bundled MiniLM
    ext_pca_dim: int | None = Field(64, ge=1, description="PCA dimensions of the teacher (None: none)")
    # how the teacher's token states become a caption feature: mean (sentence-transformers, the bundled
    # MiniLM), eot (the last non-padding token: a CLIP text encoder, Fig. 4(d)), cls (the first token)
    ext_pooling: Literal["mean", "eot", "cls"] = "mean"
    ext_max_length: int = Field(64, ge=4, le=512)
    ext_batch_size: int = Field(256, ge=1)
    ext_cache_dir: str | None = None  # None: $NCLIP_CACHE or ~/.cache/nclip

    @model_validator(mode="after")
    def _consistent(self):
        for key in ("clusters", "ext_clusters"):
            k = getattr(self, key)
            if k is not None and k > self.episode_size:
                raise ValueError(f"{key} {k} exceeds episode_size {self.episode_size}")
        if self.lit_episode is not None and self.lit_episode < self.warmup_episodes:
            raise ValueError(f"lit_episode {self.lit_episode} precedes the end of warm-up ({self.warmup_episodes})")
        return self

    @property
    def use_ext(self) -> bool:
        return self.w_ext > 0

    @property
    def k_ext(self) -> int:
        return self.ext_clusters or self.clusters


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


# the per-episode state: (buffer name, dtype). Shapes come from the first episode (or checkpoint).
_DIRECTIONS = ("i2t", "t2i", "i2e", "t2e")  # student 2 teacher
_EPISODE_BUFFERS = [("episode_labels", torch.long)] + [
    (f"{d}_{part}", dt) for d in _DIRECTIONS for part, dt in (("centroids", torch.float32), ("valid", torch.bool),
                                                               ("targets", torch.float32))
]


class ProtoclipObjective(Objective):
    heads = frozenset({"clip", "proto"})
    zero_shot = "clip"  # App. B: zero-shot transfer uses z, the CLIP embeddings
    # App. B: "frozen 1024-dimensional image representations (z^I) before normalization are used for
    # linear probing"; k-NN (DINO's) on the same z, normalised. z is nclip's CLIP-head embedding
    # ("emb"), not the 128-d prototype projection h = g(z) (that one is --features proto)
    probe_features = "clip"
    sgd_probe_recipe = "protoclip"  # App. B: SGD for ImageNet
    episodic = True

    def __init__(self, cfg: ProtoclipConfig):
        super().__init__()
        self.cfg = cfg
        # s = ln(1/τ_Proto), clamped at ln 100 like CLIP's logit scale (App. A.1)
        self.logit_scale_proto = nn.Parameter(torch.tensor(math.log(1.0 / cfg.t_proto_init)))
        self.register_buffer("episode", torch.tensor(-1, dtype=torch.long))  # the episode of the state
        # its host copy, read by every forward (proto_active) without reading the device: kept equal
        # to the buffer by set_episode and by loading a state dict, the only writers of the buffer
        self._episode = -1
        for name, dtype in _EPISODE_BUFFERS:
            self.register_buffer(name, torch.zeros(0, dtype=dtype))

    # ---- episode state --------------------------------------------------------------------

    def proto_active(self, episode: int | None = None) -> bool:
        """Whether the prototype terms are on in ``episode`` (default: the loaded one)."""
        e = self._episode if episode is None else episode
        if e < self.cfg.warmup_episodes:
            return False
        if self.cfg.lit_episode is not None and e >= self.cfg.lit_episode:
            return False
        return self.cfg.w_proto > 0 or self.cfg.use_ext

    @torch.no_grad()
    def set_episode(self, episode: int, labels: torch.Tensor | None = None, **state: torch.Tensor | None) -> None:
        """Load an episode's state (identical on every rank).

        labels: [m, 3] int64, per episode position: (label^I, label^T, label^E) (label^E = 0 without
            an external teacher). state: ``{direction}_centroids`` [K, d_h], ``{direction}_valid``
            bool [K], ``{direction}_targets`` [K, d'] (soft-target centroids, only with
            ``soft_targets_from: teacher``) for direction in i2t, t2i, i2e, t2e; missing ones are
            emptied. The buffers are resized in place, so references to them stay valid.
        """
        self.episode.fill_(episode)
        self._episode = int(episode)
        values = {"episode_labels": labels, **state}
        for name, dtype in _EPISODE_BUFFERS:
            buf = getattr(self, name)
            value = values.get(name)
            if value is None:
                buf.resize_(0)
            else:
                buf.resize_(value.shape).copy_(value.to(device=buf.device, dtype=dtype))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name, _ in _EPISODE_BUFFERS:  # take the checkpoint's shapes (resized in place)
            if prefix + name in state_dict:
                getattr(self, name).resize_(state_dict[prefix + name].shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "episode" in state_dict:  # loading (resume) reads it once, not a training step
            self._episode = int(state_dict[prefix + "episode"])

    # ---- loss -------------------------------------------------------------------------------

    def t_proto(self) -> torch.Tensor:
        return self.logit_scale_proto.clamp(max=LOG_SCALE_MAX).exp().reciprocal()

    def _direction(self, name: str, h: torch.Tensor, labels: torch.Tensor, t_proto, t_target: float) -> dict:
        targets = getattr(self, f"{name}_targets")
        return functional.proto_terms(
            h, getattr(self, f"{name}_centroids"), labels, t_proto, t_target,
            valid=getattr(self, f"{name}_valid"), teacher_centroids=targets if targets.numel() else None,
        )

    def forward(self, out: EncoderOutput, batch: Batch):
        """``batch.episode``: [B] int64 episode positions of the batch's rows (given by the episodic data)."""
        rows = batch.episode
        cfg = self.cfg
        clip = functional.clip_terms(out.image["clip"], out.text["clip"], out.logit_scale,
                                     global_batch=cfg.global_batch, reduction=cfg.clip_reduction)
        logged = {f"clip/{k}": v for k, v in clip.items()}
        loss = cfg.w_clip * clip["loss"]
        h_i = F.normalize(_at_least_float32(out.image["proto"]), dim=-1)  # [B, d_h]
        h_t = F.normalize(_at_least_float32(out.text["proto"]), dim=-1)  # [B, d_h]
        t_proto = self.t_proto()
        if not self.proto_active():
            # keep every parameter in the graph (zero gradient): DDP expects a gradient for each
            return {"loss": loss + 0.0 * (h_i.sum() + h_t.sum() + t_proto), **logged}
        if rows is None or self.episode_labels.numel() == 0:
            raise ValueError("ProtoCLIP needs an episode's prototypes and the batch's episode rows: "
                             "train it with nclip.train.episodic (nclip train does so for episodic objectives)")
        labels = self.episode_labels[rows]  # [B, 3]: label^I, label^T, label^E
        total = 0.0 * t_proto
        if cfg.w_proto > 0:
            i2t = self._direction("i2t", h_i, labels[:, 1], t_proto, cfg.t_target)  # image ← text prototypes
            t2i = self._direction("t2i", h_t, labels[:, 0], t_proto, cfg.t_target)  # text ← image prototypes
            l_proto = (i2t["loss"] + t2i["loss"]) / 2  # Eq. 4 (mean of both directions, Algorithm 1)
            total = total + cfg.w_proto * l_proto
            logged.update({"proto/L_proto": l_proto, "proto/acc_i2t": i2t["acc"], "proto/acc_t2i": t2i["acc"],
                           "proto/L_i2t": i2t["loss"], "proto/L_t2i": t2i["loss"]})
        if cfg.use_ext:
            i2e = self._direction("i2e", h_i, labels[:, 2], t_proto, cfg.t_target_ext)
            t2e = self._direction("t2e", h_t, labels[:, 2], t_proto, cfg.t_target_ext)
            l_ext = (i2e["loss"] + t2e["loss"]) / 2
            total = total + cfg.w_ext * l_ext
            logged.update({"proto/L_ext": l_ext, "proto/acc_i2e": i2e["acc"], "proto/acc_t2e": t2e["acc"]})
        logged["proto/t_proto"] = t_proto.detach()
        # heads unused by a disabled term still get a (zero) gradient, for DDP
        return {"loss": loss + total + 0.0 * (h_i.sum() + h_t.sum()), **logged}
