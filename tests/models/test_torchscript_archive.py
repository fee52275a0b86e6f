"""A hostile or damaged TorchScript archive is one line through nclip.load, never a RecursionError or a
MemoryError: its module tree's depth, each record's inflated size and the records' total are bounded
before anything is read (tests/models/test_openclip_import.py reads real archives torch wrote)."""

import struct
import zipfile

import pytest

import nclip
from nclip.errors import NclipError
from nclip.models import torchscript_archive


def _text(s: str) -> bytes:
    """A pickle BINUNICODE string."""
    return b"X" + struct.pack("<I", len(s.encode())) + s.encode()


def _module(key: str, value: bytes) -> bytes:
    """Pickle opcodes of a ``__torch__`` module object whose state is {key: value}, as TorchScript writes."""
    return b"c__torch__.M\nM\n)\x81}" + _text(key) + value + b"sb"


def _float_tensor(numel: int) -> bytes:
    """_rebuild_tensor_v2(storage ("storage", FloatStorage, "0", "cpu", numel), 0, (numel,), (1,))."""
    storage = b"(" + _text("storage") + b"ctorch\nFloatStorage\n" + _text("0") + _text("cpu") + \
        b"J" + struct.pack("<i", numel) + b"tQ"
    return b"ctorch._utils\n_rebuild_tensor_v2\n(" + storage + b"K\x00J" + struct.pack("<i", numel) + \
        b"\x85K\x01\x85\x89)tR"


def _archive(path, pickled: bytes, record: bytes | None = None, compression=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compression=compression) as zf:
        zf.writestr("m/data.pkl", b"\x80\x02" + pickled + b".")
        zf.writestr("m/code/__torch__/m.py", "")
        if record is not None:
            zf.writestr("m/data/0", record)
    return path


def _one_line(path, *words):
    with pytest.raises(NclipError) as e:
        nclip.load(path, device="cpu")
    message = str(e.value)
    assert "\n" not in message and f"{path}: cannot read it as a TorchScript archive" in message, message
    for word in words:
        assert word in message, message


def test_a_well_formed_archive_reads(tmp_path):
    values = struct.pack("<4f", 1, 2, 3, 4)
    path = _archive(tmp_path / "ok.pt", _module("visual", _module("weight", _float_tensor(4))), values)
    assert torchscript_archive.is_torchscript(path)
    tensors = torchscript_archive.read_tensors(path)
    assert list(tensors) == ["visual.weight"] and tensors["visual.weight"].tolist() == [1, 2, 3, 4]


def test_a_module_tree_5000_deep_is_one_line(tmp_path):
    """It was a RecursionError: the tree is walked with a stack of its own, to MAX_DEPTH."""
    depth = 5000
    # _module("sub", _module("sub", ...)) written flat: the opcodes of 5000 levels, then 5000 closings
    pickled = (b"c__torch__.M\nM\n)\x81}" + _text("sub")) * depth + b"N" + b"sb" * depth
    _one_line(_archive(tmp_path / "deep.pt", pickled), "module tree is more than 100 modules deep")


def test_a_compressed_record_that_would_inflate_to_gigabytes_is_refused_unread(tmp_path, monkeypatch):
    """The tensor holds 4 values; its record inflates to 64 MiB (6 GiB in the wild: a MemoryError).
    Refused from the zip's directory, before one byte is inflated."""
    path = _archive(tmp_path / "bomb.pt", _module("weight", _float_tensor(4)), bytes(64 << 20), zipfile.ZIP_DEFLATED)
    assert path.stat().st_size < 1 << 20

    open_member = zipfile.ZipFile.open

    def never_the_record(self, name, *args, **kwargs):
        assert getattr(name, "filename", name) != "m/data/0", "the record was opened"
        return open_member(self, name, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", never_the_record)  # ZipFile.read opens through it too
    with pytest.raises(NclipError, match="record data/0 inflates to 67,108,864 bytes, where its 4 values take 16"):
        torchscript_archive.read_tensors(path)


def test_a_record_shorter_than_its_tensor_and_tensors_beyond_memory_are_one_line(tmp_path, monkeypatch):
    short = _archive(tmp_path / "short.pt", _module("weight", _float_tensor(4)), bytes(8))
    _one_line(short, "record data/0 inflates to 8 bytes, where its 4 values take 16")
    big = _archive(tmp_path / "big.pt", _module("weight", _float_tensor(1 << 18)), bytes(1 << 20))
    assert torchscript_archive.read_tensors(big)["weight"].numel() == 1 << 18
    monkeypatch.setattr(torchscript_archive, "machine_memory", lambda: (1 << 19, "a test's"))
    _one_line(big, "its tensors take more than this machine's memory (record data/0, 1,048,576 bytes)")
