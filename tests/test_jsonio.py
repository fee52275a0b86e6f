"""nclip.jsonio: the one JSONL reader and truncation (damaged lines are skipped, never an error)."""

import json
import math

from nclip.jsonio import read_jsonl, truncate_jsonl

ROWS = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": float("nan")}, {"step": 3, "loss": 1.5}]


def _log(path, rows, tail: bytes = b""):
    path.write_bytes("".join(json.dumps(r) + "\n" for r in rows).encode() + tail)
    return path


def test_read_jsonl_skips_a_torn_last_line_and_blank_lines(tmp_path):
    path = _log(tmp_path / "metrics.jsonl", ROWS, tail=b'{"step": 4, "lo')  # killed mid-write
    rows = read_jsonl(path)
    assert [r["step"] for r in rows] == [1, 2, 3] and math.isnan(rows[1]["loss"])
    path.write_bytes(b'\n{"step": 1}\n   \n\r\n{"step": 2}\r\n\n')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]


def test_read_jsonl_skips_non_objects_and_non_utf8_lines_anywhere(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'[1, 2]\n"text"\n3\nnull\n{"step": 1}\n\xff\xfe{"step": 9}\nnot json\n{"step": 2}\n')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    assert read_jsonl(str(path)) == [{"step": 1}, {"step": 2}]  # a str path as well


def test_read_jsonl_of_a_missing_file_is_empty(tmp_path):
    assert read_jsonl(tmp_path / "nope.jsonl") == []


def test_truncate_jsonl_keeps_rows_verbatim_and_drops_torn_lines(tmp_path):
    # the trainer on resume from step 2: keep what was logged up to the checkpoint
    path = _log(tmp_path / "metrics.jsonl", ROWS + [{"note": "no step"}], tail=b'{"step": 4, "lo')
    before = path.read_bytes().splitlines()
    truncate_jsonl(path, lambda row: row.get("step", math.inf) <= 2)
    assert path.read_bytes().splitlines() == before[:2]  # byte for byte, NaN included
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left

    # the episodic driver on resume from episode 1: keep the finished episodes before it
    episodes = _log(tmp_path / "episodes.jsonl", [{"episode": 0}, {"episode": 1}], tail=b"\xff\n\n")
    truncate_jsonl(episodes, lambda row: row.get("episode", math.inf) < 1)
    assert episodes.read_text() == '{"episode": 0}\n'
    truncate_jsonl(episodes, lambda row: False)
    assert episodes.read_text() == ""


def test_truncate_jsonl_leaves_a_missing_file_missing(tmp_path):
    truncate_jsonl(tmp_path / "nope.jsonl", lambda row: True)
    assert not (tmp_path / "nope.jsonl").exists()


def test_a_yaml_mistake_names_its_line_and_column(tmp_path):
    """Issue 28.11: a preset file, a sweep grid file or a run's config.yaml with a YAML mistake is one
    line that says where it is."""
    import pytest

    from nclip.cli import main
    from nclip.config import load_preset
    from nclip.errors import NclipError
    from nclip.jsonio import parse_yaml
    from nclip.sweep.grid import load_grid_file

    text = "train:\n  steps: 10\n  lr: [0.1\n"  # the flow sequence is never closed
    with pytest.raises(NclipError, match=r"cannot parse x\.yaml: expected .* but got .* \(line 4, column 1\)"):
        parse_yaml("x.yaml", text)
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: 10\n   lr: 0.1\n")  # lr indented under steps
    with pytest.raises(NclipError, match=r"bad\.yaml: mapping values are not allowed here \(line 3, column 6\)"):
        load_preset(str(bad))
    with pytest.raises(NclipError, match=r"\(line 3, column 6\)"):
        load_grid_file(bad)
    assert main(["config", "--preset", str(bad)]) == 2
