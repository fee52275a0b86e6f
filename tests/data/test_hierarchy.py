"""Class hierarchies and ReCo's Eq. 4 similarity (OmniBenchmark Sec. 4.3), with hand-computed numbers."""

import json
import math

import pytest
import torch

from nclip.data.hierarchy import Hierarchy
from nclip.errors import NclipError

# animal (0) -> mammal (1) -> dog (2) -> husky, labrador (3); mammal -> cat (2); animal -> bird (1) -> sparrow (2)
TREE = {"mammal": "animal", "dog": "mammal", "husky": "dog", "labrador": "dog", "cat": "mammal",
        "bird": "animal", "sparrow": "bird"}


@pytest.fixture
def tree():
    return Hierarchy(TREE, require_single_root=True)


def test_structure(tree):
    assert tree.root == "animal" and tree.roots == ("animal",)  # named only as a parent: a root node
    assert tree.parents["animal"] is None
    assert set(tree.classes) == {"husky", "labrador", "cat", "sparrow"}
    assert tree.children("dog") == ("husky", "labrador")
    assert tree.path("husky") == ["animal", "mammal", "dog", "husky"]
    assert [tree.depth(n) for n in ("animal", "mammal", "dog", "husky")] == [0, 1, 2, 3]


def test_distances(tree):
    assert tree.distance("husky", "husky") == 0
    assert tree.distance("dog", "husky") == 1  # parent-child (the paper's Fig. 3 b)
    assert tree.distance("husky", "labrador") == 2  # siblings
    assert tree.distance("husky", "cat") == 3
    assert tree.distance("husky", "sparrow") == 5  # through the root
    assert tree.distance("animal", "labrador") == 3


def test_similarity_hand_computed(tree):
    s = tree.similarity
    assert s("husky", "husky") == pytest.approx(math.log(7))  # -log(1 / (2*3 + 1))
    assert s("husky", "labrador") == pytest.approx(math.log(7 / 3))
    assert s("dog", "husky") == pytest.approx(math.log(7 / 2))
    assert s("dog", "mammal") == pytest.approx(math.log(5 / 2))
    assert s("husky", "sparrow") == pytest.approx(math.log(7 / 6))
    # equal depth, lowest common ancestor = root: the least related pairs get exactly 0
    assert s("mammal", "bird") == 0.0 and s("dog", "sparrow") == 0.0
    # the paper's claims: the dog is closer to the husky than to the mammal (same d_min, deeper node)
    assert s("dog", "husky") > s("dog", "mammal")
    # deeper siblings are closer than shallower siblings
    assert s("husky", "labrador") > s("dog", "cat") == pytest.approx(math.log(5 / 3))
    assert s("husky", "cat") == s("cat", "husky")


def test_similarity_non_negative_and_self_is_row_max(tree):
    below_root = [n for n in tree.nodes if n != "animal"]
    for m in below_root:
        row = [tree.similarity(m, n) for n in tree.nodes]
        assert min(row) >= 0.0
        assert max(row) == pytest.approx(tree.similarity(m, m))


def test_normalized_similarity(tree):
    classes = ["husky", "labrador", "cat", "sparrow"]
    sim = tree.normalized_similarity(classes)
    assert sim.shape == (4, 4) and sim.dtype == torch.float32
    assert torch.equal(sim, sim.T)
    assert float(sim.min()) >= 0.0 and float(sim.max()) == pytest.approx(1.0)
    assert float(sim[0, 1]) == pytest.approx(math.log(7 / 3) / math.log(7))  # divided by the largest value
    assert float(sim[2, 2]) == pytest.approx(math.log(5) / math.log(7))  # the shallower cat's self-similarity
    assert float(sim[0, 3]) == pytest.approx(math.log(7 / 6) / math.log(7))
    rows = tree.normalized_similarity(classes, per_class=True)
    assert torch.allclose(rows.diagonal(), torch.ones(4))
    assert float(rows[2, 0]) == pytest.approx(math.log(7 / 4) / math.log(5))  # s(cat, husky) / s(cat, cat)
    assert float(rows.min()) >= 0.0 and float(rows.max()) <= 1.0


def test_realms(tree):
    assert tree.realms() == {"husky": "mammal", "labrador": "mammal", "cat": "mammal", "sparrow": "bird"}
    assert tree.realms(["bird", "dog"]) == {"bird": "bird", "dog": "mammal"}


@pytest.mark.parametrize("suffix", [".json", ".tsv"])
def test_file_round_trip(tree, tmp_path, suffix):
    again = Hierarchy.load(tree.save(tmp_path / f"tree{suffix}"), require_single_root=True)
    assert again.parents == tree.parents
    assert again.similarity("husky", "cat") == tree.similarity("husky", "cat")


def test_tsv_comments_blank_lines_and_roots(tmp_path):
    f = tmp_path / "h.tsv"
    f.write_text("# a comment\n\nvehicle\t\ncar\tvehicle\n  # indented comment\nboat\tvehicle\nplant\n"
                 .replace("plant\n", "plant\t\n"))
    h = Hierarchy.load(f)
    assert h.roots == ("vehicle", "plant") and h.classes == ("car", "boat", "plant")


def test_json_null_root(tmp_path):
    f = tmp_path / "h.json"
    f.write_text(json.dumps({"a": None, "b": "a", "c": "a"}))
    assert Hierarchy.load(f).realms() == {"b": "b", "c": "c"}


def _one_line_error(fn, *needles):
    with pytest.raises(NclipError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg


def test_errors(tree, tmp_path):
    _one_line_error(lambda: Hierarchy({"a": "b", "b": "c", "c": "a"}), "cycle", "a -> b -> c -> a")
    _one_line_error(lambda: Hierarchy({"a": "a"}), "cycle")
    _one_line_error(lambda: Hierarchy({}), "empty")
    _one_line_error(lambda: Hierarchy({"a": None, "b": None}, require_single_root=True), "single root", "'a', 'b'")
    _one_line_error(lambda: Hierarchy({"a": None, "b": None}).root, "single root")
    _one_line_error(lambda: Hierarchy({"": "a"}), "non-empty")
    _one_line_error(lambda: Hierarchy({"a": 3}), "parent of 'a'")
    _one_line_error(lambda: tree.depth("wolf"), "unknown class 'wolf'")
    _one_line_error(lambda: tree.similarity("husky", "wolf"), "'wolf'")
    _one_line_error(lambda: tree.normalized_similarity(["husky", "wolf"]), "'wolf'")
    _one_line_error(lambda: tree.check_covers(["husky", "wolf", "fox"]), "2 labels", "'wolf', 'fox'")
    tree.check_covers(["husky", "cat", "mammal"])  # inner nodes are nodes too
    _one_line_error(lambda: tree.realm("animal"), "root")
    _one_line_error(lambda: Hierarchy({"a": None, "b": None}).distance("a", "b"), "different trees")


def test_check_classes_names_missing_classes_and_extra_leaves(tree):
    tree.check_classes(["husky", "labrador", "cat", "sparrow"])  # the leaves exactly
    tree.check_classes(["dog", "cat", "bird"])  # classes may be inner nodes: the leaves below them are theirs
    _one_line_error(lambda: tree.check_classes(["husky", "labrador", "cat"]), "does not match the 3 classes: ",
                    "1 leaf not among the classes: 'sparrow'")
    _one_line_error(lambda: tree.check_classes(["husky", "labrador", "cat", "sparrow", "wolf"], of="of data.csv x"),
                    "the 5 classes of data.csv x: 1 class without a node: 'wolf'")
    wide = Hierarchy({"root": None, **{f"leaf{i}": "root" for i in range(8)}})
    classes = [f"class{i}" for i in range(7)]
    _one_line_error(lambda: wide.check_classes(classes), "7 classes without a node: 'class0', 'class1', 'class2', "
                    "'class3', 'class4' (and 2 more); 8 leaves not among the classes: 'leaf0', 'leaf1', 'leaf2', "
                    "'leaf3', 'leaf4' (and 3 more)")


@pytest.mark.parametrize("text, needles", [
    ("car\tvehicle\nboat\n", ["h.tsv:2:", "child<TAB>parent"]),
    ("car\tvehicle\tthing\n", ["h.tsv:1:", "2 tab-separated columns, got 3"]),
    ("\tvehicle\n", ["h.tsv:1:", "empty class name"]),
    ("# c\ncar\tvehicle\ncar\tthing\n", ["h.tsv:3:", "listed twice", "line 2"]),
    ("a\tb\nb\ta\n", ["h.tsv:", "cycle"]),
])
def test_tsv_errors_name_file_and_line(tmp_path, text, needles):
    f = tmp_path / "h.tsv"
    f.write_text(text)
    _one_line_error(lambda: Hierarchy.load(f), *needles)


def test_file_errors(tmp_path):
    _one_line_error(lambda: Hierarchy.load(tmp_path / "nope.json"), "not found")
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": "b",\n "c": }')
    _one_line_error(lambda: Hierarchy.load(bad), "bad.json:2:", "invalid JSON")
    bad.write_text('["a", "b"]')
    _one_line_error(lambda: Hierarchy.load(bad), "JSON object")
    bad.write_text('{"a": "b", "a": "c"}')
    _one_line_error(lambda: Hierarchy.load(bad), "listed twice")
    binary = tmp_path / "bin.tsv"
    binary.write_bytes(b"\xff\xfe\x00a\tb\n")
    _one_line_error(lambda: Hierarchy.load(binary), "UTF-8")
