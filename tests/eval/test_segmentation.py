"""Zero-shot segmentation by GroupViT's groups (nclip.eval.segmentation): the groups-to-pixels,
groups-to-classes and IoU/Acc steps against hand-computed examples, and the task end to end."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nclip.config import resolve
from nclip.eval import runner
from nclip.eval.segmentation import confusion, evaluate, group_labels, iou_and_accuracy, pixel_groups

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


def test_groups_below_the_threshold_are_background():
    groups = torch.tensor([[[1.0, 0.0], [0.6, 0.8]]])  # [1, 2 groups, D = 2], unit norm
    classes = torch.eye(2)
    # scale 10: group 0 p = softmax(10, 0) ≈ 0.99995; group 1 p = softmax(6, 8)[1] ≈ 0.881
    assert group_labels(groups, classes, 10.0, 0.95).tolist() == [[1, 0]]
    assert group_labels(groups, classes, 10.0, 0.85).tolist() == [[1, 2]]


def test_evaluate_maps_groups_to_pixels_to_scores():
    g0 = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    f = {"groups": torch.stack([g0, 1 - g0])[None], "group_emb": torch.tensor([[[1.0, 0.0], [0.6, 0.8]]]),
         "truth": torch.tensor([[[1, 1, 2, 2]] * 4])}
    r = evaluate(f, torch.eye(2), 10.0, 0.85)
    assert r["pred"].tolist() == [[[1, 1, 2, 2]] * 4] and r["miou"] == 1.0 and r["macc"] == 1.0
    r = evaluate(f, torch.eye(2), 10.0, 0.95)  # group 1 → background: class 2 missed, background false
    assert r["iou"].tolist() == pytest.approx([0.0, 1.0, 0.0]) and r["macc"] == pytest.approx(0.5)


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
