"""train.report_to: [tensorboard, wandb] (train.tensorboard: true its older spelling), W&B offline
with the same scalars as metrics.jsonl at the same steps and the run's config, a missing package
as one line before training; and RUN/curves.png, labelled, beside metrics.jsonl. Neither changes
what the run computes."""

from __future__ import annotations

import importlib.util
import json
import struct

import pytest

from nclip.cli import main
from nclip.config import resolve, to_yaml, validate
from nclip.train.logbook import WALL_CLOCK

from conftest import micro_sizes

OVERRIDES = micro_sizes() + ["train.steps=4", "train.batch_size=8", "train.warmup_steps=1", "train.log_every=2",
                             "train.checkpoint_every=4", "train.threads=1", "data.train_length=64",
                             "train.eval_every=4", "train.eval_samples=16"]


@pytest.fixture(autouse=True)
def _fresh_wandb():
    """W&B reads its environment once per process (wandb.setup): each test starts it afresh."""
    yield
    import sys

    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()


def _train(out, *extra):
    args = ["train", "--preset", "micro", "--out", str(out), "--no-progress", "--no-eval"]
    return main(args + [x for o in OVERRIDES + list(extra) for x in ("--set", o)])


def _rows(out):
    return [{k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def wandb_records(path) -> list:
    """The protobuf records of an offline W&B run file (run-<id>.wandb): W&B's write-ahead log, in
    LevelDB's log format (a 7-byte file header, 32 KiB blocks of chunks with a 7-byte header: crc,
    length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, records, chunk = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the padding at a block's end
            pos += left
            continue
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def test_tensorboard_true_is_report_to_tensorboard(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # as if tensorboard were installed
                        lambda name, *a: object() if name == "tensorboard" else real(name, *a))
    old = resolve("micro", ["train.tensorboard=true"]).train
    new = resolve("micro", ["train.report_to=[tensorboard]"]).train
    assert old.report_to == new.report_to == ["tensorboard"] and old.tensorboard and new.tensorboard
    both = resolve("micro", ["train.report_to=[wandb, tensorboard, wandb]", "train.tensorboard=true"])
    assert both.train.report_to == ["wandb", "tensorboard"]
    assert validate(both.model_dump(mode="json")) == both  # a resumed run's config.yaml reads back the same
    assert resolve("micro").train.report_to == [] and not resolve("micro").train.tensorboard
    assert "report_to" in to_yaml(both)


@pytest.mark.parametrize("setting, package", [("train.report_to=[wandb]", "wandb"),
                                              ("train.report_to=[tensorboard]", "tensorboard")])
def test_a_missing_package_is_one_line_before_training(monkeypatch, tmp_path, capsys, setting, package):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    assert main(["train", "--preset", "micro", "--out", str(tmp_path / "r"), "--set", setting]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    extra = "nclip[tensorboard]" if package == "tensorboard" else "'nclip[wandb]'"
    assert "train." in err and f"pip install {extra}" in err
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_report_to_unknown_is_one_line(tmp_path, capsys):
    assert main(["train", "--preset", "micro", "--out", str(tmp_path / "r"), "--set", "train.report_to=[mlflow]"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.report_to" in err, err


@pytest.mark.slow
def test_wandb_offline_logs_metrics_jsonl_and_the_run_changes_nothing(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from nclip.train import logbook

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-elsewhere"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    reported = tmp_path / "reported"
    assert _train(reported, "train.report_to=[wandb]") == 0
    with monkeypatch.context() as m:  # the same run without W&B and without curves.png
        m.setattr(logbook, "CurvesPng", lambda *a, **k: None)
        assert _train(tmp_path / "plain") == 0
    rows = _rows(reported)
    assert rows == _rows(tmp_path / "plain")  # every logged number, bit for bit
    assert not (tmp_path / "plain" / "curves.png").exists() and not (tmp_path / "plain" / "wandb").exists()

    [run_file] = list((reported / "wandb").glob("offline-run-*/run-*.wandb"))  # W&B's dir is the run directory
    records = wandb_records(run_file)
    history = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    assert [h["_step"] for h in history] == [r["step"] for r in rows] == [2, 4]
    for h, row in zip(history, rows):
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                assert h[key] == value, key
    assert "eval/zeroshot/synthetic-shape/top1" in history[-1]
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    saved = json.loads(json.dumps(validate(json.loads(json.dumps(config_yaml(reported)))).model_dump(mode="json")))
    assert config["train"] == saved["train"] and config["objective"] == saved["objective"]
    assert run.run_id == (reported / "wandb" / "nclip-run-id").read_text().strip()


def config_yaml(run_dir) -> dict:
    from nclip.jsonio import parse_yaml, read_text

    return parse_yaml(*read_text(run_dir / "config.yaml", "config.yaml"))


@pytest.mark.slow
def test_curves_png_is_written_beside_metrics_jsonl(tmp_path):
    from PIL import Image

    out = tmp_path / "run"
    assert _train(out) == 0
    png = out / "curves.png"
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] > 400
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_curves_panels_are_labelled_losses_and_evaluations():
    from nclip.eval.figures import curves_plot
    from nclip.train.curves_png import panels_to_draw

    rows = [{"step": s, "lr": 1e-3, "loss": 1.0 / s, "clip/loss": 2.0 / s, "clip/acc_i2t": 0.1 * s,
             "nclip/L_CE": 5.0, "nclip/L_EH": 4.0 + s, "nclip/usage": 0.5, "grad_norm": 1.0, "samples_per_s": 100.0,
             "data/skipped": 0} for s in (1, 2, 3, 4)]
    rows[1].update({"eval/zeroshot/synthetic-shape/top1": 0.2, "eval/zeroshot/synthetic-colour/top1": 0.3,
                    "eval/retrieval/synthetic/i2t@1": 0.1, "eval/retrieval/synthetic/mean_recall": 0.15, "eval_s": 1.5})
    rows[3].update({"eval/zeroshot/synthetic-shape/top1": 0.4, "eval/zeroshot/synthetic-colour/top1": 0.5,
                    "eval/retrieval/synthetic/i2t@1": 0.2, "eval/retrieval/synthetic/mean_recall": 0.25, "eval_s": 1.5})
    panels = panels_to_draw(rows)
    fig = curves_plot(rows, panels)
    drawn = {ax.get_title(): ax for ax in fig.axes if ax.axison}
    assert set(drawn) == {"total loss", "InfoNCE (CLIP head)", "nCLIP terms",
                          "eval while training: zero-shot top-1", "eval while training: retrieval recall@k"}
    for title, ax in drawn.items():
        assert ax.get_xlabel() == "step (optimizer steps)" and ax.get_ylabel(), title
        assert "unknown" not in ax.get_ylabel() and "unknown" not in title and "other" not in title
        labels = [line.get_label() for line in ax.lines]
        assert labels and all(not lab.startswith("_") for lab in labels), (title, labels)
        assert ax.get_legend() is not None and [t.get_text() for t in ax.get_legend().get_texts()] == labels
    assert drawn["eval while training: zero-shot top-1"].get_ylabel() == "top-1 accuracy (0 to 1)"
    assert [line.get_label() for line in drawn["nCLIP terms"].lines] == ["L_CE", "L_EH"]
    assert sorted(line.get_label() for line in drawn["eval while training: zero-shot top-1"].lines) \
        == ["synthetic-colour", "synthetic-shape"]
    assert sorted(line.get_label() for line in drawn["eval while training: retrieval recall@k"].lines) \
        == ["synthetic i2t@1", "synthetic mean_recall"]


@pytest.mark.slow
def test_a_resumed_run_continues_its_wandb_run_and_a_new_one_starts_another(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from nclip.train.report_to import WANDB_ID, WandbReporter

    for name, value in (("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"),
                        ("WANDB_CONFIG_DIR", str(tmp_path / "cfg")), ("WANDB_CACHE_DIR", str(tmp_path / "cache"))):
        monkeypatch.setenv(name, value)
    ids = []
    for resuming in (False, True, False):
        reporter = WandbReporter(tmp_path / "run", {"seed": 0}, resuming)
        reporter.log({"step": 1, "loss": 1.5, "monitor/warnings": ["x"], "flag": True}, 1)
        reporter.close()
        ids.append((tmp_path / "run" / "wandb" / WANDB_ID).read_text().strip())
    assert ids[0] == ids[1] != ids[2]


@pytest.mark.slow
def test_wandb_without_a_login_is_one_line(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for name, value in (("WANDB_MODE", "online"), ("WANDB_SILENT", "true"),  # no key: W&B refuses before any network
                        ("WANDB_CONFIG_DIR", str(tmp_path / "cfg")), ("WANDB_CACHE_DIR", str(tmp_path / "cache")),
                        ("HOME", str(tmp_path)), ("NETRC", str(tmp_path / "netrc"))):  # no login found anywhere
        monkeypatch.setenv(name, value)
    assert _train(tmp_path / "run", "train.report_to=[wandb]") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("nclip: error")]
    assert len(err) == 1 and "cannot start a W&B run" in err[0] and "WANDB_MODE=offline" in err[0], err


@pytest.mark.parametrize("module, setting", [("wandb", "train.report_to=[wandb]"),
                                             ("tensorboard", "train.report_to=[tensorboard]")])
def test_a_package_that_fails_to_import_is_one_line(monkeypatch, tmp_path, capsys, module, setting):
    """Installed (the config's check finds it) but broken: its import raises, here protobuf's
    well-known TypeError. It was a traceback."""
    import sys

    fake = tmp_path / "site" / module
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise TypeError("Descriptors cannot be created directly.\\nMore lines.")\n')
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [m for m in sys.modules if m == module or m.startswith(f"{module}.") or m == "torch.utils.tensorboard"]:
        monkeypatch.delitem(sys.modules, name)
    assert _train(tmp_path / "run", setting) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("nclip: error")]
    assert len(err) == 1 and f"train.report_to {module}: `import " in err[0], err
    assert "fails (TypeError: Descriptors cannot be created directly.); reinstall it" in err[0], err
    assert f"take {module} out of train.report_to" in err[0]


@pytest.mark.parametrize("saved, why", [(b"\xff\xfe\x00garbage", "not UTF-8 text: byte 0"),
                                        (b"abc/def\n", "'abc/def': W&B takes 1 to 64 letters"),
                                        (b"\n", "empty")])
def test_a_garbage_wandb_run_id_on_resume_is_one_line(tmp_path, capsys, saved, why):
    """RUN/wandb/nclip-run-id is read when a run resumes with W&B (here turned on at the resume,
    which train.report_to allows): bytes that are no run id were a UnicodeDecodeError or W&B's error."""
    pytest.importorskip("wandb")
    from nclip.train.report_to import WANDB, WANDB_ID

    run = tmp_path / "run"
    assert _train(run, "train.steps=2", "train.checkpoint_every=2") == 0
    (run / WANDB).mkdir()
    (run / WANDB / WANDB_ID).write_bytes(saved)
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--extend-to", "4", "--no-progress", "--no-eval",
                 "--set", "train.report_to=[wandb]"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("nclip: error")]
    assert len(err) == 1 and f"{run / WANDB / WANDB_ID}: not a W&B run id ({why}" in err[0], err
    assert "delete the file to log the rest of the run to a new W&B run" in err[0]
