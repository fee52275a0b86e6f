"""Two augmented views for MSF/CMSF with kornia: shapes, range, seeding, what each view may change."""

import pytest
import torch

from nclip.data.views import TwoViews, strong_view, weak_view


def _images(b=4, h=24, w=20, seed=0):
    return torch.rand(b, 3, h, w, generator=torch.Generator().manual_seed(seed))


def test_shapes_range_and_order():
    views = TwoViews(16)(_images(), seed=0)
    assert views.target.shape == views.online.shape == (4, 3, 16, 16)
    for x in views:
        assert x.min() >= 0 and x.max() <= 1
    norm = TwoViews(16, normalize=True)(_images(), seed=0)
    mean, std = TwoViews(16).mean, TwoViews(16).std
    torch.testing.assert_close(norm.target, (views.target - mean) / std)


def test_seeded_reproducible_and_leaves_the_global_generator_alone():
    aug, x = TwoViews(12), _images()
    state = torch.get_rng_state()
    a, b, c = aug(x, seed=5), aug(x, seed=5), aug(x, seed=6)
    assert torch.equal(state, torch.get_rng_state())
    assert torch.equal(a.target, b.target) and torch.equal(a.online, b.online)
    assert not torch.equal(a.online, c.online)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert torch.equal(aug(x, generator=g1).online, aug(x, generator=g2).online)
    torch.manual_seed(3)
    d = aug(x)
    torch.manual_seed(3)
    assert torch.equal(aug(x).online, d.online)  # or the global seed
    with pytest.raises(ValueError, match="not both"):
        aug(x, seed=1, generator=g1)


def test_weak_view_keeps_colours_strong_view_changes_them():
    flat = torch.tensor([0.8, 0.3, 0.1]).view(1, 3, 1, 1).expand(8, 3, 20, 20).contiguous()
    views = TwoViews(10, jitter_p=1.0, grayscale_p=0.0)(flat, seed=0)
    torch.testing.assert_close(views.target, flat[:, :, :10, :10])  # crop + flip only
    assert (views.online - flat[:, :, :10, :10]).abs().amax(dim=(1, 2, 3)).min() > 1e-3  # every image jittered
    gray = TwoViews(10, jitter_p=0.0, grayscale_p=1.0)(flat, seed=0).online
    assert torch.allclose(gray[:, 0], gray[:, 1]) and torch.allclose(gray[:, 1], gray[:, 2])


def test_paper_defaults_and_options():
    names = [type(m).__name__ for m in strong_view(224).children()]
    assert names == ["RandomResizedCrop", "ColorJitter", "RandomGrayscale", "RandomGaussianBlur",
                     "RandomHorizontalFlip"]
    assert [type(m).__name__ for m in weak_view(224).children()] == ["RandomResizedCrop", "RandomHorizontalFlip"]
    assert type(list(strong_view(32, solarize_p=0.2).children())[-1]).__name__ == "RandomSolarize"
    solar = TwoViews(8, solarize_p=1.0, jitter_p=0.0, grayscale_p=0.0, blur_p=0.0)(_images(h=8, w=8), seed=0).online
    assert solar.max() <= 0.5 + 1e-6  # every pixel above the threshold 0.5 was inverted
    for kwargs, match in [({"jitter_p": 1.5}, "jitter_p"), ({"blur_sigma": (0.0, 1.0)}, "blur_sigma")]:
        with pytest.raises(ValueError, match=match):
            TwoViews(8, **kwargs)
    with pytest.raises(ValueError, match="B, 3, H, W"):
        TwoViews(8)(torch.rand(3, 8, 8))
