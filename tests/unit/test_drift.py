"""The share of the fp32 update that the exported checkpoint carries (train/drift.py), by hand.

bf16 spacing: 2^-8 in [0.5, 1), 2^-7 in [1, 2), 2^-6 in [2, 4); a weight on the grid moves in the
cast only when its update passes half a spacing (the dead zone of docs/benchmarks.md).
"""

from __future__ import annotations

import math

import pytest
import torch

from train.drift import WeightFiles, canonical_name, checkpoint_drift, summarize, sums_against, update_sums


def test_bf16_deadzone_by_hand():
    #   1.0 + 0.001 -> 1.0 (0.001 < 2^-8)          1.0 + 0.005 -> 1.0078125 (0.005 > 2^-8)
    #   0.5 + 0.001 -> 0.5 (0.001 < 2^-9)          -2.0 - 0.02 -> -2.015625 (nearest of -2.0, -2.015625, -2.03125)
    w0 = torch.tensor([1.0, 1.0, 0.5, -2.0])
    w = w0 + torch.tensor([0.001, 0.005, 0.001, -0.02])
    acc: dict[str, float] = {}
    update_sums(acc, w0, w, torch.bfloat16)
    s = summarize(acc)
    assert s["elements"] == 4 and s["share_moved_fp32"] == 1.0 and s["share_moved_cast"] == 0.5
    # <d, d> = 1e-6 + 25e-6 + 1e-6 + 400e-6 = 4.27e-4; <dc, dc> = 2^-14 + 2^-12 = 3.0518e-4;
    # <d, dc> = 0.005 * 2^-7 + 0.02 * 2^-6 = 3.515625e-4
    assert s["l2_update_fp32"] == pytest.approx(4.27e-4 ** 0.5, rel=1e-4)
    assert s["l2_update_cast"] == pytest.approx(3.0517578125e-4 ** 0.5, rel=1e-6)
    assert s["slope_cast_on_fp32"] == pytest.approx(3.515625e-4 / 4.27e-4, rel=1e-4)  # 0.823
    assert s["cosine"] == pytest.approx(3.515625e-4 / (4.27e-4 * 3.0517578125e-4) ** 0.5, rel=1e-4)  # 0.974


def test_a_later_round_catches_up_what_earlier_rounds_left_in_the_dead_zone():
    # round k-1 left the master at 1 + 2^-9 (off the grid) and exported 1.0; round k adds 2^-8:
    # 1 + 2^-9 + 2^-8 = 1 + 0.75 * 2^-7 rounds up to 1 + 2^-7. The round's fp32 update is 2^-8, the
    # engine's 2^-7: slope 2 (the cast carries the earlier round's remainder too)
    prev, prev_engine = torch.tensor([1.0 + 2 ** -9]), torch.tensor([1.0])
    w = prev + 2 ** -8
    acc: dict[str, float] = {}
    update_sums(acc, prev, w, torch.bfloat16, ref_engine=prev_engine)
    s = summarize(acc)
    assert s["slope_cast_on_fp32"] == 2.0 and s["cosine"] == 1.0
    assert s["l2_update_fp32"] == 2 ** -8 and s["l2_update_cast"] == 2 ** -7


def test_small_updates_vanish_sums_accumulate_and_slices_add_up():
    # every update below half a spacing: the cast keeps the start exactly (slope 0); a second
    # tensor exported in float32 keeps its whole update (slope 1); the running sums add both
    w0 = torch.tensor([[0.25, -0.125], [1.5, 3.0]])
    w = w0 + 1e-4
    acc: dict[str, float] = {}
    update_sums(acc, w0, w, torch.bfloat16)
    s = summarize(acc)
    assert s["share_moved_cast"] == 0.0 and s["slope_cast_on_fp32"] == 0.0 and s["l2_update_cast"] == 0.0
    assert math.isnan(s["cosine"])  # no engine update: no direction
    acc32: dict[str, float] = {}
    update_sums(acc32, w0, w, torch.float32, chunk=3)  # slices of 3 over 4 elements
    assert summarize(acc32)["slope_cast_on_fp32"] == 1.0 and summarize(acc32)["share_moved_cast"] == 1.0
    update_sums(acc, w0, w, torch.float32)
    both = summarize(acc)
    assert both["elements"] == 8 and both["share_moved_cast"] == 0.5 and both["slope_cast_on_fp32"] == pytest.approx(0.5)


def test_no_update_gives_nan_and_empty_sums_raise():
    acc: dict[str, float] = {}
    update_sums(acc, torch.ones(3), torch.ones(3), torch.bfloat16)
    s = summarize(acc)
    assert s["share_moved_fp32"] == 0.0 and math.isnan(s["slope_cast_on_fp32"])
    with pytest.raises(ValueError, match="no weights were compared"):
        summarize({})


def test_shape_mismatch_names_both_and_leaves_the_sums_alone():
    with pytest.raises(ValueError, match=r"master shape \(2,\) != trained shape \(3,\)"):
        update_sums({}, torch.zeros(2), torch.zeros(3), torch.bfloat16)
    acc: dict[str, float] = {}
    with pytest.raises(ValueError, match=r"reference 1: engine shape \(2,\) != trained shape \(3,\)"):
        sums_against(torch.zeros(3), [(acc, torch.zeros(3), None), ({}, torch.zeros(3), torch.zeros(2))], torch.bfloat16)
    assert acc == {}


def test_an_fp32_start_off_the_grid_is_not_counted_as_an_export_move():
    # the engine never saw 1.001 (fp32 start): it saw its bf16 cast 1.0, so no update moves nothing
    w0 = torch.tensor([1.001, 0.3, -0.7])
    acc: dict[str, float] = {}
    update_sums(acc, w0, w0.clone(), torch.bfloat16)
    assert summarize(acc)["share_moved_cast"] == 0.0


def test_canonical_names_drop_the_wrappers_prefixes():
    assert canonical_name("module.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert canonical_name("_orig_mod.lm_head.weight") == "lm_head.weight"
    assert canonical_name("model.norm.weight") == "model.norm.weight"
    assert canonical_name("_orig_mod.module.model.norm.weight") == "model.norm.weight"


def _save(path, tensors):
    from safetensors.torch import save_file

    path.mkdir()
    save_file(tensors, path / "model.safetensors")
    return path


def test_checkpoint_drift_of_rounds_1_and_2_from_files(tmp_path):
    """Round 1 against the start; round 2 against round 1's state and checkpoint, with the start
    still the reference of the run's share. One tensor of 4 elements, plus a buffer the start lacks."""
    name = "model.layers.0.mlp.up_proj.weight"
    w0 = torch.tensor([1.0, 1.0, 0.5, -2.0])
    start = _save(tmp_path / "start", {name: w0.to(torch.bfloat16)})
    w1 = w0 + torch.tensor([0.001, 0.005, 0.001, -0.02])
    r1 = checkpoint_drift([("module." + name, w1), ("model.rotary.inv_freq", torch.ones(2))], "bfloat16", start)
    assert r1["master_moved_frac"] == 1.0 and r1["export_moved_frac"] == 0.5
    assert r1["export_update_share"] == pytest.approx(0.8233, abs=1e-4)  # the slope worked in the first test
    assert r1["export_update_share_from_start"] == r1["export_update_share"]
    state1 = _save(tmp_path / "state1", {name: w1})
    ckpt1 = _save(tmp_path / "ckpt1", {name: w1.to(torch.bfloat16)})
    # round 2 moves only the first element, by 0.004: 1.005 -> bf16 1.0078125 (round 1's 0.001 and
    # this round's 0.004 crossed half a spacing together); the engine's change 2^-7, the master's 0.004
    w2 = w1 + torch.tensor([0.004, 0.0, 0.0, 0.0])
    r2 = checkpoint_drift([(name, w2)], "bfloat16", start, state1, ckpt1)
    assert r2["master_moved_frac"] == 0.25 and r2["export_moved_frac"] == 0.25
    assert r2["export_update_share"] == pytest.approx(2 ** -7 / 0.004, rel=1e-4)  # 1.95: the remainder caught up
    # since the start: d = (0.005, 0.005, 0.001, -0.02), dc = (2^-7, 2^-7, 0, -2^-6)
    dd, dc = 0.005 ** 2 * 2 + 0.001 ** 2 + 0.02 ** 2, 0.005 * 2 ** -7 * 2 + 0.02 * 2 ** -6
    assert r2["export_update_share_from_start"] == pytest.approx(dc / dd, rel=1e-4)
    r32 = checkpoint_drift([(name, w2)], "float32", start, state1, _save(tmp_path / "ckpt1f", {name: w1}))
    assert r32["export_update_share"] == 1.0 and r32["export_update_share_from_start"] == 1.0


def test_checkpoint_drift_refuses_bad_input(tmp_path):
    name = "model.embed_tokens.weight"
    start = _save(tmp_path / "start", {name: torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="save_dtype 'fp8' is not one of"):
        checkpoint_drift([(name, torch.ones(2, 2))], "fp8", start)
    with pytest.raises(ValueError, match="no weight matched by name in all of .*start"):
        checkpoint_drift([("base_model.model.x.lora_A.weight", torch.ones(2, 2))], "bfloat16", start)
    with pytest.raises(ValueError, match="go together"):
        checkpoint_drift([(name, torch.ones(2, 2))], "bfloat16", start, prev_master=start)
    with pytest.raises(FileNotFoundError, match="no .safetensors file under .*nowhere"):
        WeightFiles(tmp_path / "nowhere")
