"""Benchmark suites: ``nclip eval --suite FILE.yaml`` evaluates a list of datasets, each with its own
tasks (and prompts), in one run, and reports them as the papers print a zero-shot suite: one row,
a column per dataset, and the mean (:mod:`nclip.eval.suite_table`).

The file (typed and checked; an unknown key is an error)::

    name: my-suite                      # optional: the table's title (default: the file's name)
    datasets:
      - spec: wds:/data/wds_cifar10     # any --dataset spec
        tasks: [zeroshot, linear]       # optional; default: zeroshot on classes, retrieval on captions
      - spec: wds:/data/wds_imagenet1k
        name: imagenet1k                # optional: the dataset part of the result keys
        templates: imagenet80           # optional: this dataset's --templates / --classnames
      - spec: karpathy:/data/coco/dataset_coco.json:/data/coco/images

Relative paths (in specs, ``classnames`` and ``templates``) are read from the current directory,
as ``--dataset``'s are. Every dataset is built (and its copy checked) before the model runs, so a
damaged copy fails the run in its first seconds. The model, the feature cache and the results are
shared: results.json holds every ``task/dataset/metric`` key as ``nclip eval`` writes them, plus a
``suite`` section with the table's cells and means (:func:`nclip.eval.suite_table.suite_section`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from nclip.errors import NclipError
from nclip.eval.settings import TASKS, EvalSettings


class SuiteDataset(BaseModel):
    """One dataset of a suite: its spec, tasks, result name and prompts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    spec: str
    tasks: tuple[str, ...] | None = Field(None, min_length=1)
    name: str | None = Field(None, min_length=1, pattern=r"^[A-Za-z0-9_.]+$")
    classnames: str | None = None
    templates: str | None = None

    @field_validator("spec")
    @classmethod
    def _spec(cls, spec: str) -> str:
        from nclip.dataset_specs import checked_spec

        return checked_spec(spec)

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, tasks: tuple[str, ...] | None) -> tuple[str, ...] | None:
        bad = [t for t in tasks or () if t not in TASKS]
        if bad:
            raise ValueError(f"unknown task {bad[0]!r}; available: {', '.join(TASKS)}")
        return tasks


class Suite(BaseModel):
    """A suite file (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = None
    datasets: tuple[SuiteDataset, ...] = Field(min_length=1)


def load_suite(path: str | Path) -> tuple[Suite, Path]:
    """The suite of a YAML file, checked; a problem is one line naming the file and the key."""
    import yaml

    from nclip.jsonio import read_text

    path, text = read_text(path, "suite file")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        raise NclipError(f"{path}: invalid YAML{line} ({getattr(e, 'problem', None) or 'parse error'})") from None
    if not isinstance(raw, dict):
        raise NclipError(f"{path}: expected a mapping with a 'datasets' list")
    try:
        return Suite.model_validate(raw), path
    except ValidationError as e:
        from nclip.config import describe_validation_error  # the one formatter (imports torch: errors only)

        raise NclipError(describe_validation_error(e, str(path))) from None


def _entry_settings(base: EvalSettings, entry: SuiteDataset, where: str) -> EvalSettings:
    try:
        return base.updated(datasets=(entry.spec,), classnames=entry.classnames, templates=entry.templates,
                            tasks=entry.tasks or base.tasks)
    except NclipError as e:  # "eval: classnames: ..." -> name the suite entry
        raise NclipError(f"{where}: {str(e).removeprefix('eval: ')}") from None


def _default_tasks(data) -> tuple[str, ...]:
    """A dataset's headline task when the suite names none: zero-shot on classes, else retrieval."""
    if data.label_kinds:
        return ("zeroshot",)
    return ("retrieval",) if data.retrieval else ("sts",) if data.sts else ("zeroshot",)


def plan(suite: Suite, path: Path, base: EvalSettings, cfg) -> list[tuple[str, EvalSettings, list]]:
    """[(where, settings, datasets)] per suite entry: every dataset built (its copy checked) and named."""
    from nclip.eval.runner import build_datasets

    out, names = [], {}
    for i, entry in enumerate(suite.datasets):
        where = f"{path}: datasets[{i}]"
        settings = _entry_settings(base, entry, where)
        built = build_datasets(cfg, settings)
        if entry.name is not None:
            if len(built) != 1:
                raise NclipError(f"{where}: name: {entry.spec!r} yields {len(built)} datasets; leave out the name")
            built[0].name = entry.name
        for data in (d for d in built if not d.sts):  # synthetic's STS pairs share its name
            if data.name in names:
                raise NclipError(f"{where}: dataset name {data.name!r} is already datasets[{names[data.name]}]'s; "
                                 "give this one a name:")
            names[data.name] = i
        tasks = entry.tasks or tuple(dict.fromkeys(t for d in built if not d.sts for t in _default_tasks(d)))
        out.append((where, settings.updated(tasks=tasks), built))
    return out


def run_suite(checkpoint: str | Path, out: str | Path | None, suite_file: str | Path, *,
              settings: EvalSettings | None = None, cache_dir: str | Path | None = "default", report: bool = True,
              log: Callable[[str], None] | None = None) -> dict:
    """Evaluate ``checkpoint`` on every dataset of the suite ``suite_file`` with its tasks; write one
    results.json (with a ``suite`` section) and one report.html to ``out``. Returns the document."""
    from nclip.eval import realms
    from nclip.eval.probe import threads
    from nclip.eval.runner import _resolve_settings, evaluate, finish, start
    from nclip.eval.suite_table import suite_section

    t0 = time.perf_counter()
    suite, path = load_suite(suite_file)
    specs = tuple(dict.fromkeys(e.spec for e in suite.datasets))
    base = _resolve_settings(settings or EvalSettings(), out, cache_dir, datasets=specs)
    st, objective = start(checkpoint, base, log)
    allowed = st.settings.tasks  # an image-only objective's text tasks are skipped with their reason
    steps = plan(suite, path, st.settings, st.ck.cfg)
    used: list[str] = []
    with threads(1):
        for where, entry_settings, built in steps:
            tasks = tuple(t for t in entry_settings.tasks if t in allowed)
            used += [t for t in tasks if t not in used]
            if not tasks:
                continue
            st.settings = entry_settings.updated(tasks=tasks)
            if "realms" in tasks:
                realms.attach_hierarchies(built, st.settings.hierarchy)
            for data in built:
                evaluate(st, data)
    requested = tuple(dict.fromkeys(t for _, s, _ in steps for t in s.tasks))
    st.skipped = {t: why for t, why in st.skipped.items() if t in requested}  # start() saw every task
    st.settings = st.settings.updated(datasets=specs, tasks=tuple(used) or requested, classnames=None,
                                      templates=None)
    entries = [{"spec": e.spec, "tasks": list(s.tasks), "datasets": [d.name for d in b if not d.sts],
                "classnames": s.classnames, "templates": s.templates}
               for e, (_, s, b) in zip(suite.datasets, steps)]
    section = suite_section(suite.name or path.stem, str(path.resolve()), entries, st.results)
    return finish(st, objective, out, report, t0, extra={"suite": section})
