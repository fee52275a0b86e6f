"""Heads as registered modules (nclip.heads): the model holds its heads in a ModuleDict in registration
order, returns their outputs keyed by head name, refuses what it cannot build in one line, and takes a
head kind registered outside the built-ins as one of its own."""

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from nclip.config import resolve
from nclip.heads import Head, build_heads, head_class, param_side, register_head, registered_heads
from nclip.heads.base import HeadContext
from nclip.models import DualEncoder, build_model

HEADS_SRC = Path(__file__).resolve().parents[2] / "src" / "nclip" / "heads"
LAYER_0 = ("nclip.errors", "nclip.jsonio", "nclip.precision", "nclip.distributed", "nclip.defaults")


@register_head
class ScaledHead(Head):
    """A head of a test's own: each side's features times a learned scalar, read after the CLIP head."""

    name = "test_scaled"
    sides = ("image", "text")
    after = ("clip",)

    def __init__(self):
        super().__init__()
        self.image_gain = nn.Parameter(torch.tensor(2.0))
        self.text_gain = nn.Parameter(torch.tensor(3.0))

    @classmethod
    def build(cls, ctx):
        return cls()

    def forward(self, side, f, outs):
        return {"test_scaled": getattr(self, f"{side}_gain") * outs["clip"], "test_scaled_raw": f}


def _batch(model, b=4):
    torch.manual_seed(0)
    ids, mask = model.tokenizer([f"caption {i}" for i in range(b)])
    return torch.randn(b, 3, 16, 16), ids, mask


def test_heads_import_nothing_below_layer_0():
    for path in HEADS_SRC.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name.startswith("nclip"):
                    assert name.startswith(("nclip.heads", *LAYER_0)), f"{path.name} imports {name}"


def test_outputs_are_keyed_by_head_name_in_registration_order(micro_overrides):
    cfg = resolve("micro", micro_overrides + ["objective.name=xclip", "model.nclip_layers=2",
                                              "model.nclip_shared_layers=1"])
    model = build_model(cfg, pretrained_text=False).eval()
    assert list(model.heads) == ["shared", "clip", "nclip"]  # the order parameters are created in
    pixels, ids, mask = _batch(model)
    image, text = model.encode_image(pixels), model.encode_text(ids, mask)
    assert list(image) == list(text) == ["features", "shared", "clip", "nclip"]
    out = model(pixels, ids, mask)
    torch.testing.assert_close(out.image["clip"], image["clip"])
    torch.testing.assert_close(out.text["nclip"], text["nclip"])
    assert out.image_features.shape[0] == 4 and "features" not in out.image


def test_a_head_registered_outside_the_builtins_is_built_trained_and_saved(micro_overrides, tmp_path):
    from nclip.models.io import save_model

    cfg = resolve("micro", micro_overrides)
    model = DualEncoder(cfg, frozenset({"clip", "nclip", "test_scaled"}), pretrained_text=False)
    assert list(model.heads) == ["clip", "nclip", "test_scaled"]
    out = model(*_batch(model))
    torch.testing.assert_close(out.image["test_scaled"], 2.0 * out.image["clip"])
    torch.testing.assert_close(out.text["test_scaled"], 3.0 * out.text["clip"])
    assert torch.equal(out.text["test_scaled_raw"], out.text_features)
    out.image["test_scaled"].sum().backward()
    assert model.heads["test_scaled"].image_gain.grad is not None
    assert {"heads.test_scaled.image_gain", "heads.test_scaled.text_gain"} <= set(model.state_dict())
    save_model(model, cfg, tmp_path / "m")  # the head's parameters are saved like a built-in's


def test_what_a_model_cannot_build_is_one_line(micro_overrides):
    cfg = resolve("micro", micro_overrides)
    for heads, needle in ((frozenset({"proto"}), "the proto head reads the clip head"),
                          (frozenset({"test_scaled"}), "reads the clip head"),
                          (frozenset({"clip", "no_such_head"}), "no head named 'no_such_head'")):
        with pytest.raises(ValueError, match=needle) as e:
            DualEncoder(cfg, heads, pretrained_text=False)
        assert "\n" not in str(e.value)
    with pytest.raises(KeyError, match="no head named"):
        head_class("no_such_head")


def test_a_name_is_registered_once():
    class Other(Head):
        name = "clip"

    with pytest.raises(ValueError, match="registered twice"):
        register_head(Other)
    register_head(head_class("clip"))  # the same class again: a no-op
    built_in = ["shared", "clip", "nclip", "proto", "cmsf", "xent", "supcon"]  # the order models build them in
    assert [c.name for c in registered_heads()][:7] == built_in


def test_param_side_reads_the_naming_rule():
    assert param_side("vision.model.embeddings.patch_embedding.weight") == "image"
    assert param_side("heads.clip.image.weight") == "image"
    assert param_side("heads.cmsf.image_predictor.0.weight") == "image"
    assert param_side("heads.nclip.text.0.weight") == "text"
    assert param_side("text.model.final_layer_norm.weight") == "text"
    assert param_side("heads.cmsf.target_vision.model.post_layernorm.weight") is None
    assert param_side("logit_scale") is None


def test_an_image_only_model_freezes_the_text_tower_and_reads_views_by_its_head(micro_overrides):
    cfg = resolve("micro", micro_overrides + ["objective.name=cmsf"])
    model = build_model(cfg, pretrained_text=False)
    assert not model.uses_text and not any(p.requires_grad for p in model.text.parameters())
    assert set(model.towers()) == {"vision", "text", "target_vision"}
    pixels, ids, mask = _batch(model)
    out = model(torch.stack([pixels, pixels.flip(-1)], 1), ids, mask)
    assert set(out.image) == {"cmsf_target", "cmsf", "cmsf_pred"} and out.text == {}
    assert not out.image["cmsf_target"].requires_grad and out.image["cmsf_pred"].requires_grad
    with pytest.raises(ValueError, match="two views need a model with a head that reads them"):
        DualEncoder(cfg, frozenset({"clip"}), pretrained_text=False)(torch.stack([pixels] * 2, 1), ids, mask)


def test_build_heads_passes_the_class_count_only_when_asked(micro_overrides):
    cfg = resolve("micro", micro_overrides)
    model = build_model(cfg, pretrained_text=False)

    def refuse():
        raise AssertionError("the class count was asked for")

    ctx = HeadContext(cfg, model.vision, model.text, frozenset({"clip"}), refuse)
    assert list(build_heads(ctx)) == ["clip"]
    ctx = HeadContext(cfg, model.vision, model.text, frozenset({"xent"}), lambda: 7)
    assert build_heads(ctx)["xent"].image.out_features == 7


def test_every_head_lists_model_fields_that_exist():
    from nclip.config import ModelConfig

    for cls in registered_heads():
        missing = [f for f in cls.config_fields if f not in ModelConfig.model_fields]
        assert not missing, (cls.name, missing)
    assert head_class("nclip").config_fields and head_class("supcon").config_fields == ("supcon_hidden", "supcon_dim")


def test_side_modules_follow_the_naming_rule(micro_overrides):
    cfg = resolve("micro", micro_overrides + ["objective.name=cmsf"])
    head = build_model(cfg, pretrained_text=False).heads["cmsf"]
    assert head.side_modules("image") == [head.image, head.image_predictor]  # not the target copies
    assert head.side_modules("text") == []
