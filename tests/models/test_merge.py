"""`nclip merge A B --alpha α --out C` (and nclip.merge): θ = (1 − α)·θ_A + α·θ_B for floating-point
tensors, integer buffers from A, a loadable model directory; bad inputs are one line, exit 2."""

import json

import pytest
import torch
from safetensors.torch import load_file

import nclip
from nclip.cli import main
from nclip.config import resolve
from nclip.errors import NclipError
from nclip.models import build_model
from nclip.models.io import WEIGHTS, load_model, save_model, weights_metadata
from nclip.runlock import LOCK_NAME, DirLock


def _model_dir(path, overrides, seed):
    cfg = resolve("micro", overrides)
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("num_batches_tracked"):
                buf.fill_(10 + seed)  # A and B differ in their integer buffers too
    return save_model(model, cfg, path)


@pytest.fixture
def pair(tmp_path, micro_overrides):
    _model_dir(tmp_path / "runA" / "model", micro_overrides, 0)
    b = _model_dir(tmp_path / "B", micro_overrides, 1)
    return tmp_path / "runA", b


def _one_line_error(capsys, *words):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


def test_merge_interpolates_floats_and_keeps_a_integers(pair, tmp_path, capsys):
    run_a, dir_b = pair
    out = tmp_path / "C"
    assert main(["merge", str(run_a), str(dir_b), "--alpha", "0.25", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "0.25" in said and "integer tensors" in said and "from A" in said
    a, b, c = (load_file(str(d / WEIGHTS)) for d in (run_a / "model", dir_b, out))
    assert set(c) == set(a)
    ints = [k for k in a if not a[k].is_floating_point()]
    assert ints and all(k.endswith("num_batches_tracked") for k in ints)
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(c[k], 0.75 * a[k] + 0.25 * b[k], msg=k)
            assert not torch.equal(a[k], b[k]) or torch.equal(c[k], a[k])
        else:
            assert torch.equal(c[k], a[k]) and not torch.equal(c[k], b[k]), k
    model, cfg = load_model(out)  # a model directory like training's RUN/model
    assert cfg.model == load_model(run_a / "model")[1].model
    record = json.loads((out / "merge.json").read_text())
    assert record["alpha"] == 0.25 and record["integer_tensors_from_a"] == sorted(ints)
    assert not (out / LOCK_NAME).exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_alpha_zero_and_one_are_exact_through_the_python_api(pair, tmp_path):
    run_a, dir_b = pair
    a, b = load_file(str(run_a / "model" / WEIGHTS)), load_file(str(dir_b / WEIGHTS))
    zero = load_file(str(nclip.merge(run_a, dir_b, 0.0, tmp_path / "zero") / WEIGHTS))
    one = load_file(str(nclip.merge(run_a, dir_b, 1, tmp_path / "one") / WEIGHTS))
    assert all(torch.equal(zero[k], a[k]) for k in a)
    assert all(torch.equal(one[k], b[k] if b[k].is_floating_point() else a[k]) for k in a)


@pytest.mark.parametrize("alpha", ["1.5", "-0.1", "nan"])
def test_alpha_outside_zero_one_is_one_line(pair, tmp_path, capsys, alpha):
    run_a, dir_b = pair
    assert main(["merge", str(run_a), str(dir_b), "--alpha", alpha, "--out", str(tmp_path / "C")]) == 2
    _one_line_error(capsys, "--alpha", "[0, 1]")
    assert not (tmp_path / "C").exists()


@pytest.mark.parametrize("change,named", [(["model.embed_dim=16"], "model.embed_dim"),
                                          (["objective.name=clip"], "tensor "),
                                          (["model.vision.width=48"], "model.vision.width")])
def test_different_architectures_are_refused_naming_the_first_difference(pair, tmp_path, micro_overrides,
                                                                        capsys, change, named):
    run_a, _ = pair
    other = _model_dir(tmp_path / "other", micro_overrides + change, 2)
    assert main(["merge", str(run_a), str(other), "--alpha", "0.5", "--out", str(tmp_path / "C")]) == 2
    _one_line_error(capsys, "cannot merge different architectures", named)
    assert not (tmp_path / "C").exists()


def test_targets_that_are_refused(pair, tmp_path, capsys):
    run_a, dir_b = pair
    args = [str(run_a), str(dir_b), "--alpha", "0.5", "--out"]
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    assert main(["merge", *args, str(full)]) == 2
    _one_line_error(capsys, "not empty", "--force")
    assert (full / "notes.txt").read_text() == "mine"
    assert main(["merge", *args, str(full), "--force"]) == 0  # replaced as a whole
    names = {p.name for p in full.iterdir()}
    assert {"config.json", "merge.json", "model.safetensors"} <= names and "notes.txt" not in names
    for target in (dir_b, run_a / "model", run_a):  # a source, a run's model/, a run: never, --force or not
        assert main(["merge", *args, str(target), "--force"]) == 2
        _one_line_error(capsys, "--out")
    assert main(["merge", str(tmp_path / "nothing"), str(dir_b), "--alpha", "0.5", "--out", str(tmp_path / "C")]) == 2
    _one_line_error(capsys, "not an nclip model directory")


def test_a_locked_target_is_refused(pair, tmp_path, capsys):
    run_a, dir_b = pair
    with DirLock(tmp_path / "C", "another writer"):
        assert main(["merge", str(run_a), str(dir_b), "--alpha", "0.5", "--out", str(tmp_path / "C")]) == 2
    _one_line_error(capsys, "in use by another nclip process")


@pytest.mark.parametrize("alpha", ["0", "0.5"])
def test_a_source_with_nan_weights_is_refused_and_nothing_written(pair, tmp_path, capsys, alpha):
    """It wrote NaN weights without a word (at α = 0 too: 0·NaN is NaN)."""
    from safetensors.torch import save_file

    run_a, dir_b = pair
    weights = load_file(str(dir_b / WEIGHTS))
    key = next(k for k, v in weights.items() if k.startswith("vision.") and v.is_floating_point())
    weights[key].view(-1)[:3] = torch.tensor([float("nan"), float("inf"), 1.0])
    save_file(weights, str(dir_b / WEIGHTS), metadata=weights_metadata())
    capsys.readouterr()
    assert main(["merge", str(run_a), str(dir_b), "--alpha", alpha, "--out", str(tmp_path / "C")]) == 2
    _one_line_error(capsys, f"B {dir_b}: tensor {key} holds 2 NaN or infinite values of", "NaN there at every alpha")
    assert not (tmp_path / "C").exists()
    with pytest.raises(NclipError, match=f"^A {dir_b}: tensor {key} holds 2 NaN"):  # the Python API, as A
        nclip.merge(dir_b, run_a, 0.5, tmp_path / "D")
    assert not (tmp_path / "D").exists()
