"""ProtoCLIP: PBT and the prototypical loss against float64 transcriptions of the paper (Eq. 3-5,
Algorithm 1), the episode sampler, K-Means, the external-teacher cache, the light augmentation, an
end-to-end episodic run through the CLI (warm-up, timings, locked-image tuning) and 2-rank
equality of the loss, the gathered features and the broadcast prototypes."""

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from batches import row_batch
from nclip.cli import main
from nclip.config import resolve
from nclip.objectives import functional
from nclip.objectives.base import EncoderOutput
from nclip.objectives.protoclip import ProtoclipConfig, ProtoclipObjective
from nclip.train import episodic, teacher
from nclip.train import kmeans as km
from nclip.train.logbook import WALL_CLOCK

from references import ref_clip_algorithm1, ref_proto_loss

# ---- straight transcriptions of Algorithm 1, in float64 with loops ---------------------------


def ref_pbt(features, labels, k):
    """Algorithm 1's PBT with its loop over clusters; empty clusters stay zero (torch.zeros)."""
    out = torch.zeros(k, features.shape[1], dtype=features.dtype)
    for c in range(k):
        idx = torch.where(labels == c)[0]
        if len(idx):
            out[c] = features[idx].mean(0)
    return out


def _unit(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    return torch.nn.functional.normalize(x, dim=-1)


@pytest.mark.parametrize("seed,m,k,d", [(0, 1, 1, 3), (1, 50, 7, 5), (2, 30, 40, 4)])
def test_pbt_matches_algorithm1_values_grads_and_empty_clusters(seed, m, k, d):
    feats = _unit(m, d, seed=seed).requires_grad_()
    g = torch.Generator().manual_seed(seed + 10)
    labels = torch.randint(0, max(k // 2, 1), (m,), generator=g)  # the upper half of clusters stays empty
    ours, valid = functional.pbt(feats, labels, k, return_mask=True)
    ref = ref_pbt(feats, labels, k)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    assert valid.tolist() == [bool((labels == c).any()) for c in range(k)]
    assert torch.all(ours[~valid] == 0)
    w = torch.randn(k, d, generator=g, dtype=torch.float64)
    (ga,) = torch.autograd.grad((ours * w).sum(), feats)
    (gr,) = torch.autograd.grad((ref * w).sum(), feats)
    torch.testing.assert_close(ga, gr, rtol=1e-12, atol=1e-12)


def test_pbt_errors():
    with pytest.raises(ValueError, match="lie in"):
        functional.pbt(torch.randn(4, 2), torch.tensor([0, 1, 2, 3]), 3)
    with pytest.raises(ValueError, match="1-D"):
        functional.pbt(torch.randn(4, 2), torch.tensor([0, 1]), 3)


@pytest.mark.parametrize("t_target,from_teacher",
                         [(0.01, False), (0.5, False), (0.1, True), (0.0, False), (-1.0, False)])
@pytest.mark.parametrize("seed,b,k", [(0, 1, 3), (3, 9, 6)])
def test_proto_loss_matches_algorithm1(seed, b, k, t_target, from_teacher):
    h = _unit(b, 5, seed=seed).requires_grad_()
    c = (0.8 * _unit(k, 5, seed=seed + 1)).requires_grad_()
    c_t = _unit(k, 5, seed=seed + 2) if from_teacher else None
    labels = torch.randint(0, k, (b,), generator=torch.Generator().manual_seed(seed))
    t = torch.tensor(0.07, dtype=torch.float64, requires_grad=True)
    ours = functional.proto_terms(h, c, labels, t, t_target, teacher_centroids=c_t)["loss"]
    ref = ref_proto_loss(h, c, labels, t, t_target, c_t)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    for a, r in zip(torch.autograd.grad(ours, [h, c, t]), torch.autograd.grad(ref, [h, c, t])):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-12)


def test_proto_loss_drops_empty_clusters():
    h = _unit(6, 4, seed=5)
    c = _unit(5, 4, seed=6)
    valid = torch.tensor([True, False, True, True, False])
    labels = torch.tensor([0, 2, 3, 3, 0, 2])
    keep = valid.nonzero().squeeze(1)
    remap = {int(o): n for n, o in enumerate(keep)}
    for tt in (0.01, 0.0):
        ours = functional.proto_terms(h, c, labels, 0.1, tt, valid=valid)
        ref = ref_proto_loss(h, c[keep], torch.tensor([remap[int(x)] for x in labels]), 0.1, tt)
        torch.testing.assert_close(ours["loss"], ref)
    # without the mask a zero (empty) prototype competes with logit 0: a different loss
    assert not torch.isclose(functional.proto_terms(h, c * valid[:, None], labels, 0.1, 0.01)["loss"], ours["loss"])


def test_proto_terms_diagnostics_and_extremes():
    c = torch.eye(4, dtype=torch.float64)
    t = functional.proto_terms(c, c, torch.arange(4), 0.01, 0.0)
    assert t["acc"].item() == 1.0 and t["target_entropy"].item() == 0.0
    # float32, τ at its clamp (0.01) and τ_y = 0.01 with collapsed inputs: finite loss and grads
    h = torch.ones(3, 8, requires_grad=True)
    loss = functional.proto_terms(torch.nn.functional.normalize(h, dim=-1), torch.ones(5, 8) / 8**0.5,
                         torch.tensor([0, 1, 4]), 0.01, 0.01)["loss"]
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(h.grad).all()
    assert loss.item() == pytest.approx(math.log(5), rel=1e-5)  # uniform scores and targets


# ---- the objective module ----------------------------------------------------------------


def _out(hi, ht, zi, zt, scale=14.0):
    return EncoderOutput(image_features=zi, text_features=zt, logit_scale=torch.tensor(scale, dtype=zi.dtype),
                         image={"clip": zi, "proto": hi}, text={"clip": zt, "proto": ht})


def _episode_state(m, k, ke, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.stack([torch.randint(0, k, (m,), generator=g), torch.randint(0, k, (m,), generator=g),
                          torch.randint(0, ke, (m,), generator=g)], 1)
    h_i, h_t = _unit(m, d, seed=seed + 1), _unit(m, d, seed=seed + 2)
    st = {}
    for name, feats, lab, kk in (("i2t", h_i, labels[:, 1], k), ("t2i", h_t, labels[:, 0], k),
                                 ("i2e", h_i, labels[:, 2], ke), ("t2e", h_t, labels[:, 2], ke)):
        st[f"{name}_centroids"], st[f"{name}_valid"] = functional.pbt(feats, lab, kk, return_mask=True)
    return labels, st


def test_objective_combines_eq6_terms_and_warmup():
    cfg = ProtoclipConfig(episode_size=40, clusters=6, ext_clusters=4, warmup_episodes=1, w_clip=0.5, w_proto=2.0,
                          w_ext=0.3)
    obj = ProtoclipObjective(cfg).double()
    labels, st = _episode_state(40, 6, 4, 5)
    b = 8
    hi, ht = _unit(b, 5, seed=7), _unit(b, 5, seed=8)
    zi, zt = _unit(b, 3, seed=9), _unit(b, 3, seed=10)
    rows = torch.arange(3, 3 + b)
    obj.set_episode(0)  # warm-up: L_CLIP only
    warm = obj(_out(hi, ht, zi, zt), row_batch(episode=rows))
    torch.testing.assert_close(warm["loss"], 0.5 * functional.clip_terms(zi, zt, 14.0)["loss"])
    assert "proto/L_proto" not in warm
    obj.set_episode(1, labels, **st)
    t = obj(_out(hi, ht, zi, zt), row_batch(episode=rows))
    lab = labels[rows]
    i2t = functional.proto_terms(hi, st["i2t_centroids"], lab[:, 1], 0.07, 0.01, valid=st["i2t_valid"])["loss"]
    t2i = functional.proto_terms(ht, st["t2i_centroids"], lab[:, 0], 0.07, 0.01, valid=st["t2i_valid"])["loss"]
    i2e = functional.proto_terms(hi, st["i2e_centroids"], lab[:, 2], 0.07, 0.0, valid=st["i2e_valid"])["loss"]
    t2e = functional.proto_terms(ht, st["t2e_centroids"], lab[:, 2], 0.07, 0.0, valid=st["t2e_valid"])["loss"]
    want = 0.5 * functional.clip_terms(zi, zt, 14.0)["loss"] + 2.0 * (i2t + t2i) / 2 + 0.3 * (i2e + t2e) / 2
    torch.testing.assert_close(t["loss"], want)
    torch.testing.assert_close(t["proto/t_proto"], torch.tensor(0.07, dtype=torch.float64))
    # the episode state survives a state_dict round trip into a fresh module (resume)
    fresh = ProtoclipObjective(cfg).double()
    fresh.load_state_dict(obj.state_dict())
    torch.testing.assert_close(fresh(_out(hi, ht, zi, zt), row_batch(episode=rows))["loss"], t["loss"])


def test_clip_reduction_sum_is_algorithm1s_l_clip():
    """objective.clip_reduction sum (issue 27.2): L_CLIP is the sum of both InfoNCE directions, as the
    xCLIP paper's Algorithm 1 writes it (ProtoCLIP's own Eq. 1 is the mean, the default), logged and
    weighted as such; values and gradients in float64."""
    cfg = ProtoclipConfig(episode_size=40, clusters=6, warmup_episodes=1, w_clip=0.5, clip_reduction="sum")
    obj = ProtoclipObjective(cfg).double()
    obj.set_episode(0)  # warm-up: L_CLIP only
    hi, ht = _unit(8, 5, seed=7), _unit(8, 5, seed=8)
    leaves = [_unit(8, 3, seed=s).requires_grad_() for s in (9, 10, 9, 10)]
    t = obj(_out(hi, ht, leaves[0], leaves[1]), row_batch(episode=torch.arange(8)))
    want = ref_clip_algorithm1(leaves[2], leaves[3], torch.tensor(14.0, dtype=torch.float64))
    torch.testing.assert_close(t["clip/loss"], want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(t["loss"], 0.5 * want, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad(t["loss"], leaves[:2])
    for ours, theirs in zip(grads, torch.autograd.grad(0.5 * want, leaves[2:])):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-11)


def test_ablation_runs_use_the_soft_targets_docs_protoclip_states():
    """docs/protoclip.md's ablation table was measured by benchmarks/protoclip_ablation.py with soft
    targets from the teacher's own prototypes (issue 27.7: the doc said both that and `translated`)."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("protoclip_ablation", root / "benchmarks" / "protoclip_ablation.py")
    ablation = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablation)
    for name, (preset, extra) in ablation.RUNS.items():
        objective = resolve(preset, ablation.COMMON + extra).objective
        if objective.name == "protoclip":
            assert objective.soft_targets_from == "teacher", name
    doc = " ".join((root / "docs" / "protoclip.md").read_text().split())
    assert "soft targets from the teacher's own centroids (the default)" in doc
    assert "the measurements below were made with it" not in doc


# ---- episodes, K-Means, teacher, augmentation ---------------------------------------------


def test_episode_sampler():
    a = episodic.episode_indices(0, 100, 500, 3)
    assert a.shape == (500,) and a.min() >= 0 and a.max() < 100
    assert len(np.unique(a)) < 100 or len(np.unique(a)) == 100  # with replacement: repeats in 500 of 100
    assert np.bincount(a).max() > 1
    np.testing.assert_array_equal(a, episodic.episode_indices(0, 100, 500, 3))  # deterministic
    assert not np.array_equal(a, episodic.episode_indices(0, 100, 500, 4))  # a new draw per episode
    order = episodic.episode_order(0, 500, 3)
    np.testing.assert_array_equal(np.sort(order), np.arange(500))
    cfg = resolve("protoclip-tiny", ["objective.episode_size=300", "train.batch_size=64", "train.steps=10"])
    assert episodic.steps_per_episode(cfg) == 4 and episodic.num_episodes(cfg) == 3  # ⌊300/64⌋, last one partial


def test_kmeans_methods():
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((20, 8)).astype(np.float32) * 5
    x = centres[rng.integers(0, 20, 1000)] + rng.standard_normal((1000, 8)).astype(np.float32)
    for method in ("flat", "two_level"):
        r = km.kmeans(x, 20, niter=15, nredo=3, method=method, seed=1)
        assert r.method == method and r.centroids.shape == (20, 8) and r.labels.shape == (1000,)
        d = ((torch.from_numpy(x) - r.centroids[r.labels]) ** 2).sum()
        assert float(d) == pytest.approx(r.objective, rel=1e-3)
        assert r.objective < 1000 * 8 * 2  # near the noise floor (variance 1 per dimension)
    assert km.kmeans(x, 5, method="auto").method == "flat"
    np.testing.assert_array_equal(km.allocate(np.array([1, 1, 5, 100]), 10), [1, 1, 1, 7])
    for sizes, k in (([3, 9, 30], 40), ([1] * 5 + [50], 12), ([7, 7, 7], 21)):
        alloc = km.allocate(np.array(sizes), k)
        assert alloc.sum() == k and np.all(alloc >= 1) and np.all(alloc <= sizes)
    with pytest.raises(ValueError, match="k must lie"):
        km.kmeans(x[:3], 4)


@pytest.mark.slow
def test_teacher_cache_and_pca(tmp_path, monkeypatch):
    cfg = resolve("protoclip-tiny", ["data.train_length=24", f"objective.ext_cache_dir={tmp_path}"])
    calls = []
    real = teacher.encode_captions

    def counting(captions, *a, **k):
        calls.append(len(captions))
        return real(captions, *a, **k)

    monkeypatch.setattr(teacher, "encode_captions", counting)
    first, cached1 = teacher.teacher_features(cfg)
    second, cached2 = teacher.teacher_features(cfg)
    assert (cached1, cached2) == (False, True) and calls == [24]
    torch.testing.assert_close(first, second)
    assert first.shape == (24, 384)
    # the shortcuts (distinct captions once, trimmed padding) are exact: plain mean pooling
    from transformers import AutoModel

    from nclip.data.tokenization import CaptionTokenizer

    enc = teacher.encoder_dir(None)
    ids, mask = CaptionTokenizer(cfg.objective.ext_max_length, enc / "tokenizer.json")(teacher.train_captions(cfg))
    with torch.no_grad():
        states = AutoModel.from_pretrained(str(enc), local_files_only=True).eval()(
            input_ids=ids, attention_mask=mask).last_hidden_state
    w = mask.unsqueeze(-1).float()
    torch.testing.assert_close(first, torch.nn.functional.normalize((states * w).sum(1) / w.sum(1), dim=-1),
                               rtol=1e-4, atol=1e-5)
    # another dataset identity (or encoder, pooling, length) is another entry
    other = resolve("protoclip-tiny", ["data.train_length=25", f"objective.ext_cache_dir={tmp_path}"])
    assert teacher._key(teacher.identity(other, enc, 64)) != teacher._key(teacher.identity(cfg, enc, 64))
    assert teacher._key(teacher.identity(cfg, enc, 32)) != teacher._key(teacher.identity(cfg, enc, 64))
    # PCA: the projection on sklearn's components, up to each component's sign
    from sklearn.decomposition import PCA

    x = torch.randn(200, 12, dtype=torch.float64) @ torch.randn(12, 12, dtype=torch.float64)
    ours = teacher.pca(x, 4).double()
    ref = torch.from_numpy(PCA(4).fit_transform(x.numpy()))
    torch.testing.assert_close(ours.abs(), ref.abs(), rtol=1e-4, atol=1e-4)


def test_light_augmentation():
    from nclip.data.transforms import augment, color_jitter

    cfg = resolve("protoclip-tiny").data.augment
    assert (cfg.crop_scale, cfg.color_jitter_prob, cfg.grayscale_prob) == ((0.5, 1.0), 0.2, 0.2)
    img = np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8)
    out = [augment(img, 16, cfg, np.random.default_rng(i)) for i in range(200)]
    assert all(o.shape == (16, 16, 3) and o.dtype == np.uint8 for o in out)
    gray = sum(bool(np.all(o[..., 0] == o[..., 1]) and np.all(o[..., 1] == o[..., 2])) for o in out)
    assert 20 <= gray <= 65  # grayscale with p = 0.2
    jittered = color_jitter(img, (0.4, 0.4, 0.4, 0.1), np.random.default_rng(1))
    assert jittered.shape == img.shape and not np.array_equal(jittered, img)
    np.testing.assert_array_equal(color_jitter(img, (0, 0, 0, 0), np.random.default_rng(1)), img)
    # without colour augmentation the crops are unchanged from the plain pipeline
    from nclip.data.transforms import random_resized_crop

    plain = resolve("clip-tiny").data.augment
    np.testing.assert_array_equal(augment(img, 16, plain, np.random.default_rng(3)),
                                  random_resized_crop(img, 16, plain.crop_scale, plain.crop_ratio,
                                                      np.random.default_rng(3)))


# ---- end to end through the CLI ------------------------------------------------------------

MICRO = [
    "data.image_size=16", "data.text_length=16", "data.train_length=64",
    "model.vision.patch_size=4", "model.vision.width=32", "model.vision.layers=1", "model.vision.heads=2",
    "model.text.width=32", "model.text.layers=1", "model.text.heads=2", "model.embed_dim=32",
    "model.proto_hidden=64", "model.proto_dim=16", "train.steps=8", "train.batch_size=8", "train.warmup_steps=1",
    "train.log_every=1", "train.checkpoint_every=6", "train.keep_checkpoints=3", "eval.samples=32",
    "eval.batch_size=32", "objective.episode_size=16", "objective.clusters=4", "objective.warmup_episodes=1",
    "objective.lit_episode=3",
]


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One external-teacher cache for the runs below (same training set): encoded once."""
    return str(tmp_path_factory.mktemp("teacher-cache"))


@pytest.mark.slow
def test_episodic_run_end_to_end(tmp_path, capsys, shared_cache):
    out = tmp_path / "run"
    args = ["train", "--preset", "protoclip-tiny", "--out", str(out), "--no-progress"]
    for o in MICRO + [f"objective.ext_cache_dir={shared_cache}"]:
        args += ["--set", o]
    assert main(args) == 0
    assert "zeroshot/shape/top1" in capsys.readouterr().out
    eps = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
    assert [e["episode"] for e in eps] == [0, 1, 2, 3] and all(e["steps"] == 2 for e in eps)
    assert [e["proto"] for e in eps] == [False, True, True, False]  # warm-up, 2 episodes, LiT
    assert [e["lit"] for e in eps] == [False, False, False, True]
    for e in eps[1:3]:
        assert e["extract_s"] > 0 and e["kmeans_s"] > 0 and e["train_s"] > 0 and e["empty_image"] >= 0
    logs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [("proto/L_proto" in x, "proto/L_ext" in x) for x in logs] == (
        [(False, False)] * 2 + [(True, True)] * 4 + [(False, False)] * 2)
    assert all(math.isfinite(x["loss"]) for x in logs)
    # locked-image tuning from episode 3 (steps 6-7): the image tower stops, the text tower moves
    w6 = load_file(str(out / "checkpoints" / "step_00000006" / "model.safetensors"))
    w8 = load_file(str(out / "model" / "model.safetensors"))
    for k in w6:
        same = torch.equal(w6[k], w8[k])
        image_side = k.startswith(("vision.", "heads.clip.image.", "heads.proto.image."))
        if image_side and "running" not in k and "num_batches" not in k:
            assert same, k
        if k.startswith("text.") and w6[k].dtype.is_floating_point and w6[k].numel() > 1000:
            assert not same, k


# ---- 2 ranks (gloo) ----------------------------------------------------------------------------


def _objective_on_two_ranks(rank, world):
    from nclip import distributed as collectives
    from nclip.train.episodic import _broadcast

    # the objective: W ranks with half the batch each = 1 process with the whole batch (DDP averaging)
    cfg = ProtoclipConfig(episode_size=40, clusters=6, ext_clusters=4, w_clip=0.7, w_proto=1.3, w_ext=0.5,
                          soft_targets_from="teacher", t_target_ext=0.05)
    labels, st = _episode_state(40, 6, 4, 5, seed=3)
    st.update(i2t_targets=_unit(6, 5, seed=20), t2i_targets=_unit(6, 5, seed=21), i2e_targets=_unit(4, 7, seed=22),
              t2e_targets=_unit(4, 7, seed=22))
    # rank 0 alone holds the state; _broadcast delivers it (the episodic driver's path)
    got = _broadcast({"labels": labels, **st} if rank == 0 else None, torch.device("cpu"))
    for k, v in {"labels": labels, **st}.items():
        assert torch.equal(got[k], v.to(got[k].dtype)), k
    b = 8
    full = {"hi": _unit(b, 5, seed=30), "ht": _unit(b, 5, seed=31),
            "zi": _unit(b, 3, seed=32), "zt": _unit(b, 3, seed=33)}
    rows = torch.arange(5, 5 + b)

    def run(inputs, rws, global_batch=True):
        obj = ProtoclipObjective(cfg.model_copy(update={"global_batch": global_batch})).double()
        obj.set_episode(0, got["labels"], **{k: v for k, v in got.items() if k != "labels"})
        leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
        loss = obj(_out(leaves["hi"], leaves["ht"], leaves["zi"], leaves["zt"]), row_batch(episode=rws))["loss"]
        loss.backward()
        return loss.detach(), {k: v.grad for k, v in leaves.items()}, obj.logit_scale_proto.grad

    sl = slice(rank * b // world, (rank + 1) * b // world)
    loss, grads, gs = run({k: v[sl] for k, v in full.items()}, rows[sl])
    mean_loss = collectives.all_reduce_mean_no_grad(loss)
    gs_mean = collectives.all_reduce_mean_no_grad(gs)
    grads_all = {k: collectives.all_gather_no_grad(g) / world for k, g in grads.items()}  # DDP's 1/W
    import torch.distributed as dist

    dist.barrier()
    ref_loss, ref_grads, ref_gs = run(full, rows, global_batch=False)  # one process, whole batch
    torch.testing.assert_close(mean_loss, ref_loss)
    torch.testing.assert_close(gs_mean, ref_gs)
    for k in ref_grads:
        torch.testing.assert_close(grads_all[k], ref_grads[k], msg=k)
    return True




# ---- the paper-scale preset and the ResNet tower ----------------------------------------------


def test_rn50_preset_has_table_a3_settings():
    cfg = resolve("protoclip-rn50-cc")
    o, t, m = cfg.objective, cfg.train, cfg.model
    assert (t.batch_size, o.episode_size, o.warmup_episodes, o.clusters,
            o.kmeans_iters) == (512, 200_000, 40, 20_000, 20)
    assert (t.lr, t.weight_decay, t.betas, t.eps, t.grad_clip) == (5e-4, 0.5, (0.9, 0.999), 1e-8, 1e5)
    # App. A.1: CLIP's modified ResNet-50 (issue 27.3), its attention pool to d_z = 1024
    assert (m.vision.kind, m.vision.depths, m.vision.heads, m.vision.pool_dim, m.embed_dim, m.proto_dim,
            m.proto_hidden) == ("clip_resnet", (3, 4, 6, 3), 32, 1024, 1024, 128, 2048)
    assert (o.t_proto_init, o.t_target, o.ext_pca_dim, cfg.data.image_size) == (0.07, 0.01, 64, 224)
    # 32 epochs of 2.5M pairs = 400 episodes of 390 steps; LiT from epoch 16
    assert t.steps == 400 * episodic.steps_per_episode(cfg) and o.lit_episode == 200


def test_resnet_tower_builds_from_config():
    from nclip.models import build_model

    cfg = resolve("protoclip-tiny", MICRO + ["model.vision.kind=resnet", "model.vision.depths=[1,1]",
                                             "model.vision.hidden_sizes=[16,32]", "model.vision.embedding_size=8"])
    model = build_model(cfg, pretrained_text=False)
    ids, mask = model.tokenizer(["a red circle", "two blue squares"])
    out = model(torch.randn(2, 3, 16, 16), ids, mask)
    assert out.image_features.shape == (2, 32)
    assert out.image["clip"].shape == (2, 32) and out.image["proto"].shape == (2, 16)
    assert model.vision.kind == "resnet"


# ---- the episodic loop on 2 ranks (DDP, gloo) against 1 process ------------------------------

DIST_RUN = [o for o in MICRO
            if not o.startswith(("train.steps", "train.checkpoint_every", "objective.lit_episode"))] + [
    "train.steps=6", "train.checkpoint_every=6", "train.threads=1"]


def _episodic_rank(rank, world, root, cache):
    from pathlib import Path

    from nclip.train.loop import train

    _objective_on_two_ranks(rank, world)
    train(resolve("protoclip-tiny", DIST_RUN + [f"objective.ext_cache_dir={cache}"]), Path(root) / "ddp",
          progress=False, evaluate=False)
    return True


@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path, shared_cache):
    """The objective: loss and gradients of 2 ranks with half the batch each = 1 process with the
    whole batch, and the broadcast episode state = rank 0's. The episodic loop: sharded extraction
    + rank-0 K-Means + broadcast + DDP with per-row episode positions log the losses of 1 process."""
    from nclip.train.loop import train

    from distributed_utils import run_ranks

    train(resolve("protoclip-tiny", DIST_RUN + [f"objective.ext_cache_dir={shared_cache}"]), tmp_path / "single",
          progress=False, evaluate=False)  # also fills the teacher cache the ranks read
    assert run_ranks(_episodic_rank, world_size=2, args=(str(tmp_path), shared_cache)) == [True, True]
    rows = [[json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
            for r in ("single", "ddp")]
    assert [r["step"] for r in rows[1]] == list(range(1, 7))
    for a, b in zip(*rows):
        assert set(a) == set(b)
        for k in ("loss", "clip/loss", "proto/L_proto", "proto/L_ext", "proto/acc_i2t", "grad_norm"):
            if k in b:
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=5e-5), (a["step"], k)
    assert sum("proto/L_proto" in r for r in rows[1]) == 4  # episodes 1 and 2 (episode 0 warms up)


@pytest.mark.slow
def test_resume_in_the_middle_of_an_episode_is_exact(tmp_path, shared_cache):
    import shutil

    from nclip.train.loop import train

    cfg = resolve("protoclip-tiny", DIST_RUN + ["train.checkpoint_every=3", f"objective.ext_cache_dir={shared_cache}"])
    run = tmp_path / "run"
    train(cfg, run, progress=False, evaluate=False)
    full = (run / "metrics.jsonl").read_text()
    shutil.rmtree(run / "checkpoints" / "step_00000006")  # the run "died" after step 3, inside episode 1
    train(cfg, run, resume=True, progress=False, evaluate=False)

    def rows(text):
        return [{k: v for k, v in json.loads(x).items() if k not in WALL_CLOCK} for x in text.splitlines()]

    assert rows((run / "metrics.jsonl").read_text()) == rows(full)
    eps = [json.loads(x) for x in (run / "episodes.jsonl").read_text().splitlines()]
    assert [e["episode"] for e in eps] == [0, 1, 2] and eps[1].get("resumed") is True
