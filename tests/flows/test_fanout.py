"""Critique fan-out (flows/fanout.py) and the shard plan it shares with the local runner
(pipeline/stages/critique.py).

Fast tests: the shard plan, chunk split, seeds, resume/prune rules and a fan-out simulated in this
process, on a hand-built round of 7 rollouts with a fake critic engine; the missing-extra error.

Slow tests (a local Dask cluster and a local Ray instance, SmolLM2-135M as policy and critic, about
5 minutes on 2 CPU cores): the critique stage of a real tiny round fanned out over 2 workers,
through vLLM (the engine configs/tiny.yaml names) on Dask and through the transformers engine on
Ray; a fan-out that resumes a shard committed by ``capo stage critique --shards``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import storage
from pipeline.config import load_config
from pipeline.core.critique import PARSE_STATUSES, VERDICT_STATUSES
from pipeline.engines.base import Engine, Generation, Sample
from pipeline.schemas import SCHEMAS
from pipeline.stages import stage_key
from pipeline.stages.base import prompts_path, round_paths

# --------------------------------------------------------------------------------- hand-built round
#
# 7 rollouts r0..r6 (r3 has an empty response: no critic call), batch_rollouts 2, N = 2:
#   plan   = [[r0, r1], [r2, r3], [r4, r5], [r6]]            -> shards 0..3
#   2 workers, contiguous chunks: [[0, 1], [2, 3]]; after shard 1 is committed: [[0, 2], [3]]
RIDS = [f"r{i}" for i in range(7)]
EMPTY = "r3"


def _cfg(tmp_path: Path, *overrides: str):
    prompts = tmp_path / "toy.jsonl"
    if not prompts.exists():
        rows = [{"question": "Sam has 6 apples, eats half, then buys 2. How many now?", "answer": "#### 5"},
                {"question": "How many grams in a kilogram?", "answer": "#### 1,000"}]
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config(None, [f"runs_dir={tmp_path / 'runs'}", f"data_dir={tmp_path / 'data'}", "run_id=toy",
                              f"data.train_prompts={prompts}", "critique.critic=hand-critic",
                              "critique.batch_rollouts=2", "critique.num_critiques=2",
                              "critique.structured_output=false", *overrides])


def _write_round(cfg) -> None:
    pids = pq.read_table(prompts_path(cfg), columns=["prompt_id"]).column("prompt_id").to_pylist()
    ro, steps = [], []
    for i, rid in enumerate(RIDS):
        text = "" if rid == EMPTY else f"Step one of {rid}.\n\nSo \\boxed{{5}}."
        ro.append({"run_id": cfg.run_id, "round": 1, "rollout_id": rid, "prompt_id": pids[i % 2], "sample_idx": i // 2,
                   "policy": "hand", "prompt_token_ids": [1, 2], "response_text": text, "response_token_ids": [7, 8],
                   "rollout_logprobs": [-0.1, -0.2], "finish_reason": "stop", "num_tokens": 2})
        n_steps = 1 if rid == EMPTY else 2
        for s in range(n_steps):
            steps.append({"run_id": cfg.run_id, "round": 1, "rollout_id": rid, "step_idx": s, "n_steps": n_steps,
                          "char_start": 0, "char_end": 1, "token_start": s, "token_end": s + 1,
                          "step_text": "" if rid == EMPTY else f"step {s} of {rid}", "empty_response": rid == EMPTY})
    p = round_paths(cfg, 1)
    storage.write_table(pa.Table.from_pylist(ro, schema=SCHEMAS["rollouts"]), p["rollouts"], "rollouts",
                        stage="rollout", key={"hand": "rollouts"})
    storage.write_table(pa.Table.from_pylist(steps, schema=SCHEMAS["steps"]), p["steps"], "steps",
                        stage="segment", key={"hand": "steps"})


class FakeCritic(Engine):
    """Answers every conversation with ``Wrong step list: [0]`` and records its seed."""

    name = "fake"
    seeds: list[int] = []
    calls: list[int] = []

    def __init__(self, model, cfg, seed=0):
        super().__init__()
        self.model, self.seed, self.tokenizer = model, seed, None
        FakeCritic.seeds.append(seed)

    def generate(self, conversations, n, sampling, constraints=None):
        assert constraints is None, "structured outputs are off in these tests"
        FakeCritic.calls.append(len(conversations))
        gens = [Generation([1, 2, 3], [Sample(f"seed {self.seed} sample {k}\nWrong step list: [0]", [5, 6], [-0.1, -0.2], "stop")
                                       for k in range(n)]) for _ in conversations]
        self._account(gens, 0.25)
        return gens


@pytest.fixture
def toy(tmp_path, monkeypatch):
    import pipeline.stages.critique as sg

    FakeCritic.seeds, FakeCritic.calls = [], []
    monkeypatch.setattr(sg, "make_engine", FakeCritic)
    cfg = _cfg(tmp_path)
    _write_round(cfg)
    return cfg


def _table(cfg):
    """The round's LLM critiques (the arithmetic check's rows, one per rollout, are not the critic's)."""
    return [r for r in pq.read_table(round_paths(cfg, 1)["critiques"]).to_pylist() if r["source"] == "llm"]


def test_shard_plan_and_chunks_by_hand(toy):
    from flows.fanout import split_chunks
    from pipeline.stages.critique import critique_done_shards, critique_shard_plan

    plan = critique_shard_plan(toy, 1)
    assert plan == [["r0", "r1"], ["r2", "r3"], ["r4", "r5"], ["r6"]]
    assert critique_done_shards(toy, 1, plan) == []
    assert split_chunks([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert split_chunks([0, 2, 3], 2) == [[0, 2], [3]]
    assert split_chunks([0, 1, 2, 3], 3) == [[0, 1], [2], [3]]
    assert split_chunks([5], 4) == [[5]]
    assert split_chunks([], 2) == []
    with pytest.raises(ValueError):
        split_chunks([0], 0)


def test_critic_seed_rule(toy):
    from pipeline.stages.base import round_seed
    from pipeline.stages.critique import critic_seed

    base = round_seed(toy, 1, 2)
    assert critic_seed(toy, 1, 0) == base  # the first chunk / an uninterrupted local run: as before
    assert critic_seed(toy, 1, 2) not in (base, critic_seed(toy, 1, 3))  # vLLM: one stream per worker
    tf = _cfg(Path(toy.runs_dir).parent, "critique.engine={type: transformers}")
    assert critic_seed(tf, 1, 2) == base  # reseeds per call: results independent of the chunking


def test_fanout_in_process_matches_local_and_records_workers(toy, tmp_path):
    """A fan-out simulated here (each chunk through critique_shards, as a worker's child would)
    writes the same table under the same key as the local runner."""
    from flows.fanout import split_chunks
    from pipeline.stages.critique import critic_seed, critique_stage

    asked = []

    def run_shards(todo):
        asked.append(todo)
        from pipeline.stages.critique import critique_shards

        return [{"runner": "test", "chunk": i, **critique_shards(toy, 1, c)} for i, c in enumerate(split_chunks(todo, 2))]

    res = critique_stage(toy, 1, run_shards=run_shards)
    assert asked == [[0, 1, 2, 3]] and not res.skipped and res.rows == 7 * 2 + 7  # + one arithmetic row each
    assert res.critic_calls == 6  # r3 is empty: no critic call
    rows = _table(toy)
    keys = [(r["rollout_id"], r["critique_idx"]) for r in rows]
    assert sorted(keys) == keys == [(rid, k) for rid in RIDS for k in range(2)]
    assert {r["parse_status"] for r in rows if r["rollout_id"] == EMPTY} == {"skipped_empty_response"}
    assert {r["parse_status"] for r in rows if r["rollout_id"] != EMPTY} == {"incomplete"}  # a list, no step lines
    # chunk [0, 1] starts at shard 0 (stage seed), chunk [2, 3] at shard 2 (its own vLLM stream)
    assert FakeCritic.seeds == [critic_seed(toy, 1, 0), critic_seed(toy, 1, 2)]
    assert {r["raw_text"].split("\n")[0] for r in rows if r["rollout_id"] == "r4"} == \
        {f"seed {critic_seed(toy, 1, 2)} sample {k}" for k in range(2)}
    man = storage.read_manifest(round_paths(toy, 1)["critiques"])
    assert man["key_hash"] == storage.key_hash(stage_key("critique", toy, 1))
    assert man["critic_calls"] == 6 and man["parse_failures"] == 0  # an empty response's rows are not critic failures
    assert man["statuses"] == {"incomplete": 12, "skipped_empty_response": 2}
    assert man["shards"] == {"planned": 4, "computed": 4, "batch_rollouts": 2}
    assert [(w["chunk"], w["shards"], w["computed"]) for w in man["workers"]] == [(0, [0, 1], [0, 1]), (1, [2, 3], [2, 3])]
    assert man["engine"]["requests"] == 6 and man["engine"]["seconds"] == pytest.approx(0.25 * 4)  # 4 generate calls
    assert not round_paths(toy, 1)["critiques"].with_suffix(".parts").exists()
    # the local runner now finds the table current
    assert critique_stage(toy, 1).skipped


def test_fanout_resumes_committed_shards_and_local_resume_logs(toy, caplog):
    from pipeline.stages.critique import critique_shards, critique_stage

    first = critique_shards(toy, 1, [1])
    assert first["computed"] == [1] and first["critic_calls"] == 1  # r3 is empty
    before = pq.read_table(round_paths(toy, 1)["critiques"].with_suffix(".parts") / "part-00001.parquet").to_pylist()
    again = critique_shards(toy, 1, [1])  # committed already: nothing to do, no engine
    assert again["computed"] == [] and again["engine"] is None and again["critic_calls"] == 0
    asked = []

    def run_shards(todo):
        asked.append(todo)
        return [critique_shards(toy, 1, todo)]

    with caplog.at_level("INFO", logger="capo.stages"):
        res = critique_stage(toy, 1, run_shards=run_shards)
    assert asked == [[0, 2, 3]] and res.critic_calls == 5  # r0, r1, r4, r5, r6
    assert "resuming: 2 rollouts already critiqued in 1 shards, 5 to go" in caplog.text
    assert "5/5 rollouts critiqued" in caplog.text  # the progress line counts what this run does
    rows = {(r["rollout_id"], r["critique_idx"]): r for r in _table(toy)}
    assert len(rows) == 14
    for r in before:
        assert rows[(r["rollout_id"], r["critique_idx"])]["raw_text"] == r["raw_text"]  # not recomputed


def test_prune_keeps_finished_critiques_of_another_key_and_removes_interrupted_writes(toy, tmp_path):
    from pipeline.stages.critique import (
        critique_done_shards,
        critique_parts_dir,
        critique_shards,
    )

    critique_shards(toy, 1, [0, 1])
    parts = critique_parts_dir(toy, 1)
    shutil.copy(parts / "part-00000.parquet", parts / "part-00009.parquet")  # no sidecar: never committed
    (parts / "part-00001.json").write_text(json.dumps({"key": "another-key", "rows": 4}))
    (parts / ".part-00001.parquet.abc.tmp").write_bytes(b"torn")  # a write killed before its rename
    (parts / ".part-00007.replies.jsonl").write_text('{"key": "k", "reply": 1}\n')  # no shard 7 in this plan
    (parts / ".part-00000.replies.jsonl").write_text('{"key": "k", "reply": 1}\n')  # shard 0 committed since
    assert critique_done_shards(toy, 1) == [0]
    assert critique_done_shards(toy, 1, prune=True) == [0]
    assert sorted(f.name for f in parts.iterdir()) == ["part-00000.json", "part-00000.parquet"]
    # part 1 (another key, committed) and the replies are finished critic output: moved, not deleted
    (moved,) = (parts.parent / "superseded").iterdir()
    assert moved.name.startswith("critiques.parts-")
    assert sorted(f.name for f in moved.iterdir()) == [".part-00007.replies.jsonl", "part-00001.json", "part-00001.parquet"]
    assert json.loads((moved / "part-00001.json").read_text())["key"] == "another-key"
    # another batch_rollouts: shard 0 would hold r0, r1, r2: the old part is not reused, but kept
    shard0 = (parts / "part-00000.parquet").read_bytes()
    bigger = _cfg(Path(toy.runs_dir).parent, "critique.batch_rollouts=3")
    assert critique_done_shards(bigger, 1, prune=True) == [] and list(parts.iterdir()) == []
    kept = [d for d in (parts.parent / "superseded").iterdir() if d != moved]
    assert len(kept) == 1 and (kept[0] / "part-00000.parquet").read_bytes() == shard0


def test_part_without_rollouts_sha_is_checked_by_content(toy):
    """Parts written before shards were planned have only the key in their sidecar."""
    from pipeline.stages.critique import (
        critique_done_shards,
        critique_parts_dir,
        critique_shards,
    )

    critique_shards(toy, 1, [0])
    side = critique_parts_dir(toy, 1) / "part-00000.json"
    meta = json.loads(side.read_text())
    side.write_text(json.dumps({"key": meta["key"], "rows": meta["rows"]}))
    assert critique_done_shards(toy, 1) == [0]


def test_a_shard_left_missing_fails_the_stage(toy):
    from pipeline.stages.critique import critique_shards, critique_stage

    with pytest.raises(RuntimeError, match=r"shards \[3\] of round 1 were not committed"):
        critique_stage(toy, 1, run_shards=lambda todo: [critique_shards(toy, 1, todo[:-1])])
    assert not round_paths(toy, 1)["critiques"].exists()
    with pytest.raises(ValueError, match="not in round 1's plan"):
        critique_shards(toy, 1, [4])


def test_sum_engine_stats_by_hand():
    from pipeline.stages.critique import sum_engine_stats

    a = {"requests": 2, "generated_tokens": 30, "seconds": 2.0, "generated_tokens_per_s": 15.0, "load_seconds": 1.0}
    b = {"requests": 1, "generated_tokens": 10, "seconds": 3.0, "generated_tokens_per_s": 3.3, "load_seconds": 2.0}
    assert sum_engine_stats([a, None]) == a
    assert sum_engine_stats([None, None]) is None
    assert sum_engine_stats([a, b]) == {"requests": 3, "generated_tokens": 40, "seconds": 5.0, "load_seconds": 3.0,
                                        "generated_tokens_per_s": 8.0}


def test_task_runner_settings():
    """What each scale.critique setting asks of Dask and Ray (nothing is started here)."""
    pytest.importorskip("prefect_dask")
    pytest.importorskip("prefect_ray")
    from flows.fanout import make_task_runner
    from pipeline.config import CritiqueFanoutConfig as F

    local_dask = make_task_runner(F(runner="dask", workers=3))
    assert local_dask.address is None
    assert {k: local_dask.cluster_kwargs[k] for k in ("n_workers", "threads_per_worker", "processes")} == \
        {"n_workers": 3, "threads_per_worker": 1, "processes": True}
    assert make_task_runner(F(runner="dask", address="tcp://sched:8786")).address == "tcp://sched:8786"
    local_ray = make_task_runner(F(runner="ray", workers=2))
    assert local_ray.address is None
    assert {k: local_ray.init_kwargs[k] for k in ("address", "num_cpus", "include_dashboard")} == \
        {"address": "local", "num_cpus": 2, "include_dashboard": False}  # never joins someone else's cluster
    assert make_task_runner(F(runner="ray", address="ray://head:10001")).address == "ray://head:10001"
    assert make_task_runner(F(runner="ray", address="auto")).init_kwargs["address"] == "auto"
    with pytest.raises(ValueError, match=r"scale.critique.runner='local' has no task runner; valid: \['dask', 'ray'\]"):
        make_task_runner(F(runner="local"))


@pytest.mark.parametrize("runner, package", [("dask", "prefect-dask"), ("ray", "prefect-ray")])
def test_missing_extra_names_what_to_install(toy, monkeypatch, runner, package):
    from flows.fanout import MissingExtraError, make_task_runner
    from flows.runner import run_stage

    monkeypatch.setitem(sys.modules, package.replace("-", "_"), None)  # import of it raises ImportError
    cfg = _cfg(Path(toy.runs_dir).parent, f"scale.critique.runner={runner}")
    with pytest.raises(MissingExtraError) as e:
        make_task_runner(cfg.scale.critique)
    assert package in str(e.value) and "pip install -e '.[fanout]'" in str(e.value)
    assert f"scale.critique.runner={runner}" in str(e.value)
    with pytest.raises(MissingExtraError):
        run_stage("critique", cfg, 1)  # fails before any work
    assert not round_paths(cfg, 1)["critiques"].exists() and not FakeCritic.calls


# ------------------------------------------------------------- the fan-out's Prefect server under load


@pytest.fixture
def busy_cpu():
    """Every core saturated by a busy-loop child (as the rest of a round, or a test suite, loads a
    2-core machine) until the test ends."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    yield len(hogs)
    for h in hogs:
        h.kill()
        h.wait()


@pytest.fixture
def no_prefect_server(monkeypatch):
    """No Prefect server known to this process: Prefect keeps one ``SubprocessASGIServer`` per process
    (``_instances``), which is the test harness's own server once a harness test has run."""
    from prefect.server.api.server import SubprocessASGIServer

    monkeypatch.setattr(SubprocessASGIServer, "_instances", {})
    return SubprocessASGIServer


def test_ephemeral_server_starts_on_a_saturated_cpu(busy_cpu, no_prefect_server):
    """The server the fan-out starts (with no PREFECT_API_URL) answers /health while every core runs a
    busy loop; Prefect's own default of 20 s was missed under such load on a 2-core AVX2 CPU. Bounded:
    at most the two tries of the fan-out's own timeout."""
    import time

    import httpx

    from flows.fanout import EPHEMERAL_STARTUP_ATTEMPTS, ephemeral_startup_timeout, start_ephemeral_server

    timeout, source = ephemeral_startup_timeout()
    if "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" not in os.environ:
        assert timeout >= 120 and "EPHEMERAL_STARTUP_TIMEOUT_S" in source
    t0 = time.monotonic()
    server = start_ephemeral_server()
    try:
        assert server.server_process is not None and server.server_process.poll() is None  # started here
        took = time.monotonic() - t0
        assert httpx.get(f"{server.api_url}/health", timeout=30).status_code == 200
        assert took < EPHEMERAL_STARTUP_ATTEMPTS * timeout + 30
        print(f"ephemeral Prefect server answered after {took:.1f} s with {busy_cpu} busy-loop children")
    finally:
        server.stop()


def test_ephemeral_server_timeout_names_the_setting(no_prefect_server):
    """A user's own PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS is honoured; when the server
    misses it, the error says which setting to raise and how to use a server of one's own, after
    a second try (and the late server processes are stopped)."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    from flows.fanout import PrefectServerStartError, ephemeral_startup_timeout, start_ephemeral_server

    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 1}):
        assert ephemeral_startup_timeout() == (1, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS")
        with pytest.raises(PrefectServerStartError) as e:  # the server imports Prefect's API for seconds
            start_ephemeral_server()
    msg = str(e.value)
    assert "within 1 s" in msg and "in 2 tries" in msg and "try 2:" in msg
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=600" in msg and "PREFECT_API_URL" in msg
    assert None not in no_prefect_server._instances  # the failed tries left no server behind


# ---------------------------------------------------------------------------- real fan-out (slow)
#
# configs/tiny.yaml with 3 prompts x 2 rollouts and batch_rollouts 2: 3 shards, chunks [[0, 1], [2]]
# on 2 workers. The rollouts come from the transformers engine (quicker than starting vLLM here).
TINY_OVER = {"data.prompts_per_round": 3, "critique.batch_rollouts": 2, "rollout.engine": "{type: transformers}"}
# fp32: a bf16 matmul on an AMX CPU sums in an order that follows the thread count (a Ray or Dask
# worker runs torch on one thread, the CLI on all cores), so bf16 critiques could differ in their
# last tokens between runners for reasons that have nothing to do with the per-call seeding tested
TRANSFORMERS_CRITIC = {"critique.engine": "{type: transformers, dtype: float32}"}


def _tiny(repo: Path, data_dir: Path, runs: Path, **over):
    ov = {"runs_dir": str(runs), "data_dir": str(data_dir), **TINY_OVER, **over}
    return load_config(repo / "configs" / "tiny.yaml", [f"{k}={v}" for k, v in ov.items()])


def _overrides(runs: Path, data_dir: Path, **over) -> list[str]:
    ov = {"runs_dir": str(runs), "data_dir": str(data_dir), **TINY_OVER, **over}
    return [f"{k}={v}" for k, v in ov.items()]


@pytest.fixture(scope="module")
def inputs(repo, data_dir, module_tmp):
    """rollouts, outcomes and steps of round 1 (the critique stage's inputs), computed once."""
    from flows.runner import run_stage

    runs = module_tmp("inputs")
    cfg = _tiny(repo, data_dir, runs)
    for name in ("rollout", "verify", "segment"):
        assert not run_stage(name, cfg, 1).skipped
    return runs


def _copy_inputs(src_runs: Path, dst_runs: Path, cfg) -> None:
    src = src_runs / cfg.run_id / "round_001"
    dst = round_paths(cfg, 1)["round_dir"]
    dst.mkdir(parents=True)
    for name in ("rollouts", "outcomes", "steps"):
        for suffix in (".parquet", ".parquet.manifest.json"):
            shutil.copy2(src / f"{name}{suffix}", dst / f"{name}{suffix}")


def _check_complete(cfg) -> list[dict]:
    """Every rollout has exactly N critiques, no duplicates, parse statuses recorded, parts gone."""
    p = round_paths(cfg, 1)
    every = pq.read_table(p["critiques"]).to_pylist()
    crit = [c for c in every if c["source"] == "llm"]
    rollouts = pq.read_table(p["rollouts"], columns=["rollout_id"]).column("rollout_id").to_pylist()
    assert sorted(c["rollout_id"] for c in every if c["source"] == "arithmetic") == sorted(rollouts)
    keys = [(c["rollout_id"], c["critique_idx"]) for c in crit]
    assert len(keys) == len(set(keys)) == len(rollouts) * cfg.critique.num_critiques
    assert {k for k, _ in keys} == set(rollouts)
    for c in crit:
        assert c["parse_status"] in PARSE_STATUSES + ("skipped_empty_response",)
        assert (c["wrong_steps"] is not None) == (c["parse_status"] in VERDICT_STATUSES)
    assert not p["critiques"].with_suffix(".parts").exists()
    return crit


def _check_workers(man: dict, runner: str, chunks: list[list[int]]) -> None:
    """Each chunk ran in its own child process, started by a Dask/Ray worker process (not here)."""
    workers = man["workers"]
    assert [w["runner"] for w in workers] == [runner] * len(chunks)
    assert [w["shards"] for w in workers] == chunks
    assert len({w["pid"] for w in workers}) == len(chunks)
    assert len({w["worker_pid"] for w in workers}) == len(chunks)
    for w in workers:
        assert w["ppid"] == w["worker_pid"] != os.getpid() and w["pid"] != os.getpid()
    assert man["critic_calls"] == sum(w["critic_calls"] for w in workers)
    assert man["engine"]["requests"] == sum(w["engine"]["requests"] for w in workers)


def _env() -> dict[str, str]:
    """This process's environment, less pytest's own record of the running test and phase."""
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


@pytest.fixture(scope="module")
def dask_vllm(harness, inputs, repo, data_dir, module_tmp):
    """Fan-out on a local Dask cluster (2 workers) through the engine the config names (vLLM)."""
    from flows.runner import run_stage

    runs = module_tmp("dask")
    cfg = _tiny(repo, data_dir, runs, **{"scale.critique.runner": "dask", "scale.critique.workers": 2})
    assert cfg.critique.engine.type == "vllm"
    _copy_inputs(inputs, runs, cfg)
    env = _env()
    first = run_stage("critique", cfg, 1)
    second = run_stage("critique", cfg, 1)
    return cfg, first, second, env


@pytest.mark.slow
def test_dask_fanout_through_vllm(dask_vllm, repo, data_dir):
    from flows.runner import check_current

    cfg, first, second, env = dask_vllm
    # Dask's nanny writes OMP_NUM_THREADS=1 (and more) into the starting process: none of it may stay,
    # or every later stage child of the orchestrator runs torch on one thread
    now = _env()
    assert now == env, {k: (env.get(k), now.get(k)) for k in set(env) | set(now) if env.get(k) != now.get(k)}
    assert not first.skipped and first.rows == 6 * (cfg.critique.num_critiques + 1)  # + the arithmetic rows
    _check_complete(cfg)
    man = storage.read_manifest(round_paths(cfg, 1)["critiques"])
    _check_workers(man, "dask", [[0, 1], [2]])
    assert first.critic_calls == man["critic_calls"] > 0
    assert man["shards"] == {"planned": 3, "computed": 3, "batch_rollouts": 2}
    # the key is the local runner's: a local re-run skips; so does a second fan-out
    local = _tiny(repo, data_dir, Path(cfg.runs_dir))
    assert man["key_hash"] == storage.key_hash(stage_key("critique", local, 1))
    assert check_current("critique", local, 1).current
    assert second.skipped and "current" in second.reason


@pytest.fixture(scope="module")
def ray_transformers(harness, inputs, repo, data_dir, module_tmp):
    from flows.runner import run_stage

    runs = module_tmp("ray")
    cfg = _tiny(repo, data_dir, runs, **TRANSFORMERS_CRITIC,
                **{"scale.critique.runner": "ray", "scale.critique.workers": 2})
    _copy_inputs(inputs, runs, cfg)
    env = _env()
    return cfg, run_stage("critique", cfg, 1), run_stage("critique", cfg, 1), env


@pytest.mark.slow
def test_ray_fanout_through_transformers(ray_transformers, repo, data_dir):
    from flows.runner import check_current

    cfg, first, second, env = ray_transformers
    assert _env() == env, "ray.init's variables (RAY_*, PYTHONBREAKPOINT) stayed in the orchestrator"
    assert not first.skipped
    _check_complete(cfg)
    man = storage.read_manifest(round_paths(cfg, 1)["critiques"])
    _check_workers(man, "ray", [[0, 1], [2]])
    local = _tiny(repo, data_dir, Path(cfg.runs_dir), **TRANSFORMERS_CRITIC)
    assert check_current("critique", local, 1).current
    assert second.skipped


@pytest.fixture(scope="module")
def resumed_cli(inputs, repo, data_dir, module_tmp):
    """``capo stage critique --shards 1`` (here, no cluster), then ``capo stage critique`` with
    runner=dask: the fan-out must compute shards 0 and 2 only. Both through the CLI, which runs
    Prefect on its ephemeral server."""
    runs = module_tmp("resume")
    cfg = _tiny(repo, data_dir, runs, **TRANSFORMERS_CRITIC)
    _copy_inputs(inputs, runs, cfg)
    base = [sys.executable, "-m", "flows.cli", "stage", "critique", "--config", str(repo / "configs" / "tiny.yaml"),
            "--round", "1"]
    over = _overrides(runs, data_dir, **TRANSFORMERS_CRITIC)
    pre = subprocess.run([*base, "--shards", "1", *over], cwd=repo, capture_output=True, text=True, timeout=600)
    assert pre.returncode == 0, pre.stderr[-3000:]
    part = round_paths(cfg, 1)["critiques"].with_suffix(".parts") / "part-00001.parquet"
    before = pq.read_table(part).to_pylist()
    fan = [*over, "scale.critique.runner=dask", "scale.critique.workers=2"]
    out = subprocess.run([*base, *fan], cwd=repo, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    again = subprocess.run([*base, *fan], cwd=repo, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    return cfg, before, out, again


@pytest.mark.slow
def test_fanout_resumes_a_shard_committed_by_the_cli(resumed_cli):
    cfg, before, out, again = resumed_cli
    log = out.stderr + out.stdout
    assert "resuming: 2 rollouts already critiqued in 1 shards, 4 to go" in log
    assert "fanning out 2 shards in 2 chunks on dask (local cluster): [[0], [2]]" in log
    crit = {(c["rollout_id"], c["critique_idx"]): c for c in _check_complete(cfg)}
    for r in before:  # shard 1 is the one committed before the fan-out, not recomputed
        assert crit[(r["rollout_id"], r["critique_idx"])]["raw_text"] == r["raw_text"]
    man = storage.read_manifest(round_paths(cfg, 1)["critiques"])
    assert man["shards"] == {"planned": 3, "computed": 2, "batch_rollouts": 2}
    _check_workers(man, "dask", [[0], [2]])
    assert "skipped: critiques.parquet is current" in again.stderr
    assert "fanning out" not in again.stderr + again.stdout


@pytest.mark.slow
def test_transformers_critiques_do_not_depend_on_the_runner(ray_transformers, resumed_cli):
    """The transformers critic reseeds per call: shard 1 computed by a plain CLI process, shards 0
    and 2 by Dask workers, and all three by Ray workers give the same critiques."""
    ray_rows = _table(ray_transformers[0])
    dask_rows = _table(resumed_cli[0])
    assert [(r["rollout_id"], r["critique_idx"], r["raw_text"], r["parse_status"]) for r in ray_rows] == \
        [(r["rollout_id"], r["critique_idx"], r["raw_text"], r["parse_status"]) for r in dask_rows]


@pytest.mark.parametrize("damage", ["truncate", "same-size-edit", "sidecar-garbage"])
def test_a_torn_or_altered_shard_is_recomputed_not_trusted(toy, damage):
    """The commit check opens the part (row count, sha256 from its sidecar); a
    damaged shard is critiqued again and the stage succeeds, --force not needed."""
    from pipeline.stages.critique import critique_shards, critique_stage

    assert critique_shards(toy, 1, [1])["computed"] == [1]
    part = round_paths(toy, 1)["critiques"].with_suffix(".parts") / "part-00001.parquet"
    data = part.read_bytes()
    if damage == "truncate":
        part.write_bytes(data[: len(data) // 2])
    elif damage == "same-size-edit":
        mid = len(data) // 2
        part.write_bytes(data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:])
    else:
        part.with_suffix(".json").write_bytes(b"\xff[]")
    asked = []

    def run_shards(todo):
        asked.append(todo)
        return [critique_shards(toy, 1, todo)]

    res = critique_stage(toy, 1, run_shards=run_shards)
    assert asked == [[0, 1, 2, 3]] and not res.skipped  # shard 1 is among those computed again
    assert len({(r["rollout_id"], r["critique_idx"]) for r in _table(toy)}) == 14


def test_reference_guided_critiques_show_each_problems_reference(tmp_path, monkeypatch):
    """``critique.include_reference``: every critic prompt holds its own problem's reference solution (the
    prompt table's ``gold_solution``, annotations removed); the option enters the stage key only when on."""
    import pipeline.stages.critique as sg

    seen: list = []

    class Recording(FakeCritic):
        def generate(self, conversations, n, sampling, constraints=None):
            seen.extend(conversations)
            return super().generate(conversations, n, sampling, constraints)

    monkeypatch.setattr(sg, "make_engine", Recording)
    (tmp_path / "toy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"question": "Sam has 6 apples, eats half, then buys 2. How many now?",
         "answer": "He eats 6 / 2 = <<6/2=3>>3.\nThen 3 + 2 = <<3+2=5>>5.\n#### 5"},
        {"question": "How many grams in a kilogram?", "answer": "A kilogram is 1,000 grams.\n#### 1,000"}]))
    plain = _cfg(tmp_path)
    cfg = _cfg(tmp_path, "critique.include_reference=true")
    _write_round(cfg)
    assert "include_reference" not in sg.critique_key(plain, 1)["critique"]
    assert sg.critique_key(cfg, 1)["critique"]["include_reference"] is True
    sg.critique_stage(cfg, 1)
    users = [c[1]["content"] for c in seen]
    assert len(users) == len(RIDS) - 1  # the empty response is not sent
    for u in users:
        ref = u.split("Reference solution", 1)[1].split("The solution is between", 1)[0]
        if "Sam has 6 apples" in u:
            assert "He eats 6 / 2 = 3.\nThen 3 + 2 = 5." in ref and "<<" not in ref and "####" not in ref
        else:
            assert "A kilogram is 1,000 grams." in ref


def test_environment_kept_undoes_what_a_cluster_writes(monkeypatch):
    """What Dask's nanny does to the starting process (OMP_NUM_THREADS=1 among others) is undone:
    added variables removed, changed ones set back, removed ones restored; also when the block fails."""
    from flows.fanout import environment_kept

    monkeypatch.setenv("CAPO_TEST_KEEP", "a")
    monkeypatch.setenv("CAPO_TEST_GONE", "b")
    monkeypatch.delenv("CAPO_TEST_NEW", raising=False)
    before = dict(os.environ)
    with pytest.raises(RuntimeError, match="a chunk failed"):
        with environment_kept():
            os.environ.update(CAPO_TEST_KEEP="changed", CAPO_TEST_NEW="1", OMP_NUM_THREADS="1")
            del os.environ["CAPO_TEST_GONE"]
            raise RuntimeError("a chunk failed")
    assert dict(os.environ) == before


def test_the_genorm_critiques_key_names_its_own_escaping(tmp_path):
    """A whole solution's first line is escaped too (the outcome escaping's own version): GenORM
    critiques of the earlier prompt are not reused, and step critiques keep their key."""
    import pipeline.stages.critique as sg
    from pipeline.core.critique import DATA_ESCAPE_VERSION, OUTCOME_DATA_ESCAPE_VERSION

    steps = _cfg(tmp_path)
    genorm = _cfg(tmp_path, "critique.mode=outcome", "reward.outcome=genorm", "reward.process_weight=0")
    _write_round(steps)
    assert sg.critique_key(steps, 1)["data_escape"] == DATA_ESCAPE_VERSION == "tags-entities-lookalikes-lines-v2"
    assert sg.critique_key(genorm, 1)["data_escape"] == OUTCOME_DATA_ESCAPE_VERSION != DATA_ESCAPE_VERSION
