"""Precision resolution (pipeline/precision.py) on given device capabilities, no such hardware needed."""

from __future__ import annotations

import logging

import pytest

from pipeline.config import load_config
from pipeline.precision import (
    DeviceInfo,
    announce,
    describe,
    native_bf16,
    precision_record,
    resolve_dtype,
    resolve_mixed_precision,
    resolve_save_dtype,
)

AVX2 = DeviceInfo("AMD EPYC 7B13", 2, "x86_64", "AVX2", frozenset({"avx", "avx2", "fma"}))
AVX512 = DeviceInfo("Intel Xeon Platinum 8259CL", 8, "x86_64", "AVX512", frozenset({"avx2", "avx512f", "avx512bw"}))
AVX512_BF16 = DeviceInfo("AMD EPYC 9R14", 8, "x86_64", "AVX512", frozenset({"avx2", "avx512f", "avx512_bf16"}))
AMX = DeviceInfo("Intel Xeon Platinum 8488C", 8, "x86_64", "AVX512", frozenset({"avx512f", "amx_bf16", "amx_tile"}))
ARM_BF16 = DeviceInfo("Neoverse-V1", 4, "aarch64", "SVE256", frozenset({"asimd", "bf16", "sve"}))
ARM_NO_BF16 = DeviceInfo("Cortex-A72", 4, "aarch64", "DEFAULT", frozenset({"asimd", "fp"}))
MAC_M2 = DeviceInfo("Apple M2", 8, "arm64", "DEFAULT", frozenset({"feat_bf16", "feat_fp16"}))
GPU_BF16 = DeviceInfo("AMD EPYC", 16, "x86_64", "AVX2", frozenset({"avx2"}), gpu_name="NVIDIA H100", gpu_bf16=True)
GPU_NO_BF16 = DeviceInfo("Intel Xeon", 8, "x86_64", "AVX2", frozenset({"avx2"}), gpu_name="Tesla T4", gpu_bf16=False)

#                         device        native  auto dtype   auto autocast
CASES = [pytest.param(AVX2, False, "float32", "no", id="avx2"),
         pytest.param(AVX512, False, "float32", "no", id="avx512-without-bf16"),
         pytest.param(AVX512_BF16, True, "bfloat16", "bf16", id="avx512-bf16"),
         pytest.param(AMX, True, "bfloat16", "bf16", id="amx"),
         pytest.param(ARM_BF16, True, "bfloat16", "bf16", id="arm-bf16"),
         pytest.param(ARM_NO_BF16, False, "float32", "no", id="arm-without-bf16"),
         pytest.param(MAC_M2, True, "bfloat16", "bf16", id="macos-feat-bf16"),
         pytest.param(GPU_BF16, True, "bfloat16", "bf16", id="gpu-bf16"),
         pytest.param(GPU_NO_BF16, False, "float16", "fp16", id="gpu-without-bf16")]


@pytest.mark.parametrize("info, native, dtype, autocast", CASES)
def test_auto_resolves_by_capability(info, native, dtype, autocast):
    assert native_bf16(info)[0] is native
    assert resolve_dtype("auto", info).value == dtype
    assert resolve_mixed_precision("auto", info).value == autocast
    assert not resolve_dtype("auto", info).slow and not resolve_mixed_precision("auto", info).slow


@pytest.mark.parametrize("info, native, dtype, autocast", CASES)
def test_explicit_choice_wins_and_bf16_is_slow_only_where_emulated(info, native, dtype, autocast):
    for req in ("float32", "bfloat16"):
        assert resolve_dtype(req, info).value == req
    assert resolve_dtype("bfloat16", info).slow is (not native)
    assert resolve_mixed_precision("bf16", info).slow is (not native)
    assert resolve_dtype("float32", info).slow is False
    assert resolve_mixed_precision("no", info).value == "no" and not resolve_mixed_precision("no", info).slow


def test_fp16_is_slow_on_a_cpu_without_native_fp16():
    assert resolve_dtype("float16", AVX2).slow
    assert not resolve_dtype("float16", GPU_NO_BF16).slow
    assert not resolve_dtype("float16", MAC_M2).slow


def test_avx2_reason_names_the_missing_feature():
    native, why = native_bf16(AVX2)
    assert not native and "AVX512-BF16" in why and "AVX2" in why


def test_bad_values_name_the_valid_ones():
    with pytest.raises(ValueError, match=r"'bf32'.*'auto'.*'float32'"):
        resolve_dtype("bf32", AVX2)
    with pytest.raises(ValueError, match=r"'yes'.*'bf16'"):
        resolve_mixed_precision("yes", AVX2)
    with pytest.raises(ValueError, match="resolved first"):
        resolve_save_dtype("auto", "auto")


def test_save_dtype_auto_follows_the_rollout_engine():
    assert resolve_save_dtype("auto", "bfloat16").value == "bfloat16"
    assert resolve_save_dtype("auto", "float32").value == "float32"
    assert resolve_save_dtype("float32", "bfloat16").value == "float32"


def test_explicit_slow_choice_warns_once(caplog):
    log = logging.getLogger("capo.test_precision")
    with caplog.at_level(logging.INFO, logger="capo.test_precision"):
        assert announce("test.dtype", resolve_dtype("bfloat16", AVX2), log) == "bfloat16"
        announce("test.dtype", resolve_dtype("bfloat16", AVX2), log)
        assert announce("test.other", resolve_dtype("auto", AVX2), log) == "float32"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "emulated" in warnings[0].getMessage()
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == ["test.other: float32 (auto: CPU (AVX2) has no AVX512-BF16 or AMX: bf16 would be emulated)"]


def test_default_config_keeps_the_policy_in_float32_and_the_critic_on_auto():
    """The policy is sampled, trained and exported in fp32 on every device (the precision of the
    learning benchmark's runs); only the critic follows ``auto``."""
    cfg = load_config("configs/default.yaml")
    rec = precision_record(cfg, AVX2)
    assert (rec["rollout_dtype"], rec["critique_dtype"], rec["eval_dtype"], rec["train_mixed_precision"],
            rec["train_save_dtype"]) == ("float32", "float32", "float32", "no", "float32")
    assert rec["device"]["torch_cpu_capability"] == "AVX2" and rec["device"]["cores"] == 2
    assert rec["device"]["cpu_model"] == "AMD EPYC 7B13"
    rec = precision_record(cfg, AMX)
    assert (rec["rollout_dtype"], rec["critique_dtype"], rec["eval_dtype"], rec["train_mixed_precision"],
            rec["train_save_dtype"]) == ("float32", "bfloat16", "float32", "no", "float32")
    assert "precision on CPU Intel Xeon Platinum 8488C" in describe(rec)
    # an engine named without a dtype keeps the policy in fp32 (the engine classes default to auto)
    for over in (["rollout.engine.type=transformers"], ["rollout.engine={type: vllm, max_model_len: 1024}"]):
        assert precision_record(load_config("configs/default.yaml", over), AMX)["rollout_dtype"] == "float32"
        assert precision_record(load_config(None, over), AMX)["rollout_dtype"] == "float32"
    # auto for the policy too: bf16 where native, the checkpoint following the rollout engine
    rec = precision_record(load_config("configs/default.yaml", ["rollout.engine.dtype=auto",
                                                                "train.mixed_precision=auto"]), AMX)
    assert (rec["rollout_dtype"], rec["critique_dtype"], rec["train_mixed_precision"], rec["train_save_dtype"]) == \
        ("bfloat16", "bfloat16", "bf16", "bfloat16")
    # an OpenAI critic: the server picks its dtype
    cfg = load_config("configs/default.yaml", ["critique.engine.type=openai"], preset="capo-majority")
    assert precision_record(cfg, AVX2)["critique_dtype"] == "server"
