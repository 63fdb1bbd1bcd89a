"""bench_rivals.py's arms: each arm's config from a finished round's settings, and the round's tables
shared by hard links (the source never written)."""

from __future__ import annotations

import os

import pytest

from pipeline.config import load_config
from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_rivals")


def test_each_arm_runs_its_method_on_the_sources_settings(bench, repo, tmp_path):
    resolved = load_config(repo / "configs" / "default.yaml", ["run_id=src", "eval.sample_size=4"]).model_dump(mode="json")
    cfgs = {arm: bench.arm_config(resolved, arm, tmp_path) for arm in bench.ARM_STAGES}
    assert {a: c.reward.estimator for a, c in cfgs.items()} == {
        "grpo": "grpo", "capo": "capo-token-group", "grpo-lambda": "grpo-lambda", "fipo": "fipo",
        "vineppo": "vineppo", "densr": "densr"}
    assert cfgs["capo"].critique.enabled and not any(c.critique.enabled for a, c in cfgs.items() if a != "capo")
    assert cfgs["fipo"].train.future_kl is not None and cfgs["grpo-lambda"].train.ratio_trace is not None
    for arm, c in cfgs.items():  # the source's settings, in a run of the arm's own
        assert (c.run_id, c.variant, c.runs_dir) == (f"rivals-{arm}", arm, str(tmp_path))
        assert c.eval.sample_size == 4 and c.rollout.group_size == resolved["rollout"]["group_size"]
    from pipeline.stages import REGISTRY

    for arm, stages in bench.ARM_STAGES.items():  # every stage listed for an arm runs under its config
        assert not [s for s in stages if REGISTRY[s].not_applicable(cfgs[arm])], arm


def test_the_round_is_shared_by_hard_links(bench, repo, tmp_path):
    src = tmp_path / "src" / "round_001"
    src.mkdir(parents=True)
    for name in ("rollouts", "outcomes", "steps", "critiques"):
        for suffix in ("", ".manifest.json"):
            (src / f"{name}.parquet{suffix}").write_text(name)
    resolved = load_config(repo / "configs" / "default.yaml").model_dump(mode="json")
    cfg = bench.arm_config(resolved, "grpo", tmp_path / "runs")
    bench.link_round(tmp_path / "src", cfg, 1, "grpo")
    dst = tmp_path / "runs" / "rivals-grpo" / "round_001"
    assert sorted(p.name for p in dst.iterdir() if p.is_file()) == sorted(
        f"{n}.parquet{s}" for n in ("rollouts", "outcomes", "steps") for s in ("", ".manifest.json"))
    assert os.path.samefile(dst / "rollouts.parquet", src / "rollouts.parquet")
    with pytest.raises(ValueError, match="only round 1 is supported"):
        bench.link_round(tmp_path / "src", cfg, 2, "grpo")
    (src / "critiques.parquet").unlink()
    with pytest.raises(FileNotFoundError, match="lacks the critiques table"):
        bench.link_round(tmp_path / "src", bench.arm_config(resolved, "capo", tmp_path / "runs"), 1, "capo")
