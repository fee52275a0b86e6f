"""nclip bench: the command runs every row at --quick size and writes the JSON the issue asks for."""

from __future__ import annotations

import json
import math

import pytest

from nclip.bench.runner import Report, Sizes
from nclip.cli import main


def test_an_unknown_comparison_is_one_line_and_exit_2(capsys):
    assert main(["bench", "--compare", "timm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--compare" in err[0]


def test_quick_sizes_are_smaller_than_the_cpu_defaults():
    quick, cpu = Sizes.pick(quick=True, cuda=False), Sizes.pick(quick=False, cuda=False)
    assert quick.kmeans[0] < cpu.kmeans[0] < Sizes.pick(quick=False, cuda=True).kmeans[0] == 200_000
    assert quick.loop_window_s < cpu.loop_window_s


def test_the_table_has_one_line_per_row():
    rep = Report()
    rep.add("a", 1.5, "x")
    rep.add("longer row", 12345678.0)
    lines = rep.table().splitlines()
    assert len(lines) == 3 and "1.23e+07" in lines[2]


@pytest.mark.slow
def test_quick_bench_writes_positive_finite_ratios(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--json", str(out), "--compare", "open_clip"]) == 0
    doc = json.loads(out.read_text())
    for key in ("trainer_over_hand_loop", "xclip_over_clip_time", "xclip_over_clip_memory", "mfu"):
        assert isinstance(doc[key], float) and math.isfinite(doc[key]) and doc[key] > 0, key
    assert doc["device"].startswith("cpu")
    assert all(math.isfinite(r["value"]) and r["value"] > 0 for r in doc["rows"])
    printed = capsys.readouterr()
    assert "trainer / hand loop speed" in printed.out
    if doc["open_clip"] is None:  # not installed here: one line says it is skipped
        assert "open_clip skipped" in printed.err
