"""The objectives by name: the built-in ones, and the user's own from a file or a package.

``objective.name`` is a built-in name (``xclip``), ``module:Class`` (an installed module or one on
``PYTHONPATH``, or, with the user's consent, one in the working directory: :mod:`nclip.plugin_consent`,
docs/plugins.md), or the name of an entry point in the group ``nclip.objectives`` of an installed
package. This module and :mod:`nclip.objectives.plan` are the only ones that read :data:`REGISTRY`;
the rest of nclip asks the plan.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
from importlib.machinery import PathFinder
from importlib.metadata import entry_points
from pathlib import Path

from nclip import plugin_consent
from nclip.objectives.base import Objective, ObjectiveConfig
from nclip.objectives.clip import ClipConfig, ClipObjective
from nclip.objectives.clip_supcon import ClipSupconConfig, ClipSupconObjective
from nclip.objectives.cmsf import ClipCmsfConfig, ClipCmsfObjective, CmsfConfig, CmsfObjective
from nclip.objectives.cmsf_baselines import FrzProtoConfig, FrzProtoObjective, ProtoNwConfig, ProtoNwObjective
from nclip.objectives.nclip import NclipConfig, NclipObjective, XclipConfig, XclipObjective
from nclip.objectives.protoclip import ProtoclipConfig, ProtoclipObjective
from nclip.objectives.siglip import SiglipConfig, SiglipObjective, XsiglipConfig, XsiglipObjective
from nclip.objectives.supcon import (
    PacoConfig,
    PacoObjective,
    RecoConfig,
    RecoObjective,
    SupconConfig,
    SupconObjective,
)
from nclip.objectives.unified import UnifiedConfig, UnifiedObjective
from nclip.objectives.xent import XentConfig, XentObjective
from nclip.objectives.yclip import YclipConfig, YclipObjective

# name -> (typed config, module). The config classes are unioned on ``name`` in nclip.config.
REGISTRY: dict[str, tuple[type[ObjectiveConfig], type[Objective]]] = {
    "clip": (ClipConfig, ClipObjective),
    "nclip": (NclipConfig, NclipObjective),
    "xclip": (XclipConfig, XclipObjective),
    "unified": (UnifiedConfig, UnifiedObjective),
    "yclip": (YclipConfig, YclipObjective),
    "siglip": (SiglipConfig, SiglipObjective),
    "xsiglip": (XsiglipConfig, XsiglipObjective),
    "protoclip": (ProtoclipConfig, ProtoclipObjective),
    "cmsf": (CmsfConfig, CmsfObjective),
    "clip_cmsf": (ClipCmsfConfig, ClipCmsfObjective),
    "xent": (XentConfig, XentObjective),
    "protonw": (ProtoNwConfig, ProtoNwObjective),
    "frzproto": (FrzProtoConfig, FrzProtoObjective),
    "supcon": (SupconConfig, SupconObjective),
    "paco": (PacoConfig, PacoObjective),
    "reco": (RecoConfig, RecoObjective),
    "clip_supcon": (ClipSupconConfig, ClipSupconObjective),
}

ENTRY_POINT_GROUP = "nclip.objectives"

# plugin name -> (path, sha256) of the file that defines its objective class, read when the plugin was
# imported: the code the run trains with (a resumed run compares it with its checkpoint's record)
SOURCES: dict[str, tuple[str, str]] = {}


def objective_class(name: str) -> type[Objective]:
    """The objective module registered as ``name`` (loading a plugin on first use)."""
    return _entry(name)[1]


def config_class(name: str) -> type[ObjectiveConfig]:
    """The typed config of the objective ``name`` (loading a plugin on first use)."""
    return _entry(name)[0]


def registered_configs() -> tuple[type[ObjectiveConfig], ...]:
    """Every config class known now: the built-ins and the plugins loaded so far (the config's
    union of objective sections)."""
    return tuple(config for config, _ in REGISTRY.values())


def registered_names() -> tuple[str, ...]:
    """The names of :func:`registered_configs`, in the same order."""
    return tuple(REGISTRY)


def is_known(name: str) -> bool:
    return name in REGISTRY


def _entry(name: str) -> tuple[type[ObjectiveConfig], type[Objective]]:
    if name not in REGISTRY:
        load_plugin(name)
    return REGISTRY[name]


def load_plugin(name: str) -> None:
    """Register the user's objective ``name``: ``module:Class`` or an entry point of the group
    ``nclip.objectives``. A ValueError of one line for a name that is neither, a module that does
    not import, or a class that is not an objective (docs/plugins.md lists what it must have)."""
    if name in REGISTRY:
        return
    cls = _import_class(name) if ":" in name else _entry_point_class(name)
    REGISTRY[name] = (_named_config(name, cls), cls)
    source = _source_file(cls)
    if source is not None:
        SOURCES[name] = source


def plugin_source(name: str) -> tuple[str, str] | None:
    """(path, sha256) of the file that defines plugin ``name``'s objective class, as imported;
    None for a built-in objective or a class without a readable file."""
    return SOURCES.get(name)


def _source_file(cls) -> tuple[str, str] | None:
    path = getattr(sys.modules.get(cls.__module__), "__file__", None)
    if not path:
        return None
    try:
        return os.path.abspath(path), hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _import_class(name: str):
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ValueError(f"objective.name {name!r}: a plugin is named module:Class")
    if plugin_consent.given():
        module = _import(name, module_name, from_working_directory=True)
    elif _installed(module_name):
        module = _import(name, module_name, from_working_directory=False)
    else:  # e.g. a received model's evil.py beside its config: importing it would run it
        raise ValueError(f"objective.name {name!r}: module {module_name!r} is not installed, and importing it "
                         f"from the working directory runs its code; if you trust it, pass "
                         f"{plugin_consent.FLAG} (Python: {plugin_consent.API_ARGUMENT})")
    if not hasattr(module, attr):
        raise ValueError(f"objective.name {name!r}: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)


def _import(name: str, module_name: str, from_working_directory: bool):
    """Import the user's module; from the working directory too when they consented (the console
    script's sys.path lacks it; it is taken off again afterwards)."""
    cwd = os.getcwd()
    added = from_working_directory and cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except Exception as e:  # the user's file: any error in it is theirs, said in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"objective.name {name!r}: module {module_name!r} does not import "
                         f"({type(e).__name__}: {first})") from None
    finally:
        if added:
            sys.path.remove(cwd)


def _installed(module_name: str) -> bool:
    """Whether Python finds ``module_name`` without the working directory: already imported, or its
    top-level package found by the import system with the sys.path entries that name the working
    directory ('' under ``python -c``, its path under ``python -m``) left out. Finding runs no code."""
    if module_name in sys.modules:
        return True
    top = module_name.partition(".")[0]
    cwd = os.path.realpath(os.getcwd())
    elsewhere = [p for p in sys.path if isinstance(p, str) and os.path.realpath(p or ".") != cwd]
    for finder in sys.meta_path:  # the path finder, and those of editable installs and the like
        try:
            if finder is PathFinder:
                spec = PathFinder.find_spec(top, elsewhere)
            else:
                find = getattr(finder, "find_spec", None)
                spec = find(top, None) if find is not None else None
        except Exception:  # noqa: BLE001 - a finder that fails finds nothing
            spec = None
        if spec is not None:
            return True
    return False


def _entry_point_class(name: str):
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        raise ValueError(f"objective.name: unknown objective {name!r}; available: {', '.join(REGISTRY)} "
                         f"(or module:Class, or an installed {ENTRY_POINT_GROUP} entry point)")
    try:
        return found[0].load()
    except Exception as e:
        raise ValueError(f"objective.name {name!r}: entry point {found[0].value!r} does not load "
                         f"({type(e).__name__}: {e})") from None


# what a plugin's objective class must define (the rest has the defaults of Objective)
REQUIRED = ("Config", "heads", "zero_shot", "forward")


def _named_config(name: str, cls) -> type[ObjectiveConfig]:
    """The plugin's ``Config`` with ``name`` fixed to the name the run uses, so the config's union,
    discriminated by ``name``, validates its options like a built-in's."""
    from typing import Literal

    from pydantic import create_model

    if not (isinstance(cls, type) and issubclass(cls, Objective)):
        raise ValueError(f"objective.name {name!r} is {cls!r}, not a subclass of nclip.objectives.Objective")
    missing = [a for a in REQUIRED if getattr(cls, a, None) is getattr(Objective, a, None)]
    if missing:
        raise ValueError(f"objective.name {name!r}: {cls.__name__} does not define {', '.join(missing)} "
                         "(docs/plugins.md)")
    config = cls.Config
    if not (isinstance(config, type) and issubclass(config, ObjectiveConfig)):
        raise ValueError(f"objective.name {name!r}: {cls.__name__}.Config is not a subclass of "
                         "nclip.objectives.ObjectiveConfig")
    named = create_model(config.__name__, __base__=config, __module__=__name__,
                         name=(Literal[name], name))  # type: ignore[valid-type]
    # pickle finds a class by module and qualified name: this module's __getattr__ answers the name
    # below by loading the plugin, in this process or a fresh one (a spawned worker). The name says
    # whether the plugin was loaded under the user's consent, so that a spawned worker of their run
    # imports it from the working directory as the run did.
    prefix = _CONSENTED_PLUGIN_CONFIG if plugin_consent.given() else _PLUGIN_CONFIG
    named.__qualname__ = prefix + name.encode().hex()
    return named


_PLUGIN_CONFIG = "_plugin_config_"
_CONSENTED_PLUGIN_CONFIG = "_consented_plugin_config_"


def __getattr__(attr: str):
    """A plugin's config class by its pickled name (:func:`_named_config`), loading the plugin. Only
    nclip's own pickles name these (a run's config sent to its spawned workers): the files nclip
    reads are never unpickled beyond tensors (``weights_only``), so no received file gives consent."""
    for prefix, consented in ((_CONSENTED_PLUGIN_CONFIG, True), (_PLUGIN_CONFIG, False)):
        if attr.startswith(prefix):
            with plugin_consent.consent(consented):
                return config_class(bytes.fromhex(attr[len(prefix):]).decode())
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
