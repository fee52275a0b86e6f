"""Tab. 9's LN column for one run: a linear probe on its frozen image backbone, written to
RUN/probe.json by the sweep process itself (one interpreter start less per run)."""

from __future__ import annotations

import time
from pathlib import Path


def probe_dataset(cfg) -> tuple[str, str]:
    """(built-in dataset, label kind) that a run is probed on: its own data's primary label
    (synthetic scenes for runs on user data)."""
    from nclip.data.sources import MAIN_LABEL

    source = cfg.data.source if cfg.data.source in MAIN_LABEL else "synthetic"
    return source, MAIN_LABEL[source]


def preload_probe() -> None:
    """Import what :func:`probe_run` needs once, in the sweep's thread, not concurrently in the
    pool's workers."""
    import nclip.data.digits  # noqa: F401
    import nclip.data.synthetic  # noqa: F401
    import nclip.eval.features  # noqa: F401
    import nclip.eval.probe  # noqa: F401
    import nclip.models.dual_encoder  # noqa: F401
    import nclip.models.io  # noqa: F401


def probe_run(run_dir: str | Path, train_samples: int = 2000, test_samples: int = 1000, seed: int | None = None,
              device: str = "cpu") -> dict:
    """Linear probe (Tab. 9's LN) on frozen image-backbone features of held-out built-in data.

    The protocol of ``nclip eval --tasks linear`` (:func:`nclip.eval.probe.linear`: L-BFGS
    logistic regression, L2 picked on a stratified validation split, refit) on the primary label
    kind only (shape for synthetic scenes, digit for digits), which is what Tab. 9's LN column
    reports; the full evaluation probes every label kind. Synthetic scenes are drawn with seed
    ``cfg.seed + 1`` (default), so neither the probe's training nor its test images were seen in
    pre-training; digits use the run's own held-out split.
    """
    import torch

    from nclip.eval.features import extract
    from nclip.eval.probe import linear
    from nclip.models.io import load_model

    t = time.perf_counter()
    run_dir = Path(run_dir)
    model, cfg = load_model(run_dir / "model", device=device)
    dataset, kind = probe_dataset(cfg)
    seed = cfg.seed + 1 if seed is None else seed
    if dataset == "digits":
        from nclip.data.digits import DigitsPairs

        make = lambda split, n: DigitsPairs(split, seed=cfg.seed, image_size=cfg.data.image_size, val_fraction=0.0)  # noqa: E731
    else:
        from nclip.data.synthetic import SyntheticScenes

        # faithful captions only, as nclip.eval.datasets.synthetic (the captions are not used here)
        make = lambda split, n: SyntheticScenes(split=split, length=n, seed=seed, image_size=cfg.data.image_size,  # noqa: E731
                                                max_objects=cfg.data.max_objects, loose_caption_prob=0.0)
    train, test = make("train", train_samples), make("test", test_samples)
    dev = torch.device(device)
    ftr = extract(model, train, cfg.data.image_size, dev, texts=False)
    fte = extract(model, test, cfg.data.image_size, dev, texts=False)
    n_cls = len(test.label_kinds[kind])
    r = linear(ftr.image["features"], ftr.labels[kind], fte.image["features"], fte.labels[kind], n_cls, seed=seed)
    return {"linear/top1": float(r["top1"]), "linear/mean_per_class": float(r["mean_per_class"]),
            "linear/l2": float(r["l2"]), "dataset": f"{dataset}-{kind}", "train_samples": len(train),
            "test_samples": len(test), "seed": seed, "features": "image backbone ([CLS], frozen)",
            "protocol": "nclip.eval.probe.linear", "wall_s": time.perf_counter() - t}
