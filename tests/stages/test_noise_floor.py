"""The eval noise floor's pieces with numbers worked by hand: the one-rounding checkpoint copy
and the pairing of two eval tables. The measurement on a real round runs in
tests/slow/test_round_integration.py (test_noise_floor_of_a_real_round)."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.noise_floor import one_rounding_copy, paired_rows
from pipeline.schemas import EVAL_SCHEMA


def _ckpt(tmp_path, tensors: dict) -> str:
    src = tmp_path / "src"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "toy"}))
    return str(src)


def test_fp32_checkpoint_is_rounded_to_bf16(tmp_path):
    # 1 + 2^-10 is below half a bf16 step at 1 (2^-7 / 2): rounds to 1.0; the others are bf16 values
    w = torch.tensor([1.0, 1.0 + 2**-10, 0.0, -3.0], dtype=torch.float32)
    ids = torch.tensor([1, 2, 3])
    info = one_rounding_copy(_ckpt(tmp_path, {"w": w, "ids": ids}), tmp_path / "dst")
    out = load_file(str(tmp_path / "dst" / "model.safetensors"))
    assert info["perturbation"] == "rounded to bf16"
    assert out["w"].dtype == torch.float32 and out["w"].tolist() == [1.0, 1.0, 0.0, -3.0]
    assert torch.equal(out["ids"], ids)
    assert info["changed_share"] == pytest.approx(1 / 4)
    assert info["max_rel_change"] == pytest.approx(2**-10 / (1 + 2**-10))
    assert json.loads((tmp_path / "dst" / "config.json").read_text()) == {"model_type": "toy"}
    assert not list(tmp_path.glob(".dst.tmp"))


def test_bf16_valued_checkpoint_moves_every_nonzero_weight_by_one_step(tmp_path):
    # bf16 steps: at 1.0 up 2^-7, down 2^-8 (1.0 starts a binade); at 2.0 up 2^-6, down 2^-7; at 0.5 up 2^-8
    w = torch.tensor([1.0, 0.0, -2.0, 0.5], dtype=torch.bfloat16)
    info = one_rounding_copy(_ckpt(tmp_path, {"w": w}), tmp_path / "dst", seed=3)
    out = load_file(str(tmp_path / "dst" / "model.safetensors"))["w"]
    assert info["perturbation"] == "one bf16 step" and out.dtype == torch.bfloat16
    assert out[1] == 0.0
    assert float(out[0]) in (1.0 + 2**-7, 1.0 - 2**-8)
    assert float(out[2]) in (-2.0 - 2**-6, -2.0 + 2**-7)
    assert float(out[3]) in (0.5 + 2**-8, 0.5 - 2**-9)
    assert info["changed_share"] == pytest.approx(3 / 4)
    assert 2**-9 <= info["max_rel_change"] <= 2**-7


def test_missing_weights_name_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        one_rounding_copy(tmp_path, tmp_path / "dst")


def _eval(correct: list[bool], texts: list[str], bench: str = "gsm8k") -> pa.Table:
    rows = [{"run_id": "r", "round": 0, "variant": None, "policy": "p", "benchmark": bench, "prompt_id": f"q{i}",
             "decoding": "greedy", "sample_idx": 0, "gold_answer": "1", "response_text": t, "num_tokens": 3,
             "finish_reason": "stop", "extracted_answer": None, "correct": c, "verify_status": "ok"}
            for i, (c, t) in enumerate(zip(correct, texts))]
    return pa.Table.from_pylist(rows, schema=EVAL_SCHEMA)


def test_paired_rows_count_flips_and_identical_text():
    base = _eval([True, False, True, False], ["a", "b", "c", "d"])
    other = _eval([True, True, False, False], ["a", "B", "C", "d"])
    (r,) = paired_rows(base, other)
    assert r["benchmark"] == "gsm8k" and r["n"] == 4
    assert r["diff"] == 0.0 and r["n10"] == 1 and r["n01"] == 1  # one right->wrong, one wrong->right
    assert r["same_text"] == 0.5 and not r["significant"]
    assert r["p_mcnemar"] == 1.0
