"""Transfer to the user's own benchmarks (issue #17): zero-shot with the user's class names and
templates (``--classnames``, ``--templates FILE|imagenet80``), ``multilabel:FILE.csv`` (xCLIP Tab. 3)
and ``masks:DIR`` (xCLIP Tab. 12), their one-line errors, and ``nclip eval`` on all three."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from nclip.errors import NclipError
from nclip.eval import datasets as eval_data
from nclip.eval import masks, multilabel, prompts
from nclip.eval.mask_folder import mask_folder
from nclip.eval.multilabel_file import multilabel_file
from nclip.eval.settings import EvalSettings, validated


def _png(path, colour=(200, 30, 30), size=(12, 12)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size[1], size[0], 3), colour, np.uint8)).save(path)
    return path


def _folder(root, classes=("blue_boat", "green-tree", "red_car"), n=5):
    for c, name in enumerate(classes):
        for i in range(n):
            _png(root / name / f"{i}.png", (80 * c, 10, 10))
    return root


# ---------------------------------------------------------------- class names and templates


def test_imagenet80_is_clips_eighty_templates():
    t = prompts.IMAGENET80
    assert len(t) == 80 and len(set(t)) == 80 and all(x.count("{}") == 1 for x in t)
    assert t[0] == "a bad photo of a {}." and t[-1] == "a tattoo of the {}." and "itap of a {}." in t
    assert prompts.templates("imagenet80", ("x {}",)) is t and prompts.templates(None, ("x {}",)) == ("x {}",)


def test_folder_with_the_users_class_names_and_templates(tmp_path):
    root = _folder(tmp_path / "flat")
    (tmp_path / "names.txt").write_text("a blue boat\n\nan oak\na red car\n")  # blank lines skipped
    (tmp_path / "t.txt").write_text("# mine\na snapshot of {}.\n{}, seen from afar\n")
    space = eval_data.image_folder(root, classnames=str(tmp_path / "names.txt"),
                                   templates=str(tmp_path / "t.txt")).label_kinds["class"]
    assert space.names == ("a blue boat", "an oak", "a red car")
    assert space.prompts(1) == ["a snapshot of an oak.", "an oak, seen from afar"]

    (tmp_path / "names.json").write_text(json.dumps({"red_car": "sports car", "green-tree": "tree",
                                                     "blue_boat": "rowing boat", "unused": "x"}))
    space = eval_data.image_folder(root, classnames=str(tmp_path / "names.json"),
                                   templates="imagenet80").label_kinds["class"]
    assert space.names == ("rowing boat", "tree", "sports car")  # sorted folder order, from the map
    assert space.templates == prompts.IMAGENET80 and len(space.prompts(0)) == 80
    default = eval_data.image_folder(root).label_kinds["class"]
    assert default.names == ("blue boat", "green tree", "red car") and len(default.templates) == 4


@pytest.mark.parametrize(
    "names,templates,needle",
    [
        (None, "a photo of {}.\nno class name here\n", "t.txt:2: a template needs exactly one {}"),
        ("a\nb\n", None, "names.txt: 2 class names for 3 class folders; give one name per line in sorted class "
                         "folder order (blue_boat, green-tree, red_car)"),
        ('{"blue_boat": "boat", "red_car": "car"}', None, "names.json: class folder 'green-tree' has no class name"),
        ('{"blue_boat": "boat", "green-tree": "", "red_car": "car"}', None, "must be a non-empty string"),
        ('{"blue_boat": "boat",', None, "names.json: invalid JSON"),
        ("missing", None, "--classnames: file not found: "),
        (None, "missing", "--templates: file not found: "),
    ],
)
def test_prompt_file_errors_are_one_line(tmp_path, names, templates, needle):
    root = _folder(tmp_path / "flat")
    kw = {}
    if names is not None:
        name = "names.json" if names.startswith("{") else "names.txt"
        if names != "missing":
            (tmp_path / name).write_text(names)
        kw["classnames"] = str(tmp_path / name)
    if templates is not None:
        if templates != "missing":
            (tmp_path / "t.txt").write_text(templates)
        kw["templates"] = str(tmp_path / "t.txt")
    with pytest.raises(NclipError) as e:
        eval_data.image_folder(root, **kw)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_prompt_settings_record_the_source_and_need_a_user_dataset(tmp_path, monkeypatch):
    from nclip.eval.command import _option

    monkeypatch.chdir(tmp_path)
    s = EvalSettings(datasets=("folder:x", "synthetic"), classnames="names.txt", templates="imagenet80")
    assert s.classnames == str(tmp_path / "names.txt") and s.templates == "imagenet80"  # as results.json records
    assert s.multilabel_topk == (3, 5, 10, 20)
    with pytest.raises(NclipError, match=r"^eval: --classnames: applies to folder:, multilabel:, wds:, imagefolder: "
                                         r"datasets and none"):
        validated({"datasets": ("synthetic", "realms:x"), "classnames": "n.txt"}, _option)
    with pytest.raises(NclipError, match=r"^eval: --templates: applies to folder:, realms:, multilabel:, masks:, "
                                         r"wds:, "):
        validated({"datasets": ("digits",), "templates": "imagenet80"}, _option)
    with pytest.raises(NclipError, match=r"^eval: --topk: "):
        validated({"multilabel_topk": (3, 0)}, _option)


# ---------------------------------------------------------------- multilabel:FILE.csv


def test_multilabel_metrics_hand_computed():
    # 3 images x 4 classes; targets {0, 2}, {1}, {0, 3}
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.3], [0.2, 0.7, 0.6, 0.1], [0.5, 0.4, 0.3, 0.9]])
    targets = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 1]], dtype=torch.bool)
    r = multilabel.evaluate(scores, targets, ks=(1, 2, 3, 5))
    # AP per class: 1 (ranks 1, 2), 1/2 (rank 2), 1/3 (rank 3), 1 (rank 1)
    assert r["mAP"] == pytest.approx((1 + 1 / 2 + 1 / 3 + 1) / 4)
    # top-1 hits all 3 images: TP = 3 of 3 predicted, of 5 positives
    assert (r["precision@1"], r["recall@1"], r["f1@1"]) == pytest.approx((1.0, 3 / 5, 3 / 4))
    # top-2: TP = 1 + 1 + 2 = 4 of 6 predicted
    assert (r["precision@2"], r["recall@2"], r["f1@2"]) == pytest.approx((4 / 6, 4 / 5, 8 / 11))
    # top-3: TP = 1 + 1 + 2 = 4 of 9 predicted
    assert (r["precision@3"], r["recall@3"], r["f1@3"]) == pytest.approx((4 / 9, 4 / 5, 4 / 7))
    assert "f1@5" not in r  # k above the number of classes


def test_multilabel_file_reads_targets_and_names(tmp_path):
    for i in range(3):
        _png(tmp_path / "img" / f"{i}.png")
    (tmp_path / "ml.csv").write_text("path,tags\nimg/0.png,dog;grass\n\nimg/1.png, traffic_light ;dog;\n"
                                     f"{tmp_path / 'img' / '2.png'},grass\n")
    data = multilabel_file(tmp_path / "ml.csv")
    assert data.name == "ml" and data.multilabel_kinds == ("label",) and not data.retrieval
    assert data.label_kinds["label"].names == ("dog", "grass", "traffic light")
    samples = data.splits["test"]
    assert len(samples) == 3 and samples[1].labels == {}
    assert [s.multilabels["label"].tolist() for s in samples] == [[True, True, False], [True, False, True],
                                                                  [False, True, False]]
    (tmp_path / "names.json").write_text('{"dog": "puppy", "grass": "lawn", "traffic_light": "traffic light"}')
    data = multilabel_file(tmp_path / "ml.csv", str(tmp_path / "names.json"), "imagenet80")
    assert data.label_kinds["label"].names == ("puppy", "lawn", "traffic light")
    assert data.label_kinds["label"].templates == prompts.IMAGENET80


@pytest.mark.parametrize(
    "content,needle",
    [
        ("image,labels\nimg/0.png,a;b\nimg/9.png,a\n", "ml.csv:3: image not found"),
        ("image,labels\nimg/0.png,a;b\nimg/0.png, ; \n", "ml.csv:3: no labels"),
        ("image,labels\nimg/0.png,a,b\n", "ml.csv:2: expected 2 columns (image path, ';'-separated labels), got 3"),
        ("image,labels\nimg/0.png\n", "ml.csv:2: expected 2 columns"),
        ("image\nimg/0.png\n", "ml.csv:1: expected a header row of 2 columns"),
        ("image,labels\nimg/0.png,a\n", "at least 2 distinct labels"),
    ],
)
def test_multilabel_file_errors_name_file_and_line(tmp_path, content, needle):
    _png(tmp_path / "img" / "0.png")
    (tmp_path / "ml.csv").write_text(content)
    with pytest.raises(NclipError) as e:
        multilabel_file(tmp_path / "ml.csv")
    assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(NclipError, match="multi-label file not found"):
        multilabel_file(tmp_path / "nope.csv")


# ---------------------------------------------------------------- masks:DIR


def _voc(root, n=2, size=(8, 8), val=None):
    """VOC layout: class 1 in columns 0-2, void (255) in column 3, background in columns 4-7."""
    cls = np.zeros((size[1], size[0]), np.uint8)
    cls[:, :3], cls[:, 3] = 1, 255
    for i in range(n):
        _png(root / "JPEGImages" / f"2007_{i:06d}.jpg", size=size)
        (root / "SegmentationClass").mkdir(parents=True, exist_ok=True)
        im = Image.fromarray(cls, mode="P")
        im.putpalette([0, 0, 0, 128, 0, 0] + [224, 224, 192] * 254)
        im.save(root / "SegmentationClass" / f"2007_{i:06d}.png")
    if val is not None:
        (root / "ImageSets" / "Segmentation").mkdir(parents=True)
        (root / "ImageSets" / "Segmentation" / "val.txt").write_text("".join(f"2007_{i:06d}\n" for i in val))
    return root


def test_voc_masks_reach_the_jaccard_with_void_pixels_left_out(tmp_path):
    data = mask_folder(_voc(tmp_path / "voc"))
    assert data.masks and data.name == "voc" and len(data.splits["test"]) == 2 and not data.label_kinds
    s = data.splits["test"][0]
    assert s.masks.shape == (1, 8, 8) and s.masks[0, :, :3].all() and not s.masks[0, :, 3:].any()
    assert s.mask_classes.tolist() == [0]  # VOC class 1 (aeroplane), for zero-shot segmentation
    assert s.ignore[:, 3].all() and s.ignore.sum() == 8

    class Vision:  # a 2x2 patch grid: head 0 attends to the left half, head 1 everywhere
        def attention_maps(self, pixels):
            left = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
            return torch.stack([left, torch.ones(2, 2)]).expand(len(pixels), 2, 2, 2)

    class Model(torch.nn.Module):
        vision = Vision()

    f = masks.extract(Model(), data.splits["test"], 8, "cpu")
    r = masks.evaluate(f["attn"], f["masks"], ignore=f["ignore"])
    # head 0 keeps columns 0-3: exactly the class pixels once the void column 3 is left out (else 24 / 32)
    assert r["jaccard"] == pytest.approx(1.0) and r["best_head"] == 0
    assert masks.evaluate(f["attn"], f["masks"])["jaccard"] == pytest.approx(24 / 32)
    assert float(r["per_head"][1]) == pytest.approx(24 / 56)  # every valid pixel predicted


def test_mask_folder_layouts_and_val_list(tmp_path):
    assert len(mask_folder(_voc(tmp_path / "voc", n=3, val=[0, 2])).splits["test"]) == 2  # VOC val list
    root = tmp_path / "plain"
    (root / "masks").mkdir(parents=True)
    for name in ("a", "b"):
        _png(root / "images" / f"{name}.jpg", size=(10, 6))
        Image.fromarray(np.full((6, 10), 2, np.uint8), mode="L").save(root / "masks" / f"{name}.png")
    samples = mask_folder(root).splits["test"]
    assert samples[1].image.shape == (6, 10, 3) and samples[1].masks.all() and not samples[1].ignore.any()


def test_mask_folder_errors_name_the_file(tmp_path):
    with pytest.raises(NclipError, match="dataset folder not found"):
        mask_folder(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NclipError, match=r"expected JPEGImages/ \+ SegmentationClass/ \(Pascal VOC\) or images/"):
        mask_folder(tmp_path / "empty")
    root = _voc(tmp_path / "voc")
    _png(root / "JPEGImages" / "2008_000001.jpg")
    with pytest.raises(NclipError, match=r"2008_000001.jpg: no mask .*SegmentationClass/2008_000001.png"):
        mask_folder(root)
    root = _voc(tmp_path / "voc2")
    _png(root / "JPEGImages" / "2007_000001.jpg", size=(9, 8))
    with pytest.raises(NclipError, match=r"2007_000001.png: mask is 8x8 pixels but its image 2007_000001.jpg is 9x8"):
        mask_folder(root)
    root = _voc(tmp_path / "voc3", n=1)
    _png(root / "SegmentationClass" / "2007_000000.png", size=(8, 8))  # an RGB picture, not class indices
    with pytest.raises(NclipError, match="a mask must be a single-channel PNG of class indices, got mode RGB"):
        mask_folder(root)
    with pytest.raises(NclipError, match=r"val.txt:2: no image 2007_000009"):
        mask_folder(_voc(tmp_path / "voc4", val=[0, 9]))


# ---------------------------------------------------------------- nclip eval on all three

MICRO = [
    "data.image_size=16", "data.text_length=16",
    "model.vision.patch_size=4", "model.vision.width=32", "model.vision.layers=1", "model.vision.heads=2",
    "model.text.width=32", "model.text.layers=1", "model.text.heads=2",
    "model.embed_dim=32", "model.nclip_hidden=64", "model.nclip_dim=128", "train.threads=1",
]


@pytest.mark.slow
def test_nclip_eval_on_the_users_benchmarks(tmp_path, capsys, monkeypatch, one_thread):
    from nclip.cli import main
    from nclip.config import resolve
    from nclip.models import build_model
    from nclip.models.io import save_model

    cfg = resolve("micro", MICRO + ["objective.name=xclip"])
    torch.manual_seed(0)
    model = save_model(build_model(cfg, pretrained_text=True), cfg, tmp_path / "model")  # untrained: plumbing only
    folder = _folder(tmp_path / "pets", ("cat", "dog"))
    (tmp_path / "names.json").write_text('{"cat": "tabby cat", "dog": "puppy", "sofa": "couch"}')
    for i in range(4):
        _png(tmp_path / "ml" / f"{i}.png", (60 * i, 10, 10))
    (tmp_path / "ml.csv").write_text("image,labels\nml/0.png,cat\nml/1.png,cat;dog\nml/2.png,dog;sofa\nml/3.png,sofa\n")
    voc = _voc(tmp_path / "voc", n=3, size=(20, 14))
    (tmp_path / "bad.txt").write_text("a photo of {}\nnothing to fill\n")
    base = ["eval", "--checkpoint", str(model), "--out", str(tmp_path / "out"), "--quiet", "--no-cache",
            "--dataset", f"folder:{folder}", "--dataset", f"multilabel:{tmp_path / 'ml.csv'}",
            "--dataset", f"masks:{voc}", "--classnames", str(tmp_path / "names.json")]
    import matplotlib.axes

    shown = []
    imshow = matplotlib.axes.Axes.imshow

    def record(self, x, *a, **k):
        shown.append(np.shape(x)[:2])
        return imshow(self, x, *a, **k)

    monkeypatch.setattr(matplotlib.axes.Axes, "imshow", record)
    # the report (masks of non-square user images) without zero-shot, whose t-SNE takes seconds
    assert main([*base, "--templates", "imagenet80", "--topk", "1,2", "--tasks", "multilabel,masks"]) == 0
    printed = capsys.readouterr().out
    assert "multilabel/ml-label/mAP" in printed and "masks/voc/jaccard" in printed
    assert 'id="masks-voc"' in (tmp_path / "out" / "report.html").read_text()
    assert shown and set(shown) == {(16, 16)}  # 20x14 images drawn as the model saw them, under their masks
    r = json.loads((tmp_path / "out" / "results.json").read_text())["results"]
    from nclip.eval import dispatch

    spaces = []
    encode = dispatch.prompt_outputs
    monkeypatch.setattr(dispatch, "prompt_outputs", lambda model, space, device, *rest: spaces.append(space) or
                        encode(model, space, device, *rest))
    assert main([*base, "--templates", "imagenet80", "--topk", "1,2", "--no-report", "--tasks", "zeroshot",
                 "--force"]) == 0
    assert [(s.names, s.templates) for s in spaces] == [(("tabby cat", "puppy"), prompts.IMAGENET80)]  # 160 prompts

    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    r.update(doc["results"])
    for key in ("zeroshot/pets-class/top1", "multilabel/ml-label/mAP", "multilabel/ml-label/f1@1",
                "multilabel/ml-label/precision@2", "multilabel/ml-label/recall@2", "masks/voc/jaccard"):
        assert 0.0 <= r[key] <= 1.0, key
    assert "multilabel/ml-label/f1@3" not in r and "zeroshot/ml-label/top1" not in r and doc["skipped"] == {}
    assert doc["config"]["templates"] == "imagenet80" and doc["config"]["multilabel_topk"] == [1, 2]
    assert doc["config"]["classnames"] == str(tmp_path / "names.json")

    for extra, needle in ((["--templates", str(tmp_path / "bad.txt")], "bad.txt:2: a template needs exactly one {}"),
                          (["--topk", "3,x"], "eval: --topk: expected comma-separated integers")):
        assert main([*base, *extra, "--force"]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err
