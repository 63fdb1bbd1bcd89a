"""A real CAPO round, end to end: SmolLM2-135M-Instruct as policy and critic through vLLM,
math-verify, the Prefect ``capo-round`` flow, the Accelerate trainer and the DuckDB catalog.

Slow (about 3 minutes on 2 CPU cores): one round, then a second run that must skip every stage,
then a round killed in the middle of its critique stage and resumed.

The tests that drive ``capo`` commands in subprocesses on a copy of the finished round (a critique and
an eval killed and resumed, the noise floor) are independent of the ones that run the Prefect flow in
this process (variants retrained on the shared round): :func:`round_jobs` starts them on a worker
thread as soon as the round is done, and their tests, last in the file, check what they left. While
one of them runs, the flows of this process start their stage children on one thread each
(:func:`one_thread_while_jobs_run`), so the two streams share the 2 cores of CI instead of
oversubscribing them. Nothing those tests assert depends on the thread count, except the eval table
the killed eval must reproduce bit for bit: that job runs with the environment of the round itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.config import load_config
from pipeline.core.critique import PARSE_STATUSES, VERDICT_STATUSES
from pipeline.stages.base import round_paths
from tests.toy_round import rival_credit_by_hand

pytestmark = pytest.mark.slow


def tiny_cfg(repo: Path, data_dir: Path, runs: Path, **over):
    ov = {"runs_dir": str(runs), "data_dir": str(data_dir), **over}
    return load_config(repo / "configs" / "tiny.yaml", [f"{k}={v}" for k, v in ov.items()])


@pytest.fixture(scope="module")
def tiny_round(harness, repo, data_dir, module_tmp):
    """Run round 1 of configs/tiny.yaml through the Prefect flow, twice; return both results."""
    from flows.round import capo_round

    runs = module_tmp("runs")
    over = [f"runs_dir={runs}", f"data_dir={data_dir}"]
    first = capo_round(round=1, config=str(repo / "configs" / "tiny.yaml"), overrides=over)
    t0 = time.perf_counter()
    second = capo_round(round=1, config=str(repo / "configs" / "tiny.yaml"), overrides=over)
    second_s = time.perf_counter() - t0
    cfg = tiny_cfg(repo, data_dir, runs)
    return cfg, first, second, second_s


def _t(cfg, name):
    return pq.read_table(round_paths(cfg, 1)[name]).to_pylist()


# ------------------------------------------------------------- subprocess tests, in the background
def _clone_run(src: Path, dst: Path) -> None:
    """A copy of the finished run folder ``src`` at ``dst`` for a test that writes into it: tables and
    weights (written by a rename, never in place) hard-linked, every other file (manifests, summaries,
    report pages, which may be rewritten in place) copied; the run's lock file left out (a hard link
    to it would be the original run's lock)."""
    from pipeline.runlock import LOCK_NAME

    def copy(s: str, d: str) -> None:
        if s.endswith((".parquet", ".safetensors", ".bin", ".pkl")):
            os.link(s, d)
        else:
            shutil.copy2(s, d)

    shutil.copytree(src, dst, copy_function=copy, ignore=shutil.ignore_patterns(LOCK_NAME, f"{LOCK_NAME}.json"))


def _kill_mid_critique(repo: Path, cfg, args: list[str], env: dict) -> dict:
    """`capo round` killed (its process group) during the critique stage once a shard is committed,
    then `capo stage critique` run again (the job of
    :func:`test_killed_mid_critique_resumes_without_lost_or_doubled_rows`)."""
    parts = round_paths(cfg, 1)["critiques"].with_suffix(".parts")
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "round", *args], cwd=repo, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, env=env)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not list(parts.glob("part-*.json")):
            assert proc.poll() is None, "the round ended before the critique stage committed a shard"
            time.sleep(0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):  # (gone already when the round ended early)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    done_before = len(list(parts.glob("part-*.json")))
    table_after_kill = round_paths(cfg, 1)["critiques"].exists()
    out = subprocess.run([sys.executable, "-m", "flows.cli", "stage", "critique", *args], cwd=repo,
                         capture_output=True, text=True, timeout=600, env=env)
    return {"done_before": done_before, "table_after_kill": table_after_kill, "out": out}


def _kill_at_eval_write(repo: Path, cmd: list[str], ev: Path, env: dict) -> dict:
    """`capo round` SIGKILLed when round 1's eval table is written but not yet in place, then started
    again (the job of :func:`test_killed_while_the_vllm_eval_commits_resumes_to_the_uninterrupted_table`)."""
    point = "table.written:round_001/variants/capo-majority/eval.parquet"
    killed = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600, start_new_session=True,
                            env={**env, "CAPO_KILL_AT": point})
    res = {"killed": killed, "tmp_after_kill": list(ev.parent.glob(".eval.parquet.*.tmp")),
           "eval_after_kill": ev.exists(), "out": None}
    if killed.returncode == -signal.SIGKILL:
        res["out"] = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600, env=env)
    return res


def _noise_floor(repo: Path, cfg, env: dict) -> subprocess.CompletedProcess:
    """`capo noise-floor --round 1` (the job of :func:`test_noise_floor_of_a_real_round`)."""
    over = [f"runs_dir={cfg.runs_dir}", f"data_dir={cfg.data_dir}"]
    return subprocess.run([sys.executable, "-m", "flows.cli", "noise-floor", "--round", "1", "--config",
                           str(repo / "configs" / "tiny.yaml"), *over], cwd=repo, capture_output=True, text=True,
                          timeout=900, env=env)


_JOBS: dict = {}  # name -> Future of round_jobs' background jobs, while the module runs


@pytest.fixture(scope="module")
def round_jobs(request, tiny_round, repo, module_tmp):
    """The subprocess tests of the finished round (those of this session's selection), started at
    once, one after another on a worker thread, each on its own copy of what it reads (made here,
    before any test of this module writes into the shared run): ``{name: (..., Future)}`` of what each
    left for its test to check.

    The killed critique and the noise floor run their stage children on one thread: their tests
    count rows and compare tables written by the same run. The killed eval keeps this process's
    environment, as the round had: its table must equal the round's bit for bit, and a greedy eval on
    another thread count may sum in another order.
    """
    from concurrent.futures import ThreadPoolExecutor

    src_cfg = tiny_round[0]
    env = {k: v for k, v in os.environ.items() if k != "CAPO_RUN_LOCK"}
    one_thread = {**env, "OMP_NUM_THREADS": "1"}
    data_dir = Path(src_cfg.data_dir)
    jobs: dict = {}
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="round-jobs") as pool:
        # the eval killed while it commits: a copy of the whole round (hard links) without round 1's eval
        if "test_killed_while_the_vllm_eval_commits_resumes_to_the_uninterrupted_table" in selected:
            runs = module_tmp("kill-eval") / "runs"
            _clone_run(src_cfg.run_dir(), runs / src_cfg.run_id)
            cfg = tiny_cfg(repo, data_dir, runs)
            ev = round_paths(cfg, 1)["eval"]
            ev.unlink()
            ev.with_name(ev.name + ".manifest.json").unlink()
            cmd = [sys.executable, "-m", "flows.cli", "round", "--config", str(repo / "configs" / "tiny.yaml"),
                   "--round", "1", f"runs_dir={runs}", f"data_dir={data_dir}"]
            jobs["kill_eval"] = (cfg, ev, pool.submit(_kill_at_eval_write, repo, cmd, ev, env))
        # the critique killed mid-stage: the round's rollouts, outcomes and steps only, one rollout a shard
        if "test_killed_mid_critique_resumes_without_lost_or_doubled_rows" in selected:
            runs = module_tmp("kill-critique") / "runs"
            cfg = tiny_cfg(repo, data_dir, runs, **{"critique.batch_rollouts": 1})
            src, dst = round_paths(src_cfg, 1), round_paths(cfg, 1)
            dst["round_dir"].mkdir(parents=True)
            for name in ("rollouts", "outcomes", "steps"):
                for f in (src[name], src[name].with_name(src[name].name + ".manifest.json")):
                    shutil.copy2(f, dst[name].parent / f.name)
            args = ["--config", str(repo / "configs" / "tiny.yaml"), "--round", "1", f"runs_dir={runs}",
                    f"data_dir={data_dir}", "critique.batch_rollouts=1"]
            jobs["kill_critique"] = (cfg, pool.submit(_kill_mid_critique, repo, cfg, args, one_thread))
        # the noise floor: a copy of the whole round (it writes its arms and the report into the run)
        if "test_noise_floor_of_a_real_round" in selected:
            runs = module_tmp("noise-floor") / "runs"
            _clone_run(src_cfg.run_dir(), runs / src_cfg.run_id)
            cfg = tiny_cfg(repo, data_dir, runs)
            jobs["noise_floor"] = (cfg, pool.submit(_noise_floor, repo, cfg, one_thread))
        _JOBS.update({k: v[-1] for k, v in jobs.items()})
        try:
            yield jobs
        finally:
            _JOBS.clear()  # (leaving the with block waits for the jobs still running)


@contextlib.contextmanager
def one_thread_while_jobs_run():
    """``OMP_NUM_THREADS=1`` for the stage children started in the block while a job of
    :func:`round_jobs` still runs (the other core is the job's); the environment as it was after."""
    if not any(not f.done() for f in _JOBS.values()):
        yield
        return
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old


def test_every_table_has_the_expected_rows(tiny_round, round_jobs):
    # (round_jobs: the subprocess tests at the end of the file start now, beside the flows below)
    cfg, first, _, _ = tiny_round
    assert [r["stage"] for r in first] == ["rollout", "verify", "segment", "mc", "densr", "critique", "vote", "reward",
                                           "train", "eval", "eval"]  # round 1's policy, then round 0 = the starting one
    assert [r["stage"] for r in first if r["skipped"]] == ["mc", "densr"]  # the vineppo and densr estimators only
    G, N, P = cfg.rollout.group_size, cfg.critique.num_critiques, cfg.data.prompts_per_round
    rollouts = _t(cfg, "rollouts")
    assert len(rollouts) == P * G
    assert len({r["prompt_id"] for r in rollouts}) == P
    for r in rollouts:
        assert r["num_tokens"] == len(r["response_token_ids"]) == len(r["rollout_logprobs"]) > 0
        assert r["prompt_token_ids"] and r["finish_reason"] in ("stop", "length")
        assert all(lp <= 0 for lp in r["rollout_logprobs"])
    assert {o["rollout_id"] for o in _t(cfg, "outcomes")} == {r["rollout_id"] for r in rollouts}
    every = _t(cfg, "critiques")
    crit = [c for c in every if c["source"] == "llm"]
    assert len(crit) == P * G * N
    # one arithmetic check per rollout, the verdict of the checker over the steps as written
    from pipeline.core.arithmetic import critique_steps

    texts: dict[str, list] = {}
    for st in sorted(_t(cfg, "steps"), key=lambda st: (st["rollout_id"], st["step_idx"])):
        texts.setdefault(st["rollout_id"], []).append(st["step_text"])
    arith = {c["rollout_id"]: c for c in every if c["source"] == "arithmetic"}
    assert sorted(arith) == sorted(r["rollout_id"] for r in rollouts) and len(every) == len(crit) + P * G
    for rid, c in arith.items():
        if c["parse_status"] != "skipped_empty_response":
            assert tuple(c["wrong_steps"]) == critique_steps(texts[rid]).wrong_steps
    assert len({(c["rollout_id"], c["critique_idx"]) for c in crit}) == len(crit)
    from pipeline.core.critique import parse_critique

    for c in crit:
        assert c["parse_status"] in PARSE_STATUSES + ("skipped_empty_response",)
        assert (c["wrong_steps"] is not None) == (c["parse_status"] in VERDICT_STATUSES)
        if c["parse_status"] != "skipped_empty_response":  # the row is the parser's reading of the stored reply
            parsed = parse_critique(c["raw_text"], c["n_steps"])
            assert (c["parse_status"], c["steps_judged"], c["steps_wrong_lines"]) == (
                parsed.status, list(parsed.judged), list(parsed.wrong_by_lines))
            assert c["wrong_steps"] == (None if parsed.wrong_steps is None else list(parsed.wrong_steps))
        assert set(c["steps_wrong_lines"] or []) <= set(c["steps_judged"] or []) <= set(range(c["n_steps"]))
        assert all(0 <= s < c["n_steps"] for s in c["wrong_steps"] or [])
        assert c["template_version"] and c["critic_model"].endswith("smollm2-135m-instruct")
    # the round's summary measures its process signal where it is used (pipeline/process_signal.py)
    import json

    sig = json.loads(round_paths(cfg, 1)["run_summary"].read_text())["process_signal"]
    assert {(r["source"], r["scope"]) for r in sig} == {(s, c) for s in ("vote", "arithmetic", "vote+arithmetic")
                                                        for c in ("all_steps", "before_answer")}
    assert all(r["variant"] == cfg.variant and r["n_responses"] == P * G for r in sig)
    assert {r["source"] for r in sig if r["trains"]} == {"vote"}  # vote.sources is [llm] in configs/tiny.yaml
    assert all(r["groups"] == P == r["groups_outcome"] + r["groups_process_only"] + r["groups_other_signal"]
               + r["groups_no_signal"] for r in sig)


def test_steps_partition_every_response(tiny_round):
    cfg = tiny_round[0]
    n_tok = {r["rollout_id"]: r["num_tokens"] for r in _t(cfg, "rollouts")}
    by: dict[str, list] = {}
    for s in _t(cfg, "steps"):
        by.setdefault(s["rollout_id"], []).append(s)
    assert set(by) == set(n_tok)
    for rid, steps in by.items():
        steps.sort(key=lambda s: s["step_idx"])
        assert [s["step_idx"] for s in steps] == list(range(len(steps)))
        assert steps[0]["token_start"] == 0 and steps[-1]["token_end"] == n_tok[rid]
        for a, b in zip(steps, steps[1:]):
            assert a["token_end"] == b["token_start"] and a["char_end"] <= b["char_start"]


def test_votes_rewards_and_advantages_are_consistent(tiny_round):
    cfg = tiny_round[0]
    C, P = cfg.reward.correct_weight, cfg.reward.process_weight
    w = {(v["rollout_id"], v["step_idx"], v["rule"]): v["weight"] for v in _t(cfg, "step_verdicts")}
    for (rid, s, rule), weight in w.items():
        if rule == "intersection":
            assert weight <= w[(rid, s, "majority")] <= w[(rid, s, "union")]
    correct = {o["rollout_id"]: o["outcome_correct"] for o in _t(cfg, "outcomes")}
    steps = _t(cfg, "steps")
    n_tok = {r["rollout_id"]: r["num_tokens"] for r in _t(cfg, "rollouts")}
    tr = _t(cfg, "token_rewards")
    assert len(tr) == len(n_tok)
    groups: dict[str, list] = {}
    rewards: dict[str, list] = {}
    for r in tr:
        assert len(r["rewards"]) == len(r["advantages"]) == n_tok[r["rollout_id"]]
        expected = np.zeros(n_tok[r["rollout_id"]])
        for s in (s for s in steps if s["rollout_id"] == r["rollout_id"]):
            expected[s["token_start"]:s["token_end"]] = C * correct[r["rollout_id"]] - P * w[(r["rollout_id"], s["step_idx"], cfg.vote.rule)]
        np.testing.assert_allclose(r["rewards"], expected, rtol=0, atol=1e-6)
        groups.setdefault(r["prompt_id"], []).extend(r["advantages"])
        rewards.setdefault(r["prompt_id"], []).extend(r["rewards"])
    assert cfg.reward.estimator == "capo-token-group" and cfg.reward.scale_by_std
    for pid, adv in groups.items():  # each token's reward less the group's token mean, over its token std (ddof 1)
        rew = np.asarray(rewards[pid], dtype=np.float64)
        std = rew.std(ddof=1) if rew.size > 1 else 0.0
        np.testing.assert_allclose(adv, (rew - rew.mean()) / (std + cfg.reward.eps), rtol=0, atol=1e-5)


def test_training_wrote_a_new_policy(tiny_round, data_dir):
    from safetensors.torch import load_file

    cfg = tiny_round[0]
    ckpt = round_paths(cfg, 1)["checkpoint"]
    assert (ckpt / "config.json").is_file() and (ckpt / "tokenizer_config.json").is_file()
    new = load_file(str(ckpt / "model.safetensors"))
    old = load_file(str(data_dir / "models" / "smollm2-135m-instruct" / "model.safetensors"))
    changed = [k for k in new if k in old and not np.array_equal(new[k].float().numpy(), old[k].float().numpy())]
    names = {m["name"] for m in _t(cfg, "train_metrics")}
    assert {"loss", "clip_frac", "approx_kl", "grad_norm", "export_update_share", "export_moved_frac"} <= names
    # configs/tiny.yaml's round 1 has a signal (its process penalties make token advantages non-zero
    # even where a group's outcomes agree); a round without one would test nothing here
    n_nonzero = sum(abs(a) > 0 for r in _t(cfg, "token_rewards") for a in r["advantages"])
    assert n_nonzero > 0, "tiny.yaml's round 1 has no non-zero advantage: choose a seed whose round has a signal"
    assert changed, "a non-zero advantage must move the weights"
    # tiny.yaml saves float32: the checkpoint is the master weights, it carries the whole update
    drift = {m["name"]: m["value"] for m in _t(cfg, "train_metrics") if m["name"].startswith(("export", "master"))}
    assert drift["export_update_share"] == 1.0 == drift["export_update_share_from_start"]
    assert drift["export_moved_frac"] == drift["master_moved_frac"] > 0
    # and it moved the way the round's credit says: the checkpoint reloaded from disk, against the
    # starting model, on the round's own tokens: tokens with a positive advantage gained log-prob on
    # average, tokens with a negative one lost it
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.stages.train import load_examples
    from train.examples import collate
    from train.logprobs import token_logprobs

    reloaded = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    before = AutoModelForCausalLM.from_pretrained(data_dir / "models" / "smollm2-135m-instruct",
                                                  dtype=torch.float32).eval()
    mb = collate(load_examples(cfg, 1), pad_id=0)
    with torch.no_grad():
        delta = (token_logprobs(reloaded, mb) - token_logprobs(before, mb))[mb["mask"]]
    adv = mb["advantages"][mb["mask"]]
    up, down = float(delta[adv > 0].mean()), float(delta[adv < 0].mean())
    agree = float(((delta > 0) == (adv > 0))[adv != 0].float().mean())
    print(f"round 1: mean dlogp adv>0 {up:.2e}, adv<0 {down:.2e}; {agree:.0%} of the tokens moved with their advantage")
    assert up > 0 > down, (up, down)
    # (AVX2 EPYC: +0.20 and -0.094, 83 %; weights moved at random would agree about half the time)
    assert agree > 0.6, f"only {agree:.0%} of the tokens moved with their advantage"


def test_manifests_record_the_resolved_precision_and_the_cpu(tiny_round):
    """Every stage's manifest and the round summary say which dtypes were used and on which CPU."""
    import json

    import platform

    from pipeline.storage import read_manifest

    cfg = tiny_round[0]
    p = round_paths(cfg, 1)
    # what the manifests should say, read from the machine itself, not from pipeline.precision
    from pipeline.engines.base import has_cuda

    if platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists() or has_cuda():
        pytest.skip("the expected values are read from an x86 Linux /proc/cpuinfo (on a GPU machine the GPU decides)")
    cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    flags = set(next(ln for ln in cpuinfo if ln.startswith("flags")).split(":", 1)[1].split())
    model = next(ln for ln in cpuinfo if ln.startswith("model name")).split(":", 1)[1].strip()
    native = bool(flags & {"avx512_bf16", "amx_bf16"})
    want_autocast = "bf16" if native else "no"  # tiny.yaml leaves it on auto: bf16 only where native
    for name in ("rollouts", "outcomes", "critiques", "token_rewards", "checkpoint", "eval"):
        prec = read_manifest(p[name])["precision"]
        assert (prec["rollout_dtype"], prec["critique_dtype"]) == ("float32", "float32")  # tiny.yaml: explicit
        assert prec["train_mixed_precision"] == want_autocast
        assert prec["device"]["cores"] >= 1 and prec["device"]["torch_cpu_capability"]
        assert (prec["device"]["cpu_model"], prec["device"]["native_bf16"]) == (model, native)
    summary = json.loads(p["run_summary"].read_text())
    assert summary["precision"]["device"]["cpu_model"] == model


def test_second_run_skips_every_stage_as_current(tiny_round):
    _, _, second, _ = tiny_round  # the time it took is a benchmark figure (bench_round.py), not a test
    assert all(r["skipped"] for r in second), [r for r in second if not r["skipped"]]
    assert all("current" in r["reason"] for r in second if r["stage"] not in ("mc", "densr"))  # not applicable


def test_catalog_answers_sql_read_only(tiny_round, tmp_path):
    cfg = tiny_round[0]
    cwd = os.getcwd()
    os.chdir(tmp_path)  # views hold absolute paths: any working directory works
    try:
        con = duckdb.connect(str(Path(cfg.runs_dir) / "catalog.duckdb"), read_only=True)
        n = con.execute("SELECT count(*) FROM critiques").fetchone()[0]
        flagged = con.execute("SELECT rule, avg(weight) FROM step_verdicts GROUP BY rule").fetchall()
        toks = con.execute("SELECT count(*) FROM (SELECT unnest(rewards) FROM token_rewards)").fetchone()[0]
        con.close()
    finally:
        os.chdir(cwd)
    assert n == len(_t(cfg, "critiques"))
    assert {r for r, _ in flagged} == {"intersection", "union", "majority", "average"}
    assert toks == sum(r["num_tokens"] for r in _t(cfg, "rollouts"))


def test_the_documented_example_queries_answer_on_a_finished_round(tiny_round, repo):
    """Every example query of docs/tables.md runs on the round's catalog as written and returns rows."""
    import importlib.util
    import re

    spec = importlib.util.spec_from_file_location("render_table_docs", repo / "scripts" / "render_table_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sql = re.findall(r"```sql\n(.*?)```", mod.INTRO, flags=re.S)[0]
    queries = [q.strip() for q in sql.split(";\n") if q.strip()]
    assert len(queries) == 7
    con = duckdb.connect(str(Path(tiny_round[0].runs_dir) / "catalog.duckdb"), read_only=True)
    try:
        answered = {q.splitlines()[0]: len(con.execute(q).fetchall()) for q in queries}
    finally:
        con.close()
    assert all(answered.values()), answered


def test_retraining_a_cached_round_under_another_preset_calls_no_critic(tiny_round, harness, repo):
    import json

    from flows.round import capo_round

    cfg = tiny_round[0]
    # no eval: nothing here reads it, and it is a vLLM engine start (variant_summary does not join it)
    over = [f"runs_dir={cfg.runs_dir}", f"data_dir={cfg.data_dir}", "eval.enabled=false"]
    with one_thread_while_jobs_run():
        res = {r["stage"]: r for r in capo_round(round=1, config=str(repo / "configs" / "tiny.yaml"),
                                                  overrides=over, preset="capo-union")}
    assert all(res[s]["skipped"] for s in ("rollout", "verify", "segment", "critique"))
    assert not any(res[s]["skipped"] for s in ("vote", "reward", "train"))
    union = tiny_cfg(repo, Path(cfg.data_dir), Path(cfg.runs_dir), variant="capo-union", **{"vote.rule": "union"})
    summary = json.loads(round_paths(union, 1)["run_summary"].read_text())
    assert summary["critic_calls"] == 0 and summary["variant"] == "capo-union"
    # both variants side by side, nothing overwritten
    assert round_paths(cfg, 1)["checkpoint"].is_dir() and round_paths(union, 1)["checkpoint"].is_dir()
    con = duckdb.connect(str(Path(cfg.runs_dir) / "catalog.duckdb"), read_only=True)
    rows = con.execute("SELECT variant, rule, share_tokens_penalized, clip_frac FROM variant_summary "
                       "WHERE variant IN ('capo-majority', 'capo-union') ORDER BY variant").fetchall()
    con.close()
    assert [r[0] for r in rows] == ["capo-majority", "capo-union"]
    assert rows[0][2] <= rows[1][2]  # majority penalizes no more tokens than union


@pytest.mark.parametrize("preset", ["grpo-lambda", "fipo", "vineppo", "densr"])
def test_each_rival_method_retrains_the_cached_round_through_the_flow(tiny_round, harness, repo, preset):
    """Each rival credit method, as a variant of the same cached round through the Prefect flow: no
    rollout, verification or segmentation again and no critic, its own stage where it has one (mc:
    the policy's continuations through vLLM; densr: the policy's hidden states), the estimator named
    in ``token_rewards``' key, a checkpoint, and the credit the update put on each token."""
    from flows.round import capo_round
    from pipeline import storage

    cfg = tiny_round[0]
    over = [f"runs_dir={cfg.runs_dir}", f"data_dir={cfg.data_dir}", "eval.enabled=false",
            "mc.continuations=2", "mc.max_states=2"]
    with one_thread_while_jobs_run():
        res = {r["stage"]: r for r in capo_round(round=1, config=str(repo / "configs" / "tiny.yaml"),
                                                  overrides=over, preset=preset)}
    assert all(res[s]["skipped"] for s in ("rollout", "verify", "segment", "critique"))
    own = {"vineppo": "mc", "densr": "densr"}.get(preset)
    for stage in ("mc", "densr"):
        assert res[stage]["skipped"] == (stage != own), (stage, res[stage])
    assert not any(res[s]["skipped"] for s in ("reward", "train"))
    vcfg = load_config(repo / "configs" / "tiny.yaml", over, preset=preset)
    p = round_paths(vcfg, 1)
    man = storage.read_manifest(p["token_rewards"])
    assert man["key"]["reward"]["estimator"] == {"grpo-lambda": "grpo-lambda", "fipo": "fipo", "vineppo": "vineppo",
                                                 "densr": "densr"}[preset]
    assert (p["checkpoint"] / "config.json").is_file()
    # the method reached the update: its loss settings in the checkpoint's key, its table in the reward's
    train = storage.read_manifest(p["checkpoint"])["key"]["train"]
    assert ("ratio_trace" in train) == (preset == "grpo-lambda") and ("future_kl" in train) == (preset == "fipo")
    reward_inputs = man["key"]
    assert ("mc_values" in reward_inputs) == (preset == "vineppo") and ("token_divergence" in reward_inputs) == (preset == "densr")
    credit = pq.read_table(p["token_credit"]).to_pylist()
    rewards = {r["rollout_id"]: r for r in pq.read_table(p["token_rewards"]).to_pylist()}
    assert credit and {r["rollout_id"] for r in credit} <= set(rewards)
    if own:  # the stage's own table, committed
        assert storage.read_manifest(p[{"mc": "mc_values", "densr": "token_divergence"}[own]]) is not None
    summary = json.loads(p["run_summary"].read_text())
    assert summary["critic_calls"] == 0 and summary["variant"] == preset
    # the credit the reward stage wrote is the estimator's, recomputed here from the tables as written
    want_r, want_a = rival_credit_by_hand(vcfg, preset)
    assert set(rewards) == set(want_a)
    for rid, r in rewards.items():
        np.testing.assert_allclose(r["rewards"], want_r[rid], rtol=0, atol=1e-6, err_msg=f"{preset} {rid}")
        np.testing.assert_allclose(r["advantages"], want_a[rid], rtol=1e-6, atol=1e-6, err_msg=f"{preset} {rid}")
    if preset == "vineppo":  # each Monte Carlo grade is its state's text plus the continuation, graded anew
        _regrade_mc_values(vcfg)


def _regrade_mc_values(cfg) -> None:
    """Every continuation of the round's ``mc_values``, graded again (its state's decoded text, then the
    continuation, against the problem's gold answer, the verify stage's rules) equals its stored grade."""
    from pipeline.core.tokenization import decode_with_bytes
    from pipeline.engines.base import load_tokenizer
    from pipeline.stages.base import policy_for_round, prompts_path
    from tests.stages.test_mc import regrade

    tok = load_tokenizer(policy_for_round(cfg, 1))
    ro = {r["rollout_id"]: r for r in _t(cfg, "rollouts")}
    gold = {r["prompt_id"]: r["gold_answer"] for r in pq.read_table(prompts_path(cfg)).to_pylist()}
    for m in _t(cfg, "mc_values"):  # (the tiny policy's are nearly all wrong: tests/stages/test_mc.py has right ones)
        r = ro[m["rollout_id"]]
        head = decode_with_bytes(tok, r["response_token_ids"][:m["token_end"]])[0]
        assert m["correct"] == regrade(cfg, m, head, gold[r["prompt_id"]]), m
        assert m["value"] == pytest.approx(sum(m["correct"]) / m["n_continuations"])


def test_the_critique_browser_of_the_real_round_in_chromium(tiny_round, repo):
    """The critique browser as a person uses it: `capo browse`, open the page, filter, click a step."""
    from pipeline.browse import headless_chromium
    from tests.conftest import require_chromium

    require_chromium()
    cfg = tiny_round[0]
    out = subprocess.run([sys.executable, "-m", "flows.cli", "browse", cfg.run_id, "--round", "1",
                          "--runs-dir", cfg.runs_dir], cwd=repo, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    page_path = Path(out.stdout.strip().splitlines()[-1])
    assert page_path.is_file() and page_path.parent.name == f"round_001-{cfg.variant}"
    # what the filter must show, from the tables themselves
    con = duckdb.connect(str(Path(cfg.runs_dir) / "catalog.duckdb"), read_only=True)
    wrong_unflagged = {r[0] for r in con.execute(
        "SELECT o.rollout_id FROM outcomes o WHERE NOT o.outcome_correct AND NOT EXISTS (SELECT 1 FROM step_verdicts v "
        "WHERE v.rollout_id = o.rollout_id AND v.rule = ? AND v.variant = ? AND v.weight > 0)",
        [cfg.vote.rule, cfg.variant]).fetchall()}
    critiques = {}
    for rid, idx, raw in con.execute("SELECT rollout_id, critique_idx, raw_text FROM critiques WHERE source = 'llm' "
                                     "ORDER BY 1, 2").fetchall():
        critiques.setdefault(rid, []).append(raw)
    tokens = dict(con.execute("SELECT rollout_id, num_tokens FROM rollouts").fetchall())
    con.close()
    with headless_chromium() as browser:
        page = browser.new_page()
        page.goto(page_path.as_uri())
        assert page.locator(".response").count() == cfg.data.prompts_per_round * cfg.rollout.group_size
        page.check("input[name=filter][value=wrong_unflagged]")
        shown = page.locator(".response:not(.hidden)")
        assert {shown.nth(i).get_attribute("data-rollout") for i in range(shown.count())} == wrong_unflagged
        page.check("input[name=filter][value=all]")
        first = page.locator(".response").first
        rid = first.get_attribute("data-rollout")
        first.locator(".step").first.click()
        shown_raw = [first.locator('[data-testid="critique"] pre').nth(i).inner_text()
                     for i in range(len(critiques[rid]))]
        assert [s.strip() for s in shown_raw] == [c.strip() for c in critiques[rid]]
        assert first.locator('[data-testid="token-strip"] span').count() == tokens[rid]


def test_two_rounds_started_together_on_one_run_exactly_one_writes(tiny_round, repo):
    """`capo round` twice at once on the finished run (vote forced, so there is
    something to write): one runs, the other exits with status 3 naming it; the tables are one run's."""
    from pipeline import storage

    cfg = tiny_round[0]
    p = round_paths(cfg, 1)
    before = {n: storage.read_manifest(p[n])["fingerprint"] for n in ("critiques", "step_verdicts", "token_rewards")}
    cmd = [sys.executable, "-m", "flows.cli", "round", "--config", "configs/tiny.yaml", "--round", "1",
           "--force", "vote", f"runs_dir={cfg.runs_dir}", f"data_dir={cfg.data_dir}"]
    env = {k: v for k, v in os.environ.items() if k != "CAPO_RUN_LOCK"}
    procs = [subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [pr.communicate(timeout=900) for pr in procs]
    codes = sorted(pr.returncode for pr in procs)
    assert codes == [0, 3], [o[1][-1500:] for o in outs]
    loser = outs[[pr.returncode for pr in procs].index(3)][1]
    winner_pid = procs[[pr.returncode for pr in procs].index(0)].pid
    assert f"being written by pid {winner_pid}" in loser
    after = {n: storage.read_manifest(p[n])["fingerprint"] for n in before}
    assert after == before  # the forced vote wrote the same verdicts; nothing else ran twice


# ------------------------------------------------ the subprocess tests, run by round_jobs beside the flows
def test_killed_mid_critique_resumes_without_lost_or_doubled_rows(round_jobs):
    """Copy the finished round's rollouts/outcomes/steps, kill `capo round` (its process group)
    during the critique stage once a shard is committed, run the critique stage again, and check the
    critiques table: every (rollout, critique) once. (Resuming the whole round after such a kill is
    the kill matrix's "critique" group, tests/slow/test_multi_round.py; the stage alone here spares
    this test the round's training and eval.) Run by :func:`round_jobs` (:func:`_kill_mid_critique`)."""
    cfg, job = round_jobs["kill_critique"]
    res = job.result()
    done_before, out = res["done_before"], res["out"]
    parts = round_paths(cfg, 1)["critiques"].with_suffix(".parts")
    assert 1 <= done_before < 4 and not res["table_after_kill"]
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming: {done_before} rollouts already critiqued in {done_before} shards" in out.stderr, out.stderr[-3000:]
    crit = pq.read_table(round_paths(cfg, 1)["critiques"]).to_pylist()
    keys = [(c["rollout_id"], c["critique_idx"]) for c in crit if c["source"] == "llm"]
    assert len(keys) == len(set(keys)) == 4 * cfg.critique.num_critiques
    assert sum(c["source"] == "arithmetic" for c in crit) == 4  # one arithmetic check per rollout
    assert not parts.exists()


def test_killed_while_the_vllm_eval_commits_resumes_to_the_uninterrupted_table(tiny_round, round_jobs):
    """The kill point with the real vLLM engines (the others are in tests/slow/test_multi_round.py):
    a copy of the finished round (hard links) without round 1's eval; `capo round` SIGKILLed (its
    process group, vLLM's engine included) when the eval table is written but not yet in place;
    started again: the eval table equals the uninterrupted run's, and the killed write left nothing.
    Run by :func:`round_jobs` (:func:`_kill_at_eval_write`), with the round's own environment."""
    src_cfg = tiny_round[0]
    cfg, ev, job = round_jobs["kill_eval"]
    res = job.result()
    killed, out = res["killed"], res["out"]
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert res["tmp_after_kill"] and not res["eval_after_kill"]  # killed between write and rename
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[train] skipped: checkpoint is current" in out.stderr and not list(ev.parent.glob(".eval.parquet.*.tmp"))
    a, b = pq.read_table(round_paths(src_cfg, 1)["eval"]), pq.read_table(ev)
    drop = [c for c in ("policy",) if c in a.column_names]  # the checkpoint's path names the runs folder
    assert a.num_rows > 0 and a.drop_columns(drop).equals(b.drop_columns(drop))


def test_noise_floor_of_a_real_round(round_jobs):
    """`capo noise-floor --round 1` on the real round (a copy of its run folder): its fp32 checkpoint
    evaluated again and rounded to bf16, each paired with round 1's eval table as written; the report
    prints both. Run by :func:`round_jobs` (:func:`_noise_floor`)."""
    import json

    import torch
    from safetensors.torch import load_file

    cfg, job = round_jobs["noise_floor"]
    out = job.result()
    assert out.returncode == 0, out.stderr[-3000:]
    nf = Path(cfg.runs_dir) / cfg.run_id / "noise_floor" / "round_001" / cfg.variant
    s = json.loads((nf / "noise_floor.json").read_text())
    base = {(r["benchmark"], r["prompt_id"]): r for r in _t(cfg, "eval") if r["decoding"] == "greedy"}
    for arm in ("repeat", "one_rounding"):
        again = {(r["benchmark"], r["prompt_id"]): r for r in pq.read_table(nf / f"{arm}.parquet").to_pylist()}
        assert set(again) == set(base)  # the same problems
        for row in s["arms"][arm]["benchmarks"]:
            keys = [k for k in base if k[0] == row["benchmark"]]
            assert row["n"] == len(keys) == cfg.eval.sample_size
            assert row["n10"] == sum(base[k]["correct"] and not again[k]["correct"] for k in keys)
            assert row["n01"] == sum(again[k]["correct"] and not base[k]["correct"] for k in keys)
            assert row["same_text"] == sum(base[k]["response_text"] == again[k]["response_text"] for k in keys) / len(keys)
    # tiny saves float32: the copy is round 1's weights rounded to bf16 (at most half a bf16 step, 2^-8 relative)
    r1 = s["arms"]["one_rounding"]
    assert r1["perturbation"] == "rounded to bf16" and 0 < r1["changed_share"] <= 1 and r1["max_rel_change"] <= 2**-8
    ckpt = load_file(str(round_paths(cfg, 1)["checkpoint"] / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in ckpt.values())
    assert not (nf / "one_rounding_checkpoint").exists()  # the model copy is not kept, its table is
    report = (Path(cfg.runs_dir) / cfg.run_id / "report" / "report.md").read_text()
    assert "Noise floor of the eval" in report and "one bf16 rounding (rounded to bf16)" in report
    assert "same checkpoint again" in report and "not batch-invariant" in report
