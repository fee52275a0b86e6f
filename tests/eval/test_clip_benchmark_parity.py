"""CLIP_benchmark's own evaluation of an `nclip export --open-clip` model and `nclip eval` on the same
CLIP_benchmark copy (written by `nclip data write-shards --layout clip_benchmark`) of non-square
images give the same top-1, top-5, mean per-class recall and R@1/5/10, from the same logits: the
pixels of every image, whatever its centre-crop overhang, are torchvision's."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from clip_benchmark_data import CLASSES, captions_csv, class_folders, overhang

import nclip
from nclip.cli import main
from nclip.config import resolve
from nclip.data import clip_bpe
from nclip.eval import datasets as eval_data
from nclip.models import build_model
from nclip.models.io import save_model

# CLIP_benchmark leaves webdataset's shardshuffle unset (it reads the shards in order)
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:WebDataset.shardshuffle")]


def micro_clip(path, overrides, **data):
    """A micro CLIP model with CLIP's BPE tokenizer (open_clip's) and weights moved off their initial
    values, saved as PATH/model; ``data``: data settings of its config (its eval convention)."""
    extra = [f"data.{k}={v}" for k, v in data.items()]
    cfg = resolve("micro", [*overrides, "objective.name=clip", f"model.text.tokenizer={clip_bpe.packaged_bpe()}",
                            *extra])
    torch.manual_seed(0)
    model = build_model(cfg, pretrained_text=False).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    save_model(model, cfg, path / "model")
    return cfg


def fixed_accuracy(output, target, topk=(1,)):
    """CLIP_benchmark 1.6.2's ``accuracy`` with ``.item()``: its ``float()`` of a one-element array is a
    TypeError under NumPy 2.4 (deprecated since NumPy 1.25). Same counts, same division."""
    pred = output.topk(max(topk), 1, True, True)[1].t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [correct[:k].reshape(-1).float().sum().item() / len(target) for k in topk]


def clip_benchmark(monkeypatch, tmp_path, argv) -> tuple[dict, torch.Tensor]:
    """Run CLIP_benchmark's command line in this process; (its metrics, the scores it ranked: logits
    [images, classes] or similarities [texts, images])."""
    cli = pytest.importorskip("clip_benchmark.cli")
    from clip_benchmark.metrics import zeroshot_classification as zc
    from clip_benchmark.metrics import zeroshot_retrieval as zr

    seen = []
    run_classification, batchify = zc.run_classification, zr.batchify

    def keep_logits(*args, **kw):
        logits, true = run_classification(*args, **kw)
        seen.append(logits)
        return logits, true

    def keep_scores(func, X, *args, **kw):
        seen.append(X)
        return batchify(func, X, *args, **kw)

    monkeypatch.setattr(zc, "accuracy", fixed_accuracy)
    monkeypatch.setattr(zc, "run_classification", keep_logits)
    monkeypatch.setattr(zr, "batchify", keep_scores)
    out = tmp_path / f"cb-{len(list(tmp_path.glob('cb-*')))}.json"
    monkeypatch.setattr(sys, "argv", ["clip_benchmark", "eval", *map(str, argv), "--output", str(out),
                                      "--num_workers", "0", "--quiet"])
    cli.main()
    return json.loads(out.read_text())["metrics"], seen[0]


def read(spec):
    (data,) = eval_data.build(spec, image_size=16, max_objects=1, seed=0, test_samples=10, train_samples=10,
                              sts_pairs=0)
    return data


def nclip_eval(checkpoint, out, *specs) -> dict:
    argv = ["eval", "--checkpoint", str(checkpoint), "--out", str(out), "--tasks", "zeroshot,retrieval",
            "--no-report", "--no-cache", "--quiet"]
    assert main([*argv, *(a for s in specs for a in ("--dataset", s))]) == 0
    return json.loads((out / "results.json").read_text())["results"]


def test_clip_benchmark_and_nclip_eval_agree_on_non_square_images(tmp_path, micro_overrides, monkeypatch):
    pytest.importorskip("open_clip")
    cfg = micro_clip(tmp_path / "run", micro_overrides)
    size = cfg.data.image_size
    export = tmp_path / "export"
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--open-clip", str(export)]) == 0

    files = class_folders(tmp_path / "colours" / "test", size, per_class=8)
    class_folders(tmp_path / "colours" / "train", size, per_class=1)
    assert {overhang(w, h, size) % 4 for _, w, h in files} == {0, 1, 2, 3}
    caps = captions_csv(tmp_path / "caps", size, images=24)
    copies = {"cls": tmp_path / "wds_colours", "ret": tmp_path / "wds_caps"}
    write = ["data", "write-shards", "--preset", "micro", "--layout", "clip_benchmark", "--shard-size", "20"]
    assert main([*write, "--dataset", f"folder:{tmp_path / 'colours'}", "--split", "test",
                 "--out", str(copies["cls"])]) == 0
    assert main([*write, "--dataset", f"captions:{caps}", "--out", str(copies["ret"])]) == 0

    model = ["--model", f"local-dir:{export}", "--pretrained", "none", "--no_amp"]
    cb_cls, logits = clip_benchmark(monkeypatch, tmp_path, ["--dataset", "wds/colours", "--dataset_root",
                                                            copies["cls"], *model, "--task", "zeroshot_classification"])
    cb_ret, scores = clip_benchmark(monkeypatch, tmp_path, ["--dataset", "wds/caps", "--dataset_root", copies["ret"],
                                                            *model, "--task", "zeroshot_retrieval",
                                                            "--recall_k", "1", "5", "10"])
    n_images, n_texts = scores.shape[1], scores.shape[0]
    assert logits.shape == (len(files), len(CLASSES)) and n_images == 24 and n_texts > n_images
    assert len(set(logits.argmax(1).tolist())) > 1  # the predictions depend on the image

    specs = [f"wds:{copies['cls']}", f"wds:{copies['ret']}"]
    for checkpoint in (export, tmp_path / "run"):  # the export, and the nclip model it came from
        r = nclip_eval(checkpoint, tmp_path / f"eval-{checkpoint.name}", *specs)
        assert r["zeroshot/colours-class/top1"] == cb_cls["acc1"]
        assert r["zeroshot/colours-class/top5"] == cb_cls["acc5"]
        assert r["zeroshot/colours-class/mean_per_class"] == cb_cls["mean_per_class_recall"]
        for k in (1, 5, 10):
            # CLIP_benchmark averages its hits in float32: the same counts, rounded to float32
            ours, theirs = r[f"retrieval/caps/i2t@{k}"], cb_ret[f"text_retrieval_recall@{k}"]
            assert round(ours * n_images) == round(theirs * n_images) and abs(ours - theirs) < 1e-7
            ours, theirs = r[f"retrieval/caps/t2i@{k}"], cb_ret[f"image_retrieval_recall@{k}"]
            assert round(ours * n_texts) == round(theirs * n_texts) and abs(ours - theirs) < 1e-7

    # beneath the equal numbers, equal scores (CLIP_benchmark's logits are 100 x the cosine): every
    # image's pixels are torchvision's
    copy, caps_copy = (read(spec) for spec in specs)
    images = [s.image for s in copy.splits["test"]]  # uint8 RGB arrays: the files are RGB
    space = copy.label_kinds["class"]
    loaded = nclip.load(export)
    assert (loaded.zero_shot(images, space.names, space.templates) - logits / 100).abs().max() < 1e-5
    texts = [c for s in caps_copy.splits["test"] for c in s.captions]
    sim = loaded.encode_text(texts) @ loaded.encode_image([s.image for s in caps_copy.splits["test"]]).T
    assert (sim - scores).abs().max() < 1e-5

    # and the test can tell: the crop that floors (transformers' convention) moves exactly the images
    # whose overhang is 3 mod 4
    micro_clip(tmp_path / "floor", micro_overrides, eval_convention="transformers")
    floor = nclip.load(tmp_path / "floor").zero_shot(images, space.names, space.templates)
    moved = (floor - logits / 100).abs().amax(1) > 1e-4
    assert moved.tolist() == [overhang(im.shape[1], im.shape[0], size) % 4 == 3 for im in images]
