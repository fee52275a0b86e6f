"""Defaults shared by more than one config, in a module that imports nothing (not even pydantic):
the run config (:mod:`nclip.config`) and the ``nclip eval`` settings (:mod:`nclip.eval.settings`,
which the CLI parser imports without torch) both read them here."""

# Images or captions per forward pass when evaluation extracts features: the end-of-run eval
# (the run config's eval.batch_size) and `nclip eval --batch-size`. 256, not the run config's
# former 250: results.json of `nclip eval` (its "config" section) stays as it was, a power of two
# fills accelerator tiles without a ragged remainder per batch, and it changes no number -- every
# tower runs in eval mode (BatchNorm on its running statistics), so a batch size only reorders
# float rounding.
EVAL_BATCH_SIZE = 256
