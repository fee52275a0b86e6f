"""Zero-shot scores as registered kinds (nclip.objectives.scores): the built-ins read their head and
embed, ensemble, compare and measure distance as the papers do; the plan resolves an objective's
score once, with the run's options; a wrong name is one line."""

import pytest
import torch
import torch.nn.functional as F

from nclip.config import resolve
from nclip.objectives import REGISTRY, plan_for, plan_of
from nclip.objectives.scores import (
    ClipScore,
    CosineScore,
    NclipScore,
    Score,
    YclipScore,
    register_score,
    registered_scores,
    score_named,
)


def _x(seed: int, n: int = 7, d: int = 5) -> torch.Tensor:
    return 2 * torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def test_the_builtin_scores_by_name():
    assert registered_scores()[:3] == ("clip", "nclip", "yclip")
    assert [(s.name, s.head, s.normalised) for s in map(score_named, ("clip", "nclip", "yclip"))] == [
        ("clip", "clip", True), ("nclip", "nclip", False), ("yclip", "nclip", False)]
    x = _x(0)
    torch.testing.assert_close(ClipScore().embed(x), F.normalize(x, dim=-1))
    assert NclipScore().embed(x) is x  # the logits as they are: normalising them would change p


def test_every_objective_plan_has_a_registered_score_on_a_head_it_builds():
    for name, (config, objective) in REGISTRY.items():
        score = plan_of(config()).zero_shot
        assert (score is None) == (objective.zero_shot is None), name
        assert score is None or (score.name == objective.zero_shot and score.head in plan_of(config()).heads), name


def test_the_plan_configures_nclips_direction_from_the_run():
    assert plan_for(resolve("micro", ["objective.name=nclip"])).zero_shot == NclipScore("symmetric")
    one_way = plan_for(resolve("micro", ["objective.name=nclip", "eval.nclip_score=image_to_text"])).zero_shot
    assert one_way == NclipScore("image_to_text") and one_way.options() == {"nclip_score": "image_to_text"}
    x, y = _x(1), _x(2, 4)
    assert not torch.equal(one_way.compare(x, y), NclipScore().compare(x, y))
    yclip = plan_for(resolve("micro", ["objective.name=yclip", "eval.nclip_score=image_to_text"])).zero_shot
    assert yclip == YclipScore() and yclip.options() == {}  # S has one form


@pytest.mark.parametrize("score", [ClipScore(), NclipScore(), YclipScore()], ids=lambda s: s.name)
def test_the_derived_distance_is_the_builtin_one(score):
    """Score.distance, d(i, j) = (s(i, i) + s(j, j)) / 2 − (s(i, j) + s(j, i)) / 2, which a plugin's score
    gets: 1 − cos for CLIP, the symmetrised KL for nCLIP (either direction), twice it for yCLIP's S."""
    x = _x(3).double()
    derived = Score.distance(score, x)
    own = score.distance(x)
    torch.testing.assert_close(derived, own * (2 if score.name == "yclip" else 1), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(Score.distance(NclipScore("image_to_text"), x), NclipScore().distance(x))
    assert (own.diagonal().abs() < 1e-12).all() and torch.allclose(own, own.T)


def test_the_ensembles():
    prompts = _x(4, 12, 6).view(4, 3, 6)  # [C, T, D]
    clip = ClipScore().ensemble(prompts)
    torch.testing.assert_close(clip, F.normalize(F.normalize(prompts, dim=-1).mean(1), dim=-1))
    nclip = NclipScore().ensemble(prompts)
    torch.testing.assert_close(F.softmax(nclip, -1), F.softmax(prompts, -1).mean(1))  # the mean distribution
    assert torch.equal(nclip, YclipScore().ensemble(prompts))


def test_a_wrong_name_or_class_is_one_line():
    with pytest.raises(ValueError, match=r"^unknown zero-shot score 'cos'; registered: clip, nclip, yclip"):
        score_named("cos")

    class Nameless(CosineScore):
        head = "clip"

    class Twice(CosineScore):
        name, head = "clip", "clip"

    for cls, needle in ((Nameless, "does not define name"), (Twice, "registered twice"),
                        (int, "not a subclass")):
        with pytest.raises(ValueError, match=needle) as e:
            register_score(cls)
        assert "\n" not in str(e.value)
    assert registered_scores()[:3] == ("clip", "nclip", "yclip") and score_named("clip") == ClipScore()


def test_nclip_eval_head_names_a_score_and_the_checkpoint_must_have_its_head():
    from nclip.errors import NclipError
    from nclip.eval.runner import zero_shot_score
    from nclip.eval.settings import EvalSettings

    clip_only = plan_for(resolve("micro", ["objective.name=clip"]))
    assert zero_shot_score(EvalSettings(), clip_only) == ClipScore()
    with pytest.raises(NclipError, match="head 'nclip' is not in this checkpoint \\(the 'yclip' score reads it\\)"):
        zero_shot_score(EvalSettings(head="yclip"), clip_only)
    with pytest.raises(NclipError, match="--head: unknown zero-shot score 'cos'"):
        zero_shot_score(EvalSettings(head="cos"), clip_only)
    xclip = plan_for(resolve("micro", ["objective.name=xclip", "eval.nclip_score=image_to_text"]))
    # nclip eval's own --nclip-score (its settings), not the run's
    assert zero_shot_score(EvalSettings(head="nclip"), xclip) == NclipScore("symmetric")
