"""Benchmark scripts that write an evidence file refuse one that exists, before any work."""

from __future__ import annotations

import pytest

from tests.conftest import load_benchmark


@pytest.mark.parametrize("name, args", [
    ("bench_signal", []),
    ("bench_reference", ["--source-run", "nowhere", "--config", "nowhere.yaml"]),
    ("bench_trainer_gpu", ["--model", "nowhere"]),
])
def test_an_existing_out_file_is_refused_untouched(name, args, tmp_path, capsys):
    out = tmp_path / "evidence.jsonl"
    out.write_text('{"kept": true}\n')
    with pytest.raises(SystemExit) as e:
        load_benchmark(name).main([*args, "--out", str(out)])
    assert e.value.code == 2 and f"--out {out} exists" in capsys.readouterr().err
    assert out.read_text() == '{"kept": true}\n'
