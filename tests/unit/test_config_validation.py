"""Bad config input gets a clear error naming the value and what would be valid.
One row per bad input; each is tried through the same path a user takes (overrides or a file)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipeline.config import load_config

BAD_OVERRIDES = [
    # (overrides, words the message must contain)
    (["rollout.group_size=true"], ["group_size=True", "a number is expected"]),
    (["rollout.group_size=1"], ["group_size", "greater than or equal to 2"]),
    (["critique.num_critiques=-1"], ["num_critiques", "greater than or equal to 0"]),
    (["critique.num_critiques=0"], ["vote.sources", "num_critiques=0"]),
    (["rollout.sampling.temperature=.inf"], ["temperature", "finite"]),
    (["train.learning_rate=.inf"], ["learning_rate", "finite"]),
    (["train.learning_rate=.nan"], ["learning_rate", "finite"]),
    (["train.kl_coef=-0.1"], ["kl_coef", "greater than or equal to 0"]),
    (["reward.correct_weight=.inf"], ["correct_weight", "finite"]),
    (["reward.process_weight=-1"], ["process_weight", "greater than or equal to 0"]),
    (["vote.majority_threshold=1.5"], ["majority_threshold", "less than 1"]),
    (["rollout.sampling.max_tokens=4096"], ["rollout max_tokens=4096", "max_model_len=2048"]),
    (["critique.sampling.max_tokens=5000"], ["critique max_tokens=5000", "max_model_len=4096"]),
    (["eval.max_tokens=2048"], ["eval max_tokens=2048", "max_model_len=2048"]),
    (["rollout.engine.type=openai"], ["rollout.engine.type=openai cannot serve the policy", "valid: vllm, transformers"]),
    (["eval.engine.type=openai"], ["eval.engine.type=openai cannot evaluate the policy", "valid: vllm, transformers"]),
    (["rollout.policy=/no/such/checkpoint"], ["rollout.policy='/no/such/checkpoint' is not a checkpoint folder"]),
    (["critique.critic=./missing/critic/dir"], ["critique.critic='./missing/critic/dir'", "embedded model"]),
    (["run_id=a/b"], ["run_id", "pattern"]),
    (["critique.enabled=yes please"], ["enabled", "bool"]),
    (["vote.rule=unanimous"], ["rule", "'intersection'", "'union'"]),
    (["rollout.group_size"], ["must look like section.key=value"]),
    (["vote.rule=[unclosed"], ["not valid YAML"]),
    (["scale.child_silence_s=0"], ["child_silence_s", "greater than 0"]),
    (["scale.child_silence_s=-30"], ["child_silence_s", "greater than 0"]),
    (["scale.child_silence_s=.inf"], ["child_silence_s", "finite"]),
    (["scale.child_silence_s=true"], ["child_silence_s=True", "a number is expected"]),
    (["scale.child_silence_s=soon"], ["child_silence_s", "valid number"]),
    (["data.train_split=validation"], ["data.train_split='validation'", "embedded gsm8k has the splits 'train' and 'test'"]),
    (["data.train_prompts=math", "data.train_split=dev"], ["data.train_split='dev'", "embedded math"]),
    (["critique.structured_output=true", "critique.engine.type=transformers"],
     ["critique.structured_output=true needs an engine", "vllm, or openai", "'transformers'"]),
    (["eval.benchmarks=[gsm8k, aime24, gsm8k]"], ["eval.benchmarks=['gsm8k', 'aime24', 'gsm8k'] names 'gsm8k' more than once"]),
    (["eval.pass_k=4", "eval.pass_k_benchmarks=[aime24, aime24]"], ["eval.pass_k_benchmarks", "names 'aime24' more than once"]),
    (["eval.pass_k=4", "eval.pass_k_benchmarks=[aime24]"],
     ["eval.pass_k_benchmarks names 'aime24', which eval.benchmarks ['gsm8k', 'math500'] does not hold",
      "valid: a subset of eval.benchmarks"]),
    (["eval.pass_k_benchmarks=[gsm8k]"], ["eval.pass_k_benchmarks=['gsm8k'] has no effect with eval.pass_k=1",
                                          "set eval.pass_k > 1"]),
    (["eval.pass_k=4", "eval.pass_k_benchmarks=[]"], ["eval.pass_k_benchmarks=[] gives no benchmark the eval.pass_k=4 samples"]),
]


@pytest.mark.parametrize("overrides,words", BAD_OVERRIDES, ids=[o[0] for o, _ in BAD_OVERRIDES])
def test_bad_override_is_refused_with_a_clear_message(overrides, words):
    with pytest.raises((ValidationError, ValueError)) as err:
        load_config(None, overrides)
    msg = str(err.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


BAD_ESTIMATOR_SETTINGS = [
    # (preset, overrides, words): a rival estimator under a setting it would ignore, refused
    ("grpo", ["reward.estimator=grpo-lambda"], ["train.ratio_trace is not set", "preset grpo-lambda"]),
    ("grpo-lambda", ["reward.scale_by_std=false"], ["floors advantages at -0.1", "would change what it floors", "set reward.scale_by_std=true"]),
    ("vineppo", ["reward.scale_by_std=false"], ["whitens its advantages", "set reward.scale_by_std=true"]),
    ("grpo-lambda", ["reward.process_weight=1", "critique.enabled=true"],
     ["reward.estimator=grpo-lambda is sequence-level", "would ignore the process reward"]),
    ("vineppo", ["reward.overlong_buffer=64", "reward.correct_weight=0"],
     ["divides the overlong penalty by reward.correct_weight", "reward.correct_weight is 0"]),
    ("grpo", ["reward.estimator=fipo"], ["train.future_kl is not set", "preset fipo"]),
    ("fipo", ["reward.process_weight=1", "critique.enabled=true"], ["reward.estimator=fipo is sequence-level"]),
    ("densr", ["critique.enabled=true"], ["reward.estimator=densr weights each token", "set critique.enabled=false"]),
    # a rival's loss term under another method's name
    ("grpo", ["train.ratio_trace.kappa=0.99"], ["would train GRPO-λ while token_rewards and the variant name grpo",
                                                "reward.estimator=grpo-lambda"]),
    ("fipo", ["train.ratio_trace.kappa=0.99"], ["would train GRPO-λ", "name fipo"]),
    ("grpo", ["train.future_kl.half_life=32"], ["would train FIPO while token_rewards and the variant name grpo",
                                               "reward.estimator=fipo"]),
    ("grpo-lambda", ["train.future_kl.half_life=32"], ["would train FIPO", "name grpo-lambda"]),
]


@pytest.mark.parametrize("preset,overrides,words", BAD_ESTIMATOR_SETTINGS,
                         ids=[f"{p}:{' '.join(o)}" for p, o, _ in BAD_ESTIMATOR_SETTINGS])
def test_an_estimator_under_a_setting_it_would_ignore_is_refused(preset, overrides, words):
    with pytest.raises((ValidationError, ValueError)) as err:
        load_config(None, overrides, preset=preset)
    msg = str(err.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    load_config(None, [], preset=preset)  # the preset itself is valid


def test_a_leading_zero_run_id_stays_as_written(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("run_id: 0123\nseed: 010\n")
    cfg = load_config(f)
    assert cfg.run_id == "0123" and cfg.seed == 10  # not octal 83 / 8
    assert load_config(None, ["run_id=0123"]).run_id == "0123"


@pytest.mark.parametrize("text,words", [
    ("vote:\n  rule: union\nvote:\n  rule: average\n", ["duplicate key 'vote'", "lines 1 and 3"]),
    ("reward:\n  correct_weight: 2\n  correct_weight: 3\n", ["duplicate key 'correct_weight'"]),
    ("- just\n- a list\n", ["must hold a mapping"]),
    ("vote: [unclosed\n", ["is not valid YAML"]),
])
def test_bad_config_file_is_refused_naming_the_file(tmp_path, text, words):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ValueError) as err:
        load_config(f)
    assert all(w in str(err.value) for w in words) and "bad.yaml" in str(err.value)


def test_a_config_file_that_is_not_utf8_is_named(tmp_path):
    f = tmp_path / "latin1.yaml"
    f.write_bytes("run_id: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.yaml' is not UTF-8 text"):
        load_config(f)


def test_valid_references_still_load(tmp_path):
    ckpt = tmp_path / "my" / "policy" / "ckpt"
    ckpt.mkdir(parents=True)
    cfg = load_config(None, [f"rollout.policy={ckpt}", "critique.critic=Qwen/Qwen2.5-72B-Instruct",
                             "critique.engine.type=openai", "critique.engine.base_url=http://127.0.0.1:8000/v1"])
    assert cfg.rollout.policy == str(ckpt) and cfg.critique.engine.type == "openai"
    assert load_config(None, []).scale.child_silence_s == 1800.0
    assert load_config(None, ["scale.child_silence_s=null"]).scale.child_silence_s is None  # never stopped
    assert load_config(None, ["scale.child_silence_s=90"]).scale.child_silence_s == 90.0
    assert load_config(None, ["train.learning_rate=1e-5"]).train.learning_rate == 1e-5  # YAML 1.1 reads 1e-5 as text


def test_pass_k_benchmarks_that_are_a_subset_still_load():
    cfg = load_config(None, ["eval.benchmarks=[gsm8k, aime24]", "eval.pass_k=4", "eval.pass_k_benchmarks=[aime24]"])
    assert cfg.eval.pass_k_benchmarks == ["aime24"]
    assert load_config(None, ["eval.pass_k=4"]).eval.pass_k_benchmarks is None  # unset: all of them
