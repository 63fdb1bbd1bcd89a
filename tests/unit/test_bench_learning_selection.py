"""``bench_learning.py --selection``: train on a given file of problems, never overwrite another."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_learning")


def _args(bench, tmp_path: Path, selection) -> object:
    a = bench.parser().parse_args(["--max-tokens", "320", "--data-dir", str(tmp_path / "data"),
                                   "--runs-dir", str(tmp_path / "runs")]
                                  + (["--selection", str(selection)] if selection else []))
    return a


def test_selection_is_copied_to_the_usual_path(bench, tmp_path):
    shipped = next((REPO / "benchmarks" / "selections").glob("learning-*.jsonl"))
    out = bench.select_training_items(_args(bench, tmp_path, shipped))
    assert out.name == shipped.name and out.parent == (tmp_path / "data" / "prompts").resolve()
    assert out.read_bytes() == shipped.read_bytes()
    assert sum(1 for _ in out.open()) == 42
    assert bench.select_training_items(_args(bench, tmp_path, shipped)) == out  # the same file again: fine


def test_selection_never_overwrites_another(bench, tmp_path):
    shipped = next((REPO / "benchmarks" / "selections").glob("learning-*.jsonl"))
    existing = tmp_path / "data" / "prompts" / shipped.name
    existing.parent.mkdir(parents=True)
    existing.write_text('{"question": "1+1?", "gold_answer": "2"}\n')
    with pytest.raises(SystemExit, match="differs from the selection already at.*--select-here"):
        bench.select_training_items(_args(bench, tmp_path, shipped))
    assert existing.read_text() == '{"question": "1+1?", "gold_answer": "2"}\n'
    with pytest.raises(SystemExit, match="no such file"):
        bench.select_training_items(_args(bench, tmp_path, tmp_path / "missing.jsonl"))


def test_selection_for_other_settings_is_refused(bench, tmp_path):
    shipped = next((REPO / "benchmarks" / "selections").glob("learning-*.jsonl"))
    a = bench.parser().parse_args(["--max-tokens", "192", "--data-dir", str(tmp_path / "data"),
                                   "--selection", str(shipped)])
    with pytest.raises(SystemExit, match="made for other settings"):
        bench.select_training_items(a)
    assert not (tmp_path / "data" / "prompts").exists() or not any((tmp_path / "data" / "prompts").iterdir())


def test_precision_fp32_is_the_default_and_auto_keeps_its_run_ids(bench, tmp_path):
    """The benchmark's default is the shipped defaults' fp32 policy (the same run ids as an explicit
    ``--precision fp32``); ``--precision auto`` puts the policy's dtypes back on ``auto`` without the
    dtype settings entering its run ids, so runs made under ``auto`` before the defaults became fp32
    resume instead of starting over."""
    shipped = next((REPO / "benchmarks" / "selections").glob("learning-*.jsonl"))
    base = _args(bench, tmp_path, shipped)
    train_file = bench.select_training_items(base)
    explicit = bench.parser().parse_args(["--max-tokens", "320", "--data-dir", str(tmp_path / "data"),
                                          "--runs-dir", str(tmp_path / "runs"), "--precision", "fp32"])
    assert base.precision == "fp32"
    assert bench.run_id(base, "capo", 0, train_file) == bench.run_id(explicit, "capo", 0, train_file)
    cfg = bench.arm_config(base, "capo", 0, train_file)
    assert (cfg.rollout.engine.dtype, cfg.train.mixed_precision, cfg.train.save_dtype) == ("float32", "no", "float32")

    auto = bench.parser().parse_args(["--max-tokens", "320", "--data-dir", str(tmp_path / "data"),
                                      "--runs-dir", str(tmp_path / "runs"), "--precision", "auto"])
    assert not [o for o in bench.base_overrides(auto, 0) if "dtype" in o and "save_dtype" not in o
                or "mixed_precision" in o]
    assert bench.run_id(auto, "capo", 0, train_file) != bench.run_id(base, "capo", 0, train_file)
    cfg = bench.arm_config(auto, "capo", 0, train_file)
    assert (cfg.rollout.engine.dtype, cfg.train.mixed_precision, cfg.train.save_dtype) == ("auto", "auto", "bfloat16")


def test_the_shipped_selection_is_the_default_where_the_settings_match(bench, tmp_path):
    """Run with no ``--selection``, the benchmark trains on the problems shipped for its settings (the
    same on every machine); ``--select-here`` and settings without a shipped file select anew."""
    shipped = next((REPO / "benchmarks" / "selections").glob("learning-*.jsonl"))
    a = bench.parser().parse_args(["--data-dir", str(tmp_path / "data")])
    assert bench.selection_name(a) == shipped.name
    assert bench.shipped_selection(a) == str(shipped)
    assert bench.shipped_selection(bench.parser().parse_args(["--select-here"])) is None
    assert bench.shipped_selection(bench.parser().parse_args(["--max-tokens", "192"])) is None
    given = str(tmp_path / "mine.jsonl")
    assert bench.shipped_selection(bench.parser().parse_args(["--selection", given])) == given


def test_the_bare_command_continues_the_documented_fp32_runs(bench, tmp_path):
    """``bench_learning.py`` with no flags has the run ids of the runs docs/benchmarks.md reports for
    fp32 at 16 per step (made with every flag spelled out), so it resumes or re-summarizes them."""
    shipped = next((REPO / "benchmarks" / "selections").glob("learning-*.jsonl"))
    where = ["--data-dir", str(tmp_path / "data"), "--runs-dir", str(tmp_path / "runs")]
    documented = bench.parser().parse_args(
        ["--lr", "2e-6", "--dynamic-sampling", "--eval-samples", "4", "--max-tokens", "320",
         "--prompts-per-round", "8", "--precision", "fp32", "--selection", str(shipped)] + where)
    bare = bench.parser().parse_args(where)
    bare.selection = bench.shipped_selection(bare)
    train_file = bench.select_training_items(documented)
    assert bench.select_training_items(bare) == train_file
    for arm in ("grpo", "capo", "control"):
        assert bench.run_id(bare, arm, 1, train_file) == bench.run_id(documented, arm, 1, train_file)


@pytest.mark.parametrize("flags, want", [
    # run ids as the benchmark computed them before its defaults changed (6dd67b5), on fixed paths; the CAPO
    # arm was then capo-majority with 2 critiques, which these flags name (the test adds them)
    (["--lr", "2e-6", "--max-tokens", "320", "--prompts-per-round", "8", "--dynamic-sampling", "--precision", "auto"],
     "learn-capo-s0-7cd48174"),
    (["--lr", "2e-6", "--max-tokens", "320", "--prompts-per-round", "8", "--dynamic-sampling", "--precision", "fp32"],
     "learn-capo-s0-71821b68"),
    (["--lr", "5e-6", "--max-tokens", "192", "--prompts-per-round", "4", "--no-dynamic-sampling", "--precision", "auto"],
     "learn-capo-s0-00fd9add"),
])
def test_run_ids_of_earlier_runs_are_kept(bench, flags, want):
    """Runs made before the defaults changed resume under the flags that spell their settings out."""
    a = bench.parser().parse_args(["--runs-dir", "/r", "--data-dir", "/d", "--capo-preset", "capo-majority",
                                   "--n", "2"] + flags)
    assert bench.run_id(a, "capo", 0, Path("/d/prompts/learning.jsonl")) == want
    # the CAPO arm of today's default (capo-readout, no sampled critique) is another run, named or not;
    # capo-majority with its own N is a third; the GRPO arm of the bare command keeps its earlier id
    today = bench.parser().parse_args(["--runs-dir", "/r", "--data-dir", "/d"] + flags)
    learning = Path("/d/prompts/learning.jsonl")
    named = bench.parser().parse_args(["--runs-dir", "/r", "--data-dir", "/d", "--capo-preset", "capo-readout"] + flags)
    majority4 = bench.parser().parse_args(["--runs-dir", "/r", "--data-dir", "/d", "--capo-preset", "capo-majority"] + flags)
    ids = {bench.run_id(x, "capo", 0, learning) for x in (today, majority4)} | {want}
    assert len(ids) == 3 and bench.run_id(named, "capo", 0, learning) == bench.run_id(today, "capo", 0, learning)
    assert bench.run_id(today, "grpo", 0, learning) == bench.run_id(a, "grpo", 0, learning)
    assert bench.arm_config(today, "capo", 0, Path("/d/prompts/learning.jsonl")).variant == "capo"
    cfg = bench.arm_config(today, "capo", 0, Path("/d/prompts/learning.jsonl"))
    assert (cfg.vote.sources, cfg.critique.num_critiques) == (["arithmetic", "logprob"], 0)
    old = bench.arm_config(a, "capo", 0, Path("/d/prompts/learning.jsonl"))
    assert (old.vote.sources, old.critique.num_critiques, old.critique.logprob_readout) == (["llm"], 2, False)
