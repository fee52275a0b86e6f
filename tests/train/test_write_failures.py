"""A write that fails (a full disk) is one line that names the path and says what is kept, exit
status 2, no traceback; the checkpoint stays atomic and the run resumes (issue 28.3)."""

from __future__ import annotations

import errno
import os

import pytest

from nclip.cli import main
from nclip.train.checkpoint import list_checkpoints

from conftest import MICRO_OVERRIDES

SETS = [x for o in MICRO_OVERRIDES for x in ("--set", o)]  # 6 steps, checkpoints at 3 and 6, logs at 2, 4, 6
FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _train(run, *extra) -> list[str]:
    return ["train", "--preset", "micro", "--out", str(run), "--no-progress", "--no-eval", *SETS, *extra]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("nclip:")]
    assert len(lines) == 1, err
    return lines[0]


def _fail_on_call(n: int, real, error: Exception):
    calls = []

    def patched(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise error
        return real(*args, **kwargs)

    return patched


@pytest.mark.slow
@pytest.mark.parametrize("target, error", [
    ("save_file", FULL),  # safetensors' write
    ("torch.save", RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing "
                                "file data/0: file write failed")),
], ids=["ENOSPC in model.safetensors", "torch.save's stream writer"])
def test_a_full_disk_at_a_checkpoint_is_one_line_and_the_last_good_checkpoint_is_kept(
        target, error, tmp_path, monkeypatch, capsys):
    import nclip.train.checkpoint as checkpoint

    run = tmp_path / "R"
    if target == "save_file":
        monkeypatch.setattr(checkpoint, "save_file", _fail_on_call(2, checkpoint.save_file, error))
    else:
        monkeypatch.setattr(checkpoint.torch, "save", _fail_on_call(2, checkpoint.torch.save, error))
    assert main(_train(run)) == 2
    line = _one_line(capsys)
    step3, step6 = run / "checkpoints" / "step_00000003", run / "checkpoints" / "step_00000006"
    assert line.startswith(f"nclip: error: cannot write {step6}: "), line
    assert f"the last good checkpoint, {step3}, is kept" in line and f"nclip train --out {run} --resume auto" in line
    if target == "save_file":
        assert "No space left on device" in line
    # atomic: the failed checkpoint left nothing, not even its temporary
    assert list_checkpoints(run) == [step3] and sorted(p.name for p in (run / "checkpoints").iterdir()) == [step3.name]
    monkeypatch.undo()
    assert main(["train", "--out", str(run), "--resume", "auto", "--no-progress", "--no-eval"]) == 0
    assert list_checkpoints(run)[-1] == step6


@pytest.mark.slow
def test_a_full_disk_at_a_metrics_row_is_one_line(tmp_path, monkeypatch, capsys):
    import nclip.train.logbook as logbook

    class FullAfterOneRow:
        def __init__(self, fh):
            self.fh, self.name, self.rows = fh, fh.name, 0

        def write(self, text):
            self.rows += 1
            if self.rows > 2:  # rows at steps 2 and 4 fit; the disk fills at step 6
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.fh.write(text)

        def flush(self):
            self.fh.flush()

        def close(self):
            self.fh.close()

    init = logbook.Log.__init__

    def patched(self, *args):
        init(self, *args)
        self.file = FullAfterOneRow(self.file) if self.file is not None else None

    monkeypatch.setattr(logbook.Log, "__init__", patched)
    run = tmp_path / "R"
    assert main(_train(run)) == 2
    line = _one_line(capsys)
    assert line.startswith(f"nclip: error: cannot write {run / 'metrics.jsonl'}: No space left on device; ")
    assert f"the last good checkpoint, {run / 'checkpoints' / 'step_00000003'}, is kept" in line


@pytest.mark.slow
def test_a_failed_tensorboard_write_is_one_line(tmp_path, monkeypatch, capsys):
    """Issue 36.1: TensorBoard's writer re-raises its thread's failed write at the next scalar."""
    import importlib.util
    from pathlib import Path

    import nclip.train.report_to as report_to

    real = importlib.util.find_spec  # the config asks whether the optional package is installed
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: real("json") if name == "tensorboard" else real(name, *a))

    class FullDisk:
        def add_scalar(self, *args):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def flush(self):
            pass

        def close(self):
            pass

    def writer_on_a_full_disk(self, run_dir):
        self.folder, self.writer = Path(run_dir) / report_to.TENSORBOARD, FullDisk()

    monkeypatch.setattr(report_to.TensorBoardReporter, "__init__", writer_on_a_full_disk)
    run = tmp_path / "R"
    assert main(_train(run, "--set", "train.tensorboard=true")) == 2
    line = _one_line(capsys)
    assert line.startswith(f"nclip: error: cannot write {run / 'tensorboard'}: No space left on device"), line


def test_an_atomic_text_write_that_fails_keeps_the_old_file_and_is_one_line(tmp_path, monkeypatch):
    from pathlib import Path

    from nclip.jsonio import WriteFailed, write_text_atomic

    path = tmp_path / "results.json"
    write_text_atomic(path, "old")

    def half_then_full(self, text, **kwargs):
        real_write(self, text[: len(text) // 2], **kwargs)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real_write = Path.write_text
    monkeypatch.setattr(Path, "write_text", half_then_full)
    with pytest.raises(WriteFailed, match=f"^cannot write {path}: No space left on device$"):
        write_text_atomic(path, "a new document")
    monkeypatch.undo()
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_a_full_disk_in_an_export_is_one_line(tmp_path, monkeypatch, capsys):
    import nclip.models.export_transformers as export
    from nclip.config import resolve
    from nclip.models import build_model
    from nclip.models.io import save_model

    from conftest import micro_sizes

    cfg = resolve("micro", micro_sizes())
    model = save_model(build_model(cfg, pretrained_text=False), cfg, tmp_path / "model")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(export, "save_tokenizer", full)
    assert main(["export", "--checkpoint", str(model), "--hf", str(tmp_path / "hf")]) == 2
    assert _one_line(capsys) == f"nclip: error: cannot write {tmp_path / 'hf'}: No space left on device"
