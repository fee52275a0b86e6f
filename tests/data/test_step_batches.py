"""A batch larger than the dataset: one warning naming the largest batch without repeats (issue 36.6)."""

from __future__ import annotations

from nclip.config import resolve
from nclip.data.loader import train_loader
from nclip.data.step_batches import StepBatches
from nclip.data.tokenization import CaptionTokenizer


def test_batches_of_a_dataset_smaller_than_a_batch_repeat_rows_and_say_so():
    small = StepBatches(60, 128, steps=3, seed=0)
    assert any(len(set(small.global_batch(s).tolist())) < 128 for s in range(3))  # what the warning is about
    warning = small.repeats_warning("pairs.csv")
    assert warning.startswith("train.batch_size 128 is larger than the 60 training samples of pairs.csv")
    assert warning.endswith("the largest batch without repeats is 60 (--set train.batch_size=60)")
    # the largest batch must also split over the ranks and keep hard-negative groups whole
    assert "is 60 (" in StepBatches(63, 128, 3, 0, world_size=2, group=4).repeats_warning("synthetic")
    assert "largest" not in StepBatches(1, 4, 3, 0).repeats_warning("one.csv")


def test_a_batch_the_dataset_fills_has_no_repeats_and_no_warning():
    exact = StepBatches(128, 128, steps=3, seed=0)
    assert exact.repeats_warning("pairs.csv") is None
    assert all(len(set(exact.global_batch(s).tolist())) == 128 for s in range(3))


def test_the_training_loader_warns_once_on_rank_0(capsys):
    cfg = resolve("micro", ["data.train_length=10"])  # micro's batch is 16
    tokenizer = CaptionTokenizer(cfg.data.text_length, cfg.model.text.tokenizer)
    train_loader(cfg, tokenizer)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["nclip: warning: train.batch_size 16 is larger than the 10 training samples of synthetic: every "
                   "batch repeats samples, and a repeated pair is a false negative for contrastive objectives; the "
                   "largest batch without repeats is 10 (--set train.batch_size=10)"]
    train_loader(cfg, tokenizer, rank=1, world_size=2)
    assert capsys.readouterr().err == ""
