"""``nclip eval --suite``: what it is for -- CLIP_benchmark's copies of CIFAR-10
and ImageNet-1k validation and the Karpathy COCO JSON, one command, one table with all three and
their mean -- on tiny fixtures in those layouts and a micro model with random weights; ``nclip eval
compare`` of two such results; the suite file's one-line errors."""

import json

import pytest
from benchmark_layouts import write_imagefolder, write_karpathy, write_wds

from nclip.cli import main
from nclip.config import resolve

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

MICRO = [
    "data.image_size=16", "data.text_length=16",
    "model.vision.patch_size=4", "model.vision.width=32", "model.vision.layers=1", "model.vision.heads=2",
    "model.text.width=32", "model.text.layers=1", "model.text.heads=2",
    "model.embed_dim=32", "model.nclip_hidden=64", "model.nclip_dim=128",
]


def _model(root, objective, seed):
    """A model directory with random weights (no training needed to test the plumbing)."""
    import torch

    from nclip.models import build_model
    from nclip.models.io import save_model

    torch.manual_seed(seed)
    cfg = resolve("micro", MICRO + [f"objective.name={objective}"])
    return save_model(build_model(cfg), cfg, root / f"{objective}-{seed}" / "model")


@pytest.fixture(scope="module")
def clip_model(tmp_path_factory):
    return _model(tmp_path_factory.mktemp("models"), "clip", 0)


@pytest.fixture(scope="module")
def suite_data(tmp_path_factory):
    """The three layouts the suite is for and a suite file naming them."""
    root = tmp_path_factory.mktemp("bench")
    cifar = write_wds(root / "wds_cifar10", per_class=3, shards=2)
    write_wds(cifar, per_class=3, shards=2, split="train")
    imagenet = write_imagefolder(root / "imagenet", per_class=2)
    coco_json, coco_images = write_karpathy(root / "coco", per_split=4)
    suite = root / "suite.yaml"
    suite.write_text(f"""name: zero-shot suite
datasets:
  - spec: wds:{cifar}
    tasks: [zeroshot, linear]
  - spec: imagefolder:{imagenet / 'val'}
    name: imagenet1k
    classnames: {imagenet / 'class_index.json'}
  - spec: karpathy:{coco_json}:{coco_images}
""")
    return root, suite


@pytest.mark.slow  # two evaluations and a report (~20 s on 2 cores)
def test_suite_one_command_one_table_and_compare(tmp_path, suite_data, capsys):
    root, suite = suite_data
    outs = []
    for objective, seed in (("xclip", 0), ("clip", 1)):
        model = _model(tmp_path, objective, seed)
        out = tmp_path / f"eval-{objective}"
        argv = ["eval", "--checkpoint", str(model), "--out", str(out), "--suite", str(suite), "--quiet",
                "--tsne-iters", "250", "--batch-size", "8"] + (["--no-report"] if seed else [])
        assert main(argv) == 0, capsys.readouterr().err
        outs.append(out)
    printed = capsys.readouterr().out
    _console_cells_are_the_reports(printed.split("time ")[0], outs[0] / "report.html")

    doc = json.loads((outs[0] / "results.json").read_text())
    r, s = doc["results"], doc["suite"]
    assert {"zeroshot/cifar10-class/top1", "linear/cifar10-class/top1", "zeroshot/imagenet1k-class/top1",
            "retrieval/coco/i2t@1", "retrieval/coco/t2i@1"} <= set(r)
    assert not any(k.startswith(("zeroshot/coco", "retrieval/cifar10", "linear/imagenet1k")) for k in r)
    cells = [(c["dataset"], c["task"]) for c in s["cells"]]
    assert cells == [("cifar10", "zeroshot"), ("cifar10", "linear"), ("imagenet1k", "zeroshot"),
                     ("coco", "retrieval")]
    values = [c["value"] for c in s["cells"]]
    assert s["mean"]["all"] == pytest.approx(sum(values) / 4) and s["mean"]["cells"] == [4, 4]
    assert s["mean"]["zeroshot"] == pytest.approx((values[0] + values[2]) / 2)
    assert values[3] == pytest.approx((r["retrieval/coco/i2t@1"] + r["retrieval/coco/t2i@1"]) / 2)
    assert s["datasets"][1]["classnames"].endswith("class_index.json")
    page = (outs[0] / "report.html").read_text()
    assert "Suite: zero-shot suite" in page and "imagenet1k zero-shot top-1" in page

    md = tmp_path / "cmp.md"
    assert main(["eval", "compare", str(outs[0]), str(outs[1]), "--out", str(md)]) == 0
    text = md.read_text()
    assert "## Suite: zero-shot suite" in text
    header = next(line for line in text.splitlines() if line.startswith("| run | cifar10 zero-shot"))
    assert header.endswith("| Mean | Mean zero-shot top-1 | Mean linear top-1 | Mean R@1 (I→T, T→I mean) |")
    table = text.split("## Suite: zero-shot suite")[1].split("##")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "(" in line.split("|")[1]]
    assert [row.split("|")[1].strip().split(" (")[1] for row in rows] == ["xclip, clip head)", "clip, clip head)"]
    assert rows[1].count("(+") + rows[1].count("(-") + rows[1].count("(+0.0)") >= 8  # deltas to run 1


def _console_cells_are_the_reports(printed: str, report) -> None:
    """Issue 36.2: the console prints the cells the suite's mean is computed from, labelled with their
    dataset and metric, with the values of the report's suite table, and then that mean."""
    import re

    cells = dict(re.findall(r"^suite: (.+?)\s{2,}(\S+)$", printed, re.M))
    mean = re.search(r"^suite mean of zero-shot suite\s+(\S+) \(of the 4 cells above\)$", printed, re.M)
    assert list(cells) == ["cifar10 zero-shot top-1", "cifar10 linear top-1", "imagenet1k zero-shot top-1",
                           "coco R@1 (I→T, T→I mean)"], printed
    assert mean and float(mean[1]) == pytest.approx(sum(map(float, cells.values())) / 4, abs=0.051)
    page = report.read_text()
    table = page[page.index("Suite <b>zero-shot suite</b>"):]
    heads = re.findall(r"<th>(.*?)</th>", table.split("</thead>")[0])
    values = re.findall(r'<td class="num">(.*?)</td>', table.split("</tbody>")[0])
    shown = dict(zip([h.replace("&amp;", "&") for h in heads], values))
    assert {h: shown[h] for h in cells} == cells and shown["Mean"] == mean[1]
    assert "STS" not in printed  # no STS ran


@pytest.mark.parametrize("body, needle", [
    ("datasets:\n  - spec: digits\n    taks: [zeroshot]\n", "datasets.0.taks: unknown key"),
    ("datasets:\n  - spec: digits\n    tasks: [zeroshoot]\n", "unknown task 'zeroshoot'"),
    ("datasets:\n  - spec: wds\n", "unknown dataset 'wds'"),
    ("datasets: []\n", "datasets: "),
    ("datasets:\n  - spec: digits\n  - spec: digits\n", "dataset name 'digits' is already datasets[0]'s"),
    ("datasets:\n  - spec: digits\n    classnames: n.txt\n", "datasets[0]: classnames: applies to"),
    ("datasets:\n  - spec: wds:{tmp}/none\n", "wds dataset folder not found"),
    ("datasets: [\n", "invalid YAML"),
    ("- digits\n", "expected a mapping with a 'datasets' list"),
])
def test_suite_file_errors_are_one_line(tmp_path, clip_model, capsys, body, needle):
    model = clip_model
    suite = tmp_path / "s.yaml"
    suite.write_text(body.format(tmp=tmp_path))
    assert main(["eval", "--checkpoint", str(model), "--out", str(tmp_path / "o"), "--suite", str(suite)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("extra, needle", [
    (["--dataset", "digits"], "drop --dataset"),
    (["--tasks", "zeroshot"], "drop --tasks"),
    (["--suite", "{tmp}/missing.yaml"], "suite file not found"),
])
def test_suite_option_errors(tmp_path, capsys, extra, needle):
    suite = tmp_path / "s.yaml"
    suite.write_text("datasets:\n  - spec: digits\n")
    argv = ["eval", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "o"), "--suite", str(suite)]
    assert main(argv + [a.format(tmp=tmp_path) for a in extra]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_suite_on_an_image_only_objective(tmp_path, suite_data, capsys):
    """CMSF trains no text-aligned head: the suite's text cells are skipped with their reason, the
    mean is over the cells that have a value, and the table says how many."""
    _, suite = suite_data
    out = tmp_path / "eval"
    assert main(["eval", "--checkpoint", str(_model(tmp_path, "cmsf", 0)), "--out", str(out), "--suite", str(suite),
                 "--quiet", "--no-report"]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert set(doc["skipped"]) == {"zeroshot", "retrieval"}  # only the tasks the suite asked for
    assert doc["suite"]["mean"]["cells"] == [1, 4]
    assert doc["suite"]["mean"]["all"] == doc["results"]["linear/cifar10-class/top1"]
    from nclip.eval.suite_table import table_rows

    head, rows = table_rows([doc["suite"]])
    assert rows[0][head.index("Mean")].endswith("(1/4)") and rows[0][0] == "–"
