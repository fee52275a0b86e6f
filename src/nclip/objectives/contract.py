"""What an objective's ``forward`` returns, checked once, on a run's first step.

``forward(out, batch)`` returns a dict: ``"loss"``, the 0-d floating-point tensor the step
back-propagates (so it carries a gradient), and the named terms to log, each a 0-d tensor on the
loss's device (docs/plugins.md). An objective of the user's own that returns anything else would
fail deep inside torch, in a traceback that names no objective: a loss of shape [B] in the backward
("grad can be implicitly created only for scalar outputs"), a float or a missing key as an
AttributeError or a KeyError, a detached loss as "element 0 of tensors does not require grad",
terms of other shapes in the ``stack`` of the logged terms. Checked here before the backward, each
is one line naming the objective, the key and what was expected.

The check reads what the host already knows of a tensor (its type, shape, dtype, device and
whether it carries a gradient), never a value, so it waits on no device; and it runs on the first
step only (:class:`FirstStepCheck`): later steps pass through it untouched.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from nclip.errors import NclipError

EXPECTED = "a dict {'loss': the batch's loss, **named terms}, each a 0-d tensor (docs/plugins.md)"


class FirstStepCheck:
    """Calls :func:`check_terms` on the first dict it is given, for the objective named ``name``
    (``objective.name``), and passes every dict through."""

    def __init__(self, name: str):
        self.name, self.pending = name, True

    def __call__(self, terms):
        if self.pending:
            check_terms(self.name, terms)
            self.pending = False
        return terms


def check_terms(name: str, terms) -> None:
    """Raise :class:`NclipError` (one line) where ``terms``, what objective ``name``'s forward
    returned, is not a dict of 0-d tensors on one device with a ``"loss"`` that carries a gradient."""
    who = f"objective.name {name!r}: forward"
    if not isinstance(terms, Mapping):
        raise NclipError(f"{who} returned a {type(terms).__name__}; expected {EXPECTED}")
    if "loss" not in terms:
        keys = ", ".join(repr(k) for k in terms) or "none"
        raise NclipError(f"{who} returned no 'loss' key (its keys: {keys}); expected {EXPECTED}")
    loss = terms["loss"]
    for key, value in terms.items():
        if not isinstance(key, str):
            raise NclipError(f"{who} returned the key {key!r}, a {type(key).__name__}; expected term names that "
                             "are strings")
        if not torch.is_tensor(value):
            raise NclipError(f"{who} returned {key!r} as a {type(value).__name__}; expected a 0-d tensor on the "
                             "loss's device (a constant: loss.new_tensor(x))")
        if value.dim() != 0:
            raise NclipError(f"{who} returned {key!r} of shape {list(value.shape)}; expected a 0-d tensor, one "
                             "number for the batch (reduce it, e.g. with .mean())")
        if value.device != loss.device:
            raise NclipError(f"{who} returned {key!r} on {value.device}, the loss on {loss.device}; expected every "
                             "term on the loss's device")
    if not loss.is_floating_point():
        raise NclipError(f"{who} returned 'loss' of dtype {loss.dtype}; expected a floating-point tensor")
    if not loss.requires_grad:
        raise NclipError(f"{who} returned a 'loss' that carries no gradient (detached, made under torch.no_grad, "
                         "or from numbers read with .item()); expected a tensor computed from `out`, which the "
                         "step back-propagates")
