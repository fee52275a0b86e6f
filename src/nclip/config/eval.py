"""The evaluation sections of the run configuration: ``eval`` (the end-of-run evaluation) and the
checks of evaluation while training, ``train.eval_every``, ``train.eval_datasets`` and
``train.eval_samples`` (fields of ``train``, :mod:`nclip.config.train`; the evaluation itself:
:mod:`nclip.train.periodic_eval`, docs/runs.md).

A dataset spec is checked by the grammar ``nclip eval --dataset`` accepts (:mod:`nclip.dataset_specs`,
layer 0), so a layout added there is accepted here without a change and a mistyped spec fails when
the config is read, not hours into the run. It reads the spec's syntax only: the data itself is
opened when the run starts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nclip.config.section import Section
from nclip.dataset_specs import checked_spec
from nclip.defaults import EVAL_BATCH_SIZE, NCLIP_SCORES

DEFAULT_EVAL_EVERY = 200  # steps; see docs/runs.md for its cost on the tiny preset (≤ 5 % of the run)
DEFAULT_EVAL_SAMPLES = 500  # held-out images per dataset (and k-NN reference images)


class EvalConfig(Section):
    samples: int = Field(1000, ge=10, description="held-out synthetic pairs for the end-of-run eval")
    batch_size: int = Field(EVAL_BATCH_SIZE, ge=1)  # the same default as `nclip eval --batch-size`
    # the image features the end-of-run probes read (objectives without a zero-shot head): backbone or
    # a head of the objective that offers probe features (nclip.heads.Head.probe), checked against the
    # objective's heads with the whole config; None = the objective's paper default
    # (Objective.probe_features); as `nclip eval --features`
    probe_features: str | None = None
    # nCLIP head's −L_CE (xCLIP Eq. 2): symmetrised (Sec. 3.1) or image→text only; `nclip eval --nclip-score`
    nclip_score: Literal[NCLIP_SCORES] = "symmetric"  # type: ignore[valid-type]


def check_eval_datasets(specs):
    """``specs`` (one spec or a list of them) as a list, each accepted by ``nclip eval --dataset``;
    else a one-line ValueError."""
    if isinstance(specs, str):
        specs = [specs]
    if not isinstance(specs, list) or not all(isinstance(s, str) for s in specs):
        raise ValueError(f"expected a list of dataset specs such as [digits, folder:DIR], got {specs!r}")
    for spec in specs:
        checked_spec(spec)
    if len(set(specs)) < len(specs):
        raise ValueError(f"a dataset is listed twice in {specs}")
    return specs
