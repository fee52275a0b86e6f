"""Source strings of ``nclip data dedup``: folders, CSV files, shards and built-in data, by identifier."""

import numpy as np
import pytest
from PIL import Image

from nclip.config import resolve
from nclip.data.image_sources import open_source
from nclip.data.shards import ShardWriter
from nclip.errors import NclipError


def _config(name):
    cfg = resolve("tiny")
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"source": name})})


def _image(v: int) -> np.ndarray:
    return np.full((20, 30, 3), v, np.uint8)


def test_folder_is_recursive_and_sorted(tmp_path):
    (tmp_path / "b").mkdir()
    Image.fromarray(_image(10)).save(tmp_path / "b" / "x.png")
    Image.fromarray(_image(20)).save(tmp_path / "a.jpg")
    (tmp_path / "notes.txt").write_text("not an image")
    src = open_source(str(tmp_path), _config)
    items = list(src)
    assert src.kind == "folder" and [k for k, _ in items] == [str(tmp_path / "a.jpg"), str(tmp_path / "b" / "x.png")]
    assert items[1][1]().size == (30, 20)


def test_shards_by_key_and_bad_samples(tmp_path):
    with ShardWriter(tmp_path / "shards", shard_size=2, image_format="png") as w:
        keys = [w.write(_image(v), f"caption {v}") for v in (0, 50, 100)]
    src = open_source(str(tmp_path / "shards"), _config)
    items = list(src)
    assert src.kind == "webdataset" and [k for k, _ in items] == keys
    assert np.asarray(items[2][1]())[0, 0, 0] == 100
    assert set(src.open_many({keys[1]})) == {keys[1]}
    pattern = open_source(str(tmp_path / "shards" / "{00000..00001}.tar"), _config)
    assert [k for k, _ in pattern] == keys


def test_csv_paths_resolved_against_the_file(tmp_path):
    Image.fromarray(_image(5)).save(tmp_path / "a.png")
    (tmp_path / "pairs.tsv").write_text("path\tcaption\na.png\tgrey\n")
    src = open_source(str(tmp_path / "pairs.tsv"), _config, csv_image_key="path")
    assert src.kind == "csv" and [k for k, _ in src] == [str(tmp_path / "a.png")]
    with pytest.raises(NclipError, match="no column 'filepath'"):
        open_source(str(tmp_path / "pairs.tsv"), _config)


def test_builtin_split_and_count():
    src = open_source("digits:test:3", _config)
    items = list(src)
    assert [k for k, _ in items] == ["digits:test:0", "digits:test:1", "digits:test:2"]
    assert items[0][1]().mode == "RGB"
    assert len(list(open_source("synthetic:val:2", _config))) == 2


@pytest.mark.parametrize("spec, needle", [
    ("digits:dev", "split"), ("digits:test:0", "positive integer"), ("/no/such/dir", "not found"),
])
def test_bad_specs(spec, needle):
    with pytest.raises(NclipError, match=needle):
        open_source(spec, _config)


def test_a_single_image_is_not_a_source(tmp_path):
    Image.fromarray(_image(1)).save(tmp_path / "a.png")
    with pytest.raises(NclipError, match="not a data source"):
        open_source(str(tmp_path / "a.png"), _config)
