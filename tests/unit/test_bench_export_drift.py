"""The export-drift measurement (benchmarks/bench_export_drift.py) on hand-made weights.

The benchmark reads a real run's fp32 master weights and its starting policy; here the script on
hand-made files (its arithmetic, train/drift.py, is worked by hand in tests/unit/test_drift.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_export_drift")


def test_main_on_files(bench, tmp_path, monkeypatch, capsys):
    import json

    from safetensors.torch import save_file

    w0 = torch.tensor([1.0, 1.0, 0.5, -2.0])
    w = w0 + torch.tensor([0.001, 0.005, 0.001, -0.02])
    n0 = torch.tensor([1.0, 1.0])  # a norm whose update (1e-4) stays inside half a bf16 step (2^-8 at 1.0)
    for d, tensors in (("start", {"model.layers.0.mlp.up_proj.weight": w0.to(torch.bfloat16),
                                  "model.norm.weight": n0.to(torch.bfloat16)}),
                       ("state", {"model.layers.0.mlp.up_proj.weight": w, "model.norm.weight": n0 + 1e-4}),
                       ("ckpt", {"model.layers.0.mlp.up_proj.weight": w.to(torch.bfloat16)}),
                       ("lora", {"model.layers.0.mlp.up_proj.lora_A.weight": w})):
        (tmp_path / d).mkdir()
        save_file(tensors, tmp_path / d / "model.safetensors")
    argv = ["bench_export_drift.py", "--start", str(tmp_path / "start"), "--state", str(tmp_path / "state"),
            "--checkpoint", str(tmp_path / "ckpt")]
    monkeypatch.setattr("sys.argv", argv)
    bench.main()

    def strict(token):
        raise ValueError(f"not JSON: {token}")

    lines = [json.loads(x, parse_constant=strict) for x in capsys.readouterr().out.splitlines()]
    by = {x.get("tensors"): x for x in lines}
    # the norm's cast did not move: no cosine (null, not NaN, which is not JSON), a slope of 0
    assert by["norm"]["cosine"] is None and by["norm"]["slope_cast_on_fp32"] == 0.0
    assert by["all"]["share_moved_cast"] == 2 / 6 and by["linear"]["share_moved_cast"] == 0.5
    assert by["linear"]["slope_cast_on_fp32"] == pytest.approx(0.8233, abs=1e-4)
    assert lines[-1]["checkpoint_elements_compared"] == 4 and lines[-1]["checkpoint_elements_not_the_cast"] == 0
    assert lines[-1]["cpu_model"] and "native_bf16" in lines[-1]
    monkeypatch.setattr("sys.argv", [*argv[:4], str(tmp_path / "lora")])
    with pytest.raises(SystemExit, match="no tensor of .* matched"):
        bench.main()
