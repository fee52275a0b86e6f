"""`nclip eval` end to end on micro checkpoints: every task, the report, the feature cache, compare,
the user-facing errors, and checkpoints of every kind (CLIP-only, nCLIP-only, xCLIP, MiniLM text)."""

import hashlib
import json
import re

import numpy as np
import pytest
from PIL import Image

from nclip.cli import main
from nclip.config import resolve
from nclip.eval import dispatch, runner
from nclip.eval.settings import TASKS

MICRO = [
    "data.image_size=16", "data.text_length=16",
    "model.vision.patch_size=4", "model.vision.width=32", "model.vision.layers=1", "model.vision.heads=2",
    "model.text.width=32", "model.text.layers=1", "model.text.heads=2",
    "model.embed_dim=32", "model.nclip_hidden=64", "model.nclip_dim=128",
    "train.steps=10", "train.batch_size=16", "train.warmup_steps=1", "train.log_every=2",
    "train.checkpoint_every=10", "eval.samples=32", "eval.batch_size=32", "train.threads=1",
]
SMALL = ["--samples", "40", "--train-samples", "60", "--sts-pairs", "30", "--mask-samples", "12", "--quiet"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def xclip_run(tmp_path_factory, one_thread):
    from nclip.train.loop import train

    run = tmp_path_factory.mktemp("xclip") / "run"
    result = train(resolve("micro", MICRO), run, progress=False, evaluate=True)
    for key in ("zeroshot/shape/top1", "zeroshot/shape/chance", "retrieval/i2t@1", "retrieval/t2i@1"):
        assert 0.0 <= result.eval[key] <= 1.0  # the trainer's quick eval still reports these
    return run


def _untrained(tmp_path, objective, *extra):
    """A model directory with random weights (no training needed to test the plumbing)."""
    from nclip.models import build_model
    from nclip.models.io import save_model

    cfg = resolve("micro", MICRO + [f"objective.name={objective}", *extra])
    return save_model(build_model(cfg, pretrained_text=True), cfg, tmp_path / objective / "model")


@pytest.fixture(scope="module")
def user_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("user")
    rng = np.random.default_rng(0)
    lines = ["image,caption,caption_2"]
    for c, name in enumerate(["red", "blue"]):
        for i in range(8):
            img = np.zeros((20, 20, 3), np.uint8)
            img[..., c * 2] = 200
            img += rng.integers(0, 40, img.shape, dtype=np.uint8)
            path = root / "folder" / name / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(path)
            lines.append(f"folder/{name}/{i}.png,a {name} picture,something {name} number {i}")
            for realm in ("warm", "cold"):  # realm-wise probing on user data: one folder per realm
                path = root / "realms" / realm / f"{realm}_{name}" / f"{i}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(img if realm == "warm" else 255 - img).save(path)
    (root / "caps.csv").write_text("\n".join(lines) + "\n")
    (root / "sts.csv").write_text("sentence1,sentence2,score\n" + "".join(
        f"a {a} square,a {b} square,{5 if a == b else 1}\n" for a in ("red", "blue", "green") for b in ("red", "blue")))
    return root


@pytest.mark.slow
def test_eval_end_to_end_cache_report_compare(xclip_run, user_data, tmp_path, capsys, monkeypatch):
    out1 = tmp_path / "eval1"
    datasets = ["--dataset", "synthetic", "--dataset", f"folder:{user_data / 'folder'}",
                "--dataset", f"captions:{user_data / 'caps.csv'}", "--dataset", f"sts:{user_data / 'sts.csv'}",
                "--dataset", f"realms:{user_data / 'realms'}"]
    assert main(["eval", "--checkpoint", str(xclip_run), "--out", str(out1), *SMALL, *datasets]) == 0
    printed = capsys.readouterr().out
    assert "zeroshot/synthetic-shape/top1" in printed and "report.html" in printed

    doc = json.loads((out1 / "results.json").read_text())
    r = doc["results"]
    sha = hashlib.sha256((xclip_run / "model" / "model.safetensors").read_bytes()).hexdigest()
    assert doc["checkpoint"]["weights_sha256"] == sha
    assert doc["checkpoint"]["head"] == "clip" and doc["config"]["tasks"] == list(TASKS)
    for key in [
        "zeroshot/synthetic-shape/top1", "zeroshot/synthetic-shape/top5", "zeroshot/synthetic-colour/mean_per_class",
        "zeroshot/synthetic-count/top1", "zeroshot/synthetic-realm/top1", "zeroshot/synthetic-size/top1",
        "zeroshot/folder-class/top1",
        "retrieval/synthetic/i2t@1", "retrieval/synthetic/t2i@10", "retrieval/synthetic/mean_recall",
        "retrieval/caps/i2t@5",
        "multilabel/synthetic-shape/mAP", "multilabel/synthetic-shape/f1@3",
        "linear/synthetic-shape/top1", "linear/folder-class/top1",
        "knn/synthetic-shape/top1", "cluster/synthetic-shape/ari", "cluster/synthetic-shape/ami",
        "realms/synthetic-polygon/top1", "realms/synthetic/mean_top1", "realms/realms-warm/top1",
        "realms/realms-cold/top1", "realms/realms/mean_top1", "zeroshot/realms-class/top1",
        "sts/synthetic/spearman", "sts/sts/spearman", "masks/synthetic/jaccard", "masks/synthetic/best_head",
        "diagnostics/synthetic/erank_image_features", "diagnostics/synthetic/proto_used_image",
        "diagnostics/synthetic/row_std_image", "diagnostics/synthetic/uniformity_image_emb",
    ]:
        assert key in r, key
    assert all(len(k.split("/")) == 3 for k in r)
    assert r["sts/sts/pairs"] == 6 and r["zeroshot/synthetic-shape/chance"] == pytest.approx(1 / 15)

    page = (out1 / "report.html").read_text()
    assert page.startswith("<!doctype html>") and page.count("data:image/png;base64,") >= 8
    assert not re.search(r'(src|href)="(https?:|file:|/)', page)  # self-contained
    for section in ("results", "confusion", "tsne", "failures", "masks-synthetic", "realms-synthetic", "curves"):
        assert f'id="{section}"' in page, section
    assert "Training curves" in page and "metrics.jsonl" in page

    # second run (fewer tasks): every feature comes from the cache, nothing is extracted, same numbers
    def boom(*a, **k):
        raise AssertionError("features were extracted again")

    monkeypatch.setattr(dispatch, "extract", boom)
    monkeypatch.setattr(dispatch, "encode_texts", boom)
    monkeypatch.setattr(dispatch, "prompt_outputs", boom)
    monkeypatch.setattr(dispatch.masks, "extract", boom)
    out2 = tmp_path / "eval2"
    tasks = "zeroshot,retrieval,multilabel,realms,sts,masks,diagnostics"
    assert main(["eval", "--checkpoint", str(xclip_run), "--out", str(out2), *SMALL, *datasets, "--tasks", tasks,
                 "--baseline", str(xclip_run), "--no-report"]) == 0
    doc2 = json.loads((out2 / "results.json").read_text())
    assert doc2["cache"]["misses"] == [] and len(doc2["cache"]["hits"]) >= 8
    assert not (out2 / "report.html").exists()
    for k, v in r.items():
        if k.split("/")[0] in tasks:
            assert doc2["results"][k] == pytest.approx(v, nan_ok=True), k
    # baseline = the same checkpoint (evaluated from the cache): relative accuracy 0 on every realm
    assert doc2["results"]["realms/synthetic-polygon/relative"] == pytest.approx(0.0)
    assert doc2["results"]["realms/synthetic/mean_relative"] == pytest.approx(0.0)

    capsys.readouterr()
    md = tmp_path / "cmp.md"
    assert main(["eval", "compare", str(out1), str(out2), "--out", str(md)]) == 0
    text = md.read_text()
    assert "## Zero-shot classification, top-1" in text and "| run |" in text and "Average" in text
    assert "I→T R@1" in text and "(+0.0)" in text
    assert main(["eval", "compare", str(out1), str(xclip_run)]) == 0  # the trainer's eval.json works too
    assert "shape" in capsys.readouterr().out


def test_eval_refuses_an_out_that_holds_an_evaluation_unless_force(xclip_run, tmp_path, capsys):
    """A second `nclip eval` into the same --out used to replace results.json and report.html with rc 0
    (issue 36.1): it is refused in one line, and --force writes over it."""
    out = tmp_path / "ev"
    argv = ["eval", "--checkpoint", str(xclip_run), "--out", str(out), "--tasks", "zeroshot", *SMALL]
    assert main(argv) == 0
    first = (out / "results.json").read_bytes()
    capsys.readouterr()
    assert main([*argv, "--samples", "50"]) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds an evaluation (results.json)" in err and "--force" in err and len(err.splitlines()) == 1
    assert (out / "results.json").read_bytes() == first and not (out / ".nclip.lock").exists()
    assert main([*argv, "--samples", "50", "--force"]) == 0
    assert json.loads((out / "results.json").read_text())["config"]["test_samples"] == 50


def test_eval_takes_the_directory_lock(xclip_run, tmp_path, capsys):
    from nclip.runlock import DirLock

    out = tmp_path / "ev"
    with DirLock(out, "nclip train"):
        assert main(["eval", "--checkpoint", str(xclip_run), "--out", str(out), "--tasks", "zeroshot", *SMALL]) == 2
    err = capsys.readouterr().err.strip()
    assert "is in use by another nclip process" in err and not (out / "results.json").exists()


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--checkpoint", "{tmp}/nope", "--out", "{tmp}/o"], "no nclip checkpoint in"),
        (["--checkpoint", "{run}", "--out", "{tmp}/o", "--tasks", "zeroshot,bogus"], "unknown task 'bogus'"),
        (["--checkpoint", "{run}", "--out", "{tmp}/o", "--dataset", "imagenet"], "unknown dataset 'imagenet'"),
        (["--checkpoint", "{run}", "--out", "{tmp}/o", "--dataset", "captions:{tmp}/bad.csv"],
         "bad.csv line 3: image not found"),
        (["--checkpoint", "{run}"], "--checkpoint and --out are required"),
        # bad values are caught by EvalSettings and named by their option, in the run config's wording
        (["--checkpoint", "{run}", "--out", "{tmp}/o", "--batch-size", "0"],
         "eval: --batch-size: Input should be greater than or equal to 1 (got 0)"),
        (["--checkpoint", "{run}", "--out", "{tmp}/o", "--samples", "5"],
         "eval: --samples: Input should be greater than or equal to 10 (got 5)"),
        (["--checkpoint", "{run}", "--out", "{tmp}/o", "--sts-pairs", "1"], "eval: --sts-pairs: "),
        (["--checkpoint", "{run}", "--out", "{tmp}/o", "--tasks", ","], "eval: --tasks: no task selected"),
    ],
)
@pytest.mark.slow
def test_eval_errors_are_one_line_exit_2(xclip_run, tmp_path, capsys, argv, needle):
    (tmp_path / "bad.csv").write_text("image,caption\nbad.csv,the csv itself is a file\nmissing.png,x\n")
    argv = [a.format(tmp=tmp_path, run=xclip_run) for a in argv]
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.slow
def test_every_kind_of_checkpoint(tmp_path, xclip_run, capsys):
    # nCLIP only: zero-shot through -L_CE; the CLIP head does not exist
    nclip_dir = _untrained(tmp_path, "nclip")
    doc = runner.run_eval(nclip_dir, None, tasks=["zeroshot", "retrieval", "diagnostics"], datasets=["synthetic"],
                          settings=runner.EvalSettings(test_samples=20, train_samples=20))
    assert doc["checkpoint"]["head"] == "nclip" and "zeroshot/synthetic-shape/top1" in doc["results"]
    assert "diagnostics/synthetic/proto_perplexity_text" in doc["results"]
    assert "diagnostics/synthetic/alignment_emb" not in doc["results"]
    assert main(["eval", "--checkpoint", str(nclip_dir), "--out", str(tmp_path / "o"), "--head", "clip"]) == 2
    assert "head 'clip' is not in this checkpoint" in capsys.readouterr().err

    # CLIP only, with the pretrained MiniLM text tower: STS on its 384-d backbone features
    clip_dir = _untrained(tmp_path, "clip", "model.text.kind=pretrained")
    doc = runner.run_eval(clip_dir, None, tasks=["zeroshot", "sts", "masks"], datasets=["synthetic"],
                          settings=runner.EvalSettings(test_samples=20, train_samples=20, sts_pairs=40, mask_samples=8))
    r = doc["results"]
    assert doc["checkpoint"]["text_tower"] == "pretrained" and doc["checkpoint"]["head"] == "clip"
    assert r["sts/synthetic/spearman"] > 0.2  # MiniLM is a real sentence encoder, even untouched by training
    assert 0.0 <= r["masks/synthetic/jaccard"] <= 1.0

    # xCLIP scored with its nCLIP head, from a training checkpoint directory (config from RUN/config.yaml)
    step = xclip_run / "checkpoints" / "step_00000010"
    doc = runner.run_eval(step, None, tasks=["zeroshot", "masks"], datasets=["digits"], head="nclip")
    assert doc["checkpoint"]["head"] == "nclip" and doc["checkpoint"]["objective"] == "xclip"
    assert 0.0 <= doc["results"]["zeroshot/digits-digit/top1"] <= 1.0
    assert doc["skipped"] == {"masks": "none of the selected datasets has object masks (synthetic, masks:DIR)"}


# (overrides, extra eval arguments) per tower: the image towers at micro size (16 px: the conv net's
# stem and one pool leave a 4x4 map) and the bundled MiniLM as text tower. MiniLM is evaluated on
# synthetic scenes only: digits would add ~900 captions through it (10 s on one core) and no text
# tower code that the synthetic captions, prompts and STS pairs do not already run.
TOWERS = {
    "vit": ([], []),
    "convnet": (["model.vision.kind=convnet", "model.vision.embedding_size=8", "model.vision.depths=[1,1]",
                 "model.vision.hidden_sizes=[16,32]"], []),
    "resnet": (["model.vision.kind=resnet", "model.vision.embedding_size=8", "model.vision.depths=[1,1]",
                "model.vision.hidden_sizes=[16,32]"], []),
    "clip_resnet": (["model.vision.kind=clip_resnet", "model.vision.embedding_size=8", "model.vision.depths=[1,1]",
                     "model.vision.hidden_sizes=[16,32]"], []),
    "minilm-text": (["model.text.kind=pretrained"], ["--dataset", "synthetic"]),
    "groupvit": (["model.vision.kind=groupvit", "model.vision.depths=[1,1]", "model.vision.group_tokens=[4,0]",
                  "model.vision.output_groups=[4,4]"], []),
}


@pytest.mark.slow
@pytest.mark.parametrize("tower", list(TOWERS))
def test_eval_runs_every_task_on_every_tower(tower, tmp_path, capsys):
    """docs/evaluation.md's train-then-eval on a micro run of each tower: every task has results or a
    one-line reason it was skipped (mask probing needs an attention map; the ResNet has none)."""
    from nclip.train.loop import train

    overrides, eval_args = TOWERS[tower]
    run = tmp_path / "run"
    train(resolve("micro", MICRO + ["train.steps=4", "train.checkpoint_every=4", *overrides]), run,
          progress=False, evaluate=False)
    out = tmp_path / "eval"
    assert main(["eval", "--checkpoint", str(run), "--out", str(out), "--no-cache", *SMALL, *eval_args]) == 0
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err

    doc = json.loads((out / "results.json").read_text())
    done = {key.split("/")[0] for key in doc["results"]}
    for task in TASKS:
        assert (task in done) != (task in doc["skipped"]), task
    page = (out / "report.html").read_text()
    skipped = dict(doc["skipped"])
    if tower == "groupvit":  # segmentation instead of mask probing
        assert 0.0 <= doc["results"]["segmentation/synthetic/miou"] <= 1.0
        assert 0.0 <= doc["results"]["segmentation/synthetic/macc"] <= 1.0
        assert skipped == {"masks": "the groupvit image tower has no [CLS] or attention-pool map to probe (its "
                                    "groups: --tasks segmentation)"}
        assert 'id="segmentation-synthetic"' in page
        return
    kind = {"minilm-text": "vit"}.get(tower, tower)
    assert skipped.pop("segmentation") == (f"the {kind} image tower has no grouping to segment with (needs "
                                           "model.vision.kind groupvit)")
    if tower == "resnet":
        reason = "the resnet image tower pools without attention: no [CLS] or attention-pool map over image positions"
        assert list(skipped) == ["masks"] and skipped["masks"].startswith(reason)
        assert re.search(r"^masks +skipped: the resnet image tower", printed.out, re.M)
        assert 'id="skipped"' in page and reason in page
    else:
        assert skipped == {}
        assert 0.0 <= doc["results"]["masks/synthetic/jaccard"] <= 1.0
        maps = {"convnet": "attention-pool query attention",
                "clip_resnet": "attention-pool query attention"}.get(tower, "[CLS] attention")
        assert doc["config"]["mask_maps"] == maps and f"{maps}&#x27;s top-60% mass" in page
    if tower == "minilm-text":
        assert doc["checkpoint"]["text_tower"] == "pretrained" and "sts/synthetic/spearman" in doc["results"]
