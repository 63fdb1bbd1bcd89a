"""The learning benchmark's held-out hygiene on the real data: the shipped MAWPS selection against
the held-out subset, recomputed, equals the committed record that docs/benchmarks.md quotes."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.assets.overlap import masked_text
from tests.conftest import REPO, load_benchmark


def test_shipped_selection_twins_equal_the_committed_record(data_dir, tmp_path):
    bench = load_benchmark("bench_learning")
    (line,) = [json.loads(x) for x in (REPO / "docs" / "data" / "heldout-hygiene-mawps.jsonl").read_text().splitlines()]
    rec = line["hygiene"]
    a = bench.parser().parse_args(["--data-dir", str(data_dir), "--runs-dir", str(tmp_path / "runs")])
    held = bench.heldout_texts(a)
    assert len(held) == rec["held_out"] == a.eval_size
    shipped = REPO / "benchmarks" / "selections" / Path(rec["training_file"]).name
    copy = tmp_path / shipped.name  # the clean file is written beside its input: not into the repo
    copy.write_bytes(shipped.read_bytes())
    out, got = bench.remove_heldout_twins(copy, held, a.prompts_per_round)
    for k in ("training_rows", "held_out", "removed", "kept", "removed_origins"):
        assert got[k] == rec[k], (k, got[k], rec[k])
    # each removed problem has a held-out twin, and no kept one has
    keys = {masked_text(h) for h in held}
    rows = [json.loads(x) for x in shipped.read_text().splitlines()]
    kept = [json.loads(x) for x in out.read_text().splitlines()]
    assert all(masked_text(r["question"]) in keys for r in rows if r["origin"] in rec["removed_origins"])
    assert not any(masked_text(r["question"]) in keys for r in kept) and len(kept) == rec["kept"]


def test_the_committed_matrix_resumes_under_todays_code(data_dir, tmp_path):
    """The matrix's finished runs, committed in docs/data/learning-readout-3seeds.jsonl, are carried
    by its documented command on today's code (same settings ids, nothing refused): a change to the
    benchmark's settings that would make the matrix refuse its own evidence, or run a finished run
    again, fails here instead of on the machine that resumes it."""
    bench = load_benchmark("bench_learning")
    evidence = REPO / "docs" / "data" / "learning-readout-3seeds.jsonl"
    lines = [json.loads(x) for x in evidence.read_text().splitlines()]
    final = next(x for x in reversed(lines) if "settings" in x)
    finished = {(x["items"], x["seed"]) for x in lines if "items" in x and x["round"] == final["rounds"]}
    a = bench.parser().parse_args(["--data-dir", str(data_dir), "--runs-dir", str(tmp_path / "runs"),
                                   "--arms", "capo", "grpo", "random-credit", "--seeds", "0", "1", "2"])
    shipped = Path(bench.shipped_selection(a))
    copy = tmp_path / shipped.name
    copy.write_bytes(shipped.read_bytes())
    train_file, _ = bench.remove_heldout_twins(copy, bench.heldout_texts(a), a.prompts_per_round)
    for arm, seed in sorted(finished):
        assert bench.settings_id(a, arm, seed, train_file) == final["settings"][f"{arm}-s{seed}"], (arm, seed)
    carried, _ = bench.carried_runs(a, evidence, train_file, set())
    assert set(carried) == finished and len(finished) >= 5
    assert all(len(c["items"]) == 2 and c["rows"] for c in carried.values())
