"""`nclip finetune` (xCLIP Sec. 4.2, Tab. 6, App. C): layer-wise lr decay in the optimizer's groups,
the cosine classifier at step 0 = zero-shot, class-balanced seeded label fractions disjoint from
validation and test, one-line errors; end to end and resume on micro checkpoints (slow)."""

import hashlib
import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image

from nclip.cli import main
from nclip.config import resolve
from nclip.finetune.layers import layer_count, layer_id
from nclip.finetune.settings import FinetuneSettings
from nclip.finetune.splits import label_splits

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

MICRO = ["data.source=digits", "data.image_size=16", "model.vision.layers=2", "train.threads=1"]
FAST = ["--epochs", "2", "--lrs", "3e-3", "--batch-size", "32", "--quiet", "--no-report"]


def _model_dir(tmp_path, objective="xclip", *extra):
    """A model directory with random weights: enough to test the plumbing, no training."""
    from nclip.models import build_model
    from nclip.models.io import save_model

    cfg = resolve("micro", MICRO + [f"objective.name={objective}", *extra])
    torch.manual_seed(0)
    return save_model(build_model(cfg, pretrained_text=True), cfg, tmp_path / objective / "model")


def _net(model_dir, classifier="linear"):
    from nclip.eval.checkpoint import resolve_checkpoint
    from nclip.finetune.network import build_net

    ck = resolve_checkpoint(model_dir)
    from nclip.data.digits import DIGIT_NAMES, DIGIT_TEMPLATES
    from nclip.data.types import LabelKind

    return ck, build_net(ck, classifier, LabelKind(DIGIT_NAMES, DIGIT_TEMPLATES), torch.device("cpu"))


CLIP_RESNET = ["model.vision.kind=clip_resnet", "model.vision.embedding_size=8", "model.vision.depths=[1,2]",
               "model.vision.hidden_sizes=[8,16]"]
GROUPVIT = ["model.vision.kind=groupvit", "model.vision.patch_size=4", "model.vision.width=32", "model.vision.heads=2",
            "model.vision.depths=[1,1]", "model.vision.group_tokens=[4,0]", "model.vision.output_groups=[4,4]"]


@pytest.mark.parametrize("tower", [[], ["model.vision.kind=convnet", "model.vision.embedding_size=8",
                                        "model.vision.depths=[1,2]", "model.vision.hidden_sizes=[8,16]"], CLIP_RESNET,
                                   GROUPVIT],
                         ids=["vit", "convnet", "clip_resnet", "groupvit"])
def test_layer_decay_gives_each_layer_its_learning_rate(tmp_path, tower):
    from nclip.finetune.loop import make_optimizer, set_lr

    ck, net = _net(_model_dir(tmp_path, "xclip", *tower), "cosine")
    vcfg = ck.cfg.model.vision
    opt = make_optimizer(net, vcfg, FinetuneSettings(), lr=1e-3)
    set_lr(opt, 2e-3)  # the schedule's rate of some step
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    n = layer_count(vcfg)
    expected_layers = {  # name → documented layer id (docs/finetune.md, nclip.finetune.layers)
        "vit": {"vision.model.embeddings.patch_embedding.weight": 0, "vision.model.pre_layrnorm.weight": 0,
                "vision.model.encoder.layers.0.mlp.fc1.weight": 1,
                "vision.model.encoder.layers.1.self_attn.q_proj.weight": 2,
                "vision.model.post_layernorm.weight": 3, "head.weight": 3, "classifier": 3, "logit_scale": 3},
        "convnet": {"vision.body.0.weight": 0, "vision.body.3.weight": 1, "vision.body.7.weight": 2,
                    "vision.body.10.weight": 2, "vision.pool.in_proj_weight": 3, "head.weight": 3, "classifier": 3},
        "clip_resnet": {"vision.stem.0.weight": 0, "vision.stem.7.bias": 0, "vision.stages.0.0.branch.0.weight": 1,
                        "vision.stages.1.0.shortcut.1.weight": 2, "vision.stages.1.1.branch.3.weight": 2,
                        "vision.pool.position": 3, "vision.pool.query.weight": 3, "vision.pool.proj.bias": 3,
                        "head.weight": 3, "classifier": 3},
        "groupvit": {"vision.model.vision_model.embeddings.patch_embeddings.projection.weight": 0,
                     "vision.model.vision_model.embeddings.position_embeddings": 0,
                     "vision.model.vision_model.encoder.stages.0.group_token": 1,
                     "vision.model.vision_model.encoder.stages.0.downsample.assign.q_proj.weight": 1,
                     "vision.model.vision_model.encoder.stages.1.layers.0.mlp.fc1.weight": 2,
                     "vision.model.vision_model.layernorm.weight": 3, "head.weight": 3, "classifier": 3},
    }[vcfg.kind]
    assert n == 4
    names = dict(net.named_parameters())
    for name, layer in expected_layers.items():
        assert layer_id(name, vcfg) == layer, name
        g = group_of[id(names[name])]
        assert g["lr"] == pytest.approx(2e-3 * 0.65 ** (n - 1 - layer)), name
    for name, p in names.items():  # every parameter in exactly the group of its layer
        g = group_of[id(p)]
        assert g["layer"] == layer_id(name, vcfg)
        assert g["weight_decay"] == (0.05 if p.ndim >= 2 and "position" not in name else 0.0), name
    assert sum(len(g["params"]) for g in opt.param_groups) == len(names)


def test_drop_path_is_honest_per_tower(tmp_path):
    from nclip.models.drop_path import add_drop_path

    ck, net = _net(_model_dir(tmp_path))
    assert add_drop_path(net.vision, 0.1).startswith("0.1 (linear")
    x = torch.randn(4, 3, 16, 16)
    net.eval()
    assert torch.equal(net.vision(x), net.vision(x))  # no dropping in eval mode
    net.train()
    torch.manual_seed(1)
    a = net.vision(x)
    torch.manual_seed(2)
    assert not torch.allclose(a, net.vision(x))  # the last block's branches are dropped at rate 0.1
    conv = ["model.vision.kind=convnet", "model.vision.depths=[1]", "model.vision.hidden_sizes=[8]"]
    _, conv_net = _net(_model_dir(tmp_path / "c", "xclip", *conv))
    assert add_drop_path(conv_net.vision, 0.1) == "none (convnet has no residual blocks)"
    _, clip_resnet = _net(_model_dir(tmp_path / "r", "xclip", *CLIP_RESNET))
    assert add_drop_path(clip_resnet.vision, 0.1) == "0.1 (linear 0 to 0.1 over 3 blocks, per bottleneck block)"
    _, groupvit = _net(_model_dir(tmp_path / "g", "xclip", *GROUPVIT))
    assert add_drop_path(groupvit.vision, 0.1) == ("0.1 (linear 0 to 0.1 over 2 blocks, per transformer layer of every "
                                                   "stage, attention and MLP branches)")


def test_cosine_classifier_at_step_0_is_zero_shot(tmp_path):
    from nclip.eval.runner import run_eval
    from nclip.finetune.data import prepare
    from nclip.finetune.loop import predict

    model_dir = _model_dir(tmp_path)
    ck, net = _net(model_dir, "cosine")
    prep = prepare(ck.cfg, FinetuneSettings(dataset="digits"))
    logits = predict(net, prep.test_pixels)  # [N, 10]
    doc = run_eval(model_dir, out=None, tasks=("zeroshot",), datasets=("digits",), head="clip", cache_dir=None)
    ours = (logits.argmax(1) == prep.test_labels).float().mean().item()
    assert ours == pytest.approx(doc["results"]["zeroshot/digits-digit/top1"], abs=1e-6)
    # and prediction by prediction, against the evaluation's own zero-shot scores
    from nclip.eval import zeroshot
    from nclip.eval.datasets import digits
    from nclip.eval.features import class_text_outputs, encode_images
    from nclip.objectives.scores import score_named

    model = ck.load("cpu")
    test = digits(16, ck.cfg.seed).splits["test"]  # the test split nclip eval reads
    images = [test[i].image for i in range(len(test))]
    clip = score_named("clip")
    classes = class_text_outputs(model, prep.space, "cpu", clip)
    scores = zeroshot.scores(encode_images(model, images, 16, "cpu"), classes, clip)
    assert torch.equal(logits.argmax(1), scores.argmax(1))
    torch.testing.assert_close(logits, scores * model.scale().item(), rtol=1e-4, atol=1e-4)


def test_fraction_is_class_balanced_seeded_and_disjoint():
    y = np.repeat(np.arange(10), [60, 55, 70, 62, 58, 61, 66, 59, 63, 64])
    rng = np.random.default_rng(3)
    y = y[rng.permutation(len(y))]
    a = label_splits(y, 0.1, 0.2, seed=0)
    assert np.array_equal(a.train, label_splits(y, 0.1, 0.2, seed=0).train)  # seeded
    assert not np.array_equal(a.train, label_splits(y, 0.1, 0.2, seed=1).train)
    assert not set(a.train) & set(a.val) and set(a.train) <= set(a.pool)  # never a validation image
    counts = np.bincount(y[a.train], minlength=10)
    pool_counts = np.bincount(y[a.pool], minlength=10)
    assert np.array_equal(counts, np.maximum(1, np.floor(0.1 * pool_counts + 0.5)))  # balanced per class
    tiny = label_splits(y, 0.001, 0.2, seed=0)
    assert np.array_equal(np.bincount(y[tiny.train], minlength=10), np.ones(10))  # at least one per class
    assert set(tiny.train) <= set(a.train) <= set(label_splits(y, 1.0, 0.2, seed=0).train)  # nested
    assert np.array_equal(label_splits(y, 1.0, 0.2, seed=0).train, a.pool)


def _folder(root, classes=4, per_class=10):
    """A folder tree whose every image has unique pixels (so an image's content names its file)."""
    k = 0
    for c in range(classes):
        for i in range(per_class):
            img = np.full((16, 16, 3), k, np.uint8)
            img[0, 0] = (c * 50, i, 7)
            (root / f"class{c}").mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(root / f"class{c}" / f"{i}.png")
            k += 1
    return root


def test_fraction_never_takes_test_or_validation_images(tmp_path):
    from nclip.data.transforms import eval_tensor
    from nclip.eval.datasets import image_folder
    from nclip.finetune.data import prepare

    root = _folder(tmp_path / "imgs")
    cfg = resolve("micro", MICRO)
    prep = prepare(cfg, FinetuneSettings(dataset=f"folder:{root}", fraction=0.5, val_fraction=0.25))
    digest = lambda t: hashlib.sha256(t.numpy().tobytes()).hexdigest()  # noqa: E731
    train = {digest(eval_tensor(im, 16)) for im in prep.labelled.train_images}
    val = {digest(t) for t in prep.labelled.val_pixels}
    test = {digest(t) for t in prep.test_pixels}
    assert len(train) == len(prep.labelled.train_images) and not train & val and not train & test and not val & test
    split = image_folder(root)
    assert len(test) == len(split.splits["test"]) and prep.per_class == [3, 3, 3, 3]  # half of (7 - 2 val), rounded up


@pytest.mark.parametrize("argv, needle", [
    (["--fraction", "0"], "finetune: fraction: Input should be greater than 0"),
    (["--fraction", "1.5"], "finetune: fraction: Input should be less than or equal to 1"),
    (["--dataset", "imagenet"], "unknown dataset 'imagenet'"),
    (["--dataset", "sts:x.csv"], "cannot fine-tune on 'sts:x.csv'"),
    (["--classifier", "cosine"], "--classifier cosine needs a CLIP head, but objective 'nclip' trains none"),
    (["--lrs", "fast"], "finetune: --lrs: expected comma-separated numbers"),
])
def test_bad_inputs_are_one_line_errors(tmp_path, capsys, argv, needle):
    model = _model_dir(tmp_path, "nclip")
    code = main(["finetune", "--checkpoint", str(model), "--out", str(tmp_path / "ft"), *FAST, *argv])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1, err


def test_out_holding_a_run_is_refused_without_resume(tmp_path, capsys):
    from nclip.finetune.command import _plan

    s = FinetuneSettings()
    _plan(tmp_path, s, "abc", resume=False)
    code = main(["finetune", "--checkpoint", str(_model_dir(tmp_path, "clip")), "--out", str(tmp_path), *FAST])
    assert code == 2 and "already holds a fine-tuning run" in capsys.readouterr().err


def test_out_holding_an_evaluation_is_refused_with_or_without_force(tmp_path, capsys):
    """Fine-tuning into an evaluation's folder replaced its results.json and report.html: refused,
    and --force writes beside other files, never over another command's output."""
    from nclip.finetune.command import STATE, _plan

    out = tmp_path / "evaluated"
    out.mkdir()
    (out / "results.json").write_text('{"results": {}}')
    code = main(["finetune", "--checkpoint", str(_model_dir(tmp_path, "clip")), "--out", str(out), *FAST])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"--out {out} already holds other files (results.json)" in err and "--force" in err
    assert (out / "results.json").read_text() == '{"results": {}}' and not (out / STATE).exists()
    code = main(["finetune", "--checkpoint", str(_model_dir(tmp_path, "clip")), "--out", str(out), *FAST, "--force"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"--out {out} is nclip eval's output" in err, err  # not its own
    assert (out / "results.json").read_text() == '{"results": {}}' and not (out / STATE).exists()
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    _plan(notes, FinetuneSettings(), "abc", resume=False, force=True)  # --force: beside the user's files
    assert (notes / STATE).is_file() and (notes / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_finetune_end_to_end_on_digits(tmp_path, capsys):
    model = _model_dir(tmp_path)
    out = tmp_path / "ft"
    assert main(["finetune", "--checkpoint", str(model), "--out", str(out), "--fraction", "0.1",
                 "--epochs", "2", "--lrs", "1e-3,3e-3", "--batch-size", "32", "--quiet"]) == 0
    doc = json.loads((out / "results.json").read_text())
    r, c = doc["results"], doc["config"]
    assert 0 <= r["finetune/digits-digit/top1"] <= 1 and "finetune/digits-digit/val_top1" in r
    assert c["classifier"] == "cosine" and c["fraction"] == 0.1 and c["lr"] in (1e-3, 3e-3)
    assert len(c["sweep"]) == 2 and max(s["best_val_top1"] for s in c["sweep"]) == r["finetune/digits-digit/val_top1"]
    assert (out / "model" / "model.safetensors").is_file() and (out / "report.html").is_file()
    assert "fine-tuning" in (out / "report.html").read_text().lower()
    capsys.readouterr()
    assert main(["eval", "compare", str(out), str(out)]) == 0
    assert "End-to-end fine-tuning, top-1" in capsys.readouterr().out


@pytest.mark.slow
def test_resume_after_sigkill_gives_the_uninterrupted_result(tmp_path):
    model = _model_dir(tmp_path)
    args = ["finetune", "--checkpoint", str(model), "--fraction", "0.1", "--epochs", "2", "--lrs", "2e-3",
            "--batch-size", "16", "--no-report", "--quiet"]
    # every run in a child process: the same thread count, so the same floating-point sums
    def nclip(*extra):
        return subprocess.run([sys.executable, "-m", "nclip", *args, *extra], capture_output=True, text=True)

    assert nclip("--out", str(tmp_path / "whole")).returncode == 0
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "nclip", *args, "--out", str(killed)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = killed / "sweep" / "lr_0" / "checkpoints" / "step_00000001"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not first.is_dir():
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-300:]
    assert not (killed / "results.json").exists()
    refused = nclip("--out", str(killed))
    assert refused.returncode == 2 and "--resume auto" in refused.stderr
    assert nclip("--out", str(killed), "--resume", "auto").returncode == 0
    a, b = (json.loads((d / "results.json").read_text()) for d in (tmp_path / "whole", killed))
    assert a["results"] == b["results"] and a["config"]["sweep"] == b["config"]["sweep"]
    from safetensors.torch import load_file

    wa, wb = (load_file(str(d / "model" / "model.safetensors")) for d in (tmp_path / "whole", killed))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
