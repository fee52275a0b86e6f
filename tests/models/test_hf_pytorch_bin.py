"""A transformers CLIPModel saved as pytorch_model.bin (one file or shards): read with
torch.load(weights_only=True), the same model as from safetensors (issue 33 item 2)."""

from __future__ import annotations

import json

import pytest
import torch
from hf_fixtures import save_tiny_clip
from safetensors.torch import load_file

import nclip
from nclip.errors import NclipError

CAPTIONS = ["the red circle left of a blue square", "a", ""]


def _as_bin(directory, shards: int = 1) -> None:
    state = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    if shards == 1:
        torch.save(state, directory / "pytorch_model.bin")
        return
    keys = sorted(state)
    weight_map = {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: state[k] for k in keys[i::shards]}
        torch.save(part, directory / name)
        weight_map.update({k: name for k in part})
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))


class Payload:
    """Not a tensor: weights_only refuses to rebuild it."""


@pytest.mark.parametrize("shards", [1, 2])
def test_pytorch_model_bin_gives_the_safetensors_model(tmp_path, shards):
    save_tiny_clip(tmp_path / "st")
    save_tiny_clip(tmp_path / "bin")
    _as_bin(tmp_path / "bin", shards)
    want, got = nclip.load(tmp_path / "st", device="cpu"), nclip.load(tmp_path / "bin", device="cpu")
    pixels = torch.randn(2, 3, 32, 32)
    assert torch.equal(got.encode_image(pixels), want.encode_image(pixels))
    assert torch.equal(got.encode_text(CAPTIONS), want.encode_text(CAPTIONS))


def test_a_pickle_that_is_not_plain_tensors_is_refused(tmp_path):
    save_tiny_clip(tmp_path / "clip")
    _as_bin(tmp_path / "clip")

    torch.save({"weights": Payload()}, tmp_path / "clip" / "pytorch_model.bin")
    with pytest.raises(NclipError, match=r"cannot read .*pytorch_model.bin \(torch.load, weights_only=True\)") as e:
        nclip.load(tmp_path / "clip", device="cpu")
    assert "\n" not in str(e.value)
