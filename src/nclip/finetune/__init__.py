"""``nclip finetune``: end-to-end fine-tuning of a checkpoint's image tower on labelled images
(xCLIP paper Sec. 4.2, Tab. 6, App. C), with the fraction of the labels of semi-supervised learning.

Modules: :mod:`~nclip.finetune.settings` (the typed config), :mod:`~nclip.finetune.splits` (the
validation split and the class-balanced label fraction), :mod:`~nclip.finetune.layers` (layer-wise
learning-rate decay and drop path), :mod:`~nclip.finetune.network` (backbone → linear or cosine
classifier), :mod:`~nclip.finetune.loop` (one learning rate's epochs, checkpointed per epoch) and
:mod:`~nclip.finetune.command` (the sweep, results.json and the CLI). See docs/finetune.md.
"""
