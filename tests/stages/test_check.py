"""``capo check RUN`` on the hand-built round (tests/toy_round.py): every output verified against its
manifest, today's keys for the config's variant, torn shards and leftovers of killed writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa

from pipeline import storage
from pipeline.check import check_run
from pipeline.schemas import SCHEMAS
from pipeline.stages.base import round_paths
from pipeline.stages.reward import reward_stage
from pipeline.stages.vote import vote_stage
from tests.toy_round import critique_row, toy_config, write_round


TINY = "smollm2-135m-instruct"


def _by_output(findings):
    return {f.output: f for f in findings}


def test_check_finds_each_kind_of_damage_and_names_the_fix(tmp_path, data_dir):
    data = tmp_path / "data"
    data.mkdir()
    (data / "models").symlink_to(data_dir / "models")  # today's keys name the embedded models (prepared there)
    # the tiny critic: a key that names the default 1.5B critic would convert it (1.5 minutes) for this test alone
    cfg = toy_config(tmp_path, f"critique.critic={TINY}")
    write_round(cfg)  # rollouts ... critiques under hand-made keys: stale under today's config
    vote_stage(cfg, 1)
    reward_stage(cfg, 1)
    p = round_paths(cfg, 1)
    found = _by_output(check_run(cfg, "my.yaml"))
    v = "round_001/variants/capo-majority"
    assert found[f"{v}/step_verdicts.parquet"].status == "ok"
    assert found[f"{v}/token_rewards.parquet"].status == "ok"
    stale = found["round_001/rollouts.parquet"]
    assert stale.status == "stale" and "another key" in stale.detail
    assert stale.fix == f"capo round --round 1 --config my.yaml run_id=toy runs_dir={cfg.runs_dir}"
    assert found[f"{v}/checkpoint"].status == "missing" and "stage train" in found[f"{v}/checkpoint"].detail

    # damage: a table's bytes (size kept), a manifest lost, a torn shard, a killed write's leftover
    tr = p["token_rewards"]
    raw = bytearray(tr.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    tr.write_bytes(bytes(raw))
    storage.manifest_path(p["step_verdicts"]).unlink()
    parts = p["critiques"].with_suffix(".parts")
    part = storage.write_part(pa.Table.from_pylist([{"run_id": "toy", "round": 1, **critique_row("A", 0, [1], 3)}],
                                                    schema=SCHEMAS["critiques"]), parts, 0, "critiques", {"key": "k"})
    part.write_bytes(part.read_bytes()[:-9])  # torn: its tail lost
    (p["round_dir"] / ".outcomes.parquet.x1.tmp").write_bytes(b"half a table")
    found = _by_output(check_run(cfg, "my.yaml"))
    assert found[f"{v}/token_rewards.parquet"].status == "modified"
    assert "content hash differs" in found[f"{v}/token_rewards.parquet"].detail
    assert found[f"{v}/step_verdicts.parquet"].status == "uncommitted"
    assert found["round_001/critiques.parts/part-00000.parquet"].status == "torn"
    assert found["round_001/.outcomes.parquet.x1.tmp"].status == "leftover"

    # the command: exit status 1, one line per finding with its fix; as text and as JSON, the two
    # started together (`capo check` only reads the run: neither sees the other)
    from concurrent.futures import ThreadPoolExecutor

    cmds = ([sys.executable, "-m", "flows.cli", "check", "toy", f"runs_dir={cfg.runs_dir}",
             f"data_dir={cfg.data_dir}", f"data.train_prompts={cfg.data.train_prompts}",
             "critique.enabled=true", "reward.correct_weight=2", "reward.process_weight=1",
             f"critique.critic={TINY}"],
            [sys.executable, "-m", "flows.cli", "check", "toy", "--json", f"runs_dir={cfg.runs_dir}",
             f"data_dir={cfg.data_dir}", f"data.train_prompts={cfg.data.train_prompts}",
             f"critique.critic={TINY}"])
    with ThreadPoolExecutor(2) as pool:
        out, js = pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True, timeout=120), cmds)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "MODIFIED" in out.stdout and "TORN" in out.stdout and "fix: capo round --round 1" in out.stdout
    assert "1 modified" in out.stdout and "1 torn" in out.stdout and "1 leftover" in out.stdout
    rows = [json.loads(line) for line in js.stdout.splitlines()]
    assert {r["status"] for r in rows} >= {"modified", "torn", "leftover", "uncommitted", "missing"}


def test_check_of_an_unknown_run_names_the_runs_there(tmp_path):
    cfg = toy_config(tmp_path)
    write_round(cfg)
    other = toy_config(tmp_path, "run_id=nope")
    try:
        check_run(other)
    except FileNotFoundError as e:
        assert "no run 'nope'" in str(e) and "toy" in str(e)
    else:
        raise AssertionError("an unknown run must raise")


def test_another_variants_fix_names_that_variant_not_the_users_preset(tmp_path, data_dir):
    """A damaged output of a variant other than the checked one: its fix re-runs that variant (by its
    preset where one has its name, else ``variant=`` with its settings) without the user's own
    ``--preset`` and overrides, which would select another variant (typer keeps the last --preset)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "models").symlink_to(data_dir / "models")
    cfg = toy_config(tmp_path, f"critique.critic={TINY}")
    write_round(cfg)
    vote_stage(cfg, 1)
    reward_stage(cfg, 1)
    grpo = toy_config(tmp_path, f"critique.critic={TINY}", "critique.enabled=false", "reward.process_weight=0",
                      "reward.estimator=grpo", "variant=grpo")
    hand = toy_config(tmp_path, f"critique.critic={TINY}", "vote.rule=intersection", "variant=t07-p05")
    reward_stage(grpo, 1)
    vote_stage(hand, 1)
    reward_stage(hand, 1)
    for c in (grpo, hand):  # damage each other variant's token rewards
        tr = round_paths(c, 1)["token_rewards"]
        raw = bytearray(tr.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        tr.write_bytes(bytes(raw))
    args = f"--preset capo-majority data.train_prompts={cfg.data.train_prompts} variant=capo-majority"
    found = _by_output(check_run(cfg, "my.yaml", args))
    own = found["round_001/rollouts.parquet"]  # a shared table: the user's arguments repeated
    assert own.fix.endswith(args)
    g = found["round_001/variants/grpo/token_rewards.parquet"]
    assert g.status == "modified"
    # the shared settings stay (without them the rollouts' key differs and the round would sample again)
    assert g.fix == (f"capo round --round 1 --config my.yaml --preset grpo run_id=toy runs_dir={cfg.runs_dir} "
                     f"data.train_prompts={cfg.data.train_prompts}")
    h = found["round_001/variants/t07-p05/token_rewards.parquet"]
    assert h.fix == (f"capo round --round 1 --config my.yaml variant=t07-p05 run_id=toy runs_dir={cfg.runs_dir} "
                     f"data.train_prompts={cfg.data.train_prompts}")
    assert "variant t07-p05 is no preset: add the settings it was run with" in h.detail
    # the run given as a folder's path (as `capo browse` takes it): the same findings
    from typer.testing import CliRunner

    from flows.cli import app

    res = CliRunner().invoke(app, ["check", str(cfg.run_dir()), f"data_dir={cfg.data_dir}",
                                   f"data.train_prompts={cfg.data.train_prompts}", f"critique.critic={TINY}"])
    assert res.exit_code == 1, res.output
    assert "variants/grpo/token_rewards.parquet" in res.output and "MODIFIED" in res.output
