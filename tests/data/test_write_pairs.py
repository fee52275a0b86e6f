"""nclip.data.tools.write_pairs: a built-in dataset written as a user's own data (PNG files, a JSONL and a
CSV of the same rows with several captions and hard negatives), read back by the training source as
written, and an existing folder refused."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from PIL import Image

from nclip.config import resolve
from nclip.data.csv_source import CsvTrainPairs
from nclip.data.synthetic import SyntheticScenes
from nclip.data.tools import write_pairs
from nclip.errors import NclipError


def test_scenes_are_written_with_their_captions_and_their_groups_captions_as_negatives(tmp_path):
    scenes = SyntheticScenes("val", 12, image_size=24, hard_negative_group=4)
    jsonl, table = write_pairs(scenes, tmp_path / "pairs")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    with table.open(newline="") as f:
        cells = list(csv.DictReader(f))
    assert len(rows) == len(cells) == 12
    for i, (row, cell) in enumerate(zip(rows, cells)):
        sample = scenes[i]
        assert row["captions"] == list(sample.captions) and cell["captions"] == "|".join(sample.captions)
        assert np.array_equal(np.asarray(Image.open(jsonl.parent / row["filepath"])), sample.image)
        group = [scenes[j] for j in range(i - i % 4, i - i % 4 + 4)]
        others = [s.captions[0] for s in group if sorted(s.mask_classes) != sorted(sample.mask_classes)]
        assert row["negatives"] == (others or "") and cell["negatives"] == "|".join(others)
        assert not set(others) & set(sample.captions)
    assert sum(len(r["negatives"]) for r in rows) > 12  # most scenes have three siblings of other shapes


def test_the_training_source_reads_both_tables_as_written(tmp_path):
    jsonl, table = write_pairs(SyntheticScenes("train", 8, image_size=24, hard_negative_group=2), tmp_path / "d")
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    for path, extra in ((jsonl, []), (table, ['data.caption_separator="|"'])):
        cfg = resolve("micro", ["data.source=csv", f"data.csv={path}", "data.csv_caption_key=captions",
                                "data.hard_negative_key=negatives", "objective.name=clip", *extra])
        data = CsvTrainPairs(cfg, raw=True)
        assert data.caption_sets == [tuple(r["captions"]) for r in rows]
        assert data.negative_sets == [tuple(r["negatives"]) for r in rows]
        assert all(np.array_equal(data[i][0], np.asarray(Image.open(path.parent / rows[i]["filepath"])))
                   for i in range(8))


def test_digits_have_no_negatives_column_and_a_used_folder_is_refused(tmp_path):
    from nclip.data.digits import DigitsPairs

    jsonl, _ = write_pairs(DigitsPairs("test", seed=0, image_size=8), tmp_path / "digits")
    assert set(json.loads(jsonl.read_text().splitlines()[0])) == {"filepath", "captions"}
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    with pytest.raises(NclipError, match="used already exists and is not an empty folder"):
        write_pairs(SyntheticScenes("val", 2), tmp_path / "used")
    assert (tmp_path / "used" / "notes.txt").read_text() == "mine"
    with pytest.raises(NclipError, match="the dataset is empty"):
        write_pairs(SyntheticScenes("val", 0), tmp_path / "empty")
