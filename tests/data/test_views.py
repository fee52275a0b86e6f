"""Two views for MSF/CMSF (nclip.data.views): uint8 crops and colour parameters drawn per row from
(key, row), the colour steps batched where the views are finished; their formulas, probabilities,
seeding and split over ranks, and no host read in the finishing."""

import math

import numpy as np
import pytest
import torch
from PIL import Image
from torch.profiler import ProfilerActivity, profile

from nclip.data.transforms import clip_stats, normalize_pixels
from nclip.data.views import (
    BLUR,
    GRAY,
    JITTER,
    N_PARAMS,
    SOLARIZE,
    ViewRecipe,
    adjust_brightness,
    adjust_contrast,
    adjust_hue,
    adjust_saturation,
    crop_views,
    finish_views,
    gaussian_blur,
    photometric,
)

from host_syncs import SYNC_OPS

KEY = (7, 0x71E5, 3)  # (seed, stream, step), as the loader's


def _images(n=6, h=30, w=24, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h + i, w + 2 * i, 3), dtype=np.uint8) for i in range(n)]  # sizes differ


def test_shapes_dtypes_and_range():
    recipe = ViewRecipe(16, solarize_p=0.5)
    crops = crop_views(_images(), recipe, KEY)
    assert crops.pixels.dtype == torch.uint8 and crops.pixels.shape == (6, 2, 3, 16, 16)
    assert crops.params.dtype == torch.float32 and crops.params.shape == (6, N_PARAMS)
    views = finish_views(crops)
    assert views.dtype == torch.float32 and views.shape == (6, 2, 3, 16, 16)
    strong = photometric(crops.pixels[:, 0].float() / 255, crops.params, crops.order, recipe)
    assert strong.min() >= 0 and strong.max() <= 1
    torch.testing.assert_close(views[:, 0], normalize_pixels(strong.mul(255)).float(), rtol=0, atol=1e-5)
    assert torch.equal(views[:, 1], normalize_pixels(crops.pixels[:, 1]))  # the weak view: crop (+ flip) only


def test_rows_are_functions_of_key_and_row_alone():
    """A batch split in two (ranks) or resumed gets the rows of the whole batch, floats included."""
    recipe, images = ViewRecipe(20, blur_p=1.0), _images(8)
    whole = crop_views(images, recipe, KEY)
    again = crop_views(images, recipe, KEY)
    assert torch.equal(whole.pixels, again.pixels) and torch.equal(whole.params, again.params)
    halves = [crop_views(images[:5], recipe, KEY), crop_views(images[5:], recipe, KEY, first_row=5)]
    assert torch.equal(torch.cat([h.pixels for h in halves]), whole.pixels)
    assert torch.equal(torch.cat([h.params for h in halves]), whole.params)
    assert halves[0].order == halves[1].order == whole.order
    assert torch.equal(torch.cat([finish_views(h) for h in halves]), finish_views(whole))
    one = [finish_views(crop_views(images[i : i + 1], recipe, KEY, first_row=i)) for i in range(8)]
    assert torch.equal(torch.cat(one), finish_views(whole))  # one row per "rank"
    other = crop_views(images, recipe, (7, 0x71E5, 4))  # the next step
    assert not torch.equal(other.pixels, whole.pixels) and not torch.equal(other.params, whole.params)


def test_the_two_crops_differ_and_are_torchvision_s_crops_of_a_pil_image():
    """The reference code's RandomResizedCrop on a PIL image: crop, then Pillow's bilinear resize."""
    recipe = ViewRecipe(24, crop_scale=(0.2, 0.6))
    image = _images(1, 64, 48)[0]
    crops = crop_views([image], recipe, KEY)
    assert not torch.equal(crops.pixels[0, 0], crops.pixels[0, 1])
    rng = np.random.default_rng([*KEY, 0])
    online, online_flip, target, target_flip, _ = recipe.draw(rng, *image.shape[:2])
    for view, box, flip in ((0, online, online_flip), (1, target, target_flip)):
        pil = np.asarray(Image.fromarray(image).crop(box).resize((24, 24), Image.BILINEAR)).astype(int)
        got = crops.pixels[0, view].permute(1, 2, 0).numpy().astype(int)
        got = got[:, ::-1] if flip else got
        assert np.abs(got - pil).max() <= 1 and np.abs(got - pil).mean() < 0.1, view  # rounding


def test_weak_view_keeps_colours_strong_view_changes_them():
    flat = np.broadcast_to(np.array([200, 80, 30], dtype=np.uint8), (8, 20, 20, 3))
    jitter = ViewRecipe(10, jitter_p=1.0, grayscale_p=0.0, blur_p=0.0)
    crops = crop_views(list(flat), jitter, KEY)
    colour = torch.tensor([200, 80, 30], dtype=torch.uint8).view(1, 3, 1, 1)
    assert torch.equal(crops.pixels[:, 1], colour.expand(8, 3, 10, 10))
    strong = photometric(crops.pixels[:, 0].float() / 255, crops.params, crops.order, jitter)
    assert (strong - colour / 255).abs().amax(dim=(1, 2, 3)).min() > 1e-3  # every image jittered
    grey = ViewRecipe(10, jitter_p=0.0, grayscale_p=1.0, blur_p=0.0)
    crops = crop_views(list(flat), grey, KEY)
    gray = photometric(crops.pixels[:, 0].float() / 255, crops.params, crops.order, grey)
    assert torch.equal(gray[:, 0], gray[:, 1]) and torch.equal(gray[:, 1], gray[:, 2])


def test_probabilities_are_msf_s():
    recipe = ViewRecipe()
    rows = [recipe.draw(np.random.default_rng([1, i]), 100, 120) for i in range(4000)]
    params = np.stack([r[4] for r in rows])
    for column, p in ((JITTER, 0.8), (GRAY, 0.2), (BLUR, 0.5), (SOLARIZE, 0.0)):
        assert abs(params[:, column].mean() - p) < 0.03, column
    assert abs(np.mean([r[1] for r in rows]) - 0.5) < 0.03 and abs(np.mean([r[3] for r in rows]) - 0.5) < 0.03
    assert 0.6 <= params[:, 1:4].min() and params[:, 1:4].max() <= 1.4 and np.abs(params[:, 4]).max() <= 0.1
    areas = [(b[2] - b[0]) * (b[3] - b[1]) / 12000 for b in (r[0] for r in rows)]
    assert 0.19 < min(areas) and max(areas) <= 1.0
    assert ViewRecipe(solarize_p=0.2).draw(np.random.default_rng(0), 10, 10)[4][SOLARIZE] in (0.0, 1.0)
    assert sorted(recipe.jitter_order(np.random.default_rng(0))) == [0, 1, 2, 3]
    assert sorted(ViewRecipe(jitter=(0.4, 0.0, 0.2, 0.0)).jitter_order(np.random.default_rng(0))) == [0, 2]


def test_colour_steps_follow_torchvision_s_formulas():
    """kornia.enhance implements torchvision's formulas: ours give its values (its luma weights are
    0.299 where torchvision's are 0.2989, hence the contrast and saturation tolerance)."""
    import kornia.enhance as ke
    from kornia.filters import gaussian_blur2d

    x = torch.rand(6, 3, 17, 19, generator=torch.Generator().manual_seed(0))
    x[:, :, :4] = x[:, :1, :4]  # grey pixels
    x[:, 1, 4:8] = x[:, 0, 4:8]  # ties of the largest channel
    f = torch.tensor([0.6, 0.9, 1.0, 1.1, 1.4, 1.25])
    torch.testing.assert_close(adjust_brightness(x, f), ke.adjust_brightness_accumulative(x, f))
    torch.testing.assert_close(adjust_contrast(x, f), ke.adjust_contrast_with_mean_subtraction(x, f), atol=1e-3, rtol=0)
    torch.testing.assert_close(adjust_saturation(x, f), ke.adjust_saturation_with_gray_subtraction(x, f), atol=1e-3,
                               rtol=0)
    for turns in (torch.full((6,), 0.1), torch.full((6,), -0.1), torch.linspace(-0.5, 0.5, 6)):
        torch.testing.assert_close(adjust_hue(x, turns), ke.adjust_hue(x, turns * 2 * math.pi), atol=1e-5, rtol=0)
    sigma = torch.tensor([0.1, 0.5, 1.0, 1.5, 2.0, 0.7])
    want = gaussian_blur2d(x, 13, sigma.view(-1, 1).expand(6, 2), border_type="reflect")
    torch.testing.assert_close(gaussian_blur(x, sigma, 13), want, atol=1e-6, rtol=0)


def test_a_flip_in_the_worker_gives_the_view_of_a_flip_made_last():
    """The code flips the strong view after its colour steps; every step commutes with the flip."""
    recipe = ViewRecipe(12, jitter_p=1.0, grayscale_p=0.5, blur_p=1.0, solarize_p=0.5)
    crops = crop_views(_images(8), recipe, KEY)
    x = crops.pixels[:, 0].float() / 255
    flipped_first = photometric(x.flip(-1), crops.params, crops.order, recipe)
    torch.testing.assert_close(flipped_first, photometric(x, crops.params, crops.order, recipe).flip(-1),
                               atol=1e-6, rtol=0)


def test_solarize_and_bad_recipes():
    recipe = ViewRecipe(8, solarize_p=1.0, jitter_p=0.0, grayscale_p=0.0, blur_p=0.0)
    crops = crop_views(_images(4, 8, 8), recipe, KEY)
    assert photometric(crops.pixels[:, 0].float() / 255, crops.params, crops.order, recipe).max() <= 0.5
    assert ViewRecipe(4).taps == 7 and ViewRecipe().taps == 13  # the radius stays below the side
    for kwargs, match in [({"jitter_p": 1.5}, "jitter_p"), ({"blur_sigma": (0.0, 1.0)}, "blur_sigma"),
                          ({"size": 0}, "size"), ({"jitter": (0.4, 0.4, 0.4, 0.6)}, "hue")]:
        with pytest.raises(ValueError, match=match):
            ViewRecipe(**kwargs)


def test_finishing_reads_nothing_on_the_host():
    """The ops that wait for a GPU (tests/host_syncs.py) do not occur in the finishing."""
    crops = crop_views(_images(4), ViewRecipe(16, solarize_p=0.5), KEY)
    stats = clip_stats()  # made once, by the DeviceFeed (on a GPU a blocking copy)
    finish_views(crops, stats)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        finish_views(crops, stats)
    found = {e.name for e in prof.events()} & SYNC_OPS
    assert not found, found
