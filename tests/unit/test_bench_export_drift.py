"""The export-drift measurement (benchmarks/bench_export_drift.py) on hand-made weights.

The benchmark reads a real run's fp32 master weights and its starting policy; here only its
arithmetic: which updates survive the cast to ``train.save_dtype`` when the start sits on the bf16
grid (as the shipped bf16-valued policy does), and the shares, norms, cosine and slope it prints.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_export_drift")


def test_bf16_deadzone_by_hand(bench):
    # bf16 spacing: 2^-8 in [0.5, 1), 2^-7 in [1, 2), 2^-6 in [2, 4); a weight on the grid moves in
    # the cast only when its update passes half a spacing:
    #   1.0 + 0.001 -> 1.0 (0.001 < 2^-8)          1.0 + 0.005 -> 1.0078125 (0.005 > 2^-8)
    #   0.5 + 0.001 -> 0.5 (0.001 < 2^-9)          -2.0 - 0.02 -> -2.015625 (nearest of -2.0, -2.015625, -2.03125)
    w0 = torch.tensor([1.0, 1.0, 0.5, -2.0])
    w = w0 + torch.tensor([0.001, 0.005, 0.001, -0.02])
    acc: dict[str, float] = {}
    dc = bench.accumulate(acc, w0, w, torch.bfloat16)
    assert dc.tolist() == [0.0, 0.0078125, 0.0, -0.015625]
    s = bench.summarize(acc)
    assert s["elements"] == 4 and s["share_moved_fp32"] == 1.0 and s["share_moved_cast"] == 0.5
    # <d, d> = 1e-6 + 25e-6 + 1e-6 + 400e-6 = 4.27e-4; <dc, dc> = 2^-14 + 2^-12 = 3.0518e-4;
    # <d, dc> = 0.005 * 2^-7 + 0.02 * 2^-6 = 3.515625e-4
    assert s["l2_update_fp32"] == pytest.approx(4.27e-4 ** 0.5, rel=1e-4)
    assert s["l2_update_cast"] == pytest.approx(3.0517578125e-4 ** 0.5, rel=1e-6)
    assert s["slope_cast_on_fp32"] == pytest.approx(3.515625e-4 / 4.27e-4, rel=1e-4)  # 0.823
    assert s["cosine"] == pytest.approx(3.515625e-4 / (4.27e-4 * 3.0517578125e-4) ** 0.5, rel=1e-4)  # 0.974


def test_small_updates_vanish_and_sums_accumulate(bench):
    # every update below half a spacing: the cast keeps the start exactly (slope 0); a second
    # tensor exported in float32 keeps its whole update (slope 1); the running sums add both
    w0 = torch.tensor([[0.25, -0.125], [1.5, 3.0]])
    w = w0 + 1e-4
    acc: dict[str, float] = {}
    assert bench.accumulate(acc, w0, w, torch.bfloat16).abs().sum() == 0
    s = bench.summarize(acc)
    assert s["share_moved_cast"] == 0.0 and s["slope_cast_on_fp32"] == 0.0 and s["l2_update_cast"] == 0.0
    acc32: dict[str, float] = {}
    bench.accumulate(acc32, w0, w, torch.float32)
    assert bench.summarize(acc32)["slope_cast_on_fp32"] == pytest.approx(1.0)
    bench.accumulate(acc, w0, w, torch.float32)
    both = bench.summarize(acc)
    assert both["elements"] == 8 and both["share_moved_cast"] == 0.5 and both["slope_cast_on_fp32"] == pytest.approx(0.5)


def test_shape_mismatch_names_both(bench):
    with pytest.raises(ValueError, match=r"start shape \(2,\) != trained shape \(3,\)"):
        bench.accumulate({}, torch.zeros(2), torch.zeros(3), torch.bfloat16)


def test_main_on_files(bench, tmp_path, monkeypatch, capsys):
    import json

    from safetensors.torch import save_file

    w0 = torch.tensor([1.0, 1.0, 0.5, -2.0])
    w = w0 + torch.tensor([0.001, 0.005, 0.001, -0.02])
    for d, tensors in (("start", {"model.layers.0.mlp.up_proj.weight": w0.to(torch.bfloat16)}),
                       ("state", {"model.layers.0.mlp.up_proj.weight": w}),
                       ("ckpt", {"model.layers.0.mlp.up_proj.weight": w.to(torch.bfloat16)}),
                       ("lora", {"model.layers.0.mlp.up_proj.lora_A.weight": w})):
        (tmp_path / d).mkdir()
        save_file(tensors, tmp_path / d / "model.safetensors")
    argv = ["bench_export_drift.py", "--start", str(tmp_path / "start"), "--state", str(tmp_path / "state"),
            "--checkpoint", str(tmp_path / "ckpt")]
    monkeypatch.setattr("sys.argv", argv)
    bench.main()
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    by = {x.get("tensors"): x for x in lines}
    assert by["all"]["share_moved_cast"] == 0.5 and by["linear"]["slope_cast_on_fp32"] == pytest.approx(0.8233, abs=1e-4)
    assert lines[-1]["checkpoint_elements_compared"] == 4 and lines[-1]["checkpoint_elements_not_the_cast"] == 0
    monkeypatch.setattr("sys.argv", [*argv[:4], str(tmp_path / "lora")])
    with pytest.raises(SystemExit, match="no tensor of .* matched"):
        bench.main()
