"""Constants shared across layers, in a module that imports nothing (not even pydantic): the run
config (:mod:`nclip.config`), the objectives, the data layer, the trainer and the ``nclip eval``
settings (:mod:`nclip.eval.settings`, which the CLI parser imports without torch) read them here."""

# The built-in data sources: generated or shipped, no download, with labels and held-out splits
# (the sources that can constrain CMSF by label, be evaluated at the end of a run, be exported
# as shards, and be named as `nclip eval --dataset`).
BUILTIN_SOURCES = ("synthetic", "digits")
# The map-style sources: random access by dataset index (step-indexed exact resume, two views per
# image, frozen per-sample embeddings, episodes); webdataset shards are streamed instead.
MAP_SOURCES = (*BUILTIN_SOURCES, "csv", "folder")
# The label kind of the user's labelled sources (a CSV's data.csv_label_key column, a folder's
# class sub-folders); the built-in sources name theirs (digit, shape, colour, ...).
USER_LABEL = "label"


def has_labels(data) -> bool:
    """Whether a data config (``RunConfig.data``, duck-typed: objectives sit below the config) gives
    every training row a class label: the built-in sources, a class-folder tree, and a CSV with a
    label column. The one rule behind every "needs labelled data" check."""
    return (data.source in BUILTIN_SOURCES or data.source == "folder"
            or (data.source == "csv" and getattr(data, "csv_label_key", None) is not None))


def unlabelled_reason(data) -> str:
    """Why a data config without labels (``not has_labels(data)``) has none, and what gives them:
    the second half of every one-line "needs labelled data" refusal."""
    if data.source == "csv":
        return "data.source csv has no labels without data.csv_label_key (a class column)"
    return f"data.source {data.source} has no labels (use synthetic, digits, folder, or csv with data.csv_label_key)"

# Images or captions per forward pass when evaluation extracts features: the end-of-run eval
# (the run config's eval.batch_size) and `nclip eval --batch-size`. 256, not the run config's
# former 250: results.json of `nclip eval` (its "config" section) stays as it was, a power of two
# fills accelerator tiles without a ragged remainder per batch, and it changes no number -- every
# tower runs in eval mode (BatchNorm on its running statistics), so a batch size only reorders
# float rounding.
EVAL_BATCH_SIZE = 256

# The directions of the nCLIP head's zero-shot score −L_CE (xCLIP Eq. 2): "symmetric", −(CE(p, q) +
# CE(q, p)) / 2 as in Sec. 3.1, or "image_to_text", −CE(p_image, q_text): the run config's
# eval.nclip_score, `nclip eval --nclip-score` and nclip.objectives.functional.nclip_similarity
NCLIP_SCORES = ("symmetric", "image_to_text")

# Where a command runs: "auto" (CUDA where there is a GPU, else the CPU), "cpu" or "cuda": the run
# config's train.device and the --device of nclip eval, finetune, embed and search
DEVICES = ("auto", "cpu", "cuda")
