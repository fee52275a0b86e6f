"""Evaluation pixels equal the reference tools' own preprocessing, exactly: open_clip's eval transform and
OpenAI's ``clip._transform`` (torchvision's convention) and transformers' ``CLIPImageProcessor`` (PIL
backend), on images of many sizes -- every residue mod 4 of the centre crop's overhang -- and modes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from nclip.data.transforms import EvalPreprocess, center_crop_offset, eval_tensor, shortest_side_size

SIZE = 32
MODES = ("RGB", "RGBA", "P", "P+transparency", "L", "I;16")


def _shapes(n: int = 44) -> list[tuple[int, int]]:
    """(height, width) pairs, portrait and landscape, whose overhang after the resize takes every residue mod 4."""
    shapes, seen = [], {r: 0 for r in range(4)}
    for long in range(SIZE + 1, 400, 3):
        for short in (SIZE - 7, SIZE + 5, 2 * SIZE + 3, 37):
            if long <= short:
                continue
            w, h = shortest_side_size(short, long, SIZE)  # a landscape image
            overhang = w - SIZE
            if seen[overhang % 4] < n // 4:
                seen[overhang % 4] += 1
                shapes.append((short, long) if len(shapes) % 2 else (long, short))
    assert all(count == n // 4 for count in seen.values()), seen
    return shapes


def _image(shape: tuple[int, int], mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    h, w = shape
    rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    if mode == "RGB":
        return Image.fromarray(rgb)
    if mode == "RGBA":
        return Image.fromarray(np.concatenate([rgb, rng.integers(0, 256, (h, w, 1), dtype=np.uint8)], -1))
    if mode.startswith("P"):
        im = Image.fromarray(rgb).quantize(colors=64)
        if mode == "P+transparency":
            im.info["transparency"] = 3
        return im
    if mode == "L":
        return Image.fromarray(rgb[..., 0])
    return Image.fromarray(rng.integers(0, 1200, (h, w), dtype=np.uint16))  # I;16: values above 255 too


CASES = [(shape, mode) for i, shape in enumerate(_shapes()) for mode in MODES[i % 2::2][:2]] + \
    [(shape, mode) for shape in _shapes()[:6] for mode in MODES]


def test_the_cases_cover_every_residue_and_mode():
    shapes = {shape for shape, _ in CASES}
    residues = {(max(shortest_side_size(*s, SIZE)) - SIZE) % 4 for s in shapes}
    assert len(shapes) >= 40 and residues == {0, 1, 2, 3}
    assert {mode for _, mode in CASES} == set(MODES)


def test_the_crop_offset_rounds_as_torchvision_or_floors_as_transformers():
    assert [center_crop_offset(SIZE + d, SIZE) for d in range(8)] == [0, 0, 1, 2, 2, 2, 3, 4]
    assert [center_crop_offset(SIZE + d, SIZE, "transformers") for d in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.fixture(scope="module")
def open_clip_preprocess():
    from openclip_refs import open_clip

    return open_clip().transform.image_transform(SIZE, is_train=False, resize_mode="shortest",
                                                  interpolation="bicubic")


@pytest.fixture(scope="module")
def openai_preprocess():
    import warnings

    with warnings.catch_warnings():  # its pkg_resources import warns of its deprecation
        warnings.simplefilter("ignore")
        clip = pytest.importorskip("clip")
    return clip.clip._transform(SIZE)


@pytest.fixture(scope="module")
def clip_image_processor():
    import transformers

    cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    processor = cls(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE})

    def run(image):
        return torch.as_tensor(np.asarray(processor(images=image, return_tensors="np")["pixel_values"][0]))

    return run


def _worst_difference(convention: str, reference) -> float:
    """The largest pixel difference over CASES between nclip's ``convention`` and ``reference``'s tensors."""
    worst = 0.0
    for seed, (shape, mode) in enumerate(CASES):
        image = _image(shape, mode, seed)
        ours = eval_tensor(image, SIZE, EvalPreprocess("shortest", "bicubic", convention))
        worst = max(worst, float((ours - reference(image)).abs().max()))
    return worst


@pytest.mark.parametrize("reference", ["open_clip_preprocess", "openai_preprocess"])
def test_torchvision_convention_equals_open_clip_and_openai(reference, request):
    worst = _worst_difference("torchvision", request.getfixturevalue(reference))
    assert worst <= 1e-6, worst


def test_transformers_convention_equals_clip_image_processor(clip_image_processor):
    worst = _worst_difference("transformers", clip_image_processor)
    assert worst <= 1e-6, worst


def test_the_conventions_differ_where_the_tools_do():
    """The cases are not vacuous: on an overhang of 3 (mod 4), and on a P or RGBA image, the two
    conventions give other pixels."""
    crop = next(s for s, _ in CASES if (max(shortest_side_size(*s, SIZE)) - SIZE) % 4 == 3)
    for shape, mode in ((crop, "RGB"), ((SIZE + 10, SIZE + 30), "P"), ((SIZE + 8, SIZE + 1), "RGBA")):
        image = _image(shape, mode, 0)
        a = eval_tensor(image, SIZE, EvalPreprocess("shortest", "bicubic", "torchvision"))
        b = eval_tensor(image, SIZE, EvalPreprocess("shortest", "bicubic", "transformers"))
        assert float((a - b).abs().max()) > 0.1, (shape, mode)
