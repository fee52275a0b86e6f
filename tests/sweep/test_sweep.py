"""`nclip sweep`: grid parsing and its one-line errors, run expansion, verdicts from metrics,
a 2-run micro sweep end to end (table.md, table.csv, curves.png, sweep.json), resume, a failed run."""

import csv
import json
import math

import numpy as np
import pytest

from nclip.cli import main
from nclip.errors import NclipError
from nclip.sweep import (
    SweepOptions,
    expand,
    judge,
    load_grid_file,
    parse_grid,
    plan_parallelism,
    split_grid,
    table_settings,
    train_command,
)

# seconds-long runs: the micro preset with fewer steps and a small end-of-run evaluation
MICRO = ["train.steps=4", "train.batch_size=8", "train.warmup_steps=1", "train.log_every=1",
         "train.checkpoint_every=2", "eval.samples=32", "eval.batch_size=32"]
PROBE = ["--probe-train", "40", "--probe-test", "30"]


def _sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


# ---------------------------------------------------------------------------------------------
# grid parsing
# ---------------------------------------------------------------------------------------------


def test_parse_grid_cartesian_order_and_types():
    grid = parse_grid(["objective.lambda1=[0, 0.3,0.5] objective.lambda2=[1,1.5]", "model.nclip_dim=[512]"])
    assert grid == {"objective.lambda1": [0, 0.3, 0.5], "objective.lambda2": [1, 1.5], "model.nclip_dim": [512]}
    runs = expand(grid)
    assert len(runs) == 6
    assert [r.slug for r in runs[:3]] == ["lambda1-0_lambda2-1_nclip_dim-512", "lambda1-0_lambda2-1.5_nclip_dim-512",
                                          "lambda1-0.3_lambda2-1_nclip_dim-512"]
    assert runs[2].set_args() == ["objective.lambda1=0.3", "objective.lambda2=1", "model.nclip_dim=512"]
    assert list(runs[0].values) == ["objective.lambda1", "objective.lambda2", "model.nclip_dim"]


def test_split_grid_keeps_brackets_and_quotes_together():
    assert split_grid("a.b=[1, 2]  c={x: [1, 2], y: 'p q'} d=['s t']") == \
        ["a.b=[1, 2]", "c={x: [1, 2], y: 'p q'}", "d=['s t']"]


@pytest.mark.parametrize("grid,needle", [
    ("objective.lambda1", "not of the form key=[v1,v2,...]"),
    ("objective.lambda1=0.3", "must be a YAML list of values, e.g. objective.lambda1=[0.3]"),
    ("objective.lambda1=[]", "list of values is empty"),
    ("objective.lambda1=[0,0]", "value 0 is listed twice"),
    ("objective.lambda1=[0,0.3", "unclosed bracket"),
    ("objective.lambda1=[0]] x=[1]", "unbalanced"),
    ("objective.lambda1=[0] objective.lambda1=[1]", "given twice"),
    ("objective..x=[1]", "is not a config key"),
    ("objective=[{name: clip}] objective.name=[nclip]", "overlap"),
    ("objective.lamda1=[0.3]", "objective.lamda1: unknown key"),  # caught before any run starts
    ("train.steps=[0]", "train.steps"),
])
def test_bad_grid_is_one_line_exit_2(grid, needle, tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["sweep", "--preset", "micro", "--grid", grid, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and err.startswith("nclip: error:"), err
    assert not (out / "runs").exists()


def test_other_user_errors(tmp_path, capsys):
    for argv, needle in [
        (["--table", "b7"], "unknown table 'b7'; available: a1, 9a, 9c, 9d, 9e, 9f"),
        ([], "nothing to sweep"),
        (["--grid-file", str(tmp_path / "nope.yaml")], "grid file not found"),
        (["--grid", "objective.lambda1=[0.3]", "--parallel", "0"],
         "sweep: --parallel: Input should be greater than or equal to 1 (got 0)"),
        (["--grid", "objective.lambda1=[0.3]", "--threads", "0"], "sweep: --threads: Input should be greater"),
        (["--grid", "objective.lambda1=[0.3]", "--probe-test", "9"],
         "sweep: --probe-test: Input should be greater than or equal to 10 (got 9)"),
    ]:
        assert main(["sweep", "--preset", "micro", "--out", str(tmp_path / "s"), *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err


def test_an_out_holding_other_files_is_refused_without_force(tmp_path, capsys):
    """Issue 36.1: a sweep wrote its table.md and curves.png into any folder."""
    out = tmp_path / "evaluated"
    out.mkdir()
    (out / "results.json").write_text("{}")
    assert main(["sweep", "--preset", "micro", "--out", str(out), "--grid", "objective.lambda1=[0.3]"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{out} holds other files (results.json) and no sweep" in err, err
    assert "--force" in err and sorted(p.name for p in out.iterdir()) == ["results.json"]


def test_sweep_options_validate_like_the_run_config(tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="nothing to sweep"):
        SweepOptions(preset="micro", out=tmp_path)
    with pytest.raises(ValidationError, match="paralel"):
        SweepOptions(preset="micro", out=tmp_path, grid={"seed": [0]}, paralel=2)  # unknown options are errors
    opts = SweepOptions(preset="micro", out=str(tmp_path), settings=table_settings("9e"))
    assert opts.out == tmp_path and opts.probe_train == 2000


def test_grid_file_and_tables(tmp_path):
    f = tmp_path / "g.yaml"
    f.write_text("grid:\n  seed: [0, 1]\nsettings:\n  clip: {objective: {name: clip}}\n"
                 "  nclip: {objective.name: nclip, objective.lambda1: 0.5}\n")
    grid, settings = load_grid_file(f)
    runs = expand(grid, settings)
    assert [r.slug for r in runs] == ["clip_seed-0", "clip_seed-1", "nclip_seed-0", "nclip_seed-1"]
    assert runs[0].set_args() == ["objective={name: clip}", "seed=0"]
    # columns: the grid key and the setting keys that differ between runs
    assert list(runs[0].values) == ["seed", "objective.name", "objective.lambda1"]
    f.write_text("grid: [1, 2]\n")
    with pytest.raises(NclipError, match="'grid' must map"):
        load_grid_file(f)

    a1 = table_settings("a1")
    assert list(a1) == ["CE", "SwAV", "SCSF", "DINO", "MSN", "MSN_0.7", "nCLIP_0.8", "nCLIP"]
    assert a1["SwAV"]["objective"] == {"name": "unified", "tau": 1.0, "tau_s": 0.25, "lambda1": 0.0,
                                       "uniform": "sinkhorn", "lambda2": 1.0}
    runs = expand({}, a1)
    assert {"objective.tau_s", "objective.uniform", "objective.lambda1", "objective.lambda2"} <= set(runs[0].values)
    assert "objective.name" not in runs[0].values  # the same in every row
    from nclip.config import resolve

    cfg = resolve("nclip-tiny", runs[1].set_args())  # the preset's objective section is replaced
    assert cfg.objective.name == "unified" and cfg.objective.uniform == "sinkhorn"
    assert [r.slug for r in expand({}, table_settings("9a"))][0] == "l1-0_l2-1"
    assert len(table_settings("tab.9e")) == 4


def test_tab9c_9d_9f_recipes_expand_to_the_paper_rows(tmp_path):
    from nclip.config import resolve
    from nclip.data.shards import ShardWriter

    runs = expand({}, table_settings("9c"))
    assert [r.slug for r in runs] == ["vanilla", "bottleneck", "l2-norm", "no-last-bn"]
    assert list(runs[0].values) == ["model.nclip_bottleneck", "model.nclip_l2norm", "model.nclip_last_bn"]
    heads = [resolve("nclip-tiny", r.set_args()).model for r in runs]
    assert [(m.nclip_bottleneck, m.nclip_l2norm, m.nclip_last_bn) for m in heads] == [
        (None, False, True), (256, False, True), (None, True, True), (None, False, False)]

    runs = expand({}, table_settings("tab9d"))
    assert [r.slug for r in runs] == ["sl0-tl1", "sl0-tl2", "sl1-tl2", "sl2-tl3"]
    models = [resolve("tiny", r.set_args()).model for r in runs]
    assert [(m.nclip_shared_layers, m.nclip_layers) for m in models] == [(0, 1), (0, 2), (1, 2), (2, 3)]
    with pytest.raises(NclipError, match="no CLIP and nCLIP heads"):  # 9d is an xCLIP table
        resolve("nclip-tiny", runs[2].set_args())

    runs = expand({}, table_settings("9f"))
    assert [r.slug for r in runs] == ["vanilla", "shared-space", "debiased-sampling", "nclip-warmup"]
    vanilla, shared, warm = (resolve("tiny", runs[i].set_args()) for i in (0, 1, 3))
    assert vanilla.objective.name == "xclip" and vanilla.data.sampling == "mixed"
    assert (shared.objective.name, shared.objective.lambda1, shared.objective.lambda2) == ("yclip", 3.0, 4.0)
    assert (warm.objective.nclip_warmup_start, warm.objective.nclip_warmup_steps) == (50, 50)
    assert warm.train.warmup_steps == 50  # λ_nCLIP starts after the lr warm-up of the preset
    # debiased sampling needs weighted shard sources (docs/ablations.md writes two)
    with pytest.raises(NclipError, match="data.sampling per_source needs"):
        resolve("tiny", runs[2].set_args())
    paths = []
    for name in ("tight", "loose"):
        with ShardWriter(tmp_path / name, 4, "png") as w:
            w.write(np.zeros((16, 16, 3), np.uint8), f"a {name} caption", {})
        paths.append(str(w.paths[0]))
    data = [f"data.sources=[{{shards: {paths[0]}, weight: 1}}, {{shards: {paths[1]}, weight: 1}}]",
            "data.source=webdataset", "data.hard_negative_group=1"]
    assert resolve("tiny", data + runs[2].set_args()).data.sampling == "per_source"


def test_tab9f_without_sources_is_refused_before_any_run(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["sweep", "--preset", "micro", "--table", "9f", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "data.sampling per_source needs data.source webdataset" in err and len(err.splitlines()) == 1, err
    assert not (out / "runs").exists()


def test_parallelism_and_train_command(tmp_path):
    assert plan_parallelism(16, None, None) == (16, 1)
    assert plan_parallelism(16, None, 4) == (4, 4)
    assert plan_parallelism(16, 2, None) == (2, 8)
    assert plan_parallelism(2, None, 4) == (1, 4)
    grid = {"objective.lambda1": [0.3]}
    opts = SweepOptions(preset="micro", out=tmp_path, grid=grid, overrides=["train.steps=4"])
    run = expand(grid)[0]
    cmd = train_command(opts, run, threads=3, resume=True)
    assert cmd[1:4] == ["-m", "nclip", "train"]
    assert cmd[-6:] == ["--set", "objective.lambda1=0.3", "--set", "train.threads=3", "--resume", "auto"]
    assert "--resume" not in train_command(opts, run, threads=3, resume=False)


# ---------------------------------------------------------------------------------------------
# verdicts from metrics.jsonl
# ---------------------------------------------------------------------------------------------


def _cfg(lambda1=0.0, lambda2=1.0):
    from nclip.config import resolve

    return resolve("micro", [f"objective.lambda1={lambda1}", f"objective.lambda2={lambda2}"])


def test_judge_uniform_collapse_diverged_and_healthy():
    k = _cfg().model.nclip_dim
    ln_k = math.log(k)
    uniform = [{"step": s, "loss": 0.0, "nclip/L_EH": ln_k - 1e-4, "nclip/L_HE": ln_k - 1e-5,
                "nclip/L_KL": 1e-5, "nclip/row_std": 1e-7, "nclip/col_std": 1e-7, "nclip/usage": 0.5}
               for s in range(1, 9)]
    v = judge(uniform, _cfg())
    assert v["verdict"] == "uniform" and v["collapse"] == ["uniform"]
    assert v["final"]["L_EH"] == pytest.approx(ln_k - 1e-4)

    healthy = [dict(r, **{"nclip/L_EH": 1.0, "nclip/L_HE": ln_k - 0.1, "nclip/L_KL": 0.5, "nclip/row_std": 0.02})
               for r in uniform]
    assert judge(healthy, _cfg(0.5, 1.5))["verdict"] == "ok"

    diverged = healthy[:-1] + [dict(healthy[-1], loss=float("nan"), **{"nclip/L_KL": float("nan")})]
    assert judge(diverged, _cfg())["verdict"] == "diverged"
    assert judge(healthy, _cfg(),
                 stderr="nclip: error: 10 steps in a row had a non-finite loss")["verdict"] == "diverged"
    assert judge([], _cfg())["verdict"] == "ok"
    assert judge([{"step": 1, "loss": 1.0, "clip/loss": 1.0}], _cfg())["final"] == {"step": 1, "loss": 1.0}


# ---------------------------------------------------------------------------------------------
# end to end: real `nclip train` processes on the micro preset
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def micro_sweep(tmp_path_factory):
    """A 2-run λ1 sweep and, alongside it in a thread, a 1-run sweep whose run fails."""
    import threading

    root = tmp_path_factory.mktemp("sweep")
    bad = {}

    def failing():
        bad["code"] = main(["sweep", "--preset", "micro", "--out", str(root / "bad"), "--grid", "data.source=[csv]",
                            *_sets(MICRO + ["data.csv=/nonexistent/pairs.csv"]), *PROBE])

    thread = threading.Thread(target=failing)
    thread.start()
    out = root / "good"
    code = main(["sweep", "--preset", "micro", "--out", str(out), "--grid", "objective.lambda1=[0.3,0.5]",
                 "--parallel", "2", *_sets(MICRO), *PROBE])
    thread.join(timeout=300)
    return {"out": out, "code": code, "bad": root / "bad", "bad_code": bad.get("code")}


@pytest.mark.slow
def test_micro_sweep_end_to_end(micro_sweep, capsys):
    out = micro_sweep["out"]
    assert micro_sweep["code"] == 0
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["grid"] == {"objective.lambda1": [0.3, 0.5]} and doc["preset"] == "micro"
    assert [r["slug"] for r in doc["runs"]] == ["lambda1-0.3", "lambda1-0.5"]
    assert [r["status"] for r in doc["runs"]] == ["done", "done"]
    assert doc["parallel"] == 2 and doc["threads_per_run"] >= 1
    for slug in ("lambda1-0.3", "lambda1-0.5"):
        rd = out / "runs" / slug
        assert (rd / "model" / "model.safetensors").is_file() and (rd / "eval.json").is_file()
        probe = json.loads((rd / "probe.json").read_text())
        assert 0 <= probe["linear/top1"] <= 1 and probe["dataset"] == "synthetic-shape"
        assert probe["train_samples"] == 40 and probe["test_samples"] == 30
        assert f"  name: xclip\n  lambda1: {slug.split('-')[1]}\n" in (rd / "config.yaml").read_text()

    md = (out / "table.md").read_text()
    assert "| λ1 | ZS | LN | L_KL | L_EH | L_HE | status |" in md
    rows = list(csv.DictReader(open(out / "table.csv")))
    assert [r["objective.lambda1"] for r in rows] == ["0.3", "0.5"]
    for r in rows:
        ev = json.loads((out / "runs" / r["slug"] / "eval.json").read_text())
        assert float(r["zs_top1"]) == pytest.approx(100 * ev["zeroshot/shape/top1"], abs=1e-3)
        assert f"| {float(r['zs_top1']):.1f} |" in md
        assert math.isfinite(float(r["L_KL"])) and r["status"] == "ok"
    assert (out / "curves.png").stat().st_size > 10_000


@pytest.mark.slow
def test_resume_skips_finished_runs(micro_sweep, capsys):
    out = micro_sweep["out"]
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("runs/*/metrics.jsonl")}
    assert main(["sweep", "--preset", "micro", "--out", str(out), "--grid", "objective.lambda1=[0.3,0.5]",
                 "--resume", *_sets(MICRO), *PROBE]) == 0
    assert "(2 finished, skipped)" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    doc = json.loads((out / "sweep.json").read_text())
    assert [r["attempts"] for r in doc["runs"]] == [1, 1] and doc["resumed"]
    # without --resume an existing sweep is refused; a changed grid point is refused on resume
    assert main(["sweep", "--preset", "micro", "--out", str(out), "--grid", "objective.lambda1=[0.3]",
                 *_sets(MICRO)]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert main(["sweep", "--preset", "micro", "--out", str(out), "--grid", "objective.lambda1=[0.3]",
                 "--resume", *_sets(MICRO[1:])]) == 2
    assert "resume it with the same options" in capsys.readouterr().err


@pytest.mark.slow
def test_failed_run_is_recorded_and_the_sweep_completes(micro_sweep):
    bad = micro_sweep["bad"]
    assert micro_sweep["bad_code"] == 0  # a failed run does not fail the sweep
    run = json.loads((bad / "sweep.json").read_text())["runs"][0]
    assert run["status"] == "failed" and run["stage"] == "train" and run["returncode"] == 2
    error = (bad / "runs" / run["slug"] / "error.txt").read_text()
    assert "train exited with status 2" in error and "/nonexistent/pairs.csv" in error
    assert "| csv | failed | failed |" in (bad / "table.md").read_text()
    row = next(csv.DictReader(open(bad / "table.csv")))
    assert row["status"] == "failed" and row["zs_top1"] == "NaN"
    assert (bad / "curves.png").is_file()
