"""The checkpoint an evaluation reads: where its weights and config are, and the model they load into.

``nclip eval --checkpoint`` takes a run directory (RUN/model/), a model directory
(model.safetensors + config.json), a training checkpoint (RUN/checkpoints/step_N/, with the
config of RUN/config.yaml) or a model nclip did not train: a local transformers ``CLIPModel``
directory, an open_clip directory, an open_clip/OpenAI state-dict file (with ``--arch``, or without:
its architecture read from its tensors as OpenAI's) or OpenAI's TorchScript archive (each evaluated as
a CLIP-objective model with its own architecture, tokenizer and pixel statistics, via
:mod:`nclip.models.hf_import`), or a ``SiglipModel`` directory (a SigLIP-objective model,
:mod:`nclip.models.siglip_import`); :func:`resolve_checkpoint` tells them apart.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from nclip.errors import NclipError
from nclip.eval.cache import file_sha256
from nclip.jsonio import parse_yaml, read_text


@dataclass
class Checkpoint:
    path: Path  # as given
    weights: Path  # model.safetensors
    run_dir: Path | None  # where metrics.jsonl lives, if known
    cfg: object  # RunConfig
    sha256: str = ""
    format: str = "nclip"  # or "transformers CLIPModel", "open_clip directory", ...
    arch: str | None = None  # the open_clip config of a state-dict file

    def load(self, device):
        from nclip.models.dual_encoder import build_model
        from nclip.models.io import read_weights

        model = build_model(self.cfg, pretrained_text=False)
        if self.format != "nclip":
            from nclip.models.hf_import import load_init_weights

            load_init_weights(model, self.path, self.arch)
            return model.to(device).eval()
        state = read_weights(self.weights)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise NclipError(f"{self.weights} does not match its config: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
        if self.cfg.model.lora is not None:  # a LoRA run's step_N: merged, as its RUN/model (nclip.models.lora)
            from nclip.models.lora import merged_state_dict, without_lora

            merged = build_model(without_lora(self.cfg), pretrained_text=False)
            merged.load_state_dict(merged_state_dict(model))
            model = merged
        return model.to(device).eval()

    @property
    def vision_tower(self):
        """The image tower class of the config (its ``feature`` and ``saliency`` descriptions)."""
        from nclip.models.towers import vision_tower_class

        return vision_tower_class(self.cfg.model.vision)


def resolve_checkpoint(path: str | Path, arch: str | None = None) -> Checkpoint:
    """A run directory (RUN/model/; without it, the run's newest training checkpoint), a model
    directory (model.safetensors + config.json), a training checkpoint (RUN/checkpoints/step_N/,
    config from RUN/config.yaml), or a model nclip did not train: a transformers CLIPModel
    directory, an open_clip directory, an open_clip/OpenAI state-dict file of open_clip config
    ``arch``, OpenAI's TorchScript archive."""
    from nclip.config import validate
    from nclip.models.io import CONFIG, WEIGHTS, check_weights, read_config

    p = Path(path).expanduser()
    found = _openclip_checkpoint(p, arch)
    if found is None:
        found = _hf_checkpoint(p)
    if found is not None:
        return found
    if (p / "model" / CONFIG).is_file():
        model_dir, run_dir = p / "model", p
    elif (p / CONFIG).is_file():
        model_dir, run_dir = p, p.parent
    elif (p / WEIGHTS).is_file():  # a training checkpoint, RUN/checkpoints/step_N, whose config is RUN's
        run_dir = p.parent.parent
        if not (run_dir / "config.yaml").is_file():
            raise NclipError(f"{p} holds {WEIGHTS} but no {CONFIG}, and {run_dir / 'config.yaml'} (the config of "
                             "a training checkpoint's run) does not exist")
        cfg = validate(parse_yaml(*read_text(run_dir / "config.yaml", "config.yaml")) or {})
        check_weights(p / WEIGHTS)
        return Checkpoint(p, p / WEIGHTS, run_dir, cfg, file_sha256(p / WEIGHTS))
    elif steps := _training_checkpoints(p):  # a run that has not written model/ (stopped, or still training)
        return resolve_checkpoint(steps[-1])
    else:
        found = (f"; {p / 'checkpoints'} holds no step_N with {WEIGHTS}" if (p / "checkpoints").is_dir()
                 else "")
        raise NclipError(f"no nclip checkpoint in {p} (expected RUN_DIR/model/{CONFIG}, a model directory "
                         f"with {CONFIG} and {WEIGHTS}, or RUN_DIR/checkpoints/step_N){found}")
    weights = model_dir / WEIGHTS
    check_weights(weights)
    cfg = read_config(model_dir)
    return Checkpoint(p, weights, run_dir if (run_dir / "metrics.jsonl").is_file() else None, cfg,
                      file_sha256(weights))


def _training_checkpoints(run_dir: Path) -> list[Path]:
    """RUN/checkpoints/step_N directories that hold weights, oldest first (as the trainer names them,
    nclip.train.checkpoint; the training state beside them is not needed to evaluate)."""
    from nclip.models.io import WEIGHTS, checkpoint_step

    found = [d for d in (run_dir / "checkpoints").glob("step_*") if checkpoint_step(d) is not None
             and (d / WEIGHTS).is_file()]
    return sorted(found, key=checkpoint_step)


def _openclip_checkpoint(p: Path, arch: str | None) -> Checkpoint | None:
    """An OpenCLIP/OpenAI checkpoint as a checkpoint of the CLIP objective (None: not one)."""
    from nclip.config import validate
    from nclip.models.hf_import import init_config
    from nclip.models.openclip_files import is_openclip, source

    if not is_openclip(p, arch):
        return None
    src = source(p, arch)
    init = {"init": str(p.resolve()), "init_arch": arch}
    cfg = init_config(validate({"objective": {"name": "clip"}, "model": init}), note=lambda line: None,
                      warn=lambda line: print(line, file=sys.stderr, flush=True))  # what it assumed: said
    form = src.form.split(" ", 1)[1] if src.form.startswith(("a ", "an ")) else src.form
    return Checkpoint(p, src.weights, None, cfg, file_sha256(src.weights), format=form, arch=arch)


def _hf_checkpoint(p: Path) -> Checkpoint | None:
    """A transformers CLIPModel directory as a checkpoint of the CLIP objective, a SiglipModel one as a
    checkpoint of the SigLIP objective (None: neither)."""
    from nclip.config import validate
    from nclip.models.hf_import import PT_WEIGHTS, hf_weights_file, init_config, is_hf_clip_dir
    from nclip.models.io import WEIGHTS
    from nclip.models.siglip_import import FORMAT as SIGLIP
    from nclip.models.siglip_import import is_siglip_dir

    siglip = p.is_dir() and is_siglip_dir(p)
    if not siglip and (not p.is_dir() or not is_hf_clip_dir(p)):
        return None
    weights = hf_weights_file(p)
    if weights is None:
        raise NclipError(f"missing weights file: {p / WEIGHTS} (or {PT_WEIGHTS})")
    # a SiglipModel is a checkpoint of the SigLIP objective: its logit bias is the objective's (bias_init)
    objective = "siglip" if siglip else "clip"
    cfg = init_config(validate({"objective": {"name": objective}, "model": {"init": str(p.resolve())}}),
                      note=lambda line: None)
    return Checkpoint(p, weights, None, cfg, file_sha256(weights),
                      format=SIGLIP if siglip else "transformers CLIPModel")
