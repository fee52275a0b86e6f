"""The one table of evaluation tasks (nclip.eval.settings.TASK_TABLE): the settings' choices, the
text-task filter, the skip reasons and the dispatch read it."""

import pytest

from nclip.eval.dispatch import EvalState, explain_missing
from nclip.eval.settings import OPTIONAL_TASKS, TASK_TABLE, TASKS, TEXT_TASKS, EvalSettings


def test_task_lists_are_views_of_the_table():
    assert TASKS + OPTIONAL_TASKS == tuple(TASK_TABLE)  # in the table's order
    assert OPTIONAL_TASKS == ("classifier",) and EvalSettings().tasks == TASKS
    assert set(TEXT_TASKS) == {"zeroshot", "retrieval", "multilabel", "segmentation", "diagnostics"}
    assert EvalSettings(tasks=("classifier",)).tasks == ("classifier",)
    with pytest.raises(ValueError, match="unknown task 'zeroshots'; available: zeroshot, retrieval, .*, classifier"):
        EvalSettings(tasks=("zeroshots",))


def test_a_task_without_results_is_skipped_with_what_it_needs():
    state = EvalState(ck=None, settings=EvalSettings(tasks=("sts", "masks", "knn")), score=None, cache=None,
                      device=None, log=print)
    state.results["knn/digits-digit/top1"] = 0.5
    state.skipped["masks"] = "a reason of its own"
    explain_missing(state)
    assert state.skipped == {"sts": "none of the selected datasets has sentence pairs (synthetic with --sts-pairs "
                                    "> 0, sts:FILE.csv)",
                             "masks": "a reason of its own"}
