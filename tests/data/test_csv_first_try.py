"""Training on one's own CSV with a synthetic-scene preset works at the first try (issue 36.5): the
preset's hard-negative groups give way to the user's source and the start-up block says so; a
missing column names the --set that fixes it."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from nclip.cli import main
from nclip.config import resolve

from conftest import micro_sizes


def _pairs(tmp_path, header="filepath,title") -> str:
    rows = []
    for i in range(8):
        Image.fromarray(np.full((20, 20, 3), 30 * i, np.uint8)).save(tmp_path / f"{i}.png")
        rows.append(f"{i}.png,a grey square number {i}")
    (tmp_path / "pairs.csv").write_text(header + "\n" + "\n".join(rows) + "\n")
    return str(tmp_path / "pairs.csv")


def test_the_presets_hard_negative_groups_give_way_to_a_csv(tmp_path):
    csv = _pairs(tmp_path)
    assert resolve("tiny", []).data.hard_negative_group == 4
    assert resolve("tiny", ["data.source=csv", f"data.csv={csv}"]).data.hard_negative_group == 1
    with pytest.raises(Exception, match="needs data.source synthetic"):  # one the user gave is still checked
        resolve("tiny", ["data.source=csv", f"data.csv={csv}", "data.hard_negative_group=4"])


@pytest.mark.slow
def test_a_first_try_on_ones_own_csv_trains_and_says_what_gave_way(tmp_path, capsys):
    csv = _pairs(tmp_path)
    sets = [x for o in [*micro_sizes(), "data.source=csv", f"data.csv={csv}", "train.steps=1", "train.batch_size=8"]
            for x in ("--set", o)]
    assert main(["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "--no-progress", "--no-eval", *sets]) == 0
    err = capsys.readouterr().err
    assert f"csv {csv}, 8 samples" in err and "(the preset's synthetic-scene data.hard_negative_group 4 -> 1 for csv)" \
        in err, err


def test_a_missing_csv_column_names_the_set_that_fixes_it(tmp_path, capsys):
    csv = _pairs(tmp_path, header="image,caption")
    assert main(["train", "--preset", "micro", "--out", str(tmp_path / "run"), "--set", "data.source=csv",
                 "--set", f"data.csv={csv}", "--no-progress", "--no-eval"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"nclip: error: {csv}: no column 'filepath' (data.csv_image_key); columns: image, caption; "
                   "name yours with --set data.csv_image_key=COLUMN"), err
