"""Episodic training (ProtoCLIP Sec. 3.3, Algorithm 1) on top of :mod:`nclip.train.loop`.

An *episode* samples m = ``objective.episode_size`` training pairs with replacement
(``np.random.choice(M, m)`` in Algorithm 1, seeded by (seed, episode)) and then

1. **feature extraction**: the projections h^I, h^T (L2-normalised outputs of the ProtoCLIP heads)
   of all m pairs with the current model in eval mode, each rank encoding a contiguous 1/W of them,
   gathered on every rank;
2. **prototype construction**: on rank 0, K-Means of each modality (and of the external teacher's
   PCA-reduced caption features) into K clusters (:mod:`nclip.train.kmeans`), the cluster
   assignments, and Prototype Back Translation (``functional.pbt``); the results are broadcast to every
   rank (``nclip.distributed.broadcast_no_grad``) and loaded into the objective
   (:meth:`ProtoclipObjective.set_episode`);
3. **model training**: ⌊m / B⌋ optimizer steps over a seeded permutation of the episode's pairs
   (an incomplete last batch is dropped, as in the authors' code), by the loop's own step
   machinery (optimizer, schedule, non-finite handling, checkpoints, metrics.jsonl, final eval).
   Each batch carries the episode positions of its rows, from which the objective reads the
   rows' cluster assignments.

Budget: ``train.steps`` optimizer steps of ``train.batch_size`` pairs, as for every objective, so
n_episode = ⌈steps / ⌊m / B⌋⌉ ≈ n_epoch · M / m (Sec. 3.3). Extraction is extra compute (the
paper's Fig. A.9: 31 % of an episode), as in the paper.

Augmentation: each image is augmented independently in steps 1 and 3 (seeded by (seed, episode,
step, position)), which gives the implicit contrast of App. A.3; ``data.augment`` holds the light
augmentation (``color_jitter_prob``, ``grayscale_prob``).

Warm-up and locked-image episodes train with L_CLIP alone and skip steps 1-2. From
``objective.lit_episode`` on, the image side is locked (:func:`nclip.models.locking.lock_image_side`,
the mechanism of ``model.vision.lock``): the image tower runs without gradients and in eval mode,
and neither it nor the image heads get a gradient, so the optimizer leaves them bitwise as they are.

Per-episode timings of the three steps (the paper's Fig. A.9) and the K-Means objectives go to
``RUN/episodes.jsonl`` (rank 0), one line per finished episode.

Resume: a checkpoint holds the objective's episode state (labels and prototypes), so a run resumed
in the middle of an episode continues with the same prototypes; a run resumed at an episode
boundary builds the next episode as an uninterrupted run would.

Sources: episodes need random access, so the map-style ones: synthetic, digits, csv and folder (a row
whose image is unusable is replaced by the next good row, as in :mod:`nclip.data.csv_source`).
WebDataset shards are refused. ``train.strategy: fsdp`` is refused too (extraction calls the model
outside the sharded wrapper).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from nclip import distributed as collectives
from nclip.batch import Batch
from nclip.config import RunConfig
from nclip.data.labels import tag_captions
from nclip.data.sources import build_dataset
from nclip.data.transforms import augment, to_tensor
from nclip.data.workers import check_worker_socket_path, loader_workers
from nclip.defaults import MAP_SOURCES, USER_LABEL
from nclip.errors import NclipError
from nclip.jsonio import truncate_jsonl, writing
from nclip.models.locking import lock_image_side
from nclip.objectives import functional, plan_for
from nclip.precision import autocast_dtype, to_float32, tower_autocast
from nclip.train.kmeans import kmeans
from nclip.train.rundir import (
    EPISODES_LOG,  # one of the run's files: --force clears it, refusals keep it
)

EPISODE_STREAM = 0xE915  # separates episode sampling/augmentation from other random streams
EXTRACT, TRAIN = 0, 1  # phases (seeds of the two independent augmentations)


def steps_per_episode(cfg: RunConfig) -> int:
    return max(cfg.objective.episode_size // cfg.train.batch_size, 1)


def num_episodes(cfg: RunConfig) -> int:
    return math.ceil(cfg.train.steps / steps_per_episode(cfg))


def episode_indices(seed: int, dataset_size: int, episode_size: int, episode: int) -> np.ndarray:
    """The dataset indices of an episode's m pairs, drawn uniformly *with replacement* (Alg. 1)."""
    return np.random.default_rng([seed, EPISODE_STREAM, episode, 0]).integers(0, dataset_size, episode_size)


def episode_order(seed: int, episode_size: int, episode: int) -> np.ndarray:
    """The order in which step 3 visits the episode's positions (a seeded permutation)."""
    return np.random.default_rng([seed, EPISODE_STREAM, episode, 1]).permutation(episode_size)


class EpisodePairs(Dataset):
    """key (episode, phase, position, index) → (augmented image [3, S, S], caption); the
    augmentation of a key is a pure function of (seed, episode, phase, position). With
    ``data.tagging`` the caption is the tagging caption of (seed, episode, index): re-drawn every
    episode, the same in an episode's extraction and training phases (xCLIP Sec. 4.3)."""

    def __init__(self, samples, cfg: RunConfig):
        self.samples, self.cfg, self.tags = samples, cfg, tag_captions(cfg)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key):
        episode, phase, position, index = key
        s = self.samples[int(index)]
        rng = np.random.default_rng([self.cfg.seed, EPISODE_STREAM, episode, 2 + phase, position])
        caption = s.caption
        if self.tags is not None:
            tags, key = self.tags
            caption = tags(episode, int(index), s.labels[key])
        return to_tensor(augment(s.image, self.cfg.data.image_size, self.cfg.data.augment, rng)), caption


class _Collate:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, items) -> Batch:
        images, captions = zip(*items)
        ids, mask = self.tokenizer(list(captions))
        return Batch(torch.stack(images), ids, mask)


class CsvSamples:
    """Random access to the (image, caption) pairs of a CSV source: item i → an object with
    ``image`` (uint8 [H, W, 3]), ``caption`` and ``labels`` ({"label": class id} with
    ``data.csv_label_key``); an unusable row is replaced by the next good one."""

    def __init__(self, cfg: RunConfig):
        from nclip.data.csv_source import CsvTrainPairs

        table = CsvTrainPairs(cfg)  # the table only (captions, or class names with data.tagging; labels)
        self.file, self.images, self.captions, self.ids = table.file, table.images, table.captions, table.labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        from types import SimpleNamespace

        from nclip.data.bad_samples import MAX_BAD_IN_A_ROW
        from nclip.data.csv_source import load_pair

        n = len(self.images)
        for attempt in range(min(MAX_BAD_IN_A_ROW, n)):
            row = (index + attempt) % n
            out = load_pair(self.images[row], self.captions[row])
            if not isinstance(out, str):
                labels = {} if self.ids is None else {USER_LABEL: int(self.ids[row])}
                return SimpleNamespace(image=out[0], caption=out[1], labels=labels)
        raise NclipError(f"{self.file}: {MAX_BAD_IN_A_ROW} unusable rows in a row from row {index + 2}")


def train_samples(cfg: RunConfig):
    """The training pairs with random access: a built-in dataset, a folder or a CSV source."""
    return CsvSamples(cfg) if cfg.data.source == "csv" else build_dataset(cfg, "train")


def _check(cfg: RunConfig, world_size: int) -> None:
    if not plan_for(cfg).episodic:
        raise NclipError(f"objective {cfg.objective.name!r} is not episodic")
    if cfg.data.source not in MAP_SOURCES:
        raise NclipError(f"episodic training needs random access to the training set: data.source "
                         f"{cfg.data.source} is not supported (use {', '.join(MAP_SOURCES)})")
    if world_size > 1 and cfg.train.strategy == "fsdp":
        raise NclipError("episodic training does not support train.strategy fsdp; use ddp")



def build_prototypes(oc, h_i: torch.Tensor, h_t: torch.Tensor, teacher: torch.Tensor | None,
                     seed: int) -> tuple[dict, dict]:
    """Step 2 of an episode (Sec. 3.1-3.2; Algorithm 1, lines 31-40): K-Means of each modality (and
    of the external teacher's features) into K clusters, the assignments, PBT and the soft-target
    prototypes; (the state for :meth:`ProtoclipObjective.set_episode`, timings and statistics).

    oc: the objective config; h_i, h_t: [m, d_h] the episode's normalised projections; teacher:
    [m, D'] the episode's PCA-reduced teacher features (None: no external teacher).

    Soft targets (Eq. 5): with ``soft_targets_from: teacher`` (the default) y = softmax(C[label]·Cᵀ/τ_y)
    uses the *teacher's own* K-Means prototypes (C^T for the image student, C^I for the text student,
    C^external for both), as Eq. 5 writes them (S_k = C^T · c_k^T) and the authors' code does; the
    ``{direction}_targets`` entries carry them. ``translated`` leaves them out, and the objective then
    builds the targets from the classifier's own (PBT-translated) centroids, as Algorithm 1's
    pseudocode (line 58) does.
    """
    k, ke, m = oc.clusters, oc.k_ext, h_i.shape[0]
    t0 = time.perf_counter()
    run = lambda x, kk, j: kmeans(x, kk, niter=oc.kmeans_iters, nredo=oc.kmeans_nredo,  # noqa: E731
                                  seed=seed + j, method=oc.kmeans_method)
    km_i, km_t = run(h_i, k, 0), run(h_t, k, 1)
    km_e = run(teacher, ke, 2) if teacher is not None else None
    t1 = time.perf_counter()
    dev = h_i.device
    lab_i, lab_t = km_i.labels.to(dev), km_t.labels.to(dev)
    lab_e = km_e.labels.to(dev) if km_e is not None else torch.zeros(m, dtype=torch.long, device=dev)
    state = {"labels": torch.stack([lab_i, lab_t, lab_e], 1)}  # [m, 3]
    if oc.pbt:  # Sec. 3.2: teacher clusters → centroids of the student's own features
        state["i2t_centroids"], state["i2t_valid"] = functional.pbt(h_i, lab_t, k, return_mask=True)  # C_PBT→I
        state["t2i_centroids"], state["t2i_valid"] = functional.pbt(h_t, lab_i, k, return_mask=True)  # C_PBT→T
    else:  # "w/o PBT": the teacher's prototypes themselves (C^T for images, C^I for texts)
        state["i2t_centroids"], state["i2t_valid"] = km_t.centroids.to(dev), torch.bincount(lab_t, minlength=k) > 0
        state["t2i_centroids"], state["t2i_valid"] = km_i.centroids.to(dev), torch.bincount(lab_i, minlength=k) > 0
    if oc.soft_targets_from == "teacher":  # Eq. 5: the teacher's own prototypes
        state["i2t_targets"], state["t2i_targets"] = km_t.centroids.to(dev), km_i.centroids.to(dev)
    if km_e is not None:  # the external prototypes live in another space: always PBT
        state["i2e_centroids"], state["i2e_valid"] = functional.pbt(h_i, lab_e, ke, return_mask=True)
        state["t2e_centroids"], state["t2e_valid"] = functional.pbt(h_t, lab_e, ke, return_mask=True)
        if oc.soft_targets_from == "teacher":
            state["i2e_targets"] = state["t2e_targets"] = km_e.centroids.to(dev)
    t2 = time.perf_counter()
    stats = dict(kmeans_s=t1 - t0, pbt_s=t2 - t1, kmeans_method=km_i.method,
                 kmeans_obj_image=km_i.objective, kmeans_obj_text=km_t.objective,
                 empty_image=int(k - (torch.bincount(lab_i, minlength=k) > 0).sum()),
                 empty_text=int(k - (torch.bincount(lab_t, minlength=k) > 0).sum()))
    if km_e is not None:
        stats.update(kmeans_obj_ext=km_e.objective, empty_ext=int(ke - (torch.bincount(lab_e, minlength=ke) > 0).sum()))
    return state, stats

class EpisodicData:
    """The loop's data source for an episodic objective: this rank's batches from ``start`` to
    ``train.steps`` (with ``episode``: the rows' positions in their episode), building each episode's
    prototypes first."""

    skipped = 0  # built-in samples are never bad

    def __init__(self, cfg: RunConfig, run_dir: Path, model, objective, optimizer, ctx, start: int,
                 state: dict | None = None):
        _check(cfg, ctx.world_size)
        self.cfg, self.oc, self.run_dir = cfg, cfg.objective, Path(run_dir)
        self.model, self.objective, self.optimizer, self.ctx = model, objective, optimizer, ctx
        self.start, self.steps = start, cfg.train.steps
        self.samples = train_samples(cfg)
        if len(self.samples) == 0:
            raise NclipError("the training dataset is empty")
        self.dataset = EpisodePairs(self.samples, cfg)
        self.collate = _Collate(model.tokenizer)
        self.spe = steps_per_episode(cfg)
        self.device = ctx.device
        self.teacher: torch.Tensor | None = None  # [M, D'] PCA-reduced teacher features, rank 0
        self.timings: dict = {}

    def state(self) -> dict:
        return {"kind": "map", "skipped": 0}

    def __len__(self) -> int:
        return self.steps - self.start

    # ---- the three steps --------------------------------------------------------------------

    def _loader(self, keys: list[list[tuple]]) -> DataLoader:
        workers = loader_workers(self.cfg, self.device)  # a loader per phase: workers are not kept
        if workers > 0:
            check_worker_socket_path()
        return DataLoader(self.dataset, batch_sampler=keys, collate_fn=self.collate, num_workers=workers,
                          pin_memory=self.device.type == "cuda",
                          generator=torch.Generator().manual_seed(self.cfg.seed))  # no draw from the global RNG

    @torch.no_grad()
    def _extract(self, episode: int, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 1: (h^I, h^T) [m, d_h] of the episode, normalised, float32, on every rank."""
        m, world, rank = len(indices), self.ctx.world_size, self.ctx.rank
        per_rank = math.ceil(m / world)
        mine = np.minimum(np.arange(rank * per_rank, (rank + 1) * per_rank), m - 1)  # padded with the last
        local_batch = max((self.oc.extract_batch_size or self.cfg.train.batch_size) // world, 1)
        keys = [[(episode, EXTRACT, int(p), int(indices[p])) for p in mine[i : i + local_batch]]
                for i in range(0, per_rank, local_batch)]
        amp = autocast_dtype(self.cfg.train.precision, self.device)
        was_training = self.model.training
        self.model.eval()
        img, txt = [], []
        try:
            for batch in self._loader(keys):
                batch = batch.to(self.device)
                with tower_autocast(self.device, amp):
                    hi = self.model.encode_image(batch.pixels)["proto"]
                    ht = self.model.encode_text(batch.ids, batch.mask)["proto"]
                img.append(F.normalize(to_float32(hi), dim=-1))
                txt.append(F.normalize(to_float32(ht), dim=-1))
        finally:
            self.model.train(was_training)
        h_i = collectives.all_gather_no_grad(torch.cat(img))[:m]  # [m, d_h] in position order
        h_t = collectives.all_gather_no_grad(torch.cat(txt))[:m]
        return h_i, h_t

    def _prototypes(self, episode: int, indices: np.ndarray, h_i: torch.Tensor, h_t: torch.Tensor) -> dict:
        """Step 2 on rank 0 (:func:`build_prototypes`), its timings and K-Means statistics kept."""
        seed = (self.cfg.seed * 1_000_003 + episode * 7) % (2**31 - 1)
        teacher = self.teacher[torch.from_numpy(indices)] if self.oc.use_ext else None
        state, stats = build_prototypes(self.oc, h_i, h_t, teacher, seed)
        self.timings.update(stats)
        return state

    def _prepare(self, episode: int) -> None:
        """Steps 1-2 of ``episode`` (or nothing in warm-up/LiT episodes), then its lr scales."""
        obj = self.objective
        self.timings = {"extract_s": 0.0, "kmeans_s": 0.0, "pbt_s": 0.0}
        if obj.proto_active(episode):
            indices = episode_indices(self.cfg.seed, len(self.samples), self.oc.episode_size, episode)
            t0 = time.perf_counter()
            h_i, h_t = self._extract(episode, indices)
            self.timings["extract_s"] = time.perf_counter() - t0
            state = self._prototypes(episode, indices, h_i, h_t) if self.ctx.is_main else None
            t1 = time.perf_counter()
            state = _broadcast(state, self.device)
            self.timings["pbt_s"] = self.timings.get("pbt_s", 0.0) + time.perf_counter() - t1
            obj.set_episode(episode, state.pop("labels"), **state)
        else:
            obj.set_episode(episode)
        self.timings.update(proto=obj.proto_active(episode), lit=self._lock_image(episode))

    def _load_teacher(self) -> None:
        if not (self.oc.use_ext and self.ctx.is_main) or self.teacher is not None:
            return
        from nclip.train.teacher import pca, teacher_features

        feats, cached = teacher_features(self.cfg, self.device, log=lambda s: print(f"nclip: {s}", file=sys.stderr))
        if feats.shape[0] != len(self.samples):
            raise NclipError(f"teacher features cover {feats.shape[0]} captions, "
                             f"the training set has {len(self.samples)}")
        self.teacher = pca(feats, self.oc.ext_pca_dim)
        self.teacher_cached = cached

    # ---- iteration ----------------------------------------------------------------------------

    def __iter__(self):
        cfg, world, rank = self.cfg, self.ctx.world_size, self.ctx.rank
        whole, local = cfg.train.batch_size, cfg.train.batch_size // world
        log = _EpisodeLog(self.run_dir / EPISODES_LOG, self.ctx.is_main)
        first_episode = self.start // self.spe
        log.truncate(first_episode)
        if any(self.objective.proto_active(e) for e in range(first_episode, num_episodes(cfg))):
            self._load_teacher()
        step = self.start
        while step < self.steps:
            episode, j0 = divmod(step, self.spe)
            resumed = j0 > 0 and int(self.objective.episode) == episode
            if resumed:  # mid-episode resume: the checkpoint restored this episode's state
                self.timings = {"resumed": True, "lit": self._lock_image(episode)}
            else:
                self._prepare(episode)
            last = min((episode + 1) * self.spe, self.steps)
            indices = episode_indices(cfg.seed, len(self.samples), self.oc.episode_size, episode)
            order = episode_order(cfg.seed, self.oc.episode_size, episode)
            rows = [order[j * whole + rank * local : j * whole + (rank + 1) * local]
                    for j in range(j0, last - episode * self.spe)]
            keys = [[(episode, TRAIN, int(p), int(indices[p])) for p in r] for r in rows]
            t_train = time.perf_counter()
            for r, batch in zip(rows, self._loader(keys)):
                batch.episode = torch.from_numpy(r.astype(np.int64))
                yield batch
                step += 1
            log.write({"episode": episode, "first_step": episode * self.spe + j0,
                       "steps": last - episode * self.spe - j0,
                       **self.timings, "train_s": time.perf_counter() - t_train})

    def _lock_image(self, episode: int) -> bool:
        """Locked-image tuning: the image side locked from ``lit_episode`` on (for good: episodes
        only go forward, and a resumed run locks again here). Returns lit."""
        lit = self.oc.lit_episode is not None and episode >= self.oc.lit_episode
        if lit:
            lock_image_side(self.model)
        return lit


# (name, dtype) of the episode state broadcast from rank 0, in a fixed order
_STATE = [("labels", torch.long)] + [(f"{d}_{p}", dt) for d in ("i2t", "t2i", "i2e", "t2e")
                                     for p, dt in (("centroids", torch.float32), ("valid", torch.bool),
                                                   ("targets", torch.float32))]


def _broadcast(state: dict | None, device: torch.device) -> dict:
    """Rank 0's episode state on every rank: per entry a shape header [3] (−1: absent), then the
    tensor (bools travel as uint8)."""
    if not collectives.is_distributed():
        return {k: v for k, v in state.items() if v is not None}
    out = {}
    for name, dtype in _STATE:
        value = state.get(name) if state is not None else None
        header = torch.full((3,), -1, dtype=torch.long, device=device)
        if value is not None:
            header[: value.ndim] = torch.tensor(value.shape, dtype=torch.long)
            header[2] = value.ndim
        header = collectives.broadcast_no_grad(header)
        if int(header[2]) < 0:
            continue
        shape = tuple(int(s) for s in header[: int(header[2])])
        wire = torch.uint8 if dtype == torch.bool else dtype
        buf = (value.to(device=device, dtype=wire) if value is not None
               else torch.empty(shape, dtype=wire, device=device))
        out[name] = collectives.broadcast_no_grad(buf).to(dtype)
    return out


class _EpisodeLog:
    """RUN/episodes.jsonl on rank 0: one JSON line per finished episode."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def truncate(self, first_episode: int) -> None:
        """Drop the episodes logged from ``first_episode`` on (they run again after a resume)."""
        if self.enabled:
            truncate_jsonl(self.path, lambda row: row.get("episode", math.inf) < first_episode)

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with writing(self.path), self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
