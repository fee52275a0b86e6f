"""Does a checkpoint fit the code that resumes it? The model, the objective's state, a plugin's file.

A run resumes only with the config it was made with (:mod:`nclip.train.rundir`), but the config of
an objective of the user's own (docs/plugins.md) names its code, it does not hold it: the file can
change between a checkpoint and its resume.

- The heads the plugin declares, or their sizes, changed: the checkpoint's weights no longer fit
  the model built now. Rather than torch's ``Missing key(s) in state_dict`` listing every tensor in a
  traceback, :func:`restore_weights` says in one line which heads (or other keys) differ, for which
  objective, and that the checkpoint was made with other heads.
- Any edit: a checkpoint records the path and sha256 of the file that defines the plugin's objective
  class as it was imported (:func:`plugin_source_state`); a resume whose file hashes otherwise says
  so in one line on stderr, naming the file and both hashes, since the numbers after the checkpoint
  then come from other code. A warning, not a refusal: resuming after fixing a bug in the plugin is
  legitimate. Checkpoints made before the record existed are resumed without a comparison.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from nclip.errors import NclipError
from nclip.objectives import plan_for

PLUGIN_SOURCE = "plugin_source"  # the key of the checkpoint state's record of the plugin's file
SHOWN = 3  # differing heads or keys named in the line; the rest are counted


def plugin_source_state(cfg) -> dict:
    """What a checkpoint's state records of the run's plugin: ``{"plugin_source": {"file", "sha256"}}``
    of the file defining its objective class, as imported; ``{}`` for a built-in objective."""
    found = plan_for(cfg).source_file
    return {} if found is None else {PLUGIN_SOURCE: {"file": found[0], "sha256": found[1]}}


def restore_weights(model: torch.nn.Module, objective: torch.nn.Module, weights: dict, state: dict, cfg,
                    where: Path, main: bool) -> None:
    """Load a checkpoint (``where``: its directory; ``weights``, ``state``: what it holds) into the
    model and the objective built for ``cfg``. One line (:class:`NclipError`) where they do not fit;
    on rank 0 (``main``) a warning when the plugin's file changed since the checkpoint."""
    changed = _changed_file(cfg, state)
    for module, saved, prefix in ((model, weights, ""), (objective, state["objective"], "objective.")):
        try:  # an objective may size its state as it loads (ProtoCLIP's episode): its own load decides
            module.load_state_dict(saved)
        except RuntimeError as e:
            differences = _differences(module.state_dict(), saved, prefix) or [str(e).strip().splitlines()[0]]
            raise NclipError(_misfit(cfg, where, differences, changed)) from None
    if changed is not None and main:
        print(f"nclip: warning: {changed}; the run continues with the file as it is now, so its numbers after "
              f"{where.name} come from the edited code (docs/plugins.md)", file=sys.stderr, flush=True)


def _changed_file(cfg, state: dict) -> str | None:
    """Says how the plugin's file differs from the one the checkpoint recorded; None when it does not
    (or there is no plugin, or no record)."""
    recorded, now = state.get(PLUGIN_SOURCE), plan_for(cfg).source_file
    if not isinstance(recorded, dict) or now is None or recorded.get("sha256") == now[1]:
        return None
    moved = "" if recorded.get("file") == now[0] else f", then at {recorded.get('file')}"
    return (f"the plugin file {now[0]} of objective {cfg.objective.name!r} changed since the checkpoint "
            f"(sha256 {str(recorded.get('sha256'))[:12]} then{moved}, {now[1][:12]} now)")


def _differences(now: dict, saved: dict, prefix: str) -> list[str]:
    """What differs between the state dict built now and the saved one, head by head: heads (or
    other groups of keys) that only one side has, and tensors of other shapes."""
    missing = _groups(now.keys() - saved.keys(), prefix)
    extra = _groups(saved.keys() - now.keys(), prefix)
    reshaped = [f"{prefix}{k} is {list(saved[k].shape)} there, {list(now[k].shape)} now"
                for k in sorted(now.keys() & saved.keys()) if tuple(now[k].shape) != tuple(saved[k].shape)]
    return ([f"{g} not in the checkpoint" for g in missing] + [f"{g} only in the checkpoint" for g in extra]
            + reshaped)


def _groups(keys, prefix: str) -> list[str]:
    """Keys by what they belong to: ``heads.<name>`` for a head's, their first name otherwise."""
    groups = set()
    for key in keys:
        parts = key.split(".")
        groups.add(prefix + ".".join(parts[:2] if parts[0] == "heads" and len(parts) > 2 else parts[:1]))
    return sorted(groups)


def _misfit(cfg, where: Path, differences: list[str], changed: str | None) -> str:
    name = f"objective {cfg.objective.name!r}"
    if all(d.startswith("heads.") for d in differences):
        made = f"other heads than {name} builds now"
    elif all(d.startswith("objective.") for d in differences):
        made = f"another state than {name} holds now"
    else:
        made = f"another model than {name} builds now"
    more = len(differences) - SHOWN
    shown = "; ".join(differences[:SHOWN]) + (f"; and {more} more" if more > 0 else "")
    cause = f"; {changed}" if changed is not None else ""
    return (f"cannot resume: checkpoint {where} was made with {made} ({shown}){cause}. To resume, put the "
            "objective's code back as it was; to train it as it is, start anew (a new --out, or --force)")
