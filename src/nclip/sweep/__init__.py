"""``nclip sweep``: ablation grids (xCLIP Sec. 4.4, Tab. 9 a-f; Appendix Tab. A1 and Fig. B1).

    grid / named settings → one ``nclip train`` subprocess per setting → linear probe → judge
    → DIR/table.md + DIR/table.csv (Tab. 9 layout) + DIR/curves.png (Fig. B1) + DIR/sweep.json

A sweep is a list of runs. Each run is a set of config overrides, the cartesian product of

- a *grid*: ``--grid "objective.lambda1=[0,0.3,0.5] objective.lambda2=[1,1.5]"`` (every key
  takes a YAML list of values; the option may be repeated), and
- optional *named settings*: whole configs by name, from ``--table a1`` (the rows of Tab. A1,
  :data:`nclip.objectives.unified.TABLE_A1_SETTINGS`), ``--table 9a|9c|9d|9e|9f`` (the rows
  of Tab. 9a/c/d/e/f, which are not cartesian products; :func:`table_settings`) or a
  ``--grid-file`` (see :func:`load_grid_file`).

Every run trains in ``DIR/runs/<slug>`` as its own ``nclip train`` process (``N`` at once, each with
``train.threads`` threads), so a crash, a divergence or a bad setting stops one run, not the sweep.
Each run is then scored like Tab. 9: ZS = zero-shot top-1 of the objective's zero-shot head, from
the trainer's RUN/eval.json; LN = a linear probe (L-BFGS logistic regression, L2 chosen on a
validation split) on frozen image-backbone features of held-out built-in data, written to
RUN/probe.json by the sweep process itself (:func:`probe_run`).

Verdicts (the "NaN" rows of Tab. 9a / Tab. A1), from the run's metrics.jsonl:

- ``diverged``: the trainer stopped on non-finite losses or gradients, or the last logged loss or
  nCLIP term is not finite. ZS/LN read ``NaN``.
- ``collapsed (uniform)`` / ``collapsed (one-hot)``: :class:`~nclip.train.monitors.CollapseMonitor`
  still reports that signature at the end of training (it persisted over its last ``window``
  logs). ZS/LN read ``collapsed``; the measured numbers stay in table.csv (``*_measured``).
- ``dimensional collapse``: reported as a note with the numbers, as the paper reports its
  λ1 > 0, λ2 = 1 rows (Appendix B.1, case 2).
- ``failed``: the process failed for another reason (its stderr tail is in RUN/error.txt).

Resume (``--resume``): runs that are ``done`` or ``diverged`` are skipped; every other run (pending,
interrupted, failed) is started again with ``nclip train --resume auto`` (it continues from its
newest checkpoint); a run whose training finished but whose probe did not only runs the probe.

The package, one module per job: :mod:`~nclip.sweep.grid` (grids, named settings, runs),
:mod:`~nclip.sweep.options` (:class:`SweepOptions`), :mod:`~nclip.sweep.execute` (child processes,
journal, resume, parallelism), :mod:`~nclip.sweep.probe` (LN), :mod:`~nclip.sweep.verdicts`,
:mod:`~nclip.sweep.tables` and :mod:`~nclip.sweep.curves` (Fig. B1).
"""

from __future__ import annotations

from nclip.sweep.curves import FIG_B1_PANELS, plot_curves
from nclip.sweep.execute import FINISHED, SWEEP_VERSION, available_cores, plan_parallelism, run_sweep, train_command
from nclip.sweep.grid import RunSpec, expand, load_grid_file, parse_grid, short_names, split_grid, table_settings
from nclip.sweep.options import SweepOptions
from nclip.sweep.probe import probe_run
from nclip.sweep.tables import collect, field_title, write_table
from nclip.sweep.verdicts import STATUS_TEXT, TERM_KEYS, judge, read_metrics

__all__ = [
    "FIG_B1_PANELS", "FINISHED", "STATUS_TEXT", "SWEEP_VERSION", "TERM_KEYS", "RunSpec", "SweepOptions",
    "available_cores", "collect", "expand", "field_title", "judge", "load_grid_file", "parse_grid",
    "plan_parallelism", "plot_curves", "probe_run", "read_metrics", "run_sweep", "short_names", "split_grid",
    "table_settings", "train_command", "write_table",
]
