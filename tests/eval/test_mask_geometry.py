"""Masks take their image's evaluation geometry (nclip.eval.masks.fit_mask): the resize and centre crop
of the model's preprocessing, with the image's own arithmetic (the long side truncated, the crop
rounded as the convention rounds it). Checked against torchvision's Resize + CenterCrop and
transformers' CLIPImageProcessor with nearest-neighbour resampling, on non-square masks whose crop
overhang takes every residue mod 4, and through the segmentation and mask-probing extraction."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from nclip.data.transforms import EvalPreprocess, shortest_side_size
from nclip.eval.masks import fit_mask

SIZE = 32


def _shapes() -> list[tuple[int, int]]:
    """(height, width), portrait and landscape, 8 per residue mod 4 of the crop's overhang."""
    shapes, seen = [], {r: 0 for r in range(4)}
    for long in range(SIZE + 1, 300, 5):
        for short in (SIZE - 5, SIZE + 7, 45):
            if long <= short:
                continue
            overhang = max(shortest_side_size(short, long, SIZE)) - SIZE
            if seen[overhang % 4] < 8:
                seen[overhang % 4] += 1
                shapes.append((short, long) if len(shapes) % 2 else (long, short))
    assert all(count == 8 for count in seen.values()), seen
    return shapes


SHAPES = _shapes()


def _mask(shape: tuple[int, int], seed: int) -> np.ndarray:
    """Random blobs: an 8x coarser random grid, resized, so the mask has edges everywhere."""
    rng = np.random.default_rng(seed)
    h, w = shape
    coarse = Image.fromarray((rng.random((max(h // 3, 2), max(w // 3, 2))) > 0.5).astype(np.uint8) * 255)
    return np.asarray(coarse.resize((w, h), Image.NEAREST)) > 127


def _torchvision(mask: np.ndarray, resize: str) -> np.ndarray:
    from torchvision import transforms as T
    from torchvision.transforms import InterpolationMode

    size = SIZE if resize == "shortest" else (SIZE, SIZE)
    pipeline = T.Compose([T.Resize(size, interpolation=InterpolationMode.NEAREST), T.CenterCrop(SIZE)])
    return np.asarray(pipeline(Image.fromarray(mask.astype(np.uint8) * 255))) > 127


def _clip_image_processor(mask: np.ndarray) -> np.ndarray:
    import transformers

    cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    processor = cls(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE}, resample=0,
                    do_rescale=False, do_normalize=False)  # resample 0: PIL's NEAREST
    pixels = processor(images=Image.fromarray(mask.astype(np.uint8) * 255), return_tensors="np")["pixel_values"][0]
    return np.asarray(pixels)[0] > 127


def test_the_shapes_cover_every_overhang_residue():
    residues = {(max(shortest_side_size(*s, SIZE)) - SIZE) % 4 for s in SHAPES}
    assert residues == {0, 1, 2, 3} and any(h > w for h, w in SHAPES) and any(h < w for h, w in SHAPES)
    # where rounding the long side (the old mask arithmetic) and truncating it (the image's) part
    assert sum(round(SIZE * max(s) / min(s)) != max(shortest_side_size(*s, SIZE)) for s in SHAPES) >= 8


@pytest.mark.parametrize("resize", ["shortest", "squash"])
def test_masks_equal_torchvisions_resize_and_centre_crop(resize):
    for seed, shape in enumerate(SHAPES):
        mask = _mask(shape, seed)
        ours = fit_mask(mask, SIZE, EvalPreprocess(resize, "bicubic", "torchvision"))
        assert np.array_equal(ours, _torchvision(mask, resize)), shape


def test_masks_equal_clip_image_processor_under_the_transformers_convention():
    differ = 0
    for seed, shape in enumerate(SHAPES):
        mask = _mask(shape, seed)
        ours = fit_mask(mask, SIZE, EvalPreprocess("shortest", "bicubic", "transformers"))
        assert np.array_equal(ours, _clip_image_processor(mask)), shape
        differ += not np.array_equal(ours, fit_mask(mask, SIZE))
    assert differ >= 4  # the conventions' crops part on an overhang of 3 (mod 4): the cases tell them apart


GROUPVIT = ["model.vision.kind=groupvit", "model.vision.depths=[1,1]", "model.vision.group_tokens=[4,0]",
            "model.vision.output_groups=[4,4]"]


def _voc(root, shape: tuple[int, int]):
    """One VOC-layout image of ``shape`` (height, width) whose mask holds a person and a cat."""
    (root / "JPEGImages").mkdir(parents=True)
    (root / "SegmentationClass").mkdir()
    h, w = shape
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / "JPEGImages" / "a.png")
    classes = np.zeros((h, w), np.uint8)
    classes[:, : w // 3], classes[:, w // 2:] = 15, 8
    classes[0] = 255  # void
    Image.fromarray(classes, mode="L").save(root / "SegmentationClass" / "a.png")
    return root


@pytest.mark.parametrize("convention", ["torchvision", "transformers"])
def test_extraction_maps_masks_with_the_models_preprocessing(tmp_path, micro_overrides, convention):
    """segmentation.extract and masks.extract, on a 16 x 35 VOC image (overhang 19 ≡ 3 mod 4) and a model
    with data.eval_convention: the truth, void and object masks are fit_mask's under that convention."""
    from nclip.config import resolve
    from nclip.eval import masks, segmentation
    from nclip.eval.mask_folder import mask_folder
    from nclip.models import build_model

    overrides = [*micro_overrides, "objective.name=clip", f"data.eval_convention={convention}"]
    torch.manual_seed(0)
    groupvit = build_model(resolve("micro", overrides + GROUPVIT), pretrained_text=False)
    vit = build_model(resolve("micro", overrides), pretrained_text=False)
    size = 16
    sample = mask_folder(_voc(tmp_path / "voc", (size, 35))).splits["test"][0]
    preprocess = EvalPreprocess("shortest", "bicubic", convention)
    f = segmentation.extract(groupvit, [sample], size, "cpu", 20)
    assert f["truth"][0].tolist() == segmentation.truth_map(sample, size, 20, preprocess).tolist()
    assert np.array_equal(f["ignore"][0].numpy(), fit_mask(sample.ignore, size, preprocess))
    a = masks.extract(vit, [sample], size, "cpu")
    assert np.array_equal(a["masks"][0].numpy(), fit_mask(sample.masks.any(axis=0), size, preprocess))
    other = EvalPreprocess("shortest", "bicubic", "transformers" if convention == "torchvision" else "torchvision")
    assert f["truth"][0].tolist() != segmentation.truth_map(sample, size, 20, other).tolist()
