"""No source file over 500 lines (docs/design.md, house style: small modules with one job)."""

from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
LIMIT = 500


def long_files(root: Path = SRC) -> dict[str, int]:
    """{path under ``root``: lines} of the Python files over :data:`LIMIT` lines."""
    lines = {str(p.relative_to(root)): len(p.read_text(encoding="utf-8").splitlines())
             for p in (root / "nclip").rglob("*.py")}
    return {path: n for path, n in lines.items() if n > LIMIT}


def test_long_files_are_found(tmp_path):
    (tmp_path / "nclip" / "sub").mkdir(parents=True)
    (tmp_path / "nclip" / "sub" / "long.py").write_text("x = 1\n" * (LIMIT + 1))
    (tmp_path / "nclip" / "short.py").write_text("x = 1\n" * LIMIT)
    assert long_files(tmp_path) == {"nclip/sub/long.py": LIMIT + 1}


def test_no_source_file_over_500_lines():
    found = long_files()
    assert not found, f"over {LIMIT} lines: {found}"
