"""``bench_learning.py`` frees a finished round's disk: superseded weights go, other superseded
outputs stay."""

from __future__ import annotations

from pipeline import storage
from tests.conftest import load_benchmark


def test_pruning_a_round_deletes_superseded_weights_and_keeps_superseded_tables(tmp_path):
    bench = load_benchmark("bench_learning")
    variant = tmp_path / "round_001" / "variants" / "grpo"
    for name in ("checkpoint", "train_state"):
        (variant / name).mkdir(parents=True)
        (variant / name / "model.safetensors").write_bytes(b"w" * 10)
        storage.manifest_path(variant / name).write_text("{}")
    (variant / "eval.parquet").write_bytes(b"PAR1")
    storage.manifest_path(variant / "eval.parquet").write_text("{}")
    moved = [storage.supersede(variant / n) for n in ("checkpoint", "train_state", "eval.parquet")]
    gone = bench._prune_superseded_weights(variant / "superseded")
    left = sorted(p.name for p in (variant / "superseded").iterdir())
    assert moved[2].name in left and storage.manifest_path(moved[2]).name in left  # the superseded eval and its manifest
    assert len(left) == 2 and len(gone) == 4  # both weights folders and both of their manifests deleted
    assert not moved[0].exists() and not moved[1].exists()
