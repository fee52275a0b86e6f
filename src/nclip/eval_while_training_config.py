"""The configuration of evaluation while training, ``train.eval_every``, ``train.eval_datasets``
and ``train.eval_samples`` (fields of ``train``, declared in :mod:`nclip.config`; the evaluation
itself: :mod:`nclip.train.periodic_eval`, docs/runs.md).

Kept out of ``nclip/config.py`` so that it stays under the house limit of 500 lines. Same rules as
every section: one-line ``ValueError``s.

One exception to the layer table of docs/design.md, on purpose: a dataset spec is checked by
:func:`nclip.eval.datasets.parse_spec` (imported when a spec is given), the grammar
``nclip eval --dataset`` accepts, so that a layout added there (``wds:``, ``karpathy:``, ...) is
accepted here without a change and a mistyped spec fails when the config is read, not hours into
the run. It reads the spec's syntax only: the data itself is opened when the run starts.
"""

from __future__ import annotations

DEFAULT_EVAL_EVERY = 200  # steps; see docs/runs.md for its cost on the tiny preset (≤ 5 % of the run)
DEFAULT_EVAL_SAMPLES = 500  # held-out images per dataset (and k-NN reference images)


def check_eval_datasets(specs):
    """``specs`` (one spec or a list of them) as a list, each accepted by ``nclip eval --dataset``;
    else a one-line ValueError."""
    if isinstance(specs, str):
        specs = [specs]
    if not isinstance(specs, list) or not all(isinstance(s, str) for s in specs):
        raise ValueError(f"expected a list of dataset specs such as [digits, folder:DIR], got {specs!r}")
    if not specs:
        return specs
    from nclip.eval.datasets import checked_spec  # the spec grammar (see the module docstring)

    for spec in specs:
        checked_spec(spec)
    if len(set(specs)) < len(specs):
        raise ValueError(f"a dataset is listed twice in {specs}")
    return specs
