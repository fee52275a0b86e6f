"""The data section of the run configuration, ``data``: the source, its files and columns, the
image size, augmentation and tagging."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from nclip.config.section import Section
from nclip.defaults import USER_LABEL, has_labels


class AugmentConfig(Section):
    # RandomResizedCrop area scale, as CLIP's pre-processing with scale (0.5, 1) (Sec. 3.2)
    crop_scale: tuple[float, float] = (0.5, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    horizontal_flip: bool = False  # captions say "left of": flipping would contradict them
    # SimCLR colour jitter (brightness, contrast, saturation, hue strengths) applied with
    # probability color_jitter_prob, then grayscale with grayscale_prob. ProtoCLIP's light
    # augmentation (its App. A.3): crop scale (0.5, 1), jitter p = 0.2, grayscale p = 0.2.
    color_jitter_prob: float = Field(0.0, ge=0, le=1)
    color_jitter: tuple[float, float, float, float] = (0.4, 0.4, 0.4, 0.1)
    grayscale_prob: float = Field(0.0, ge=0, le=1)

    @model_validator(mode="after")
    def _ranges(self):
        b, c, s, h = self.color_jitter
        if min(b, c, s, h) < 0 or h > 0.5:
            raise ValueError(f"color_jitter strengths must be >= 0 with hue <= 0.5, got {self.color_jitter}")
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < lo <= hi <= 1, got {self.crop_scale}")
        if not 0 < self.crop_ratio[0] <= self.crop_ratio[1]:
            raise ValueError(f"crop_ratio must satisfy 0 < lo <= hi, got {self.crop_ratio}")
        return self


class ShardSource(Section):
    """One WebDataset source: brace-expandable shard pattern(s) and its sampling weight."""

    shards: str | list[str]
    weight: float = Field(1.0, gt=0, description="share of samples drawn from this source")


class TaggingConfig(Section):
    """Tagging data as image–text pairs (xCLIP Sec. 4.3, "Pre-training with tagging data", Tab. 8):
    the caption of a labelled sample is a prompt template filled with its class name, the template
    re-drawn every epoch (seeded by seed, epoch and sample), so a classification set trains any
    caption objective. See nclip.data.tagging and docs/tagging.md."""

    enabled: bool = False
    # the label kind whose class names fill the templates; None: the source's main label (digits:
    # digit, synthetic: shape, csv/folder: label -- the only kind those have)
    label_key: str | None = None
    # a text file, one template with {} per line, # comments; None: the label kind's zero-shot
    # prompt templates (the ones nclip eval scores with)
    templates: str | None = None

    @model_validator(mode="after")
    def _needs_enabled(self):
        if not self.enabled and (self.label_key is not None or self.templates is not None):
            raise ValueError("label_key and templates need enabled: true")
        return self


class DataConfig(Section):
    # synthetic / digits: built-in; webdataset: tar shards (img2dataset layout); csv: CSV/TSV file;
    # folder: one sub-folder of images per class (class labels; captions: the class names)
    source: Literal["synthetic", "digits", "webdataset", "csv", "folder"] = "synthetic"
    image_size: int = Field(64, ge=8, le=1024)
    # evaluation's resize (nclip.data.transforms.eval_resize): the "shortest" side to image_size, then a
    # centre crop, or "squash" to image_size²; with bicubic or bilinear interpolation. model.init of an
    # OpenCLIP checkpoint sets them from its preprocess_cfg (resize_mode, interpolation)
    eval_resize: Literal["shortest", "squash"] = "shortest"
    eval_interpolation: Literal["bicubic", "bilinear"] = "bicubic"
    # whose evaluation pixels to reproduce (nclip.data.transforms.CONVENTIONS): "torchvision" (open_clip's,
    # OpenAI's and CLIP_benchmark's preprocess: the crop rounds half the overhang, the mode becomes RGB after
    # resize and crop) or "transformers" (CLIPImageProcessor: RGB first, the crop floors). model.init sets
    # it from the checkpoint's origin; nclip's own models take torchvision's, which published numbers use
    eval_convention: Literal["torchvision", "transformers"] = "torchvision"
    train_length: int = Field(1_000_000, ge=1, description="samples in the (procedural) train split")
    max_objects: int = Field(4, ge=1, le=4)
    loose_caption_prob: float = Field(0.3, ge=0, le=1)
    # synthetic: scenes per hard-negative group (same scene, other shapes; kept whole in a batch)
    hard_negative_group: int = Field(1, ge=1, le=64)
    text_length: int = Field(32, ge=4, le=512, description="tokens per caption, [CLS]/[SEP] included")
    # loader worker processes per rank; None (auto): 0 on the CPU, as the step needs the same cores;
    # on CUDA the cores this process may use (os.sched_getaffinity) per local rank, less one for the
    # process that drives the GPU, at most 8 (nclip.data.workers.loader_workers). WebDataset: the count
    # sets the stream order, so set it explicitly for a run that may resume on another machine
    num_workers: int | None = Field(None, ge=0)
    augment: AugmentConfig = AugmentConfig()
    # --- real data (source: webdataset | csv); see nclip.data.webdataset / nclip.data.csv_source
    shards: str | list[str] | None = None  # e.g. "/data/cc3m/{00000..00331}.tar" (one source)
    sources: list[ShardSource] | None = None  # several weighted sources instead of `shards`
    # how `sources` mix: per sample (mixed), or every global batch from one source drawn ∝ weight
    # (per_source: xCLIP Tab. 9f "debiased sampling"); see nclip.data.webdataset
    sampling: Literal["mixed", "per_source"] = "mixed"
    csv: str | None = None  # CSV (or .tsv) file; image paths are relative to its directory
    # identifiers to leave out of training: the duplicates.json of `nclip data dedup` or a text file
    # (every source: image paths, shard sample keys, source:train:i for built-in data)
    exclude: str | None = None
    csv_image_key: str = "filepath"
    csv_caption_key: str = "title"  # a CSV column, or a JSONL field holding a caption or a list of them
    # several captions per image (nclip.data.captions): a CSV cell (or JSONL string) split by this
    # separator, e.g. "|" (quoted on the command line: --set 'data.caption_separator="|"'); None: a
    # cell is one caption
    caption_separator: str | None = None
    # a field of each WebDataset sample's .json holding its caption or a list of captions; None: the
    # sample's .txt member and any further KEY.N.txt members
    json_caption_key: str | None = Field(None, min_length=1)
    # which of an image's captions a step trains on: random (one, drawn by seed, epoch and index; an
    # image with one caption draws nothing), first, or all (every caption a positive of its image:
    # objectives with several_captions, e.g. clip)
    caption_choice: Literal["random", "first", "all"] = "random"
    # caption_choice all: caption slots per image in a batch (more captions: the first kept; fewer:
    # padded and masked out of the loss); None: the most captions of any row of the CSV/JSONL file
    captions_per_image: int | None = Field(None, ge=1, le=64)
    # hard negative captions (NegCLIP; nclip.data.hard_negatives): a CSV/TSV column (several split by
    # data.caption_separator), JSONL field or field of WebDataset samples' .json (a string or a list of
    # strings) holding an image's own negatives, or "swap" negatives made from each positive caption
    # (data.hard_negatives); objectives with hard_negatives (clip, siglip) add them to the image's text
    # candidates
    hard_negative_key: str | None = Field(None, min_length=1)
    hard_negatives: Literal["swap"] | None = None
    # data.hard_negative_key: negative slots per image in a batch (more negatives: the first kept;
    # fewer: padded and masked out of the loss); None: the most negatives of any row of the CSV/JSONL file
    negatives_per_image: int | None = Field(None, ge=1, le=64)
    # a class-label column of the CSV: class ids are its distinct values in sorted order (label
    # kind "label"), for label-using objectives and data.tagging; None: the CSV has no labels
    csv_label_key: str | None = None
    # source folder: DIR/<class>/<image>, or DIR/train/<class>/... (then only train/ is read, as
    # `nclip eval --dataset folder:DIR` tests on test/); class ids: the sorted sub-folder names
    folder: str | None = None
    tagging: TaggingConfig = TaggingConfig()
    shuffle_buffer: int = Field(1000, ge=0, description="samples in the shuffle buffer (0: none)")
    resampled: bool = True  # draw shards with replacement (no epochs); False: split and cycle
    exact_resume: bool = True  # resume replays the shard stream to the exact sample (no decoding)
    max_bad_fraction: float = Field(0.05, ge=0, le=1, description="stop if more bad samples in a window")
    bad_window: int = Field(1000, ge=10, description="samples per window of the bad-sample check")

    @model_validator(mode="after")
    def _real_data(self):
        if self.source == "webdataset" and (self.shards is None) == (self.sources is None):
            raise ValueError("data.source webdataset needs exactly one of data.shards or data.sources")
        if self.source == "webdataset" and self.sources is not None and not self.sources:
            raise ValueError("data.sources is empty")
        if self.sampling == "per_source" and (self.source != "webdataset" or self.sources is None):
            raise ValueError("data.sampling per_source needs data.source webdataset with data.sources "
                             "(several weighted sources)")
        if self.hard_negative_group > 1 and self.source != "synthetic":
            raise ValueError("data.hard_negative_group > 1 needs data.source synthetic")
        if self.exclude is not None and self.hard_negative_group > 1:
            raise ValueError("data.exclude needs a source without hard-negative groups")
        if self.source == "csv" and not self.csv:
            raise ValueError("data.source csv needs data.csv (the path of a CSV/TSV file)")
        if self.csv_label_key is not None and self.source != "csv":
            raise ValueError(f"data.csv_label_key needs data.source csv (got {self.source})")
        if (self.source == "folder") != (self.folder is not None):
            raise ValueError("data.source folder needs data.folder (a folder with one sub-folder of images per "
                             "class), and data.folder needs data.source folder")
        if self.tagging.enabled and not has_labels(self):
            hint = " without data.csv_label_key" if self.source == "csv" else ""
            raise ValueError(f"data.tagging needs labelled data, but data.source {self.source}{hint} has no labels")
        self._caption_checks()
        self._negative_checks()
        if (self.tagging.enabled and self.source in ("csv", "folder")
                and self.tagging.label_key not in (None, USER_LABEL)):
            raise ValueError(f"data.tagging.label_key {self.tagging.label_key!r} is not a label of data.source "
                             f"{self.source} (it has {USER_LABEL})")
        return self

    def _caption_checks(self) -> None:
        if self.caption_separator == "":  # what YAML makes of a bare | (a block scalar), as --set parses values
            raise ValueError("data.caption_separator is empty; quote the separator, e.g. --set "
                             "'data.caption_separator=\"|\"' (YAML reads a bare | as an empty text)")
        if self.caption_separator is not None and self.source != "csv":
            raise ValueError(f"data.caption_separator splits the captions of a CSV/JSONL file: it needs data.source "
                             f"csv (got {self.source}; WebDataset samples hold several captions as KEY.N.txt members "
                             "or a list in data.json_caption_key)")
        if self.json_caption_key is not None and self.source != "webdataset":
            raise ValueError(f"data.json_caption_key names a field of WebDataset samples' .json: it needs data.source "
                             f"webdataset (got {self.source}; a JSONL file's is data.csv_caption_key)")
        if self.captions_per_image is not None and self.caption_choice != "all":
            raise ValueError("data.captions_per_image sizes the caption slots of data.caption_choice all")
        if self.caption_choice != "all":
            return
        if self.source not in ("csv", "webdataset"):
            raise ValueError(f"data.caption_choice all needs a source with several captions per image (csv or "
                             f"webdataset); data.source {self.source} has one")
        if self.tagging.enabled:
            raise ValueError("data.caption_choice all trains on the data's captions; data.tagging makes one per image")
        if self.source == "webdataset" and self.captions_per_image is None:
            raise ValueError("data.caption_choice all on WebDataset needs data.captions_per_image (the caption slots "
                             "per image: a stream cannot count its images' captions up front)")

    def _negative_checks(self) -> None:
        if self.hard_negative_key is not None and self.source not in ("csv", "webdataset"):
            raise ValueError(f"data.hard_negative_key names a column of a CSV/JSONL file or a field of WebDataset "
                             f"samples' .json: it needs data.source csv or webdataset (got {self.source}); "
                             "data.hard_negatives swap makes negatives from any source")
        if self.hard_negative_key is not None and self.hard_negatives is not None:
            raise ValueError("data.hard_negative_key and data.hard_negatives are two sources of negatives; set one")
        if self.negatives_per_image is not None and self.hard_negative_key is None:
            raise ValueError("data.negatives_per_image sizes the negative slots of data.hard_negative_key")
        if self.source == "webdataset" and self.hard_negative_key is not None and self.negatives_per_image is None:
            raise ValueError("data.hard_negative_key on WebDataset needs data.negatives_per_image (the negative slots "
                             "per image: a stream cannot count its images' negatives up front)")

    def caption_keys(self) -> tuple[str, str, str | None, str | None]:
        """(image column, caption column, caption separator, hard negative column) of a CSV/JSONL
        source: how evaluation reads the file the run trained on (``nclip eval --dataset captions:FILE``,
        ``hardneg:FILE``)."""
        return self.csv_image_key, self.csv_caption_key, self.caption_separator, self.hard_negative_key
