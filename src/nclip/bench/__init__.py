"""``nclip bench``: speed and memory of training, data, ProtoCLIP's episodes and evaluation, each
as a ratio measured in the same run (see :mod:`nclip.bench.runner` and docs/performance.md)."""
