"""The nCLIP head ablations of the xCLIP paper: Tab. 9c (bottleneck, ℓ2-norm layer, no last BN) and
Tab. 9d (hidden layers shared by the CLIP and nCLIP heads)."""

import pytest
import torch
from torch import nn

from nclip.config import resolve
from nclip.errors import NclipError
from nclip.heads.layers import L2Norm, NclipHead
from nclip.models import build_model
from nclip.objectives import build_objective

# Sec. 3.2's head: Linear → BN → GELU → Linear → BN(affine=False); checkpoints hold these keys
DEFAULT_HEAD_KEYS = [
    "0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked",
    "3.weight", "3.bias", "4.running_mean", "4.running_var", "4.num_batches_tracked",
]


def _model(micro_overrides, *extra, preset="micro"):
    cfg = resolve(preset, micro_overrides + list(extra))
    return cfg, build_model(cfg, pretrained_text=False)


def _batch(model, b=6):
    torch.manual_seed(0)
    ids, mask = model.tokenizer([f"caption number {i}" for i in range(b)])
    return torch.randn(b, 3, 16, 16), ids, mask


def test_default_head_keeps_its_layout_and_state_dict_keys(micro_overrides):
    assert list(NclipHead(8, 16, 32).state_dict()) == DEFAULT_HEAD_KEYS
    _, model = _model(micro_overrides)
    keys = [k.removeprefix("heads.nclip.image.") for k in model.state_dict() if k.startswith("heads.nclip.image.")]
    assert keys == DEFAULT_HEAD_KEYS
    assert not any("shared" in k for k in model.state_dict())


def test_temperature_divides_the_standardised_logits_and_adds_no_key(micro_overrides):
    torch.manual_seed(0)
    plain, warm = NclipHead(8, 16, 32), NclipHead(8, 16, 32, temperature=0.25)
    warm.load_state_dict(plain.state_dict())  # the same keys: the temperature holds no state
    x = torch.randn(10, 8)
    torch.testing.assert_close(warm.train()(x), 4 * plain.train()(x))
    col = warm(x)
    assert torch.allclose(col.std(dim=0, unbiased=False), torch.full((32,), 4.0), atol=3e-3)  # BN's unit std × 1/τ
    cfg, model = _model(micro_overrides, "model.nclip_temperature=0.5")
    assert model.heads["nclip"].image[-1].tau == 0.5 and model.heads["nclip"].text[-1].tau == 0.5
    with pytest.raises(NclipError, match="nclip_temperature"):
        resolve("micro", micro_overrides + ["model.nclip_temperature=0"])


def test_bottleneck_and_l2norm_layer_feed_the_last_layer_a_unit_vector():
    head = NclipHead(8, 16, 32, bottleneck=4, l2norm=True)
    linears = [m for m in head if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(8, 16), (16, 4), (4, 32)]
    assert isinstance(head[-2], nn.Linear) and isinstance(head[-3], L2Norm)
    seen = {}
    head[-2].register_forward_pre_hook(lambda mod, inp: seen.update(x=inp[0]))  # the last layer's input
    logits = head(torch.randn(5, 8) * 7)
    assert logits.shape == (5, 32)
    torch.testing.assert_close(seen["x"].norm(dim=-1), torch.ones(5))
    # without the ℓ2-norm layer the bottleneck's output is not normalised
    plain = NclipHead(8, 16, 32, bottleneck=4)
    assert not any(isinstance(m, L2Norm) for m in plain) and plain[-2].in_features == 4


def test_no_last_bn_head_has_no_final_batchnorm_and_trains_a_step(micro_overrides):
    cfg, model = _model(micro_overrides, "model.nclip_last_bn=false")
    head = model.heads["nclip"].image
    assert isinstance(head[-1], nn.Linear)
    assert not any(isinstance(m, nn.BatchNorm1d) and not m.affine for m in head)
    objective = build_objective(cfg.objective, cfg)
    before = head[-1].weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = objective(model(*_batch(model)))["loss"]
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss) and not torch.equal(head[-1].weight, before)


def test_total_hidden_layers(micro_overrides):
    _, model = _model(micro_overrides, "model.nclip_layers=3")
    assert sum(isinstance(m, nn.GELU) for m in model.heads["nclip"].text) == 3


def test_shared_layers_are_one_set_of_weights_trained_by_both_heads(micro_overrides):
    cfg, model = _model(micro_overrides, "model.nclip_layers=2", "model.nclip_shared_layers=1")
    hidden = cfg.model.nclip_hidden
    shared = model.heads["shared"].image
    assert model.heads["clip"].image.in_features == hidden and model.heads["nclip"].image[0].in_features == hidden
    assert sum(isinstance(m, nn.GELU) for m in model.heads["nclip"].image) == 1  # #TL − #SL
    state = model.state_dict()
    assert "heads.shared.image.0.weight" in state and "heads.shared.text.0.weight" in state
    # one tensor: no other state-dict entry aliases the shared layer's weight
    ptr = shared[0].weight.data_ptr()
    assert [k for k, v in state.items() if v.data_ptr() == ptr] == ["heads.shared.image.0.weight"]
    out = model(*_batch(model))
    for emb in (out.image["clip"], out.image["nclip"]):  # each head alone reaches the shared weights
        model.zero_grad()
        emb.square().sum().backward(retain_graph=True)
        assert shared[0].weight.grad is not None and shared[0].weight.grad.abs().sum() > 0


@pytest.mark.parametrize("extra, needle", [
    (["model.nclip_layers=1", "model.nclip_shared_layers=2"], "nclip_shared_layers 2 exceeds nclip_layers 1"),
    (["objective.name=nclip", "model.nclip_shared_layers=1"], "has no CLIP and nCLIP heads"),
    (["model.nclip_bottleneck=0"], "model.nclip_bottleneck"),
])
def test_bad_head_options_are_config_errors(micro_overrides, extra, needle):
    with pytest.raises(NclipError, match=needle) as e:
        resolve("micro", micro_overrides + extra)
    assert "\n" not in str(e.value)


def test_old_model_files_load_and_shared_heads_refuse_hf_export(tmp_path, micro_overrides, capsys):
    import json

    from nclip.cli import main
    from nclip.models.io import load_model, save_model

    cfg, model = _model(micro_overrides)
    save_model(model, cfg, tmp_path / "old")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    new_keys = ("nclip_layers", "nclip_shared_layers", "nclip_bottleneck", "nclip_l2norm", "nclip_last_bn")
    found = json.dumps(config)
    assert all(k in found for k in new_keys)
    text = found
    for k in new_keys:  # a model file written before these options existed
        text = text.replace(f'"{k}": {json.dumps(cfg.model.model_dump()[k])}, ', "")
    assert not any(k in text for k in new_keys)
    (tmp_path / "old" / "config.json").write_text(text)
    loaded, cfg2 = load_model(tmp_path / "old")
    assert cfg2 == cfg and list(loaded.state_dict()) == list(model.state_dict())

    cfg, model = _model(micro_overrides, "model.nclip_shared_layers=1")
    save_model(model, cfg, tmp_path / "shared")
    assert main(["export", "--checkpoint", str(tmp_path / "shared"), "--hf", str(tmp_path / "hf")]) == 2
    assert "shares 1 hidden layer(s)" in capsys.readouterr().err
