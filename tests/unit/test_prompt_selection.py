"""Prompts are drawn per round without repetition until the set is used up, then a new epoch."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.stages.rollout import select_prompt_indices


def test_rounds_take_disjoint_slices_of_one_permutation_per_epoch():
    n, per = 10, 3
    rounds = [select_prompt_indices(n, per, k, seed=7) for k in range(1, 5)]  # 12 draws: epoch 0 + 2 of epoch 1
    first_epoch = np.concatenate(rounds)[:10]
    assert sorted(first_epoch.tolist()) == list(range(10))  # every prompt once before any repeats
    second = np.concatenate(rounds)[10:]
    assert len(set(second.tolist())) == 2
    assert first_epoch.tolist() != np.concatenate(rounds)[10:].tolist()


def test_selection_is_reproducible_and_seeded():
    a = select_prompt_indices(100, 8, 3, seed=1)
    assert a.tolist() == select_prompt_indices(100, 8, 3, seed=1).tolist()
    assert a.tolist() != select_prompt_indices(100, 8, 3, seed=2).tolist()


def test_more_prompts_per_round_than_exist_is_an_error():
    with pytest.raises(ValueError, match="prompts_per_round=11 exceeds the 10 prompts"):
        select_prompt_indices(10, 11, 1, seed=0)
