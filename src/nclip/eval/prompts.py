"""The user's class names and prompt templates for zero-shot transfer (``nclip eval --classnames
FILE --templates FILE|imagenet80|simple``; CLIP Sec. 3.1.4, xCLIP Sec. 4.1).

Templates: a text file, one template per line with exactly one ``{}`` for the class name (``#``
comments and blank lines skipped; the reader of :mod:`nclip.data.tagging`), or the name of a
built-in set: ``imagenet80``, the 80 ImageNet prompts of CLIP's prompt-engineering study, which CLIP
ensembles for its ImageNet zero-shot numbers; ``simple``, the one prompt "a photo of a {}." that
GroupViT segments with (its ``template: simple``). Each class is the ensemble of its prompts exactly as
for the built-in data (:func:`nclip.eval.features.ensemble`: CLIP head, mean of the normalised
prompt embeddings renormalised; nCLIP head, mean of the prompts' distributions).

Class names: a text file with one name per line in the sorted order of the class folders (or, for a
``multilabel:`` CSV, of the sorted labels), a JSON object mapping each folder name (label) to its
class name, or a class-index file: a JSON object mapping each index of that order to its name or to
``[folder, name]`` (ImageNet's ``imagenet_class_index.json``; the folder is checked). A missing
file, a wrong line count, a class the map lacks and an index out of range are one-line errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from nclip.data.tagging import read_templates
from nclip.errors import NclipError
from nclip.jsonio import parse_json, read_text

# CLIP's 80 ImageNet prompt templates (the list of its prompt-engineering notebook), in its order
IMAGENET80 = (
    "a bad photo of a {}.", "a photo of many {}.", "a sculpture of a {}.", "a photo of the hard to see {}.",
    "a low resolution photo of the {}.", "a rendering of a {}.", "graffiti of a {}.", "a bad photo of the {}.",
    "a cropped photo of the {}.", "a tattoo of a {}.", "the embroidered {}.", "a photo of a hard to see {}.",
    "a bright photo of a {}.", "a photo of a clean {}.", "a photo of a dirty {}.", "a dark photo of the {}.",
    "a drawing of a {}.", "a photo of my {}.", "the plastic {}.", "a photo of the cool {}.",
    "a close-up photo of a {}.", "a black and white photo of the {}.", "a painting of the {}.",
    "a painting of a {}.", "a pixelated photo of the {}.", "a sculpture of the {}.", "a bright photo of the {}.",
    "a cropped photo of a {}.", "a plastic {}.", "a photo of the dirty {}.", "a jpeg corrupted photo of a {}.",
    "a blurry photo of the {}.", "a photo of the {}.", "a good photo of the {}.", "a rendering of the {}.",
    "a {} in a video game.", "a photo of one {}.", "a doodle of a {}.", "a close-up photo of the {}.",
    "a photo of a {}.", "the origami {}.", "the {} in a video game.", "a sketch of a {}.", "a doodle of the {}.",
    "a origami {}.", "a low resolution photo of a {}.", "the toy {}.", "a rendition of the {}.",
    "a photo of the clean {}.", "a photo of a large {}.", "a rendition of a {}.", "a photo of a nice {}.",
    "a photo of a weird {}.", "a blurry photo of a {}.", "a cartoon {}.", "art of a {}.", "a sketch of the {}.",
    "a embroidered {}.", "a pixelated photo of a {}.", "itap of the {}.", "a jpeg corrupted photo of the {}.",
    "a good photo of a {}.", "a plushie {}.", "a photo of the nice {}.", "a photo of the small {}.",
    "a photo of the weird {}.", "the cartoon {}.", "art of the {}.", "a drawing of the {}.",
    "a photo of the large {}.", "a black and white photo of a {}.", "the plushie {}.", "a dark photo of a {}.",
    "itap of a {}.", "graffiti of the {}.", "a toy {}.", "itap of my {}.", "a photo of a cool {}.",
    "a photo of a small {}.", "a tattoo of the {}.",
)
SIMPLE = ("a photo of a {}.",)  # GroupViT's "simple" template set, the one it segments with
BUILTIN_TEMPLATES = {"imagenet80": IMAGENET80, "simple": SIMPLE}


def templates(source: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """The templates of ``source``: a built-in set's name, a templates file, or None (``default``)."""
    if source is None:
        return default
    if source in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[source]
    return read_templates(source, "--templates: file")


def class_names(source: str | None, keys: Sequence[str], default: Sequence[str], what: str) -> tuple[str, ...]:
    """The class names of the classes ``keys`` (sorted folder names or labels) from the file
    ``source`` (one name per line, in the order of ``keys``, or a JSON map key → name); None:
    ``default``. ``what`` names the classes' origin in errors ("class folder", "label")."""
    if source is None:
        return tuple(default)
    path, text = read_text(source, "--classnames: file")
    if path.suffix.lower() == ".json" or text.lstrip().startswith("{"):
        return _from_map(path, text, keys, what)
    names = [line.strip() for line in text.splitlines() if line.strip()]
    if len(names) != len(keys):
        raise NclipError(f"{path}: {len(names)} class names for {len(keys)} {what}s; give one name per line "
                         f"in sorted {what} order ({', '.join(_head(keys))}) or a JSON map {what} -> name")
    return tuple(names)


def _from_map(path: Path, text: str, keys: Sequence[str], what: str) -> tuple[str, ...]:
    mapping = parse_json(path, text)
    if not isinstance(mapping, dict):
        raise NclipError(f"{path}: expected a JSON object mapping each {what} to its class name")
    if mapping and not any(k in mapping for k in keys) and all(k.strip().isdigit() for k in mapping):
        return _from_index_map(path, mapping, keys, what)
    missing = [k for k in keys if k not in mapping]
    if missing:
        raise NclipError(f"{path}: {what} {missing[0]!r} has no class name"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    bad = next((k for k in keys if not isinstance(mapping[k], str) or not mapping[k].strip()), None)
    if bad is not None:
        raise NclipError(f"{path}: the class name of {what} {bad!r} must be a non-empty string")
    return tuple(mapping[k].strip() for k in keys)


def _from_index_map(path: Path, mapping: dict, keys: Sequence[str], what: str) -> tuple[str, ...]:
    """Names from a class-index file: index -> name, or index -> [key, name] (ImageNet's
    ``imagenet_class_index.json``), whose key must be the index's own (the sorted ``keys``)."""
    names: dict[int, str] = {}
    for raw, value in mapping.items():
        i = int(raw)
        if i >= len(keys):
            raise NclipError(f"{path}: class index {i} out of range for {len(keys)} {what}s")
        key = None
        if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
            key, value = value
        if not isinstance(value, str) or not value.strip():
            raise NclipError(f"{path}: class index {i}: expected a class name or [{what}, name], got {value!r}")
        if key is not None and key != keys[i]:
            raise NclipError(f"{path}: class index {i} is {what} {key!r}, but the {what} of index {i} "
                             f"(sorted order) is {keys[i]!r}")
        names[i] = value.strip()
    missing = [i for i in range(len(keys)) if i not in names]
    if missing:
        raise NclipError(f"{path}: class index {missing[0]} ({what} {keys[missing[0]]!r}) has no class name"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return tuple(names[i] for i in range(len(keys)))


def _head(keys: Sequence[str], n: int = 3) -> list[str]:
    return [*keys[:n], "..."] if len(keys) > n else list(keys)
