"""Run configuration: YAML defaults, dotted overrides, validation, section hashes (pipeline/config.py)."""

from pathlib import Path

import pydantic
import pytest
from pydantic import ValidationError

from pipeline.config import (
    CAPOConfig,
    TransformersEngineConfig,
    dump_config,
    load_config,
    parse_overrides,
    section_hash,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "configs" / "default.yaml"
TINY = REPO / "configs" / "tiny.yaml"


def test_default_yaml_loads_and_matches_embedded_defaults():
    cfg = load_config(DEFAULT)
    assert cfg.rollout.policy == "qwen2.5-coder-0.5b-instruct"
    # the main job trains capo-readout: the readout and the arithmetic check, no sampled critique
    assert (cfg.rollout.group_size, cfg.critique.num_critiques) == (4, 0)
    assert cfg.variant == "capo-readout" and cfg.critique.logprob_readout
    assert (cfg.vote.sources, cfg.vote.logprob_threshold) == (["arithmetic", "logprob"], 0.8)
    assert (cfg.reward.correct_weight, cfg.reward.process_weight) == (2.0, 1.0)
    assert cfg.vote.rule == "majority" and cfg.steps.mode == "blank_line"
    # the paper's presets over it sample N = 4 critiques; a file's own N and an override are kept
    assert load_config(DEFAULT, preset="capo-majority").critique.num_critiques == 4
    assert load_config(DEFAULT, preset="grpo-genorm").critique.num_critiques == 4
    assert load_config(DEFAULT, ["critique.num_critiques=2"], preset="capo-union").critique.num_critiques == 2
    assert load_config(TINY, preset="capo-union").critique.num_critiques == 2
    assert load_config(DEFAULT, preset="grpo").critique.num_critiques == 0
    # the overrides decide whether critiques vote: none sampled when they do not, N = 4 when they do
    assert load_config(DEFAULT, ["vote.sources=[arithmetic]"], preset="capo-majority").critique.num_critiques == 0
    assert load_config(DEFAULT, ["vote.sources=[llm]", "critique.logprob_readout=false"],
                       preset="capo-logprob-arithmetic").critique.num_critiques == 4
    # structured critiques: on with the vllm critic, off (and not refused) with the others
    assert cfg.critique.structured_output is True
    for engine in ("{type: transformers}", "{type: openai, base_url: 'http://127.0.0.1:8000/v1'}"):
        assert load_config(DEFAULT, [f"critique.engine={engine}"], preset="capo-majority").critique.structured_output is False
    assert load_config(DEFAULT, ["critique.engine={type: openai, base_url: 'http://127.0.0.1:8000/v1'}",
                                 "critique.structured_output=true"], preset="capo-majority").critique.structured_output is True
    # the readout needs the critic's weights: a served critic is refused with the fix named
    with pytest.raises(pydantic.ValidationError, match="logprob_readout=false"):
        load_config(DEFAULT, ["critique.engine={type: openai, base_url: 'http://127.0.0.1:8000/v1'}"])
    assert cfg.critique.engine.type == "vllm" and cfg.critique.engine.max_model_len == 4096
    # the verifier reads a boxed answer of a finished response (outcome reward and eval alike)
    assert (cfg.verify.answer, cfg.verify.truncated) == ("boxed", "zero")
    # one source of defaults: the YAML is the pydantic field defaults (the paper's capo-majority)
    # under the capo-readout preset
    assert load_config(DEFAULT) == load_config(None, preset="capo-readout")
    assert load_config(None) == CAPOConfig() and CAPOConfig().variant == "capo-majority"
    assert load_config(None, preset="capo-majority") == CAPOConfig()


def test_tiny_yaml_loads():
    cfg = load_config(TINY)
    assert cfg.run_id == "tiny"
    assert cfg.rollout.policy == cfg.critique.critic == "smollm2-135m-instruct"
    assert (cfg.rollout.group_size, cfg.critique.num_critiques, cfg.data.prompts_per_round) == (2, 2, 2)
    assert cfg.rollout.engine.dtype == "float32" and cfg.rollout.sampling.max_tokens == 48
    assert cfg.train.save_dtype == "float32"


def test_overrides_parse_to_typed_values():
    assert parse_overrides(["vote.rule=union", "critique.num_critiques=8", "critique.enabled=false",
                            "train.launcher=[accelerate, launch]"]) == {
        "vote": {"rule": "union"},
        "critique": {"num_critiques": 8, "enabled": False},
        "train": {"launcher": ["accelerate", "launch"]},
    }
    cfg = load_config(DEFAULT, ["vote.rule=union", "critique.num_critiques=8", "reward.process_weight=0.5"])
    assert cfg.vote.rule == "union"
    assert cfg.critique.num_critiques == 8 and isinstance(cfg.critique.num_critiques, int)
    assert cfg.reward.process_weight == 0.5
    assert cfg.critique.critic == "qwen2.5-coder-1.5b-instruct"  # untouched siblings survive the merge
    assert load_config(DEFAULT, {"vote": {"rule": "majority"}}).vote.rule == "majority"


def test_override_without_equals_sign_is_rejected():
    with pytest.raises(ValueError, match="section.key=value"):
        parse_overrides(["vote.rule"])


def test_bad_choice_lists_the_valid_ones():
    with pytest.raises(ValidationError) as err:
        load_config(DEFAULT, ["vote.rule=bogus"])
    msg = str(err.value)
    assert "vote.rule" in msg and "bogus" in msg
    for valid in ("intersection", "union", "majority", "average"):
        assert valid in msg
    with pytest.raises(ValidationError) as err:
        load_config(DEFAULT, ["verify.truncated=drop"])
    assert "verify.truncated" in str(err.value) and "'zero' or 'grade'" in str(err.value)


def test_bad_number_is_rejected():
    with pytest.raises(ValidationError, match="num_critiques"):
        load_config(DEFAULT, ["critique.num_critiques=-1"])
    with pytest.raises(ValidationError, match="num_critiques=0 samples none"):  # the sampled critiques vote
        load_config(DEFAULT, ["critique.num_critiques=0"], preset="capo-majority")
    with pytest.raises(ValidationError, match="group_size"):
        load_config(DEFAULT, ["rollout.group_size=four"])


def test_unknown_key_is_rejected():
    with pytest.raises(ValidationError, match="num_critics"):
        load_config(DEFAULT, ["critique.num_critics=8"])
    with pytest.raises(ValidationError, match="votes"):
        load_config(DEFAULT, ["votes.rule=union"])


def test_c_must_exceed_p():
    with pytest.raises(ValidationError) as err:
        load_config(DEFAULT, ["reward.correct_weight=1", "reward.process_weight=1"])
    msg = str(err.value)
    assert "C=1.0" in msg and "P=1.0" in msg
    with pytest.raises(ValidationError, match="C=1.0"):
        load_config(DEFAULT, ["reward.process_weight=1.5", "reward.correct_weight=1"])
    # P = 0 (no process reward) allows any C; C > P is fine
    assert load_config(DEFAULT, ["reward.process_weight=0", "reward.correct_weight=0.5"]).reward.process_weight == 0
    assert load_config(DEFAULT, ["reward.process_weight=1.9"]).reward.process_weight == 1.9


def test_switching_engine_type_by_override_drops_the_old_variants_fields():
    # default.yaml gives the critic vLLM fields (max_model_len, kv_cache_gib) that a transformers
    # or openai engine does not have; switching the type must not merge them in.
    cfg = load_config(DEFAULT, ["critique.engine.type=transformers"])
    assert cfg.critique.engine == TransformersEngineConfig()
    assert cfg.rollout.engine.type == "vllm"
    cfg = load_config(DEFAULT, ["critique.engine.type=openai", "critique.engine.max_concurrency=4"], preset="capo-majority")
    assert cfg.critique.engine.type == "openai" and cfg.critique.engine.max_concurrency == 4
    # same type: fields merge as usual
    cfg = load_config(DEFAULT, ["critique.engine.max_num_seqs=4"])
    assert (cfg.critique.engine.max_num_seqs, cfg.critique.engine.max_model_len) == (4, 4096)
    with pytest.raises(ValidationError, match="batch_size"):
        load_config(DEFAULT, ["critique.engine.batch_size=4"])  # a transformers field on a vllm engine


def test_section_hash_changes_only_with_its_section():
    base = load_config(DEFAULT)
    union = load_config(DEFAULT, ["vote.rule=union"])
    assert section_hash(base, "critique") == section_hash(union, "critique")
    assert section_hash(base, "rollout", "steps") == section_hash(union, "rollout", "steps")
    assert section_hash(base, "vote") != section_hash(union, "vote")
    assert section_hash(base, "critique", "vote") != section_hash(union, "critique", "vote")
    assert section_hash(base) != section_hash(union)
    assert section_hash(base, "vote") == section_hash(load_config(DEFAULT), "vote")  # deterministic
    assert len(section_hash(base)) == 16
    n8 = load_config(DEFAULT, ["critique.num_critiques=8"])
    assert section_hash(base, "critique") != section_hash(n8, "critique")
    assert section_hash(base, "vote", "reward") == section_hash(n8, "vote", "reward")


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(TINY, ["vote.rule=average"])
    f = tmp_path / "resolved.yaml"
    f.write_text(dump_config(cfg))
    assert load_config(f) == cfg


def test_config_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="default.yaml"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(bad)


def test_paths_and_round_dir(tmp_path):
    cfg = CAPOConfig(runs_dir=str(tmp_path / "runs"), run_id="exp1")
    assert cfg.round_dir(3) == tmp_path / "runs" / "exp1" / "round_003"
    assert cfg.round_dir(0) == tmp_path / "runs" / "exp1" / "round_000"  # the starting policy's eval
    with pytest.raises(ValueError, match=">= 0"):
        cfg.round_dir(-1)
    with pytest.raises(ValidationError, match="run_id"):
        CAPOConfig(run_id="../escape")
