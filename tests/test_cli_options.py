"""One spelling for one option across commands: a CSV's columns are --image-key / --caption-key in
`nclip eval`, `nclip data inspect` and `nclip data dedup` (issue 28.11); the old spellings of the data
commands, --csv-image-key / --csv-caption-key, still work but are not listed."""

import pytest

from nclip.cli import build_parser

COMMANDS = [["data", "inspect", "pairs.csv"], ["data", "dedup", "--reference", "a", "--target", "b"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_csv_columns_are_spelt_as_in_eval(command):
    parser = build_parser()
    args = parser.parse_args([*command, "--image-key", "path"])
    assert args.image_key == "path"
    assert parser.parse_args([*command, "--csv-image-key", "path"]).image_key == "path"  # the old spelling
    assert parser.parse_args(command).image_key == "filepath"  # data.csv_image_key's default
    if command[1] == "inspect":
        assert parser.parse_args([*command, "--caption-key", "c"]).caption_key == "c"
        assert parser.parse_args([*command, "--csv-caption-key", "c"]).caption_key == "c"
        assert parser.parse_args(command).caption_key == "title"
    eval_args = parser.parse_args(["eval", "--image-key", "path", "--caption-key", "c"])
    assert (eval_args.image_key, eval_args.caption_key) == ("path", "c")


def test_the_old_spelling_is_not_listed(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["data", "inspect", "--help"])
    text = capsys.readouterr().out
    assert "--image-key" in text and "--caption-key" in text and "--csv-" not in text
