"""Every shipped preset configures the method its name and its header comment claim (issue 27.1: a
preset named cmsf-... once trained MSF). One row per preset; a new preset without a row fails."""

from importlib import resources

import pytest

from nclip.config import preset_names, resolve
from nclip.defaults import has_labels
from nclip.objectives import REGISTRY

RN50 = ("resnet", (3, 4, 6, 3), (256, 512, 1024, 2048))  # kind, bottleneck blocks, stage widths
# CLIP's modified RN50 (issue 27.3): as RN50, with a 64-channel stem and attention pooling of 32 heads to 1024
CLIP_RN50 = ("clip_resnet", (3, 4, 6, 3), (256, 512, 1024, 2048), 64, 32, 1024)
# which ResNet-50 a preset builds, in the words its header comment must use
RN50_WORDS = {"rn50": "standard ResNet-50", "clip-rn50": "CLIP's modified ResNet-50"}
VIT_B16 = ("vit", 16, 768, 12, 12)  # kind, patch, width, layers, heads
# GroupViT-S (Xu et al. 2022): kind, patch, width, heads, layers per stage, group tokens, output groups
GROUPVIT_S = ("groupvit", 16, 384, 6, (6, 3, 3), (64, 8, 0), (64, 8, 8))

# preset -> what it configures. header: words its header comment must name (the method as the paper
# calls it); heads: the heads the model builds (Objective.heads_for); tower: "rn50" (He et al.'s),
# "clip-rn50" (CLIP's modified RN50; the header names which, RN50_WORDS), "vit-b16", or the kind of a
# small tower; constraint: CMSF's; labels: its data give every row a class label;
# clip_reduction: how L_CLIP joins its two InfoNCE directions (issue 27.2), None without a CLIP term
FACTS = {
    "clip-tiny": dict(objective="clip", header=["CLIP", "InfoNCE"], heads={"clip"}, tower="convnet",
                      clip_reduction="mean"),
    "nclip-tiny": dict(objective="nclip", header=["nCLIP"], heads={"nclip"}, tower="convnet"),
    "tiny": dict(objective="xclip", header=["xCLIP"], heads={"clip", "nclip"}, tower="convnet",
                 clip_reduction="mean"),
    "micro": dict(objective="xclip", header=["xCLIP"], heads={"clip", "nclip"}, tower="vit",
                  clip_reduction="mean"),
    "vit-b16-xclip": dict(objective="xclip", header=["xCLIP", "ViT-B/16"], heads={"clip", "nclip"},
                          tower="vit-b16", clip_reduction="mean"),
    "tagging-digits-tiny": dict(objective="xclip", header=["xCLIP", "tagging"], heads={"clip", "nclip"},
                                tower="convnet", labels=True, clip_reduction="mean"),
    "cmsf-tiny": dict(objective="cmsf", header=["CMSF", "supervised"], heads={"cmsf"}, tower="convnet",
                      constraint="labels", labels=True),
    "cmsf-noisy-tiny": dict(objective="cmsf", header=["CMSF", "label noise"], heads={"cmsf"}, tower="convnet",
                            constraint="noisy_labels", labels=True),
    "cmsf-xmodal-tiny": dict(objective="cmsf", header=["CMSF", "cross-modal", "captions"], heads={"cmsf"},
                             tower="convnet", constraint="cross_modal"),
    "cmsf-rn50-in1k": dict(objective="cmsf", header=["CMSF", "supervised", "ImageNet"], heads={"cmsf"},
                           tower="rn50", constraint="labels", labels=True),
    "protoclip-tiny": dict(objective="protoclip", header=["ProtoCLIP"], heads={"clip", "proto"}, tower="vit",
                           episodic=True, clip_reduction="mean"),
    "protoclip-rn50-cc": dict(objective="protoclip", header=["ProtoCLIP", "ResNet-50"], heads={"clip", "proto"},
                              tower="clip-rn50", episodic=True, clip_reduction="mean"),
    "groupvit-tiny": dict(objective="xclip", header=["xCLIP", "GroupViT"], heads={"clip", "nclip"},
                          tower="groupvit", clip_reduction="mean"),
    "groupvit-s-xclip": dict(objective="xclip", header=["xCLIP", "GroupViT-S", "App. D.2"], heads={"clip", "nclip"},
                             tower="groupvit-s", clip_reduction="mean"),
    "supcon-tiny": dict(objective="supcon", header=["SupCon"], heads={"supcon"}, tower="convnet", labels=True),
}


def _header(name: str) -> str:
    text = (resources.files("nclip") / "presets" / f"{name}.yaml").read_text()
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# "))
    return " ".join(lines)


def _tower(vision) -> str:
    if (vision.kind, vision.depths, vision.hidden_sizes) == RN50:
        return "rn50"
    if (vision.kind, vision.depths, vision.hidden_sizes, vision.embedding_size, vision.heads,
            vision.pool_dim) == CLIP_RN50:
        return "clip-rn50"
    if (vision.kind, vision.patch_size, vision.width, vision.layers, vision.heads) == VIT_B16:
        return "vit-b16"
    if (vision.kind, vision.patch_size, vision.width, vision.heads, vision.depths, vision.group_tokens,
            vision.output_groups) == GROUPVIT_S:
        return "groupvit-s"
    return vision.kind


def _claimed_by_name(name: str) -> dict:
    """What the name alone promises, as a check on the table's rows."""
    claims = {}
    if "rn50" in name:  # either ResNet-50, the one its paper used (the header says which)
        claims["tower"] = tuple(RN50_WORDS)
    if "b16" in name:
        claims["tower"] = "vit-b16"
    if name.startswith("groupvit"):
        claims["tower"] = "groupvit-s" if name.startswith("groupvit-s-") else "groupvit"
    for prefix, objective in (("cmsf", "cmsf"), ("protoclip", "protoclip"), ("supcon", "supcon"),
                              ("nclip-", "nclip"), ("clip-", "clip")):
        if name.startswith(prefix):
            claims["objective"] = objective
            break
    if name.endswith("xclip"):
        claims["objective"] = "xclip"
    if name.startswith("cmsf"):  # the constraint the name spells, supervised by default
        claims["constraint"] = ("noisy_labels" if "noisy" in name
                                else "cross_modal" if "xmodal" in name else "labels")
    if "in1k" in name:
        claims["labels"] = True
    return claims


def test_every_preset_has_a_row():
    assert set(preset_names()) == set(FACTS), "a shipped preset needs a row in FACTS (and a removed one loses it)"


@pytest.mark.parametrize("name", sorted(FACTS))
def test_preset_configures_the_method_it_claims(name):
    facts = FACTS[name]
    for key, value in _claimed_by_name(name).items():
        ok = facts.get(key) in value if isinstance(value, tuple) else facts.get(key) == value
        assert ok, f"{name}: the name promises {key} {value}, the table says {facts.get(key)}"
    cfg = resolve(name)
    obj = cfg.objective
    objective_cls = REGISTRY[obj.name][1]
    header = _header(name)
    missing = [word for word in facts["header"] + [RN50_WORDS.get(facts["tower"], "")] if word not in header]
    assert not missing, f"{name}: its header comment does not name {missing}"
    assert obj.name == facts["objective"]
    assert set(objective_cls.heads_for(obj)) == facts["heads"]
    assert _tower(cfg.model.vision) == facts["tower"]
    assert objective_cls.episodic == facts.get("episodic", False)
    assert getattr(obj, "constraint", None) == facts.get("constraint")
    # issue 27.2: the L_CLIP reading (mean of the two InfoNCE directions, or Algorithm 1's sum), said in the header
    assert getattr(obj, "clip_reduction", None) == facts.get("clip_reduction")
    if facts.get("clip_reduction"):
        assert "clip_reduction" in header, f"{name}: its header comment does not say which L_CLIP it uses"
    if facts.get("labels"):
        assert has_labels(cfg.data), f"{name}: claims labels, data.source {cfg.data.source} has none"
    if facts.get("constraint") == "noisy_labels":
        assert obj.label_noise > 0
    if facts.get("constraint") == "labels":
        assert obj.label_noise == 0
