"""``train.compile``: the towers compiled by ``torch.compile``, or eager where that fails.

Only the image and text towers are compiled (where the FLOPs are); the heads and the objective stay
eager, so the float32 objectives are untouched and the non-finite guard sees the same terms. Each
tower is compiled in place (``nn.Module.compile``): its parameters and state-dict keys stay what
they were, so checkpoints, resume and the saved model are the same with or without compilation.

Compilation is lazy in torch (it happens at the first call), and a build of torch may lack what its
backend needs (a C++ compiler for Inductor on the CPU, Triton on a GPU). So a small function is
compiled and run forward and backward first, on the towers' device; if that fails, the run trains
eagerly after one line on stderr saying why.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

TOWERS = ("vision", "text", "target_vision")  # DualEncoder's towers (target_vision: CMSF's momentum copy)


def _probe(device: torch.device) -> None:
    """Compile and run a tiny forward and backward on ``device``; raises where torch.compile cannot."""
    def f(x):
        return torch.nn.functional.gelu(x @ x.T).sum()

    x = torch.randn(8, 8, device=device, requires_grad=True)
    torch.compile(f)(x).backward()


def compile_towers(model: nn.Module) -> bool:
    """Compile ``model``'s towers in place; False (after a one-line warning) where torch.compile
    fails here, leaving them eager."""
    try:
        device = next(model.parameters()).device
        _probe(device)
    except Exception as e:  # any backend failure: a missing compiler, an unsupported platform
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        print(f"nclip: warning: train.compile: torch.compile failed here ({type(e).__name__}: {reason}); "
              "training eagerly", file=sys.stderr)
        return False
    for name in TOWERS:
        tower = getattr(model, name, None)
        if isinstance(tower, nn.Module):
            tower.compile()
    return True
