"""Prompts are drawn per round without repetition until the set is used up, then a new epoch."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.stages.rollout import (
    epoch_permutation,
    extra_prompt_indices,
    filter_groups,
    has_signal,
    select_prompt_indices,
)


def test_rounds_take_disjoint_slices_of_one_permutation_per_epoch():
    n, per = 10, 3
    rounds = [select_prompt_indices(n, per, k, seed=7) for k in range(1, 5)]  # 12 draws: epoch 0 + 2 of epoch 1
    first_epoch = np.concatenate(rounds)[:10]
    assert sorted(first_epoch.tolist()) == list(range(10))  # every prompt once before any repeats
    second = np.concatenate(rounds)[10:]
    assert len(set(second.tolist())) == 2
    assert second.tolist() == epoch_permutation(10, 3, 7, 1)[:2].tolist()  # the next epoch's head


def test_a_round_across_an_epoch_boundary_never_holds_a_prompt_twice():
    # 10 prompts, 3 per round: round 4 takes epoch 0's last prompt and epoch 1's first two. Seed 0's
    # plain permutations collide there (epoch 1 starts with epoch 0's last prompt); the head swaps it
    # with the next prompt of the epoch instead. Every epoch stays a permutation.
    plain0, plain1 = (np.random.default_rng([0, e]).permutation(10) for e in (0, 1))
    assert plain0[9] in plain1[:2]  # the collision this test is about
    r4 = select_prompt_indices(10, 3, 4, seed=0)
    assert len(set(r4.tolist())) == 3 and r4[0] == plain0[9]
    for seed in range(50):
        for n, per in ((10, 3), (7, 4), (11, 10), (3, 2)):
            draws = np.concatenate([select_prompt_indices(n, per, k, seed) for k in range(1, 3 * n + 1)])
            rounds = draws.reshape(-1, per)
            assert all(len(set(r.tolist())) == per for r in rounds), (seed, n, per)
            for e in range(len(draws) // n):
                assert sorted(draws[e * n:(e + 1) * n].tolist()) == list(range(n)), (seed, n, per, e)


def test_epochs_without_a_collision_are_the_plain_seeded_permutation():
    from pipeline.stages.rollout import epoch_permutation

    # 40 prompts, 4 per round: no round straddles an epoch, so nothing is ever swapped
    for e in range(3):
        assert epoch_permutation(40, 4, 7, e).tolist() == np.random.default_rng([7, e]).permutation(40).tolist()


def test_selection_is_reproducible_and_seeded():
    a = select_prompt_indices(100, 8, 3, seed=1)
    assert a.tolist() == select_prompt_indices(100, 8, 3, seed=1).tolist()
    assert a.tolist() != select_prompt_indices(100, 8, 3, seed=2).tolist()


def test_more_prompts_per_round_than_exist_is_an_error():
    with pytest.raises(ValueError, match="prompts_per_round=11 exceeds the 10 prompts"):
        select_prompt_indices(10, 11, 1, seed=0)


# ---------------------------------------------------------------- dynamic sampling (DAPO §3.2)
def test_filter_groups_keeps_the_first_groups_with_signal():
    # groups: all right, mixed, all wrong, mixed (worked by hand in filter_groups' docstring)
    outcomes = [[True, True], [False, True], [False, False], [True, False]]
    assert filter_groups(outcomes, 2) == ([1, 3], 0)
    assert filter_groups(outcomes, 1) == ([1], 0)


def test_filter_groups_fills_up_with_groups_without_signal_in_sampling_order():
    outcomes = [[True, True], [False, True], [False, False], [True, False]]
    assert filter_groups(outcomes, 3) == ([0, 1, 3], 1)
    assert filter_groups(outcomes, 4) == ([0, 1, 2, 3], 2)
    assert filter_groups([[False] * 4, [True] * 4, [False] * 4], 2) == ([0, 1], 2)


def test_has_signal_needs_both_outcomes_in_the_group():
    assert has_signal([True, False, False, False]) and has_signal([True, True, True, False])
    assert not has_signal([False] * 4) and not has_signal([True] * 4)


def test_extra_batches_skip_the_prompts_already_sampled_and_are_seeded():
    first = select_prompt_indices(10, 3, 2, seed=5)
    extra = extra_prompt_indices(10, 3, 2, 5, batch=1, exclude=first.tolist())
    assert len(extra) == 3 and not set(extra.tolist()) & set(first.tolist())
    assert extra.tolist() == extra_prompt_indices(10, 3, 2, 5, batch=1, exclude=first.tolist()).tolist()
    second = extra_prompt_indices(10, 3, 2, 5, batch=2, exclude=first.tolist() + extra.tolist())
    assert not set(second.tolist()) & (set(first.tolist()) | set(extra.tolist()))
    # the set runs out: 9 of 10 already sampled leaves one
    assert extra_prompt_indices(10, 3, 2, 5, batch=3, exclude=list(range(9))).tolist() == [9]


def test_the_rollout_key_holds_dynamic_sampling_only_when_it_is_on(tmp_path):
    from pipeline.config import load_config
    from pipeline.stages.rollout import rollout_settings

    base = [f"runs_dir={tmp_path}", f"data_dir={tmp_path}"]
    off, off5, on = (rollout_settings(load_config(None, base + x)) for x in
                     ([], ["rollout.max_gen_batches=5"], ["rollout.dynamic_sampling=true"]))
    assert off == off5 and "dynamic_sampling" not in off and "max_gen_batches" not in off
    assert {k: on["dynamic_sampling"][k] for k in ("dynamic_sampling", "max_gen_batches")} == {
        "dynamic_sampling": True, "max_gen_batches": 3}
    # the grading that picks the groups is part of the key: another verify rule, other rollouts
    assert on["dynamic_sampling"]["verify"] == {"answer": "boxed", "truncated": "zero"}
    assert on["dynamic_sampling"]["verifier"].startswith("math-verify==")
    other = rollout_settings(load_config(None, base + ["rollout.dynamic_sampling=true", "verify.answer=any"]))
    assert other["dynamic_sampling"]["verify"] == {"answer": "any", "truncated": "zero"}
    assert {k: v for k, v in on.items() if k != "dynamic_sampling"} == off


def test_the_rollout_key_holds_the_instruction_that_steps_mode_picks(tmp_path):
    """``steps.mode=step_tag`` asks the policy for ``<step k>`` markers: rollouts sampled under the
    blank-line instruction must not be reused for it (their segmentation would find no marker)."""
    from pipeline.config import DEFAULT_INSTRUCTIONS, load_config
    from pipeline.stages.rollout import rollout_settings

    base = [f"runs_dir={tmp_path}", f"data_dir={tmp_path}"]
    blank, tag, line = (rollout_settings(load_config(None, base + [f"steps.mode={m}"]))
                        for m in ("blank_line", "step_tag", "line"))
    assert blank["instruction"] is None  # the default mode's key is the one it always was
    assert tag["instruction"] == DEFAULT_INSTRUCTIONS["step_tag"] and "<step 1>" in tag["instruction"]
    assert line["instruction"] == DEFAULT_INSTRUCTIONS["line"]
    assert len({str(blank), str(tag), str(line)}) == 3
    # an explicit instruction is the key's, whatever the mode
    mine = rollout_settings(load_config(None, base + ["steps.mode=step_tag", "rollout.instruction=Box it."]))
    assert mine["instruction"] == "Box it."
    # an empty instruction is no instruction: the mode's default is given, and keyed
    empty = rollout_settings(load_config(None, base + ["steps.mode=step_tag", "rollout.instruction=''"]))
    assert empty["instruction"] == DEFAULT_INSTRUCTIONS["step_tag"]


class _FakeEngine:
    """A policy engine that records its life (no model); ``generate`` fails like a dead engine."""

    made: list["_FakeEngine"] = []

    def __init__(self, *a, **kw) -> None:
        self.closed = False
        _FakeEngine.made.append(self)

    def generate(self, *a, **kw):
        raise RuntimeError("engine died")

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    import pipeline.engines.host as host
    from pipeline.config import load_config
    from tests.toy_round import toy_config

    toy_config(tmp_path)  # the two-prompt file toy.jsonl
    _FakeEngine.made = []
    monkeypatch.setattr(host, "policy_engine", _FakeEngine)

    def cfg(*extra: str):
        return load_config(None, [f"runs_dir={tmp_path / 'runs'}", f"data_dir={tmp_path / 'data'}",
                                  f"data.train_prompts={tmp_path / 'toy.jsonl'}", "rollout.policy=org/hand-policy",
                                  *extra])
    return cfg


def test_too_many_prompts_per_round_fail_before_the_policy_engine_starts(fake_engine):
    from pipeline.stages.rollout import rollout_stage

    with pytest.raises(ValueError, match="data.prompts_per_round=5 exceeds the 2 prompts available"):
        rollout_stage(fake_engine("data.prompts_per_round=5"), 1)
    assert _FakeEngine.made == []


def test_the_policy_engine_is_closed_when_sampling_fails(fake_engine):
    from pipeline.stages.rollout import rollout_stage

    with pytest.raises(RuntimeError, match="engine died"):
        rollout_stage(fake_engine("data.prompts_per_round=2"), 1)
    assert len(_FakeEngine.made) == 1 and _FakeEngine.made[0].closed
