"""Will the model a config describes fit in this machine's memory? Answered from the config alone,
before a tensor is allocated.

A config.json with absurd sizes (a width of 1e9, a million layers, a vocabulary of 1e12 tokens,
an nCLIP head of K = 1e10) used to fail in the allocator (a RuntimeError or MemoryError) after
trying, or to swap for minutes below that. :func:`check_model_size` counts the parameters of the
largest matrices the config's sizes imply -- a lower bound of the model's count, since biases,
norms and what a kind adds are left out -- and refuses in one line, naming the fields and their
values, when they take more float32 bytes than the machine has memory (:func:`machine_memory`).
A lower bound never refuses a model that would fit.
"""

from __future__ import annotations

import os
from pathlib import Path

from nclip.config import RunConfig
from nclip.errors import NclipError

FLOAT32_BYTES = 4
GIB = 2**30


def machine_memory() -> tuple[int, str] | None:
    """(bytes, where the figure comes from): the physical memory, or the cgroup's ``memory.max``
    where lower (a container's OOM killer counts that); None where neither can be read."""
    found = None
    try:
        found = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max" and (found is None or int(limit) < found[0]):
            found = int(limit), "the cgroup's memory.max"
    except (OSError, ValueError):
        pass
    return found


def parameter_terms(cfg: RunConfig, heads: frozenset[str]) -> list[tuple[str, float]]:
    """[(the fields that size a part, with their values; its parameter count)] for the towers and
    the built-in ``heads``: lower bounds, each the product of the fields it names."""
    m, v, t = cfg.model, cfg.model.vision, cfg.model.text
    terms = _vision_terms(v, cfg.data.image_size)
    if t.kind == "transformer":  # a pretrained text tower's size is its files'
        terms.append((f"model.text.layers={t.layers} × (4 + 2 × model.text.mlp_ratio={t.mlp_ratio:g}) × "
                      f"model.text.width={t.width}² (the text blocks)", _blocks(t.layers, t.width, t.mlp_ratio)))
        if t.vocab_size is not None:
            terms.append((f"model.text.vocab_size={t.vocab_size} × model.text.width={t.width} (the token embedding)",
                          t.vocab_size * t.width))
        terms.append((f"data.text_length={cfg.data.text_length} × model.text.width={t.width} (the positions)",
                      cfg.data.text_length * t.width))
    width_v = _vision_width(v)
    width_t = t.width if t.kind == "transformer" else 0
    both = f"(vision width {width_v} + text width {width_t})"
    if "clip" in heads:  # with Tab. 9d's shared layers it reads their output, nclip_hidden wide
        reads, read = width_v + width_t, both
        if m.nclip_shared_layers and "nclip" in heads:
            reads, read = 2 * m.nclip_hidden, f"2 × model.nclip_hidden={m.nclip_hidden}"
        terms.append((f"model.embed_dim={m.embed_dim} × {read} (the CLIP head)", m.embed_dim * reads))
    if "nclip" in heads:
        last = m.nclip_bottleneck or m.nclip_hidden
        name = "nclip_bottleneck" if m.nclip_bottleneck else "nclip_hidden"
        terms.append((f"2 × model.{name}={last} × model.nclip_dim={m.nclip_dim} (the nCLIP heads' last layers)",
                      2 * last * m.nclip_dim))
        terms.append((f"model.nclip_hidden={m.nclip_hidden} × {both} (the nCLIP heads' first layers)",
                      m.nclip_hidden * (width_v + width_t)))
    if "proto" in heads:
        terms.append((f"2 × model.proto_hidden={m.proto_hidden} × (model.embed_dim={m.embed_dim} + "
                      f"model.proto_dim={m.proto_dim}) (the ProtoCLIP heads)",
                      2 * m.proto_hidden * (m.embed_dim + m.proto_dim)))
    if "cmsf" in heads:
        terms.append((f"model.cmsf_hidden={m.cmsf_hidden} × (vision width {width_v} + 3 × "
                      f"model.cmsf_dim={m.cmsf_dim}) (the CMSF projection and predictor)",
                      m.cmsf_hidden * (width_v + 3 * m.cmsf_dim)))
    if "supcon" in heads and getattr(cfg.objective, "head", "mlp") != "fc":  # "fc": one supcon_dim layer
        terms.append((f"model.supcon_hidden={m.supcon_hidden} × (vision width {width_v} + "
                      f"model.supcon_dim={m.supcon_dim}) (the SupCon projection)",
                      m.supcon_hidden * (width_v + m.supcon_dim)))
    return terms


def _blocks(layers: int, width: int, mlp_ratio: float) -> int:
    """A transformer's blocks: attention's four width² projections and the MLP's two matrices."""
    return layers * (4 * width**2 + 2 * width * int(width * mlp_ratio))


def _vision_width(v) -> int:
    if v.kind in ("vit", "groupvit"):
        return v.width
    return v.pool_dim or v.hidden_sizes[-1] if v.kind == "clip_resnet" else v.hidden_sizes[-1]


def _vision_terms(v, image_size: int) -> list[tuple[str, float]]:
    if v.kind in ("vit", "groupvit"):
        layers, name = (v.layers, "layers") if v.kind == "vit" else (sum(v.depths), "depths")
        patches = (image_size // v.patch_size) ** 2
        return [
            (f"model.vision.{name}={layers if v.kind == 'vit' else list(v.depths)} × (4 + 2 × model.vision.mlp_ratio="
             f"{v.mlp_ratio:g}) × model.vision.width={v.width}² (the vision blocks)",
             _blocks(layers, v.width, v.mlp_ratio)),
            (f"3 × model.vision.patch_size={v.patch_size}² × model.vision.width={v.width} (the patch embedding)",
             3 * v.patch_size**2 * v.width),
            (f"(data.image_size={image_size} / model.vision.patch_size={v.patch_size})² × model.vision.width="
             f"{v.width} (the positions)", patches * v.width),
        ]
    # conv kinds: per block at least a 3x3 convolution of the stage's width (a bottleneck's, of a
    # quarter of it, and two 1x1 ones: 13/16 of width²), the first block of a stage from the last
    per_block = 9 if v.kind == "convnet" else 13 / 16
    count, previous = 0.0, v.embedding_size
    for depth, width in zip(v.depths, v.hidden_sizes):
        count += per_block * width * (min(previous, width) + (depth - 1) * width)
        previous = width
    return [(f"model.vision.depths={list(v.depths)} × model.vision.hidden_sizes={list(v.hidden_sizes)}² "
             f"(the vision stages)", count)]


def check_model_size(cfg: RunConfig, heads: frozenset[str]) -> None:
    """One line naming the largest part and its fields when the parameters that ``cfg`` implies
    (:func:`parameter_terms`) take more float32 memory than the machine has; nothing otherwise."""
    memory = machine_memory()
    if memory is None:
        return
    terms = parameter_terms(cfg, heads)
    total = sum(count for _, count in terms) * FLOAT32_BYTES
    if total <= memory[0]:
        return
    what, count = max(terms, key=lambda term: term[1])
    raise NclipError(f"the model does not fit in memory: {what} = {count:.3g} parameters, "
                     f"{count * FLOAT32_BYTES / GIB:,.0f} GiB in float32 (the model takes at least "
                     f"{total / GIB:,.0f} GiB), more than this machine's {memory[0] / GIB:,.0f} GiB "
                     f"({memory[1]}); check the sizes in the model's config")
