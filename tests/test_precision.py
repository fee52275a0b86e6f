"""Under bf16 autocast the towers run in bf16 and every objective still computes in float32."""

import copy
import json

import pytest
import torch

from nclip.batch import Batch
from nclip.config import resolve
from nclip.models import build_model
from nclip.objectives import build_objective
from nclip.objectives.base import EncoderOutput
from nclip.precision import to_float32
from nclip.train.loop import train
from nclip.train.step import TrainStep


def _on_bf16_grid(x: float) -> bool:
    return float(torch.tensor(x, dtype=torch.float32).bfloat16().float()) == x


class _Recorder(torch.nn.Module):
    """Wraps an objective and keeps the EncoderOutput it was given."""

    def __init__(self, objective):
        super().__init__()
        self.objective, self.seen = objective, None

    def forward(self, out, batch=None):
        self.seen = out
        return self.objective(out, batch)


def _detached(out: EncoderOutput) -> EncoderOutput:
    def d(v):
        return v.detach().float() if torch.is_tensor(v) else v

    return EncoderOutput(d(out.image_features), d(out.text_features), d(out.logit_scale),
                         {k: d(v) for k, v in out.image.items()}, {k: d(v) for k, v in out.text.items()})


@pytest.mark.parametrize("objective", ["clip", "nclip", "xclip", "yclip", "siglip", "xsiglip",
                                       "unified"])
def test_objective_terms_are_float32_under_bf16_towers(micro_overrides, objective):
    torch.manual_seed(0)
    cfg = resolve("micro", micro_overrides + [f"objective.name={objective}", "train.precision=bf16"])
    model, recorder = build_model(cfg), _Recorder(build_objective(cfg.objective))
    reference = copy.deepcopy(recorder.objective)  # before the step updates any buffer (EMA centres)
    step = TrainStep(model, recorder, amp=torch.bfloat16)
    pixels = torch.randn(8, 3, 16, 16)
    ids, mask = model.tokenizer(["a red circle left of a blue square"] * 4 + ["two green stars"] * 4)
    terms = step(Batch(pixels, ids, mask))
    # the towers did run in bf16: their head outputs carry bf16's rounding ...
    head = recorder.seen.image["clip"] if "clip" in recorder.seen.image else recorder.seen.image["nclip"]
    assert head.dtype == torch.float32
    assert all(_on_bf16_grid(v) for v in head.flatten()[:64].tolist())
    # ... and the objective computed in float32 on exactly those outputs
    expected = reference(_detached(recorder.seen))
    for key, value in expected.items():
        if key == "logit_scale":
            continue
        assert terms[key].dtype == torch.float32, key
        torch.testing.assert_close(terms[key].detach(), value.detach(), rtol=1e-5, atol=1e-6, msg=key)


PROTOCLIP_MICRO = [  # ProtoCLIP's episodic trainer: prototypes from episode 1 on, no external teacher
    "data.train_length=64", "model.proto_hidden=64", "model.proto_dim=16", "objective.episode_size=16",
    "objective.clusters=4", "objective.warmup_episodes=1", "objective.w_ext=0",
]


@pytest.mark.parametrize("preset,extra,keys", [
    ("micro", [], ("loss", "clip/loss", "nclip/L_HE")),
    ("protoclip-tiny", PROTOCLIP_MICRO, ("loss", "clip/loss")),
])
@pytest.mark.slow
def test_logged_losses_are_not_on_the_bf16_grid(tmp_path, micro_overrides, preset, extra, keys):
    cfg = resolve(preset, micro_overrides + extra + ["train.precision=bf16", "train.steps=8", "train.log_every=1",
                                                     "train.checkpoint_every=8"])
    train(cfg, tmp_path, progress=False, evaluate=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    for key in keys:
        on_grid = sum(_on_bf16_grid(row[key]) for row in rows)
        assert on_grid < len(rows) / 2, (key, [row[key] for row in rows])


def test_to_float32_casts_half_tensors_in_any_container():
    out = EncoderOutput(torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(2, 3), torch.tensor(2.0),
                        image={"nclip": torch.ones(2, 4, dtype=torch.float16)})
    cast = to_float32(out)
    assert cast.image_features.dtype == cast.image["nclip"].dtype == torch.float32
    assert cast.text_features is out.text_features and "clip" not in cast.image and cast.text == {}
    nested = to_float32({"a": [torch.zeros(1, dtype=torch.bfloat16)], "b": torch.zeros(1, dtype=torch.long)})
    assert nested["a"][0].dtype == torch.float32 and nested["b"].dtype == torch.long
