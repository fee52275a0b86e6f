"""``nclip.Index``: the ranked search over a directory ``nclip embed`` wrote.

Queries are encoded by the model the manifest names (or another path to the same weights: the sha256
of the weights must match) and searched in the Faiss index of the image embeddings: inner product of
ℓ2-normalised vectors, i.e. cosine. For the CLIP head that is the model's own zero-shot score; for the
nCLIP head (stored as logits) it is the cosine of the logits, which ranks like but is not nCLIP's −L_CE.

    index = nclip.Index.open("embeddings/")
    index.search_text("a red circle", k=5)        # [Hit(score, row, path, caption, label, split), ...]
    index.search_image("query.jpg", k=5)          # a PIL image, a path, uint8 [H, W, 3] or pixels [3, S, S]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from nclip.embed import manifest as mf
from nclip.embed.vectors import load_shards, normalised, read_faiss
from nclip.errors import NclipError
from nclip.plugin_consent import consent


@dataclass
class Hit:
    """One ranked row: its cosine ``score``, ``row`` id and the metadata line's path, caption, label, split."""

    score: float
    row: int
    path: str | None = None
    caption: str | None = None
    label: str | None = None
    split: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


class Index:
    """An embedding directory opened for search (:meth:`open`), or written first (:meth:`build`)."""

    def __init__(self, directory: Path, doc: dict, checkpoint: str | Path | None = None, arch: str | None = None,
                 device: str | None = None, trust_plugin: bool = False):
        self.directory, self.manifest = directory, doc
        self.rows = mf.read_metadata(directory, doc)
        self.faiss = read_faiss(directory, doc)
        self._checkpoint, self._arch, self._device = checkpoint, arch, device
        self._trust_plugin = trust_plugin
        self._encoder = None

    @classmethod
    def open(cls, directory: str | Path, checkpoint: str | Path | None = None, arch: str | None = None,
             device: str | None = None, trust_plugin: bool = False) -> Index:
        """The embeddings in ``directory``; queries are encoded by the manifest's model, or by
        ``checkpoint`` if given (its weights must be the same: one line if not). ``trust_plugin``:
        as :func:`nclip.load`'s."""
        directory = Path(directory).expanduser()
        doc = mf.read_manifest(directory)
        if not doc.get("complete"):
            raise NclipError(f"{directory}: the embedding is unfinished ({doc.get('rows', 0)} rows so far); run the "
                             "same nclip embed command again to finish it")
        mf.check_finished(directory, doc)
        return cls(directory, doc, checkpoint, arch, device, trust_plugin)

    @classmethod
    def build(cls, spec: str, checkpoint: str | Path, out: str | Path, **options) -> Index:
        """Embed ``spec`` with ``checkpoint`` into ``out`` (:func:`nclip.embed.writer.embed`, same
        options, and ``trust_plugin`` as :func:`nclip.load`'s), then open it."""
        from nclip.embed.writer import embed

        trust_plugin = options.pop("trust_plugin", False)
        with consent(trust_plugin):
            embed(spec, checkpoint, out, **options)
        return cls.open(out, checkpoint, options.get("arch"), options.get("device"), trust_plugin)

    def __len__(self) -> int:
        return len(self.rows)

    def embeddings(self, kind: str = "images") -> np.ndarray:
        """[N, D] float32: the stored ``"images"`` (or ``"texts"``) embeddings, in row order."""
        return load_shards(self.directory, self.manifest, kind)

    @property
    def encoder(self):
        """The query model, loaded on first use after its fingerprint is checked against the manifest."""
        if self._encoder is None:
            from nclip.embed import model as embed_model

            model = self.manifest["model"]
            path = self._checkpoint if self._checkpoint is not None else model["path"]
            arch = self._arch if self._arch is not None else model.get("arch")
            if self._checkpoint is None and not Path(path).exists():
                raise NclipError(f"{self.directory}: its model {path} is not there any more; pass --checkpoint")
            with consent(self._trust_plugin):
                ck = embed_model.resolve(path, arch)
            if ck.sha256 != model["sha256"]:
                what = (f"--checkpoint {path} is not the model" if self._checkpoint is not None
                        else f"the model at {path} has changed since it was the one")
                raise NclipError(f"{what} {self.directory} was embedded with (weights sha256 {ck.sha256[:12]}, "
                                 f"manifest {model['sha256'][:12]}); pass --checkpoint with those weights")
            self._encoder = embed_model.Encoder.load(ck, self._device)
        return self._encoder

    def search_vectors(self, queries: np.ndarray, k: int = 10) -> list[list[Hit]]:
        """The ``k`` best rows for each query embedding [M, D], by cosine, best first."""
        if not isinstance(k, int) or k < 1:
            raise NclipError(f"k must be a positive integer, got {k!r}")
        scores, ids = self.faiss.search(normalised(queries), min(k, len(self.rows)))
        return [[Hit(float(s), **{f: self.rows[i].get(f) for f in ("row", "path", "caption", "label", "split")})
                 for s, i in zip(row_scores, row_ids) if i >= 0] for row_scores, row_ids in zip(scores, ids)]

    def search_text(self, text: str | list[str], k: int = 10):
        """Rows whose images best match ``text`` (a list of hits; for a list of texts, one list each)."""
        texts = [text] if isinstance(text, str) else list(text)
        if not texts or not all(isinstance(t, str) and t.strip() for t in texts):
            raise NclipError("search_text takes a non-empty string or a list of them")
        hits = self.search_vectors(self.encoder.texts(texts, 64).numpy(), k)
        return hits[0] if isinstance(text, str) else hits

    def search_image(self, image, k: int = 10):
        """Rows whose images best match ``image``: a PIL image, an image file's path, a uint8
        [H, W, 3] array or pre-processed pixels [3, S, S] (a list of hits); pixels [N, 3, S, S] or
        a list of any of these give one list each."""
        import torch

        many = isinstance(image, list) or (isinstance(image, torch.Tensor) and image.ndim == 4)
        items = list(image) if many else [image]
        pixels = torch.stack([self._pixels(item) for item in items])
        hits = self.search_vectors(self.encoder.images(pixels).numpy(), k)
        return hits if many else hits[0]

    def _pixels(self, item):
        import torch

        if isinstance(item, torch.Tensor):
            if item.ndim != 3 or item.shape[0] != 3:
                raise NclipError(f"pixels must be [3, S, S] or [N, 3, S, S], got {list(item.shape)}")
            return item.float()
        if isinstance(item, (str, Path)):
            item = open_image(item)
        return self.encoder.pixels(item)


def open_image(path: str | Path):
    """The decoded PIL image of a file, in its own mode (the model's convention converts it to RGB); one line
    if it is missing or not an image."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path).expanduser()
    if not path.is_file():
        raise NclipError(f"image not found: {path}")
    try:
        with Image.open(path) as im:
            im.load()
            return im.copy()
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as e:
        raise NclipError(f"{path} is not an image ({type(e).__name__})") from None
