"""Presets and impossible combinations fail before any work starts, naming the valid choices."""

from __future__ import annotations

import pydantic
import pytest

from pipeline.config import list_presets, load_config

PRESETS = ["capo-arithmetic", "capo-average", "capo-intersection", "capo-logprob-arithmetic", "capo-majority",
           "capo-majority-arithmetic", "capo-readout", "capo-union", "densr", "fipo", "grpo", "grpo-genorm",
           "grpo-lambda", "vineppo"]
SOURCES = {"capo-arithmetic": ["arithmetic"], "capo-majority-arithmetic": ["llm", "arithmetic"],
           "capo-logprob-arithmetic": ["arithmetic", "logprob"], "capo-readout": ["arithmetic", "logprob"]}


def test_every_paper_variant_is_a_preset():
    assert list_presets() == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_preset_names_the_variant_and_is_coherent(name):
    cfg = load_config("configs/default.yaml", preset=name)
    assert cfg.variant == name
    if name.startswith("capo-"):
        assert cfg.vote.sources == SOURCES.get(name, ["llm"])  # the paper's variants: the critic alone
        assert cfg.critique.logprob_readout == ("logprob" in cfg.vote.sources)
        if "llm" in cfg.vote.sources:
            assert cfg.vote.rule == name.removeprefix("capo-").removesuffix("-arithmetic")
        assert cfg.critique.enabled and cfg.critique.mode == "process" and cfg.reward.process_weight == 1.0
    if name == "capo-readout":  # the checkers alone: no sampled critique, the held-out threshold
        assert cfg.critique.num_critiques == 0 and cfg.vote.logprob_threshold == 0.8
    if name == "grpo":
        assert not cfg.critique.enabled and cfg.reward.estimator == "grpo" and cfg.reward.process_weight == 0
    if name == "grpo-genorm":
        assert cfg.critique.mode == "outcome" and cfg.reward.outcome == "genorm"
    if name == "grpo-lambda":  # critic-free: the traced ratio in the loss, GRPO's advantage floored at -0.1
        assert not cfg.critique.enabled and cfg.reward.estimator == "grpo-lambda" and cfg.reward.process_weight == 0
        assert (cfg.train.ratio_trace.kappa, cfg.train.ratio_trace.style) == (0.99, "recent")
    if name != "grpo-lambda":
        assert cfg.train.ratio_trace is None
    if name == "fipo":  # critic-free: GRPO's advantage under its own name, weighted per token in the loss
        assert not cfg.critique.enabled and cfg.reward.estimator == "fipo" and cfg.train.future_kl.half_life == 32
        assert cfg.train.num_mini_batches >= 2  # inert at one optimizer step per round
    else:
        assert cfg.train.future_kl is None


def test_overrides_win_over_the_preset():
    cfg = load_config("configs/default.yaml", ["reward.process_weight=0.5", "variant=u-p05"], preset="capo-union")
    assert (cfg.vote.rule, cfg.reward.process_weight, cfg.variant) == ("union", 0.5, "u-p05")


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown preset 'capo-vote'; valid: \['capo-arithmetic', 'capo-average'"):
        load_config("configs/default.yaml", preset="capo-vote")


@pytest.mark.parametrize("overrides, message", [
    (["reward.estimator=grpo"], "sequence-level and would ignore the process reward"),
    (["critique.enabled=false"], "needs step critiques"),
    (["critique.mode=outcome", "critique.num_critiques=4"], "needs step critiques"),
    (["reward.outcome=genorm", "reward.process_weight=0"], "reward.outcome=genorm needs critique.enabled=true"),
    (["reward.correct_weight=1", "reward.process_weight=1"], "must be > reward.process_weight"),
    (["vote.rule=plurality"], "intersection"),
    (["train.loss_agg_mode=sum"], "token-mean"),
])
def test_impossible_combinations_fail_early(overrides, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        load_config("configs/default.yaml", overrides)


def test_step_tag_mode_asks_the_policy_for_markers():
    cfg = load_config("configs/default.yaml", ["steps.mode=step_tag"])
    assert "<step 1>" in cfg.instruction() and "\\boxed{}" in cfg.instruction()
    assert "blank lines" in load_config("configs/default.yaml").instruction()


@pytest.mark.parametrize("overrides,words", [
    (["train.num_mini_batches=1"], ["this round makes 1", "min(train.num_mini_batches=1, 16)", "train.ppo_epochs=1"]),
    # 8 x 4 = 32 responses in one micro-batch of 32: two mini-batches asked, one made
    (["train.micro_batch_size=32"], ["this round makes 1", "32 responses", "train.micro_batch_size=32 are 1 micro-batch"]),
])
def test_fipo_with_one_optimizer_step_per_round_fails_early(overrides, words):
    with pytest.raises(pydantic.ValidationError) as err:
        load_config("configs/default.yaml", overrides, preset="fipo")
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    load_config("configs/default.yaml", ["train.micro_batch_size=16"], preset="fipo")  # 2 micro-batches: 2 steps
