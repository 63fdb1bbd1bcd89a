"""The ``capo`` command on bad input: a short usage error (exit status 2) that keeps the message
naming the bad value and the valid ones, before any lock or folder is made; ``capo sql`` runs only
statements that read; nothing is overwritten or made up silently. No model is loaded here."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

import flows.cli as cli


def _invoke(args, app=None):
    return CliRunner().invoke(app or cli.app, args)


def _text(res) -> str:
    """The command's output as one line of words (the error box wraps and frames the message)."""
    return " ".join(res.output.replace("│", " ").split())


def _usage_error(res) -> str:
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert isinstance(res.exception, SystemExit), res.exception  # not an uncaught exception's traceback
    return _text(res)


@pytest.fixture
def catalog(tmp_path):
    """A runs folder with one committed table and its catalog: ``(runs, table path)``."""
    from pipeline import storage

    runs = tmp_path / "runs"
    table = runs / "default" / "round_001" / "rollouts.parquet"
    table.parent.mkdir(parents=True)
    pq.write_table(pa.table({"rollout_id": ["a", "b"], "n": [1, 2]}), table)
    storage.refresh_catalog(runs)
    return runs, table


def test_capo_sql_refuses_a_copy_over_a_committed_table(catalog):
    runs, table = catalog
    before = table.read_bytes()
    for q in (f"COPY (SELECT 42 AS a) TO '{table}' (FORMAT parquet)",
              f"EXPLAIN ANALYZE COPY (SELECT 42 AS a) TO '{table}' (FORMAT parquet)",
              # a nested comment hiding the real statement behind an EXPLAIN SELECT a regex would find
              f"/* /* */ EXPLAIN SELECT 1 -- */ EXPLAIN ANALYZE COPY (SELECT 42 AS a) TO '{table}' (FORMAT parquet)",
              f"\n-- EXPLAIN SELECT 1\nEXPLAIN ANALYSE COPY (SELECT 42 AS a) TO '{table}' (FORMAT parquet)",
              "SELECT 1; COPY rollouts TO '" + str(table.parent / "x.csv") + "'",
              "PRAGMA table_info('rollouts')", "CREATE TABLE t AS SELECT 1", "SET threads = 1"):
        out = _usage_error(_invoke(["sql", q, "--runs-dir", str(runs)]))
        assert "capo sql is read-only" in out and "statements are refused" in out, (q, out)
        assert "Allowed: SELECT" in out
    assert "COPY statements are refused" in _text(_invoke(["sql", f"COPY rollouts TO '{table}'", "--runs-dir", str(runs)]))
    assert table.read_bytes() == before and not (table.parent / "x.csv").exists()
    # what reads still runs
    for q in ("SELECT count(*) AS n FROM rollouts", "DESCRIBE rollouts", "SHOW TABLES", "SUMMARIZE rollouts",
              "EXPLAIN ANALYZE SELECT * FROM rollouts", "/* a /* nested */ comment */ EXPLAIN SELECT 1",
              "SELECT name FROM pragma_table_info('rollouts')",
              "WITH x AS (SELECT 1 AS a) SELECT * FROM x"):
        res = _invoke(["sql", q, "--runs-dir", str(runs)])
        assert res.exit_code == 0, (q, res.output)
    assert "rollout_id" in _invoke(["sql", "DESCRIBE rollouts", "--runs-dir", str(runs)]).output


@pytest.mark.parametrize("query, message", [("SELEC 1", "Parser Error"),
                                            ("SELECT * FROM no_such_view", "Catalog Error")])
def test_capo_sql_errors_are_one_short_message(catalog, query, message):
    runs, _ = catalog
    res = _invoke(["sql", query, "--runs-dir", str(runs)])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert res.stderr.startswith(f"error: {message}") and len(res.stderr.splitlines()) < 8, res.stderr


@pytest.mark.parametrize("args, message", [
    (["--preset", "nope"], "unknown preset 'nope'; valid: ['capo-arithmetic',"),
    (["a.b"], "override 'a.b' must look like section.key=value"),
    (["bogus_key=1"], "bogus_key Extra inputs are not permitted"),
    (["vote.rule=bogus"], "vote.rule Input should be 'intersection', 'union', 'majority' or 'average'"),
    (["--config", "no/such/config.yaml"], "config file 'no/such/config.yaml' not found"),
])
def test_a_bad_config_is_a_usage_error_naming_it(tmp_path, args, message):
    res = _invoke(["round", "--config", "configs/tiny.yaml", *args, f"runs_dir={tmp_path}"])
    assert message in _usage_error(res)
    assert not any(tmp_path.iterdir())  # nothing written, no lock taken


def test_bad_config_of_check_and_critic_eval_is_a_usage_error(tmp_path):
    from flows.critic_eval import app as critic_eval_app

    assert "unknown preset 'bogus'" in _usage_error(_invoke(["check", "default", "--preset", "bogus",
                                                             f"runs_dir={tmp_path}"]))
    out = _usage_error(_invoke(["run", "bogus_key=1"], critic_eval_app))
    assert "bogus_key Extra inputs are not permitted" in out


def test_report_of_an_unknown_run_names_the_runs_there(catalog):
    runs, _ = catalog
    out = _usage_error(_invoke(["report", f"runs_dir={runs}", "run_id=nope"]))
    assert "no run 'nope' under" in out and "runs: ['default']" in out


def test_an_internal_error_still_shows_its_traceback(tmp_path, monkeypatch):
    import pipeline.config

    def broken(*a, **kw):
        raise KeyError("a bug")

    monkeypatch.setattr(pipeline.config, "load_config", broken)
    res = _invoke(["round", f"runs_dir={tmp_path}"])
    assert res.exit_code == 1 and isinstance(res.exception, KeyError)


@pytest.mark.parametrize("args", [["round", "--round", "0"], ["round", "--round", "-1"], ["run", "--rounds", "0"],
                                  ["run", "--start-round", "0"], ["stage", "eval", "--round", "-1"],
                                  ["stage", "rollout", "--round", "0"]])
def test_round_numbers_out_of_range_fail_before_the_lock(tmp_path, args):
    out = _usage_error(_invoke([*args, "--config", "configs/tiny.yaml", f"runs_dir={tmp_path}"]))
    assert "--round" in out or "--rounds" in out or "--start-round" in out
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args", [["round", "--round", "2"], ["run", "--start-round", "3", "--rounds", "1"]])
def test_a_round_without_the_previous_checkpoint_fails_before_the_lock(tmp_path, args):
    """Round k samples from round k-1's checkpoint: when it is missing the command says which round
    to run first, before the run lock or any folder is made."""
    k = int(args[2]) - 1
    out = _usage_error(_invoke([*args, "--config", "configs/tiny.yaml", f"runs_dir={tmp_path}"]))
    assert f"run round {k} first (capo round --round {k})" in out, out
    assert not any(tmp_path.iterdir())


def test_the_round_flow_checks_the_previous_checkpoint_before_the_lock(tmp_path):
    from flows.round import capo_round

    from flows.round import capo_run

    with pytest.raises(FileNotFoundError, match="run round 1 first"):
        capo_round.fn(round=2, config="configs/tiny.yaml", overrides=[f"runs_dir={tmp_path}"])
    with pytest.raises(FileNotFoundError, match="run round 2 first"):
        capo_run.fn(rounds=1, start_round=3, config="configs/tiny.yaml", overrides=[f"runs_dir={tmp_path}"])
    assert not any(tmp_path.iterdir())


def test_stage_eval_takes_round_0(tmp_path, monkeypatch):
    def lock(cfg):
        raise typer.Exit(7)  # reached the run lock: the arguments were accepted

    monkeypatch.setattr(cli, "_writing", lock)
    assert _invoke(["stage", "eval", "--round", "0", "--config", "configs/tiny.yaml", f"runs_dir={tmp_path}"]).exit_code == 7


def test_the_default_config_is_found_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = _usage_error(_invoke(["report", f"runs_dir={tmp_path}", "run_id=nope"]))
    assert "no run 'nope'" in out and "config file" not in out  # configs/default.yaml was read
    # a relative --config the user gives is still read from the current directory
    assert "config file 'configs/tiny.yaml' not found" in _usage_error(_invoke(["report", "--config", "configs/tiny.yaml"]))


def test_setup_refuses_an_unknown_model_before_converting_anything(tmp_path, monkeypatch):
    import pipeline.stages.base as base

    resolved = []
    monkeypatch.setattr(base, "resolve_model", lambda name, cfg: resolved.append(name) or f"/models/{name}")
    monkeypatch.setattr(base, "prompts_path", lambda cfg: tmp_path / "prompts.parquet")
    out = _usage_error(_invoke(["setup", "--config", "configs/tiny.yaml", "--model", "qwen-typo",
                                f"data_dir={tmp_path}"]))
    assert "'qwen-typo': not an embedded model" in out
    assert "qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b-instruct, smollm2-135m-instruct" in out
    assert resolved == []
    ckpt = tmp_path / "my-checkpoint"  # a local checkpoint folder is still accepted
    ckpt.mkdir()
    res = _invoke(["setup", "--config", "configs/tiny.yaml", "--model", str(ckpt), f"data_dir={tmp_path}"])
    assert res.exit_code == 0, res.output
    assert str(ckpt) in resolved


def test_critic_eval_bench_refuses_to_overwrite_its_out_file(tmp_path, monkeypatch):
    from critic_eval import stages as ces
    from flows.critic_eval import app as critic_eval_app

    def no_build(*a, **kw):
        raise AssertionError("the benchmark must not be built when --out exists")

    monkeypatch.setattr(ces, "benchmark_stage", no_build)
    out = tmp_path / "items.jsonl"
    out.write_text("keep\n")
    msg = _usage_error(_invoke(["bench", "--out", str(out), f"runs_dir={tmp_path}"], critic_eval_app))
    assert "exists; give a new file (nothing is overwritten)" in msg
    assert out.read_text() == "keep\n"


def test_catalog_refuses_a_runs_dir_that_does_not_exist(tmp_path):
    out = _usage_error(_invoke(["catalog", "--runs-dir", str(tmp_path / "typo"), "--data-dir", str(tmp_path)]))
    assert "--runs-dir" in out and "no folder" in out
    assert not (tmp_path / "typo").exists()


def test_check_browse_and_signal_find_a_run_by_one_rule(tmp_path, monkeypatch):
    """A run is ``<runs_dir>/<run>`` when that folder exists, else the folder ``run`` names; a run
    that is neither is one usage error listing the runs there, the same in the three commands."""
    runs = tmp_path / "runs"
    (runs / "r" / "round_001").mkdir(parents=True)
    (tmp_path / "elsewhere" / "round_000").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert cli._run_folder("r", runs) == runs / "r"
    assert cli._run_folder("elsewhere", runs) == Path("elsewhere")  # a folder in the working directory
    assert cli._run_folder(str(runs / "r"), "other-runs") == runs / "r"
    (tmp_path / "r").mkdir()  # a folder of the same name in the working directory: the run under runs_dir wins
    assert cli._run_folder("r", runs) == runs / "r"
    assert cli._run_folder(".", runs) == Path(".")  # a path, never <runs_dir>/. (the runs folder itself)
    for args in (["check", "nope", f"runs_dir={runs}"], ["browse", "nope", "--runs-dir", str(runs)],
                 ["signal", "nope", "--runs-dir", str(runs)]):
        out = _usage_error(_invoke(args))
        assert "no run 'nope' in" in out and "runs there: ['r']" in out, (args, out)


def test_report_into_a_folder_holding_the_users_report_md_is_a_usage_error(catalog, tmp_path):
    runs, _ = catalog
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("my notes")
    out = _usage_error(_invoke(["report", "--out-dir", str(mine), f"runs_dir={runs}", "run_id=default"]))
    assert "already holds report.md, not written by `capo report`" in out
    assert (mine / "report.md").read_text() == "my notes"


# ------------------------------------------------------------------ capo stage on stale inputs
def _hand_round(tmp_path, *extra: str):
    """Round 1's rollouts, steps and critiques (tests/toy_round.py's rows) committed under the keys
    their stages compute for configs/tiny.yaml with these overrides (no model: hub ids the keys
    only name): ``(overrides, cfg)``."""
    from pipeline import storage
    from pipeline.config import load_config
    from pipeline.stages.base import round_paths
    from pipeline.stages.critique import critique_key
    from pipeline.stages.rollout import rollout_key
    from pipeline.stages.segment import segment_key
    from tests.toy_round import toy_config, write_round

    toy_config(tmp_path)  # writes the prompt file toy.jsonl
    over = [f"runs_dir={tmp_path / 'runs'}", f"data_dir={tmp_path / 'data'}", "run_id=toy",
            f"data.train_prompts={tmp_path / 'toy.jsonl'}", "rollout.policy=org/hand-policy",
            "critique.critic=org/hand-critic", "rollout.instruction=Solve it step by step.", *extra]
    cfg = load_config("configs/tiny.yaml", over)
    write_round(cfg)
    p = round_paths(cfg, 1)
    for table, stage, key in (("rollouts", "rollout", rollout_key), ("steps", "segment", segment_key),
                              ("critiques", "critique", critique_key)):
        storage.commit_manifest(p[table], stage=stage, key=key(cfg, 1), rows=storage.read_manifest(p[table])["rows"])
    return over, cfg


def test_capo_stage_refuses_inputs_made_from_older_inputs(tmp_path):
    """Steps segmented again (another steps.mode) after the critiques were sampled: ``capo stage
    vote`` would vote the old critiques onto the new steps; it is a usage error naming the stale
    critiques and the stages to run first, and nothing is written."""
    from pipeline import storage
    from pipeline.config import load_config
    from pipeline.stages.base import round_paths
    from pipeline.stages.segment import segment_key

    over, cfg = _hand_round(tmp_path)
    args = ["stage", "vote", "--round", "1", "--config", "configs/tiny.yaml"]
    res = _invoke([*args, *over])  # consistent inputs: the vote runs
    assert res.exit_code == 0, (res.output, res.exception)
    verdicts = round_paths(cfg, 1)["step_verdicts"]
    before = verdicts.read_bytes()
    # `capo stage segment --force steps.mode=line`: two steps per response instead of three
    line = load_config("configs/tiny.yaml", [*over, "steps.mode=line"])
    steps = round_paths(cfg, 1)["steps"]
    rows = [{**r, "n_steps": 2} for r in storage.read_table(steps, "steps").to_pylist() if r["step_idx"] < 2]
    storage.write_table(pa.Table.from_pylist(rows, schema=pq.read_schema(steps)), steps, "steps", stage="segment",
                        key=segment_key(line, 1))
    out = _usage_error(_invoke([*args, *over, "steps.mode=line"]))
    assert "critiques.parquet (stage critique)" in out and "changed: ['steps']" in out, out
    assert "Run first, with the same config and overrides: capo stage critique --round 1" in out, out
    assert "or the whole round: capo round --round 1" in out
    assert "steps.parquet" not in out.split("not current under this config:")[1].split(". Run first")[0]  # current
    assert verdicts.read_bytes() == before  # nothing voted
    # the same under the config the steps were not made with: the steps are stale too, and listed first
    out = _usage_error(_invoke([*args, *over]))
    assert "steps.parquet (stage segment)" in out and "changed: ['steps']" in out, out
    assert "capo stage segment --round 1, then capo stage critique --round 1" in out, out
    # --allow-stale-inputs skips the check: the vote then meets the old critiques' step numbers
    res = _invoke([*args, "--allow-stale-inputs", *over, "steps.mode=line"])
    assert isinstance(res.exception, ValueError) and "wrong step indices" in str(res.exception), res.output


def test_a_missing_input_of_an_input_is_named_with_its_stage(tmp_path, monkeypatch):
    from pipeline.stages.base import round_paths

    over, cfg = _hand_round(tmp_path)
    round_paths(cfg, 1)["rollouts"].unlink()  # the critiques' and steps' rollouts are gone
    monkeypatch.setattr(cli, "_writing", lambda cfg: (_ for _ in ()).throw(AssertionError("took the lock")))
    out = _usage_error(_invoke(["stage", "vote", "--round", "1", "--config", "configs/tiny.yaml", *over]))
    assert "rollouts.parquet (stage rollout): rollouts.parquet does not exist" in out, out
    assert "capo stage rollout --round 1, then capo stage segment --round 1, then capo stage critique" in out, out


def test_a_stage_child_of_the_runner_does_not_check_its_inputs(tmp_path, monkeypatch):
    over, cfg = _hand_round(tmp_path)

    def lock(cfg):
        raise typer.Exit(7)  # reached the run lock: no input check refused it

    monkeypatch.setattr(cli, "_writing", lock)
    args = ["stage", "vote", "--round", "1", "--config", "configs/tiny.yaml", *over, "steps.mode=line"]
    assert _invoke(args).exit_code == 2  # the steps are stale under steps.mode=line
    monkeypatch.setenv("CAPO_CHILD", "1")
    assert _invoke(args).exit_code == 7


# ------------------------------------------------------------------ usage errors, not tracebacks
def test_stage_of_a_round_without_the_previous_checkpoint_fails_before_the_lock(tmp_path):
    out = _usage_error(_invoke(["stage", "rollout", "--round", "3", "--config", "configs/tiny.yaml",
                                f"runs_dir={tmp_path}"]))
    assert "run round 2 first (capo round --round 2)" in out and "--round" in out, out
    assert not any(tmp_path.iterdir())


def test_stage_shards_outside_the_plan_is_a_usage_error(tmp_path):
    over, cfg = _hand_round(tmp_path)  # 2 rollouts, critique.batch_rollouts=2: one shard
    out = _usage_error(_invoke(["stage", "critique", "--round", "1", "--shards", "0,99", "--config",
                                "configs/tiny.yaml", *over]))
    assert "critique shards [99] are not in round 1's plan (shards 0..0)" in out and "--shards" in out, out


@pytest.mark.parametrize("rnd, message", [("-1", "greater than or equal to 0"),
                                          ("2", "run `capo stage eval --round 2` first")])
def test_noise_floor_of_a_round_without_its_eval_fails_before_the_lock(tmp_path, rnd, message):
    out = _usage_error(_invoke(["noise-floor", "--round", rnd, "--config", "configs/tiny.yaml",
                                f"runs_dir={tmp_path}"]))
    assert message in out, out
    assert not any(tmp_path.iterdir())  # no lock file, no folder


def test_signal_n_boot_below_1_is_a_usage_error(tmp_path):
    (tmp_path / "r" / "round_001").mkdir(parents=True)
    out = _usage_error(_invoke(["signal", "r", "--runs-dir", str(tmp_path), "--n-boot", "0"]))
    assert "--n-boot" in out and "greater than or equal to 1" in out, out


def test_signal_of_tables_that_do_not_fit_is_a_usage_error(tmp_path, monkeypatch):
    import pipeline.process_signal as ps

    (tmp_path / "r" / "round_001").mkdir(parents=True)

    def misfit(*a, **kw):
        raise ValueError("3 step weights for 2 steps")

    monkeypatch.setattr(ps, "measure_run", misfit)
    out = _usage_error(_invoke(["signal", "r", "--runs-dir", str(tmp_path)]))
    assert "3 step weights for 2 steps" in out


def test_critic_eval_critique_of_an_unknown_setup_names_the_valid_ones(tmp_path):
    from critic_eval import stages as ces
    from flows.critic_eval import app as critic_eval_app

    out = _usage_error(_invoke(["critique", "--setup", "typo", f"runs_dir={tmp_path}"], critic_eval_app))
    assert "unknown setup 'typo'; valid: " in out and "--setup" in out, out
    with pytest.raises(ValueError, match="unknown setup 'typo'; valid: "):  # the stage itself, called directly
        ces.critique_stage(ces.load_eval_config("configs/critic_eval.yaml", [f"runs_dir={tmp_path}"]), "typo")


@pytest.mark.parametrize("flow, kwargs, message", [
    ("capo_run", {"rounds": 0}, "rounds=0: must be >= 1 (the number of rounds to run)"),
    ("capo_run", {"rounds": -2}, "rounds=-2: must be >= 1"),
    ("capo_run", {"rounds": 1, "start_round": 0}, "start_round=0: must be >= 1 (a round number; round 0 is"),
    ("capo_round", {"round": 0}, "round=0: must be >= 1 (a round number; round 0 is the starting policy"),
])
def test_the_flows_refuse_round_numbers_below_1_before_any_work(tmp_path, monkeypatch, flow, kwargs, message):
    import flows.round as fr

    def no_config(*a, **kw):
        raise AssertionError("the config was read: the numbers were not checked first")

    monkeypatch.setattr(fr, "load_config", no_config)
    with pytest.raises(ValueError, match=re.escape(message)):
        getattr(fr, flow).fn(config="configs/tiny.yaml", overrides=[f"runs_dir={tmp_path}"], **kwargs)
    assert not any(tmp_path.iterdir())
