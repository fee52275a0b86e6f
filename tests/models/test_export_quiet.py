"""`nclip export --hf` and the docs' transformers-only snippet are quiet (issue 28.12): export prints
its one line and no shard progress bar; the snippet of docs/api.md, run in a fresh interpreter that
never imports nclip, prints no torchao or pytree warnings."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nclip.cli import main
from nclip.config import resolve
from nclip.models import build_model
from nclip.models.io import save_model

API_MD = Path(__file__).resolve().parents[2] / "docs" / "api.md"
EXPORT_MD = API_MD.with_name("export.md")
# what transformers' import of an installed torchao prints on a CPU-only torch
SNIPPET_NOISE = ("torchao", "_pytree", "Failed to load", "register_constant")


def _exported(tmp_path, micro_overrides, capfd) -> Path:
    cfg = resolve("micro", micro_overrides)
    torch.manual_seed(0)
    save_model(build_model(cfg, pretrained_text=False), cfg, tmp_path / "run" / "model")
    capfd.readouterr()
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--hf", str(tmp_path / "hf")]) == 0
    return tmp_path / "hf"


def test_export_prints_its_line_and_no_progress_bar(tmp_path, micro_overrides, capfd):
    from transformers.utils import logging as hf_logging

    hf = _exported(tmp_path, micro_overrides, capfd)
    out, err = capfd.readouterr()
    assert out == f"wrote a transformers CLIPModel with its tokenizer and image processor to {hf}\n"
    assert err == "", err
    assert hf_logging.is_progress_bar_enabled()  # silenced for the export only, not for the caller


# the snippets run as a user of the export runs them, without nclip, in an environment without torchvision:
# the suite's own (a dev dependency of the peer tests) is built for CUDA torch and, beside the CPU wheel, imports
# only once nclip has made it importable (nclip.torchvision_compat). importlib.util.find_spec of a module that
# sys.modules maps to None is None, so transformers takes it as not installed
WITHOUT_TORCHVISION = "import sys\nsys.modules['torchvision'] = None\n"


def _snippet() -> str:
    """The python block under docs/api.md's `nclip export` heading."""
    text = API_MD.read_text(encoding="utf-8")
    section = text[text.index("## `nclip export --checkpoint RUN --hf OUT`"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_docs_transformers_snippet_runs_without_noise(tmp_path, micro_overrides, capfd):
    hf = _exported(tmp_path, micro_overrides, capfd)
    code = WITHOUT_TORCHVISION + _snippet().replace('"runs/micro-hf"', repr(str(hf))) + "\nprint('embedded')\n"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "embedded\n"
    noise = [line for line in done.stderr.splitlines() if any(n in line for n in SNIPPET_NOISE)]
    assert not noise, noise


@pytest.mark.slow
def test_the_export_docs_snippet_runs_as_written_and_prints_nclips_embeddings(tmp_path, micro_overrides, capfd):
    """docs/export.md's check of an --hf export (the README's until the README became a front door)
    runs as written, quietly, and prints the embeddings; the cosine it prints is nclip.load's."""
    from PIL import Image

    import nclip

    hf = _exported(tmp_path, micro_overrides, capfd)
    page = EXPORT_MD.read_text(encoding="utf-8")
    code = WITHOUT_TORCHVISION + re.search(r"```python\n(.*?)```",
                                           page[page.index("### Check an export with transformers alone"):],
                                           re.S).group(1)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    (tmp_path / "runs").mkdir()
    os.symlink(hf, tmp_path / "runs" / "micro-hf")  # the page's own path, as a user who ran its commands has it
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    noise = [line for line in done.stderr.splitlines() if any(n in line for n in SNIPPET_NOISE)]
    assert not noise, noise
    found = re.fullmatch(r"image torch.Size\(\[1, (\d+)\]\) text torch.Size\(\[1, (\d+)\]\) cosine (\S+)\n",
                         done.stdout)
    assert found, done.stdout
    model = nclip.load(tmp_path / "run")
    cosine = (model.encode_image([Image.new("RGB", (64, 48), "red")]) @ model.encode_text(["a red circle"]).T).item()
    assert int(found[1]) == int(found[2]) == model.encode_text(["x"]).shape[1]
    assert float(found[3]) == pytest.approx(cosine, abs=2e-4)
