"""Zero-shot segmentation by GroupViT's groups (nclip.eval.segmentation): the groups-to-pixels,
groups-to-classes and IoU/Acc steps against hand-computed examples, and the task end to end."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nclip.config import resolve
from nclip.eval import runner
from nclip.eval.segmentation import class_scores, confusion, evaluate, group_labels, iou_and_accuracy, pixel_groups

GROUPVIT = ["model.vision.kind=groupvit", "model.vision.depths=[1,1]", "model.vision.group_tokens=[4,0]",
            "model.vision.output_groups=[4,4]"]

# truth and prediction of one 2x4 image, 3 classes (0 background); by hand, rows truth, columns
# prediction: [[2, 1, 0], [0, 3, 0], [1, 0, 1]]
TRUTH = torch.tensor([[[0, 0, 1, 1], [0, 2, 2, 1]]])
PRED = torch.tensor([[[0, 1, 1, 1], [0, 2, 0, 1]]])


def test_confusion_iou_and_accuracy_by_hand():
    conf = confusion(PRED, TRUTH, 3)
    assert conf.tolist() == [[2, 1, 0], [0, 3, 0], [1, 0, 1]]
    r = iou_and_accuracy(conf)
    # IoU = TP / (truth + pred − TP): 2/4, 3/4, 1/2; Acc = TP / truth: 2/3, 3/3, 1/2
    assert r["iou"].tolist() == pytest.approx([0.5, 0.75, 0.5])
    assert r["miou"] == pytest.approx(1.75 / 3) and r["macc"] == pytest.approx((2 / 3 + 1 + 0.5) / 3)


def test_void_pixels_and_absent_classes_count_neither_way():
    ignore = torch.zeros_like(TRUTH, dtype=torch.bool)
    ignore[0, 0, 1] = True  # the background pixel predicted as class 1
    r = iou_and_accuracy(confusion(PRED, TRUTH, 4, ignore))  # class 3: in neither map
    assert r["iou"][:3].tolist() == pytest.approx([2 / 3, 1.0, 0.5]) and math.isnan(r["iou"][3])
    assert r["miou"] == pytest.approx((2 / 3 + 1 + 0.5) / 3) and r["macc"] == pytest.approx((1 + 1 + 0.5) / 3)


def test_pixels_take_their_arg_max_group_after_bilinear_upsampling():
    g0 = torch.tensor([[1.0, 0.0], [1.0, 0.0]])  # the left patch column is group 0's
    assign = torch.stack([g0, 1 - g0])[None]  # [1, 2 groups, 2, 2]
    # bilinear to 4 px: group 0 holds 1, 0.75, 0.25, 0 across each row
    assert pixel_groups(assign, 4).tolist() == [[[0, 0, 1, 1]] * 4]


def test_groups_below_the_threshold_are_background_unless_best():
    groups = torch.tensor([[[1.0, 0.0], [0.6, 0.8]]])  # [1, 2 groups, D = 2], unit norm
    image, classes = torch.tensor([[1.0, 0.0]]), torch.eye(2)  # 2 classes: both among the image's top 5
    # scale 10: both softmaxes are the full one, so a group's score is p²: group 0 softmax(10, 0)[0]² ≈ 0.9999,
    # group 1 softmax(6, 8)[1]² ≈ 0.776
    assert group_labels(groups, image, classes, 10.0, 0.95).tolist() == [[1, 0]]
    assert group_labels(groups, image, classes, 10.0, 0.7).tolist() == [[1, 2]]
    # the cut is min(threshold, the image's best score): alone, group 1 is the best and never background
    assert group_labels(groups[:, 1:], image, classes, 10.0, 0.95).tolist() == [[2]]


def test_an_image_keeps_the_five_classes_its_pooled_embedding_ranks_highest():
    classes = torch.eye(7)
    image = F.normalize(torch.tensor([[6.0, 5, 4, 3, 2, 1, 0]]), dim=-1)  # top 5: classes 0-4
    groups = torch.eye(7)[None, 5:]  # groups on classes 5 and 6, outside the image's top 5
    scores = class_scores(groups, image, classes, 10.0)
    assert (scores[..., 5:] == 0).all() and (scores[..., :5] > 0).all()
    assert group_labels(groups, image, classes, 10.0, 0.0).tolist() == [[1, 1]]  # class 0, the first of the tied
    torch.testing.assert_close(class_scores(groups, image, classes, 10.0, top=7),
                               (10.0 * groups.double() @ classes.double().T).softmax(-1) ** 2)


def test_evaluate_maps_groups_to_pixels_to_scores():
    g0 = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    f = {"groups": torch.stack([g0, 1 - g0])[None], "group_emb": torch.tensor([[[1.0, 0.0], [0.6, 0.8]]]),
         "image_emb": torch.tensor([[1.0, 0.0]]), "truth": torch.tensor([[[1, 1, 2, 2]] * 4])}
    r = evaluate(f, torch.eye(2), 10.0, 0.7)
    assert r["pred"].tolist() == [[[1, 1, 2, 2]] * 4] and r["miou"] == 1.0 and r["macc"] == 1.0
    r = evaluate(f, torch.eye(2), 10.0, 0.95)  # group 1 → background: class 2 missed, background false
    assert r["iou"].tolist() == pytest.approx([0.0, 1.0, 0.0]) and r["macc"] == pytest.approx(0.5)


def _softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _encode_decode(assign: torch.Tensor, group_emb: np.ndarray, image_emb: np.ndarray, text: np.ndarray,
                   scale: float, bg_thresh: float, size: int) -> np.ndarray:
    """GroupViT's ``GroupViTSegInference.encode_decode`` (segmentation/evaluation/group_vit_seg.py) on one
    image, then mmsegmentation's softmax and arg-max: the class map [size, size], 0 background. The
    scores in float64; the upsampling in float32 as GroupViT runs it. ``assign``: [G, h, w]."""
    g = assign.shape[0]
    # resize_attn_map: [(h w), G] -> [G, h, w] -> bilinear to the image -> [H, W, G]
    flat = assign.reshape(g, -1).T
    grid = flat.T.reshape(1, g, *assign.shape[1:])
    attn = F.interpolate(grid, size=(size, size), mode="bilinear", align_corners=False)[0].permute(1, 2, 0)
    onehot = np.eye(g)[attn.argmax(dim=-1).numpy()]  # [H, W, G]
    tokens = group_emb / np.linalg.norm(group_emb, axis=-1, keepdims=True)
    avg = image_emb / np.linalg.norm(image_emb)
    affinity = tokens @ text.T * scale  # [G, N]
    pre = _softmax(affinity)
    avg_p = _softmax(avg @ text.T * scale)
    mask = np.zeros(len(text), bool)
    mask[np.argsort(-avg_p, kind="stable")[:min(5, len(text))]] = True
    affinity = np.where(mask[None], affinity, -np.inf)
    affinity = _softmax(affinity) * pre
    logits = np.zeros((len(text) + 1, size, size))
    per_pixel = onehot @ affinity  # [H, W, N]
    logits[1:] = per_pixel.transpose(2, 0, 1)
    logits[0][per_pixel.max(axis=-1) < min(bg_thresh, affinity.max())] = 1
    return _softmax(logits, axis=0).argmax(axis=0)


@pytest.mark.parametrize("scale", [1.0, 100.0], ids=["flat", "peaked"])
def test_the_class_map_equals_groupvits_encode_decode(scale):
    """Random groups (8 on a 4x4 patch grid, 20 classes, 32 px): nclip's class map equals the
    transcription of GroupViT's encode_decode pixel for pixel, at every threshold."""
    n, g, c, d, size = 6, 8, 20, 16, 32
    gen = torch.Generator().manual_seed(int(scale))
    assign = torch.randn(n, g, 4, 4, generator=gen).mul(3).softmax(dim=1)
    group_emb = F.normalize(torch.randn(n, g, d, generator=gen), dim=-1)
    image_emb = F.normalize(group_emb.mean(dim=1) + 0.3 * torch.randn(n, d, generator=gen), dim=-1)
    text = F.normalize(torch.randn(c, d, generator=gen), dim=-1)
    f = {"groups": assign, "group_emb": group_emb, "image_emb": image_emb,
         "truth": torch.zeros(n, size, size, dtype=torch.long)}
    foreground = {}
    for t in (0.0, 0.5, 0.95, 1.0):
        pred = evaluate(f, text, scale, t)["pred"]
        for i in range(n):
            want = _encode_decode(assign[i], group_emb[i].double().numpy(), image_emb[i].double().numpy(),
                                  text.double().numpy(), scale, t, size)
            assert np.array_equal(pred[i].numpy(), want), (scale, t, i)
        foreground[t] = int((pred > 0).sum())
    assert 0 < foreground[1.0] <= foreground[0.95] <= foreground[0.5] <= foreground[0.0]  # the best group stays
    assert foreground[0.95] < foreground[0.0]
    scores = class_scores(group_emb, image_emb, text, scale)
    if scale == 1.0:  # flat scores: no group reaches 0.95, so a fixed cut would leave every pixel background
        assert float(scores.max()) < 0.95 and foreground[0.0] == n * size * size
    else:  # peaked: a group whose classes all lie outside its image's top 5 scores ~0, background at any threshold
        assert foreground[0.0] < n * size * size


def test_assignments_agree_with_transformers_grouping(micro_overrides):
    from transformers.models.groupvit.modeling_groupvit import get_grouping_from_attentions

    from nclip.models import build_model

    torch.manual_seed(0)
    tower = build_model(resolve("micro", micro_overrides + GROUPVIT), pretrained_text=False).vision.eval()
    pixels = torch.randn(2, 3, 16, 16)
    _, assign = tower.groups(pixels)
    out = tower.model(pixel_values=pixels, output_attentions=True)
    theirs = get_grouping_from_attentions(out.attentions, (16, 16))  # [B, G, 16, 16]
    torch.testing.assert_close(F.interpolate(assign, size=(16, 16), mode="bilinear"), theirs)


def test_extraction_embeds_the_groups_and_the_pooled_image_like_encode_image(micro_overrides):
    from nclip.data.transforms import eval_tensor
    from nclip.data.types import Sample
    from nclip.eval.segmentation import extract
    from nclip.models import build_model

    torch.manual_seed(0)
    model = build_model(resolve("micro", micro_overrides + GROUPVIT + ["objective.name=clip"]),
                        pretrained_text=False).eval()
    rng = np.random.default_rng(0)
    samples = [Sample(image=rng.integers(0, 256, (16, 16, 3), dtype=np.uint8), caption="", captions=("",),
                      masks=np.zeros((0, 16, 16), bool), mask_classes=np.zeros(0, np.int64)) for _ in range(3)]
    f = extract(model, samples, 16, "cpu", 15)
    pixels = torch.stack([eval_tensor(s.image, 16) for s in samples])
    with torch.no_grad():
        want = F.normalize(model.encode_image(pixels)["clip"], dim=-1)
    torch.testing.assert_close(f["image_emb"], want)
    assert f["group_emb"].shape == (3, 4, want.shape[1]) and f["groups"].shape == (3, 4, 4, 4)


def _model_dir(tmp_path, *extra):
    from nclip.models import build_model
    from nclip.models.io import save_model

    cfg = resolve("micro", ["objective.name=clip", *extra])
    return save_model(build_model(cfg, pretrained_text=False), cfg, tmp_path / "model")


def test_task_runs_end_to_end_on_a_random_groupvit(tmp_path, micro_overrides):
    torch.manual_seed(0)
    model = _model_dir(tmp_path, *micro_overrides, *GROUPVIT)
    settings = runner.EvalSettings(test_samples=10, mask_samples=12, segment_threshold=0.0)
    doc = runner.run_eval(model, None, tasks=["segmentation"], datasets=["synthetic"], settings=settings,
                          cache_dir=None)
    r = doc["results"]
    assert 0.0 <= r["segmentation/synthetic/miou"] <= 1.0 and 0.0 <= r["segmentation/synthetic/macc"] <= 1.0
    assert doc["skipped"] == {} and doc["config"]["segment_threshold"] == 0.0


def test_task_is_skipped_for_other_towers(tmp_path, micro_overrides):
    model = _model_dir(tmp_path, *micro_overrides)
    doc = runner.run_eval(model, None, tasks=["segmentation"], datasets=["synthetic"],
                          settings=runner.EvalSettings(test_samples=10, mask_samples=4), cache_dir=None)
    assert doc["results"] == {}
    assert doc["skipped"] == {"segmentation": "the vit image tower has no grouping to segment with (needs "
                                              "model.vision.kind groupvit)"}


def _voc(root, classes):
    """One 16x16 VOC-layout image: its mask holds ``classes`` [16, 16] (0 background, 255 void)."""
    import numpy as np
    from PIL import Image

    (root / "JPEGImages").mkdir(parents=True)
    (root / "SegmentationClass").mkdir()
    Image.fromarray(np.full((16, 16, 3), 90, np.uint8)).save(root / "JPEGImages" / "a.jpg")
    Image.fromarray(classes.astype(np.uint8), mode="L").save(root / "SegmentationClass" / "a.png")
    return root


def test_voc_masks_are_segmented_by_class(tmp_path, micro_overrides):
    import numpy as np

    from nclip.eval.mask_folder import VOC_CLASSES, mask_folder
    from nclip.eval.segmentation import truth_map

    cls = np.zeros((16, 16), np.uint8)
    cls[:, :4], cls[:, 4], cls[:, 8:] = 15, 255, 8  # person, void, cat
    data = mask_folder(_voc(tmp_path / "voc", cls))
    s = data.splits["test"][0]
    assert s.mask_classes.tolist() == [7, 14] and s.masks.shape == (2, 16, 16)  # index − 1, sorted
    assert VOC_CLASSES[7] == "cat" and VOC_CLASSES[14] == "person" and len(data.segment_space) == 20
    assert truth_map(s, 16, 20)[0].tolist() == [15] * 4 + [0] * 4 + [8] * 8  # void: 0 here, left out by "ignore"
    torch.manual_seed(0)
    model = _model_dir(tmp_path, *micro_overrides, *GROUPVIT)
    doc = runner.run_eval(model, None, tasks=["segmentation"], datasets=[f"masks:{tmp_path / 'voc'}"],
                          settings=runner.EvalSettings(segment_threshold=0.0), cache_dir=None)
    r = doc["results"]
    assert 0.0 <= r["segmentation/voc/miou"] <= 1.0 and 0.0 <= r["segmentation/voc/macc"] <= 1.0


def test_a_class_beyond_vocs_is_one_line(tmp_path, micro_overrides, capsys):
    import numpy as np

    from nclip.cli import main

    cls = np.full((16, 16), 21, np.uint8)
    voc = _voc(tmp_path / "voc", cls)
    model = _model_dir(tmp_path, *micro_overrides, *GROUPVIT)
    assert main(["eval", "--checkpoint", str(model), "--tasks", "segmentation", "--dataset", f"masks:{voc}",
                 "--out", str(tmp_path / "ev"), "--no-cache", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "a mask holds class 21, beyond the 20 classes segmented" in err and len(err.splitlines()) == 1


def test_groupvits_class_names_and_simple_template_for_voc(tmp_path, micro_overrides, capsys):
    """--voc-classnames groupvit and --templates simple: GroupViT's VOC names ('table', 'plant',
    'monitor') and its one prompt, through nclip eval; --voc-classnames without masks: data is refused."""
    import json

    import numpy as np

    from nclip.cli import main
    from nclip.eval import dispatch
    from nclip.eval.mask_folder import VOC_CLASSES, mask_folder

    cls = np.zeros((16, 16), np.uint8)
    cls[:, :8] = 11  # dining table
    voc = _voc(tmp_path / "voc", cls)
    space = mask_folder(voc, "simple", "groupvit").segment_space
    renamed = {a: b for a, b in zip(VOC_CLASSES, space.names) if a != b}
    assert renamed == {"dining table": "table", "potted plant": "plant", "tv monitor": "monitor"}
    assert space.templates == ("a photo of a {}.",) and space.prompts(10) == ["a photo of a table."]
    assert mask_folder(voc).segment_space.names == VOC_CLASSES and len(mask_folder(voc).segment_space.templates) == 80

    model = _model_dir(tmp_path, *micro_overrides, *GROUPVIT)
    out = tmp_path / "ev"
    prompted = []
    encode = dispatch.prompt_outputs
    dispatch.prompt_outputs = lambda model, space, *rest: prompted.append(space) or encode(model, space, *rest)
    try:
        assert main(["eval", "--checkpoint", str(model), "--tasks", "segmentation", "--dataset", f"masks:{voc}",
                     "--voc-classnames", "groupvit", "--templates", "simple", "--out", str(out), "--no-cache",
                     "--quiet", "--no-report"]) == 0
    finally:
        dispatch.prompt_outputs = encode
    assert [s.prompts(10) for s in prompted] == [["a photo of a table."]]
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["voc_classnames"] == "groupvit" and doc["config"]["templates"] == "simple"
    assert 0.0 <= doc["results"]["segmentation/voc/miou"] <= 1.0
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(model), "--tasks", "segmentation", "--dataset", "synthetic",
                 "--voc-classnames", "groupvit", "--out", str(tmp_path / "ev2"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("nclip: error: eval: --voc-classnames: applies to masks: datasets (PASCAL VOC's classes) and none "
                   "is selected")
