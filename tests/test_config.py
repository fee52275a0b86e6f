import pytest

from nclip.config import apply_overrides, load_preset, preset_names, resolve, validate
from nclip.errors import NclipError


def test_every_preset_validates():
    names = preset_names()
    assert {"tiny", "clip-tiny", "nclip-tiny", "vit-b16-xclip", "micro"} <= set(names)
    for name in names:
        resolve(name)


def test_paper_preset_has_table_f5_settings():
    cfg = resolve("vit-b16-xclip")
    t, m, o = cfg.train, cfg.model, cfg.objective
    assert (t.batch_size, t.lr, t.min_lr, t.weight_decay, t.betas, t.eps) == (4096, 1e-3, 2e-6, 0.2, (0.9, 0.98), 1e-6)
    assert (m.nclip_hidden, m.nclip_dim, m.embed_dim) == (4096, 32768, 512)
    assert (m.vision.patch_size, m.vision.width, m.vision.layers, m.vision.heads) == (16, 768, 12, 12)
    assert cfg.data.image_size == 224 and cfg.data.augment.crop_scale == (0.5, 1.0)
    assert (o.name, o.lambda1, o.lambda2, o.w_clip, o.w_nclip) == ("xclip", 0.5, 1.5, 0.2, 1.0)
    steps_per_epoch = 35e6 / 4096  # IT35M at batch 4096
    assert t.steps == round(32 * steps_per_epoch) and t.warmup_steps == round(3 * steps_per_epoch)


def test_required_key_names_exist():
    cfg = resolve("tiny", ["train.steps=7", "train.batch_size=12", "seed=3"])
    assert (cfg.train.steps, cfg.train.batch_size, cfg.seed) == (7, 12, 3)


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.bogus=1", "train.bogus: unknown key"),
        ("trian.steps=1", "trian: unknown key"),
        ("train.steps=0", "train.steps"),
        ("train.batch_size=1", "train.batch_size"),
        ("data.loose_caption_prob=1.5", "data.loose_caption_prob"),
        ("objective.name=nope", "unknown objective 'nope'"),
        ("objective.lambda9=1", "objective.lambda9: unknown key"),
        ("objective.lambda1=-1", "objective.lambda1"),
        ("model.vision.heads=3", "not divisible by heads"),
        ("train.batch_size=126", "not divisible by data.hard_negative_group 4"),
        ("train.steps=abc", "train.steps"),
    ],
)
def test_bad_values_are_one_line_errors(override, message):
    with pytest.raises(NclipError) as e:
        resolve("tiny", [override])
    text = str(e.value)
    assert message in text and "\n" not in text


def test_vit_image_size_must_be_a_multiple_of_the_patch():
    with pytest.raises(NclipError, match="not divisible by model.vision.patch_size"):
        resolve("micro", ["data.image_size=30"])


def test_convnet_stages_must_fit_the_image():
    resolve("tiny", ["data.image_size=16"])  # 4 stages: 16 → 8 → 4 → 2 → 1
    with pytest.raises(NclipError, match="too small for a convnet of 5 stages"):
        resolve("tiny", ["data.image_size=16", "model.vision.depths=[1,1,1,1,1]",
                         "model.vision.hidden_sizes=[8,8,8,8,8]", "model.vision.heads=2"])


def test_clip_objective_rejects_nclip_keys():
    with pytest.raises(NclipError, match="objective.lambda1: unknown key"):
        resolve("clip-tiny", ["objective.lambda1=0.5"])


def test_override_syntax_and_yaml_files(tmp_path):
    with pytest.raises(NclipError, match="key=value"):
        apply_overrides({}, ["train.steps"])
    assert apply_overrides({}, ["a.b=[1, 2]"]) == {"a": {"b": [1, 2]}}
    path = tmp_path / "mine.yaml"
    path.write_text("train: {steps: 5}\n")
    assert validate(load_preset(str(path))).train.steps == 5
    with pytest.raises(NclipError, match="not found"):
        load_preset(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(NclipError, match="cannot parse"):
        load_preset(str(bad))


def test_tower_kinds_come_from_one_table():
    """model.vision.kind and model.text.kind accept exactly the kinds of their tables, and the
    towers module builds a tower for each (it refuses to import otherwise)."""
    from nclip.config.model import TEXT_KINDS, VISION_KINDS

    with pytest.raises(NclipError, match="model.vision.kind: Input should be 'vit', 'resnet', 'convnet', "
                                         "'clip_resnet' or 'groupvit'"):
        resolve("micro", ["model.vision.kind=vitt"])
    with pytest.raises(NclipError, match="model.text.kind: Input should be 'transformer' or 'pretrained'"):
        resolve("micro", ["model.text.kind=bert"])
    from nclip.models.towers import VISION_TOWERS

    assert set(VISION_TOWERS) == set(VISION_KINDS) and set(TEXT_KINDS) == {"transformer", "pretrained"}


def test_unknown_preset_lists_the_shipped_ones():
    with pytest.raises(NclipError, match=r"unknown preset 'tiniest'; available: .*micro.*tiny"):
        load_preset("tiniest")


def test_config_sections_are_modules_of_the_package():
    """One module per section; the package exports the public names."""
    import nclip.config as config

    assert config.DataConfig.__module__ == "nclip.config.data"
    assert config.VisionConfig.__module__ == config.ModelConfig.__module__ == "nclip.config.model"
    assert config.TrainConfig.__module__ == "nclip.config.train"
    assert config.EvalConfig.__module__ == "nclip.config.eval"
    assert config.RunConfig.__module__ == "nclip.config.run"
