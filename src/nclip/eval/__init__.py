"""Evaluation: feature extraction, pure metrics (:mod:`nclip.eval.metrics`), protocols and reports.

``nclip.eval.run_eval(checkpoint, out, tasks=..., datasets=..., head=...)`` runs the protocols of
the papers on a checkpoint and writes results.json + report.html (the ``nclip eval`` command);
see :mod:`nclip.eval.runner`. One module per protocol: :mod:`~nclip.eval.zeroshot`,
:mod:`~nclip.eval.retrieval`, :mod:`~nclip.eval.multilabel`, :mod:`~nclip.eval.probe` (linear,
k-NN, clustering), :mod:`~nclip.eval.realms`, :mod:`~nclip.eval.sts`, :mod:`~nclip.eval.masks`,
:mod:`~nclip.eval.diagnostics`; data adapters in :mod:`~nclip.eval.datasets`, the feature cache in
:mod:`~nclip.eval.cache`, the checkpoint in :mod:`~nclip.eval.checkpoint`, the per-dataset task
dispatch in :mod:`~nclip.eval.dispatch`, the settings in :mod:`~nclip.eval.settings`, the page in
:mod:`~nclip.eval.report` (its figures in :mod:`~nclip.eval.figures`), tables in :mod:`~nclip.eval.compare`.
"""

from nclip.eval.settings import TASKS, EvalSettings

__all__ = ["run_eval", "load_results", "EvalSettings", "TASKS"]


def __getattr__(name):  # lazy: building the CLI parser must not import torch
    if name in ("run_eval", "load_results"):
        from nclip.eval import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'nclip.eval' has no attribute {name!r}")
