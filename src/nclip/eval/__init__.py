"""Evaluation: feature extraction, pure metrics (:mod:`nclip.eval.metrics`), protocols and reports."""
