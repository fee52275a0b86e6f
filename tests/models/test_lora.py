"""model.lora (nclip.models.lora): peft's LoRA layers on each tower kind's attention and MLP
projections, the base weights frozen and out of the optimizer, the heads trained whole; the merged
state dict equal to peft's own merge; the adapter alone on the starting model giving the model
again; and one line wherever LoRA cannot apply."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from nclip.config import resolve
from nclip.errors import NclipError
from nclip.models import build_model
from nclip.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, apply_adapter, base_layers, merged_state_dict
from nclip.train.optim import build_optimizer

from conftest import micro_sizes

peft = pytest.importorskip("peft")

CONV = ["model.vision.depths=[1,1]", "model.vision.hidden_sizes=[16,32]", "model.vision.embedding_size=16",
        "model.vision.heads=2"]
LORA = ["model.lora.rank=4"]


def _model(*extra):
    cfg = resolve("micro", micro_sizes() + list(extra))
    torch.manual_seed(cfg.seed)
    return cfg, build_model(cfg, pretrained_text=False)


def _trained(module, prefix: str = "") -> set[str]:
    return {n for n, p in module.named_parameters(prefix=prefix) if p.requires_grad}


# per case: the overrides and the adapted layers' names (a tail) in each tower
CASES = {
    "vit+transformer": ([], {"vision": {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                        "self_attn.out_proj", "mlp.fc1", "mlp.fc2"}}),
    "clip_resnet": (["model.vision.kind=clip_resnet", *CONV], {"vision": {"pool.query", "pool.key", "pool.value",
                                                                          "pool.proj"}}),
    "siglip": (["model.vision.pooling=map", "model.text.eos_pooling=last"],
               {"vision": {"self_attn.q_proj", "mlp.fc1", "head.mlp.fc2"}}),
    "minilm": (["model.text.kind=pretrained"], {"text": {"attention.self.query", "attention.self.value",
                                                         "attention.output.dense", "intermediate.dense",
                                                         "layer.5.output.dense"}}),
}


@pytest.mark.parametrize("case", CASES)
def test_only_the_factors_train_in_the_towers_and_the_heads_train_whole(case):
    extra, expected = CASES[case]
    cfg, full = _model(*extra)
    _, model = _model(*extra, *LORA)
    for tower in ("vision", "text"):
        trained = _trained(getattr(model, tower), tower)
        assert trained and all(".lora_A.default." in n or ".lora_B.default." in n for n in trained), (tower, trained)
        for tail in expected.get(tower, ()):
            assert any(f".{tail}.lora_A." in n for n in trained), (tower, tail)
        if case == "siglip" and tower == "vision":  # an nn.MultiheadAttention reads its out_proj by weight
            assert not any("head.attention" in n for n in trained)
        if case == "minilm" and tower == "text":  # the pooler is no attention or MLP projection
            assert not any("pooler" in n for n in trained)
    heads = {n for n, _ in model.named_parameters() if not n.startswith(("vision.", "text."))}
    assert heads and heads <= _trained(model) and heads == {n for n, _ in full.named_parameters()
                                                            if not n.startswith(("vision.", "text."))}
    in_optimizer = {id(p) for g in build_optimizer([model], cfg.train).param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in model.parameters() if p.requires_grad}
    # B starts at zero: the adapted model computes what the same weights without LoRA compute
    with base_layers(model):
        plain = {k: v for k, v in model.state_dict().items()}
    full.load_state_dict(plain)
    pixels, ids = torch.randn(3, 3, 16, 16), torch.randint(5, 90, (3, 16))
    model.eval()
    full.eval()
    with torch.no_grad():
        a, b = model.encode_image(pixels), full.encode_image(pixels)
        c, d = model.encode_text(ids, torch.ones_like(ids)), full.encode_text(ids, torch.ones_like(ids))
    torch.testing.assert_close(a["clip"], b["clip"], rtol=0, atol=1e-6)
    torch.testing.assert_close(c["clip"], d["clip"], rtol=0, atol=1e-6)


def test_a_locked_tower_gets_no_adapter_and_stays_locked():
    from nclip.models.locking import is_locked, lock_towers

    cfg, model = _model("model.vision.kind=convnet", *CONV, "model.vision.lock=true", *LORA)
    lock_towers(model, cfg.model)
    assert is_locked(model.vision) and not _trained(model.vision)
    assert _trained(model.text) and model.lora_targets.keys() == {"text"}


def test_the_modified_resnets_frozen_batchnorm_keeps_its_statistics():
    _, model = _model("model.vision.kind=clip_resnet", *CONV, *LORA)
    before = {k: v.clone() for k, v in model.vision.state_dict().items() if "running" in k}
    model.train()
    model.vision(torch.randn(4, 3, 16, 16))
    assert before and all(torch.equal(v, model.vision.state_dict()[k]) for k, v in before.items())


def _trained_a_little(model, steps: int = 3):
    """A few AdamW steps on a contrastive-looking loss: every factor B away from zero."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    pixels, ids = torch.randn(4, 3, 16, 16), torch.randint(5, 90, (4, 16))
    model.train()
    for _ in range(steps):
        out = model(pixels, ids, torch.ones_like(ids))
        (out.image["clip"] @ out.text["clip"].T).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def test_the_merged_weights_are_peft_merge_and_unload_bitwise():
    _, model = _model("model.lora.rank=4", "model.lora.alpha=6", "objective.name=clip")
    _trained_a_little(model)
    merged = merged_state_dict(model)
    for tower in ("vision", "text"):
        copied = copy.deepcopy(getattr(model, tower))  # peft's merge_and_unload, step by step
        for name, layer in [(n, m) for n, m in copied.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]:
            layer.merge()
            parent, _, attr = name.rpartition(".")
            setattr(copied.get_submodule(parent), attr, layer.get_base_layer())
        plain = copied.state_dict()
        mine = {k[len(tower) + 1:]: v for k, v in merged.items() if k.startswith(f"{tower}.")}
        assert mine.keys() == plain.keys()
        assert all(torch.equal(mine[k], plain[k]) for k in plain)
        q = "model.encoder.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(mine[q], model.state_dict()[f"{tower}.{q[:-len('weight')]}base_layer.weight"])


def test_the_adapter_on_the_starting_model_gives_the_model_again(tmp_path):
    from nclip.models.io import load_model, save_model

    cfg, model = _model(*LORA, "model.lora.dropout=0.1")
    with base_layers(model):
        start = copy.deepcopy(model.state_dict())  # the weights the run starts from
    _trained_a_little(model)
    save_model(model, cfg, tmp_path / "model")
    adapter = {p.name for p in (tmp_path / "model").iterdir()}
    assert {ADAPTER_CONFIG, ADAPTER_WEIGHTS} <= adapter
    assert (tmp_path / "model" / ADAPTER_WEIGHTS).stat().st_size < (tmp_path / "model" / "model.safetensors"
                                                                     ).stat().st_size / 5
    merged, saved_cfg = load_model(tmp_path / "model")
    assert saved_cfg.model.lora is None and not any("lora" in k for k in merged.state_dict())

    plain_cfg = resolve("micro", micro_sizes())
    base = build_model(plain_cfg, pretrained_text=False)
    base.load_state_dict(start)
    apply_adapter(base, tmp_path / "model").eval()
    pixels, ids = torch.randn(3, 3, 16, 16), torch.randint(5, 90, (3, 16))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        for got in (merged, base):
            torch.testing.assert_close(got.encode_image(pixels)["clip"], model.encode_image(pixels)["clip"],
                                       rtol=0, atol=1e-5)
            torch.testing.assert_close(got.encode_text(ids, mask)["clip"], model.encode_text(ids, mask)["clip"],
                                       rtol=0, atol=1e-5)
        bare = build_model(plain_cfg, pretrained_text=False).eval()
        bare.load_state_dict(start)  # what the merge would give without the factors: not the model
        assert (bare.encode_image(pixels)["clip"] - model.encode_image(pixels)["clip"]).abs().max() > 1e-3


@pytest.mark.parametrize("bad, message", [
    (["model.lora.rank=0"], "model.lora.rank: Input should be greater than or equal to 1"),
    (["model.lora.rank=40"], "model.lora.rank 40 exceeds the 32 features of the image tower's "
                             "model.encoder.layers.0.self_attn"),
    (["model.lora.targets=[q_proj, qkv]"], "model.lora.targets: 'qkv' matches no linear layer of the image or "
                                           "text tower"),
    (["model.lora.targets=[]"], "model.lora.targets: give module-name patterns"),
    (["model.lora.targets=[layer_norm1]"], "'layer_norm1' matches no linear layer"),
    (["model.vision.kind=resnet", *CONV, "model.lora={}"], "model.lora: the resnet image tower has no linear "
                                                           "layers for LoRA to adapt; lock it"),
    (["model.vision.kind=convnet", *CONV, "model.lora={}"], "model.lora: the convnet image tower has no linear "
                                                            "layers for LoRA to adapt"),
    (["model.lora.targets=[mlp.fc1]", "model.text.kind=pretrained"],
     "model.lora: model.lora.targets match no linear layer of the pretrained text tower"),
    (["model.lora={}", "model.vision.unlocked_layers=1"], "model.lora adapts whole towers: give "
                                                          "model.vision.lock: true"),
    (["model.lora={}", "model.vision.lock=true", "model.text.lock=true"], "model.lora: both towers are locked"),
    (["model.lora={}", "objective.name=cmsf"], "model.lora: objective 'cmsf' keeps a copy of the image tower "
                                               "\\(target_vision\\)"),
    (["model.lora={}", "model.vision.lock=true", "objective.name=xent", "data.source=digits"],
     "model.lora: no tower to adapt"),
])
def test_where_lora_cannot_apply_is_one_line(bad, message):
    with pytest.raises(NclipError, match=message) as e:
        _model(*bad)
    assert "\n" not in str(e.value)


def test_the_command_line_says_it_in_one_line_with_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "nclip", "train", "--preset", "micro", "--set",
                           "model.lora.targets=[qkv]", "--out", str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "'qkv' matches no linear layer" in done.stderr
    assert not (tmp_path / "run").exists()


def test_peft_is_not_imported_without_lora():
    code = ("import sys, nclip, torch; from nclip.config import resolve; from nclip.models import build_model; "
            "from nclip.models.io import save_model; import tempfile, os; cfg = resolve('micro'); "
            "m = build_model(cfg, pretrained_text=False); save_model(m, cfg, os.path.join(tempfile.mkdtemp(), 'm')); "
            "print('peft' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-500:]


def test_the_hf_export_of_a_lora_model_is_the_merged_model(tmp_path):
    """--open-clip and --onnx: tests/models/test_lora_doc.py (a run with CLIP's tokenizer, which --hf refuses)."""
    import torch.nn.functional as F

    import nclip
    from nclip.cli import main
    from nclip.models.io import save_model

    cfg, model = _model(*LORA)
    _trained_a_little(model)
    save_model(model, cfg, tmp_path / "run" / "model")
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]) == 0
    exported = nclip.load(tmp_path / "hf", device="cpu")
    pixels, ids = torch.randn(3, 3, 16, 16), torch.randint(5, 90, (3, 16))
    with torch.no_grad():
        want = F.normalize(model.encode_image(pixels)["clip"], dim=-1)
        torch.testing.assert_close(exported.encode_image(pixels), want, rtol=0, atol=1e-5)
        want = F.normalize(model.encode_text(ids, torch.ones_like(ids))["clip"], dim=-1)
        got = F.normalize(exported.model.encode_text(ids, torch.ones_like(ids))["clip"], dim=-1)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["vit", "resnet"])
def test_model_init_loads_into_the_wrapped_layers(tmp_path, arch):
    """An open_clip directory (a ViT, or a modified ResNet whose attention pool is adapted) loads into
    a LoRA model as into a plain one: with B = 0 both embed alike, and the base weights are the file's."""
    import torch.nn.functional as F

    import nclip
    from nclip.models.hf_import import init_config, load_init_weights

    from openclip_refs import build, resnet_cfg, save_hub, vit_cfg

    pytest.importorskip("open_clip")
    oc = (vit_cfg(image=16, patch=4, width=32, layers=1, head_width=16, text_width=32, text_layers=1, embed=32)
          if arch == "vit" else resnet_cfg(layers=(1, 1, 1, 1), width=16, image=64, embed=32, head_width=32))
    save_hub(build(oc), oc, tmp_path / "oc")
    cfg = init_config(resolve("micro", ["model.lora.rank=4", "objective.name=clip", f"model.init={tmp_path / 'oc'}"]),
                      note=lambda line: None)
    model = build_model(cfg, pretrained_text=False)
    if arch == "resnet":  # its convolutions stay as they are
        assert model.lora_targets["vision"] == ("pool.query", "pool.key", "pool.value", "pool.proj")
    load_init_weights(model, cfg.model.init)
    reference = nclip.load(tmp_path / "oc", device="cpu")
    size = cfg.data.image_size
    pixels = torch.randn(2, 3, size, size)
    with torch.no_grad():
        got = F.normalize(model.eval().encode_image(pixels)["clip"], dim=-1)
    torch.testing.assert_close(got, reference.encode_image(pixels), rtol=0, atol=1e-5)
    with base_layers(model):
        plain = model.state_dict()
    assert all(torch.equal(v, plain[k]) for k, v in reference.model.state_dict().items() if k.startswith("vision."))


def test_gradient_checkpointing_gives_the_factors_the_same_gradients():
    def grads(*extra):
        _, model = _model(*LORA, *extra)
        with torch.no_grad():  # B away from zero, so that A gets a gradient too
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.normal_(0, 0.1)
        torch.manual_seed(3)
        pixels, ids = torch.randn(4, 3, 16, 16), torch.randint(5, 90, (4, 16))
        out = model.train()(pixels, ids, torch.ones_like(ids))
        (out.image["clip"] @ out.text["clip"].T).logsumexp(-1).mean().backward()
        return {n: p.grad for n, p in model.named_parameters() if ".lora_" in n}

    plain, checkpointed = grads(), grads("model.grad_checkpointing=true")
    assert plain.keys() == checkpointed.keys() and all(g is not None and g.abs().sum() > 0 for g in plain.values())
    for name, g in plain.items():
        torch.testing.assert_close(checkpointed[name], g, rtol=1e-5, atol=1e-7, msg=name)
