"""Two on-policy rounds with the tiny model and the deterministic transformers engine (CPU).

An uninterrupted ``capo run --rounds 2`` is compared with one SIGKILLed (its whole process group) at
seeded kill points spread over every stage of both rounds (:mod:`pipeline.faults`: table and shard
commits, the training state and checkpoint writes, eval, the catalog and report, between rounds)
and started again after each: every table, both checkpoints and the training states must be the
same, and ``capo check`` must find every output intact and current.
Round 2 must sample from round 1's checkpoint, eval must have a row per benchmark per round, and
the report must be written.

The kill matrix has eleven groups of points (:data:`KILL_GROUPS`). By default the suite kills at
the :data:`DEFAULT_KILL_GROUPS` (2) of them, drawn with a seed taken from the checked-out commit, so each
commit tests another subset and every point is covered over time; each kill costs a restart and the
killed stage's lost work (about a minute on a 2-core AVX2 CPU). The seed and the points drawn are
printed and named in every failure. The full matrix, and any one draw again::

    CAPO_KILL_GROUPS=all .venv/bin/python -m pytest tests/slow/test_multi_round.py
    CAPO_KILL_SEED=1234 .venv/bin/python -m pytest tests/slow/test_multi_round.py
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.slow

VARIANT = "capo-average"
TABLES = ("rollouts", "outcomes", "steps", "critiques", f"variants/{VARIANT}/step_verdicts",
          f"variants/{VARIANT}/token_rewards", f"variants/{VARIANT}/token_credit", f"variants/{VARIANT}/eval")


def _cmd(repo: Path, runs: Path, data_dir: Path, seed: int, rounds: int = 2) -> list[str]:
    return [sys.executable, "-m", "flows.cli", "run", "--rounds", str(rounds), "--config", str(repo / "configs" / "tiny.yaml"),
            f"runs_dir={runs}", f"data_dir={data_dir}", "rollout.engine.type=transformers",
            "critique.engine.type=transformers", "critique.batch_rollouts=1", "eval.benchmarks=[gsm8k]",
            "rollout.sampling.max_tokens=64", "critique.sampling.max_tokens=32", f"variant={VARIANT}",
            "vote.rule=average", "vote.sources=[llm,logprob,arithmetic]", "critique.logprob_readout=true",
            "reward.overlong_buffer=16", "train.mixed_precision=no", f"seed={seed}"]


ONE_THREAD = {"OMP_NUM_THREADS": "1"}
"""Every run here, and the replay, computes on one thread: the uninterrupted and the killed run go at
the same time (one core each), and fp32 sums depend on the thread count, so runs compared bit for bit
must share it."""


# The runs train in fp32 (the shipped default): a kill at the training state or the checkpoint makes the
# resumed run train that round again, and bf16 autocast on a CPU with AMX is not bitwise reproducible
# between processes (a clean-clone CI run on an AMX Xeon, killed at round 2's checkpoint, ended with
# other round-2 master weights in one run of two), so only fp32 can be held to identical tables.
#
# SmolLM2 never solves GSM8K, and the tiny critic's sampled critiques rarely flag a step (it mostly
# echoes the prompt's example, out of range for a response of one or two steps), so they alone leave a
# round without a signal on some seeds and CPUs. The rounds here also vote the critic's log-prob
# readout under the average rule: every step's weight is at least its calibrated P(wrong), a number
# strictly between 0 and 1 that differs between responses, so a group's token rewards differ and both
# rounds train on a non-zero signal under any seed (the arithmetic check and the overlong penalty, the
# last 16 of the 64 tokens, vote beside it). The round-k-vs-k-1 and two-rounds-equal-one-process tests
# need that signal; the fixture still takes the first of these seeds that gives it, in case one does not.
SEEDS = (1, 2, 5, 6, 7, 8, 9, 10, 11, 12)


def _has_signal(run: Path, k: int) -> bool:
    t = pq.read_table(run / f"round_{k:03d}" / "variants" / VARIANT / "token_rewards.parquet")
    return any(abs(x) > 0 for row in t.column("advantages").to_pylist() for x in row)


V1, V2 = f"round_001/variants/{VARIANT}", f"round_002/variants/{VARIANT}"
KILL_GROUPS = (
    # (what, candidate kill points in run order; pipeline/faults.py): one point is drawn per group; with
    # CAPO_KILL_GROUPS=all a run is killed in every stage, at the training-state write, the checkpoint
    # write, the catalog refresh and between the rounds
    ("rollout", ["table.written:round_001/rollouts.parquet", "table.renamed:round_001/rollouts.parquet"]),
    ("verify+segment", ["table.renamed:round_001/outcomes.parquet", "table.written:round_001/steps.parquet",
                        "table.renamed:round_001/steps.parquet"]),
    ("critique", ["part.written:round_001/critiques.parts/part-00001.parquet",
                  "table.written:round_001/critiques.parquet", "table.renamed:round_001/critiques.parquet"]),
    ("vote+reward", [f"table.renamed:{V1}/step_verdicts.parquet", f"table.written:{V1}/token_rewards.parquet",
                     f"table.renamed:{V1}/token_rewards.parquet"]),
    ("training state", [f"state.saved:{V1}/train_state", f"state.renamed:{V1}/train_state",
                        f"table.renamed:{V1}/token_credit.parquet"]),
    ("eval", ["table.written:round_000/eval.parquet", "table.renamed:round_000/eval.parquet",
              f"table.renamed:{V1}/eval.parquet"]),
    ("catalog", ["catalog.written:catalog.duckdb@1"]),
    ("between rounds", ["report.written:*@1", "round.finished:round_001"]),
    ("round 2: rollout..critique", ["table.renamed:round_002/rollouts.parquet",
                                    "part.written:round_002/critiques.parts/part-00002.parquet"]),
    ("round 2: checkpoint", [f"checkpoint.saved:{V2}/checkpoint", f"checkpoint.renamed:{V2}/checkpoint"]),
    ("round 2: eval, catalog", [f"table.written:{V2}/eval.parquet", "catalog.written:catalog.duckdb@2"]),
)


DEFAULT_KILL_GROUPS = 2
"""Groups of :data:`KILL_GROUPS` the suite kills in by default (``CAPO_KILL_GROUPS``: a count or ``all``)."""


def kill_seed(repo: Path) -> int:
    """``CAPO_KILL_SEED`` when set, else a number made from the checked-out commit (``git rev-parse
    HEAD``), else 0: a new commit draws another subset of kill points."""
    if os.environ.get("CAPO_KILL_SEED"):
        return int(os.environ["CAPO_KILL_SEED"])
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=30)
        return int(head.stdout.strip()[:8], 16) if head.returncode == 0 and head.stdout.strip() else 0
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def kill_groups(seed: int, n: int | str) -> list[int]:
    """Indices of the :data:`KILL_GROUPS` to kill in, in run order: ``n`` of them drawn with ``seed``
    (``"all"`` or n >= 11: every group).

    Raises:
        ValueError: ``n`` is not ``all`` or a positive integer.
    """
    import random

    if n == "all":
        return list(range(len(KILL_GROUPS)))
    if not str(n).isdigit() or int(n) < 1:
        raise ValueError(f"CAPO_KILL_GROUPS={n!r}: expected 'all' or a positive number of groups (1..{len(KILL_GROUPS)})")
    k = min(int(n), len(KILL_GROUPS))
    return sorted(random.Random(seed).sample(range(len(KILL_GROUPS)), k))


def kill_points(seed: int, groups: list[int] | None = None) -> list[str]:
    """One point per group in ``groups`` (default: all) of :data:`KILL_GROUPS`, drawn with ``seed``, in
    run order. The point of a group does not depend on which other groups were drawn."""
    import random

    rng = random.Random(seed)
    drawn = [rng.choice(points) for _, points in KILL_GROUPS]
    return [drawn[i] for i in (range(len(KILL_GROUPS)) if groups is None else groups)]


def _uninterrupted(repo: Path, run: Path, data_dir: Path, seed: int) -> list[int]:
    """Run ``capo run --rounds 2`` to the end; the rounds (of 1, 2) that trained on a signal."""
    out = subprocess.run(_cmd(repo, run, data_dir, seed), cwd=repo, capture_output=True, text=True, timeout=1800,
                         env={**os.environ, **ONE_THREAD})
    assert out.returncode == 0, out.stderr[-3000:]
    return [k for k in (1, 2) if _has_signal(run / "tiny", k)]


def _killed(repo: Path, run: Path, data_dir: Path, seed: int, points: list[str], kseed: int) -> tuple[list[str], str]:
    """Run ``capo run --rounds 2`` SIGKILLed (whole process group) at each of ``points``, started again
    after each kill, then to the end: the points killed at and the last run's log."""
    shutil.rmtree(run, ignore_errors=True)
    kills = []
    for point in points:
        proc = subprocess.run(_cmd(repo, run, data_dir, seed), cwd=repo, capture_output=True, text=True, timeout=1800,
                              start_new_session=True, env={**os.environ, **ONE_THREAD, "CAPO_KILL_AT": point})
        # the whole group died at the point (not before: an earlier failure would exit non-zero; not
        # never: a point the run did not reach would exit 0)
        assert proc.returncode == -signal.SIGKILL, \
            f"CAPO_KILL_SEED={kseed} {point}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
        kills.append(point)
    out = subprocess.run(_cmd(repo, run, data_dir, seed), cwd=repo, capture_output=True, text=True, timeout=1800,
                         env={**os.environ, **ONE_THREAD})
    assert out.returncode == 0, out.stderr[-3000:]
    return kills, out.stderr


_BACKGROUND: dict = {}
"""Work :func:`two_runs` starts beside the killed run for a test to collect (``"replay"``: a Future)."""


@pytest.fixture(scope="module")
def two_runs(repo, data_dir, module_tmp):
    """Run ``a`` uninterrupted and, at the same time (one thread each), run ``b`` SIGKILLed at each of
    the drawn kill points (module docstring), started again after each kill, then to the end. Should
    the first seed leave a round of ``a`` without a signal, the next seeds are tried for ``a`` alone
    and ``b`` runs again under the one found."""
    from concurrent.futures import ThreadPoolExecutor

    base = module_tmp("multi")
    b = base / "b"
    kseed = kill_seed(repo)
    points = kill_points(kseed, kill_groups(kseed, os.environ.get("CAPO_KILL_GROUPS", str(DEFAULT_KILL_GROUPS))))
    print(f"two_runs: CAPO_KILL_SEED={kseed} kills at {points}")
    tried = []
    with ThreadPoolExecutor(2) as pool:
        killed = pool.submit(_killed, repo, b, data_dir, SEEDS[0], points, kseed)
        for seed in SEEDS:
            a = base / f"a-seed{seed}"
            signal_in = _uninterrupted(repo, a, data_dir, seed)
            if signal_in == [1, 2]:
                break
            tried.append((seed, signal_in))
            shutil.rmtree(a)
        else:
            killed.result()
            pytest.fail(f"no seed of {SEEDS} gives both rounds a signal (seed, rounds with one): {tried}")
        # the replay of a's updates (test_two_rounds_equal_one_process_training_both) needs a alone: it
        # runs on the core a leaves while b goes on
        _BACKGROUND["replay"] = pool.submit(_replay, a / "tiny", base / "carried.safetensors", fresh_optimizer=False)
        kills, log = killed.result()
    if tried:
        print(f"two_runs: seed {seed} (tried first: {tried})")
        kills, log = _killed(repo, b, data_dir, seed, points, kseed)
    return a / "tiny", b / "tiny", kills, log, seed, kseed


def _table(run: Path, k: int, name: str):
    t = pq.read_table(run / f"round_{k:03d}" / f"{name}.parquet")
    # absolute checkpoint paths differ between the two run dirs (and so do hashes over them)
    return t.drop_columns([c for c in ("policy", "reward_config_hash") if c in t.column_names])


@pytest.mark.parametrize("name", TABLES)
def test_killed_and_resumed_run_equals_uninterrupted_run(two_runs, name):
    a, b, kills, *_, kseed = two_runs
    assert kills and len(KILL_GROUPS) >= 8
    for k in (1, 2):
        ta, tb = _table(a, k, name), _table(b, k, name)
        assert ta.num_rows > 0 and ta.equals(tb), \
            f"round {k} {name} differs after kill + resume (CAPO_KILL_SEED={kseed}, kills at {kills})"


def test_resumed_run_continued_where_it_stopped(two_runs):
    log = two_runs[3]
    assert "rollouts.parquet is current" in log  # round 1 was not sampled again


def test_round_0_eval_and_checkpoints_equal_the_uninterrupted_run(two_runs):
    a, b, *_ = two_runs
    ta, tb = (pq.read_table(r / "round_000" / "eval.parquet") for r in (a, b))
    drop = [c for c in ("policy",) if c in ta.column_names]
    assert ta.num_rows > 0 and ta.drop_columns(drop).equals(tb.drop_columns(drop))
    for k in (1, 2):
        ca, cb = (_variant(r, k) / "checkpoint" / "model.safetensors" for r in (a, b))
        assert ca.read_bytes() == cb.read_bytes(), f"round {k}'s checkpoint differs after the kills"


def test_capo_check_finds_the_killed_run_intact_and_current(two_runs, repo, data_dir):
    """After the kills and the resume, every output verifies against its manifest (every byte),
    nothing is uncommitted, torn or left over, and every stage is current under the run's config."""
    b, seed = two_runs[1], two_runs[4]
    out = subprocess.run([sys.executable, "-m", "flows.cli", "check", "tiny", "--json", "--config",
                          str(repo / "configs" / "tiny.yaml"), *_cmd(repo, b.parent, data_dir, seed)[8:]],
                         cwd=repo, capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    bad = [r for r in rows if r["status"] != "ok"]
    assert out.returncode == 0 and not bad, (bad, out.stderr[-2000:])
    assert sum(r["output"].endswith("checkpoint") for r in rows) == 2 and len(rows) >= 20


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _variant(run: Path, k: int) -> Path:
    return run / f"round_{k:03d}" / "variants" / VARIANT


def _share_changed(a: dict, b: dict) -> float:
    changed = total = 0
    for n in a:
        if n in b:
            changed += int((a[n].float() != b[n].float()).sum())
            total += a[n].numel()
    return changed / total


def test_round_2_samples_from_round_1_checkpoint(two_runs, data_dir):
    a = two_runs[0]
    ckpt = _variant(a, 1) / "checkpoint"
    pol = set(pq.read_table(a / "round_002" / "rollouts.parquet").column("policy").to_pylist())
    assert pol == {str(ckpt)}
    man = json.loads((a / "round_002" / "rollouts.parquet.manifest.json").read_text())
    assert man["policy"] == str(ckpt)
    base = _weights(data_dir / "models" / "smollm2-135m-instruct")

    def has_signal(k: int) -> bool:
        return _has_signal(a, k)

    # each round's fp32 master weights move by that round's full update: round k against round k-1,
    # in most elements (Adam moves every weight with a gradient), and the engine checkpoint is their cast
    prev = {n: w.float() for n, w in base.items()}
    for k in (1, 2):
        state = _weights(_variant(a, k) / "train_state")
        share = _share_changed(state, prev)
        if has_signal(k):
            assert share > 0.5, f"round {k}'s master weights differ from round {k - 1}'s in only {share:.1%}"
        else:
            assert share == 0.0, f"round {k} had no signal but moved {share:.1%} of the weights"
        ckpt_w = _weights(_variant(a, k) / "checkpoint")
        for n, w in ckpt_w.items():
            assert torch_equal_cast(state[n], w), f"round {k} checkpoint {n} is not the cast of the master weights"
        prev = state
    assert has_signal(2), "round 2 must train on a non-zero signal"
    # prompts do not repeat across rounds
    p1 = set(pq.read_table(a / "round_001" / "rollouts.parquet").column("prompt_id").to_pylist())
    p2 = set(pq.read_table(a / "round_002" / "rollouts.parquet").column("prompt_id").to_pylist())
    assert p1.isdisjoint(p2)


def torch_equal_cast(master, exported) -> bool:
    return bool((master.to(exported.dtype) == exported).all())


_REPLAY = """
import json, sys
import torch
from accelerate import Accelerator
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from pipeline.config import load_config
from pipeline.precision import resolve_mixed_precision
from pipeline.stages.train import load_examples
from train.trainer import ppo_update

manifest, out, fresh = sys.argv[1], sys.argv[2], sys.argv[3] == "fresh"
cfg = load_config(None, json.loads(open(manifest).read())["resolved_config"])
tc = cfg.train
start = json.loads(open(sys.argv[4]).read())["policy"]
model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(start)
accelerator = Accelerator(mixed_precision=resolve_mixed_precision(tc.mixed_precision).value, cpu=True)
pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
steps = 0
for k in (1, 2):
    if k == 1 or fresh:  # fresh: the defect of a round that starts a new AdamW
        opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=tc.learning_rate,
                                weight_decay=tc.weight_decay)
        if k == 1:
            model, opt = accelerator.prepare(model, opt)
        else:
            opt = accelerator.prepare(opt)
    steps += len(ppo_update(model, opt, load_examples(cfg, k), tc, pad, cfg.seed + k, accelerator,
                            temperature=cfg.rollout.sampling.temperature))
save_file({n: t.detach().float().clone() for n, t in accelerator.unwrap_model(model).state_dict().items()}, out)
print(json.dumps({"steps": steps, "mixed_precision": str(accelerator.mixed_precision)}))
"""


def _replay(run: Path, out: Path, *, fresh_optimizer: bool) -> tuple[dict, dict]:
    """Both rounds' updates replayed in one fresh process (like the stage's own child, so no state of
    earlier tests in this process, such as an in-process vLLM, changes the kernels): its weights and
    ``{"steps", "mixed_precision"}``."""
    from safetensors.torch import load_file

    r = subprocess.run([sys.executable, "-c", _REPLAY, str(_variant(run, 1) / "train_metrics.parquet.manifest.json"),
                        str(out), "fresh" if fresh_optimizer else "carried",
                        str(run / "round_001" / "rollouts.parquet.manifest.json")],
                       capture_output=True, text=True, timeout=900, cwd=Path(__file__).resolve().parents[2],
                       env={**os.environ, **ONE_THREAD})
    assert r.returncode == 0, r.stderr[-3000:]
    return load_file(str(out)), json.loads(r.stdout.strip().splitlines()[-1])


def test_two_rounds_equal_one_process_training_both(two_runs, tmp_path):
    """Round 2 continued round 1's optimization: replaying both rounds' updates in one process, with
    one model and one AdamW, ends at round 2's saved master weights and optimizer step count.

    Under fp32 (``train.mixed_precision`` resolving to ``no``) the match is elementwise to 1e-6. Under
    bf16 autocast (CPUs with AMX/AVX512-BF16) the kernels are not bitwise reproducible between
    processes and AdamW turns a near-zero gradient's noise into a step of up to lr, so the replay is
    held to a tenth of the distance of the defect it guards against, a round 2 that starts a fresh
    AdamW (a clean-clone CI run on an AMX Xeon had 7.8 % of the elements off, worst 5.8e-5)."""
    import torch

    a = two_runs[0]
    saved = _weights(_variant(a, 2) / "train_state")
    job = _BACKGROUND.get("replay")  # run by the fixture beside the killed run
    mine, info = job.result() if job else _replay(a, tmp_path / "carried.safetensors", fresh_optimizer=False)
    man = json.loads((_variant(a, 2) / "train_state.manifest.json").read_text())
    assert man["optimizer_steps_total"] == info["steps"]

    def dist(w: dict) -> float:
        return float(torch.sqrt(sum(((w[n].float() - saved[n].float()) ** 2).sum() for n in saved)))

    diffs = [(mine[n].float() - saved[n].float()).abs() for n in saved]
    worst = max(float(d.max()) for d in diffs)
    off = sum(int((d > 1e-6).sum()) for d in diffs) / sum(d.numel() for d in diffs)
    if info["mixed_precision"] == "no":
        assert off == 0.0, f"two rounds differ from one process in {off:.3%} of the elements (worst {worst:.2e})"
        return
    fresh, _ = _replay(a, tmp_path / "fresh.safetensors", fresh_optimizer=True)
    d_mine, d_fresh = dist(mine), dist(fresh)
    assert d_fresh > 0, "a fresh AdamW in round 2 ends at the saved weights: the test cannot tell the defect"
    assert d_mine <= 0.1 * d_fresh, (f"two rounds differ from one process by L2 {d_mine:.3e}, not under a tenth of "
                                     f"a fresh round-2 optimizer's {d_fresh:.3e} ({off:.3%} of elements off, "
                                     f"worst {worst:.2e})")


def test_killed_run_resumed_to_the_same_training_state(two_runs):
    a, b = two_runs[0], two_runs[1]
    for k in (1, 2):
        wa, wb = _weights(_variant(a, k) / "train_state"), _weights(_variant(b, k) / "train_state")
        assert wa and wa.keys() == wb.keys(), f"round {k}'s training states hold other tensors"
        assert all(bool((wa[n] == wb[n]).all()) for n in wa), f"round {k}'s master weights differ after kill + resume"


def test_eval_has_every_round_and_the_report_exists(two_runs):
    a = two_runs[0]
    rounds = {0: a / "round_000" / "eval.parquet"}
    rounds.update({k: a / f"round_{k:03d}" / "variants" / VARIANT / "eval.parquet" for k in (1, 2)})
    for k, path in rounds.items():
        t = pq.read_table(path)
        assert set(t.column("benchmark").to_pylist()) == {"gsm8k"} and set(t.column("round").to_pylist()) == {k}
    rep = a / "report"
    pngs = sorted(rep.glob("*.png"))
    assert pngs, f"the report wrote no plot in {rep}"
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    html = (rep / "report.html").read_text()
    assert "<table" in html and "GSM8K" in html and html.count("<tr") >= 4  # header + rounds 0, 1, 2
    for k, path in rounds.items():  # each round's row holds its greedy accuracy, computed from its table
        greedy = [r["correct"] for r in pq.read_table(path).to_pylist() if r["decoding"] == "greedy"]
        acc = 100 * sum(greedy) / len(greedy)
        assert f"<td>{k}</td><td>{acc:.1f}</td>" in html, (k, acc)
