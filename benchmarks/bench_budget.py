"""Does a learning run's held-out gain survive a larger token budget, or is it answers that now fit?

The learning benchmark (``bench_learning.py``) trains and evaluates at one budget, ``--max-tokens``
(192 tokens in docs/benchmarks.md), and grades an answer cut at the budget as wrong
(``verify.truncated: zero``). A run can then raise held-out accuracy in two ways: by solving more
problems, or by finishing inside the budget answers that were right but too long. This benchmark
tells them apart. For every finished learning run in ``--runs-dir`` it evaluates the starting
policy (once) and the run's round-K checkpoint again, greedily, on the same held-out problems at a
larger budget ``--max-tokens`` (default 512), and reports per run and pooled over each arm's seeds:

- the change from round 0 at the training budget (the run's own eval tables) and at the larger
  one, on the items all four evals share (paired: bootstrap interval and McNemar's p,
  :func:`pipeline.core.significance.compare`; pooled over seeds with the seeds x items
  interval, :func:`pipeline.core.significance.pooled_over_seeds`);
- the share of answers cut at each budget, and the accuracy among the answers that finished.

A gain that holds at the larger budget is the policy solving more problems; one that vanishes
there was the budget. Evaluations are written to ``<runs-dir>/budget-<N>/<run>.parquet`` with a
manifest keyed on the checkpoint's fingerprint and the eval settings, and reused when current (the
benchmark resumes). JSON lines on stdout.

Every figure is computed from one per-run record of per-item results (:func:`run_record`: the four
greedy evals of the run, at both budgets). With ``--evidence FILE`` those records are written to the
file and read back: a run recorded there whose checkpoint is not under ``--runs-dir`` (re-evaluated
on another machine, whose ``runs/`` is gone) is carried into the pooled figures and the verdicts and
kept in the file, so the matrix's re-evaluations accumulate over machines. A run found both here and
there is evaluated here and replaces its record.

    .venv/bin/python benchmarks/bench_budget.py --runs-dir runs/bench_learning --max-tokens 512 \
        --evidence docs/data/budget-512.jsonl

Cost: one greedy eval of the held-out problems per checkpoint (200 problems at up to 512 tokens:
about 3-5 minutes on a 2-core CPU with vLLM), plus one for the starting policy.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.core.answer_format import FORMAT_CODE, answer_format  # noqa: E402

log = logging.getLogger("capo.bench_budget")


def finished_runs(runs_dir: Path) -> list[dict]:
    """The learning runs under ``runs_dir`` whose last evaluated round still has its checkpoint:
    ``{"name", "arm", "seed", "round", "eval0", "evalK", "checkpoint", "config", "budget"}`` (eval
    paths of round 0 and round K, the resolved config of round K's eval and its token budget), sorted
    by name."""
    from pipeline import storage

    out = []
    for run in sorted(Path(runs_dir).glob("learn-*")):
        evals = sorted(run.glob("round_*/variants/*/eval.parquet"))
        evals = [p for p in evals if storage.read_manifest(p) and (p.parent / "checkpoint").is_dir()]
        e0 = run / "round_000" / "eval.parquet"
        if not evals or storage.read_manifest(e0) is None:
            continue
        ek = evals[-1]
        man = storage.read_manifest(ek)
        arm, seed = parse_run_name(run.name)
        out.append({"name": run.name, "arm": arm_label(arm, man["resolved_config"]), "seed": seed,
                    "round": int(ek.parts[-4].split("_")[1]), "eval0": e0, "evalK": ek,
                    "checkpoint": ek.parent / "checkpoint", "config": man["resolved_config"],
                    "budget": man["resolved_config"]["eval"]["max_tokens"]})
    return out


def parse_run_name(name: str) -> tuple[str, int]:
    """``(arm, seed)`` of a learning run's name, ``learn-<arm>-s<seed>-<settings hash>`` (arms may
    hold dashes: ``random-credit``).

    Raises:
        ValueError: ``name`` is not of that form.
    """
    m = re.fullmatch(r"learn-(.+)-s(\d+)-([0-9a-f]+)", name)
    if m is None:
        raise ValueError(f"{name!r} is not a learning run's name (learn-<arm>-s<seed>-<hash>)")
    return m.group(1), int(m.group(2))


def arm_label(arm: str, rc: dict) -> str:
    """The arm and the training settings that tell bench_learning's configurations apart (seeds of
    one label are pooled): e.g. ``grpo lr=5e-06 ds`` or ``grpo lr=5e-06 kl=0.04``."""
    t, ro, rw = rc["train"], rc["rollout"], rc["reward"]
    parts = [arm, f"lr={t['learning_rate']:g}"]
    if ro.get("policy") not in (None, "qwen2.5-coder-0.5b-instruct"):  # another starting policy: never pooled together
        parts.append(f"policy={Path(str(ro['policy'])).name}")
    sources = rc.get("vote", {}).get("sources") if rc.get("critique", {}).get("enabled") else None
    if arm in ("capo", "random-credit") and sources:  # the CAPO preset's signal (readout, sampled critiques, ...)
        parts.append("signal=" + "+".join(sources) + f",N={rc['critique'].get('num_critiques')}")
    if t.get("kl_coef"):
        parts.append(f"kl={t['kl_coef']:g}")
    if ro.get("dynamic_sampling"):
        parts.append("ds")
    if rw.get("overlong_buffer"):
        parts.append(f"overlong={rw['overlong_buffer']}")
    return " ".join(parts)


Items = dict[str, tuple[bool, str]]
"""One greedy eval's per-item results: ``{"benchmark/prompt_id": (correct, format)}``, the format
one of :func:`pipeline.core.answer_format.answer_format`'s (``cut`` when stopped at the budget)."""


def greedy_items(rows: list[dict]) -> Items:
    """The :data:`Items` of an eval table's greedy rows (sampled rows are left out)."""
    return {f"{r['benchmark']}/{r['prompt_id']}": (bool(r["correct"]),
                                                   answer_format(r.get("response_text"), r["finish_reason"]))
            for r in rows if r["decoding"] == "greedy"}


def budget_change(before: Items, after: Items) -> dict:
    """Greedy round 0 (``before``) vs round K (``after``) on the items both evaluated
    (:func:`greedy_items` of each eval, or :func:`record_items` of a carried record).

    Returns ``n``, the paired change (:func:`pipeline.core.significance.compare`: ``acc_a``,
    ``acc_b``, ``diff``, bootstrap ``lo``/``hi``, ``p_mcnemar``, ``significant``), ``cut_a`` /
    ``cut_b`` (shares of answers cut at the budget: format ``cut``, ``finish_reason == "length"``) and
    ``finished_acc_a`` / ``finished_acc_b`` (accuracy among the answers that finished; None when none
    did), ``boxed_a`` / ``boxed_b`` (shares of answers finished with a box:
    :func:`pipeline.core.answer_format.answer_format`) and ``boxed_acc_a`` / ``boxed_acc_b`` (accuracy
    among those; None without any), ``item_change`` (``{item: -1.0 / 0.0 / 1.0}``, for pooling over
    seeds) and ``boxed_item_change`` (the same over the items boxed at both ends).

    Raises:
        ValueError: the two evals share no greedy item.
    """
    from pipeline.core.significance import compare

    ids = sorted(set(before) & set(after))
    if not ids:
        raise ValueError(f"no greedy item in common between the two evals ({len(before)} and {len(after)} greedy items)")
    out = compare([before[i][0] for i in ids], [after[i][0] for i in ids]).as_dict()

    def share(g, fmt):
        return float(np.mean([g[i][1] == fmt for i in ids]))

    def acc_where(g, keep):
        ok = [g[i][0] for i in ids if keep(g[i][1])]
        return float(np.mean(ok)) if ok else None

    def change(i):
        return float(after[i][0]) - float(before[i][0])

    out.update(boxed_a=share(before, "boxed"), boxed_b=share(after, "boxed"),
               boxed_acc_a=acc_where(before, lambda f: f == "boxed"), boxed_acc_b=acc_where(after, lambda f: f == "boxed"),
               boxed_item_change={i: change(i) for i in ids if before[i][1] == "boxed" == after[i][1]})
    out.update(cut_a=share(before, "cut"), cut_b=share(after, "cut"),
               finished_acc_a=acc_where(before, lambda f: f != "cut"), finished_acc_b=acc_where(after, lambda f: f != "cut"),
               item_change={i: change(i) for i in ids})
    return out


def pooled(changes: list[dict[str, float]]) -> dict | None:
    """The seeds' item changes (``budget_change(...)["item_change"]``) pooled on the items all share,
    with the seeds x items interval; None for no seed or no shared item."""
    from pipeline.core.significance import pooled_over_seeds

    if not changes:
        return None
    items = sorted(set.intersection(*(set(c) for c in changes)))
    return pooled_over_seeds([[c[i] for i in items] for c in changes]).as_dict() if items else None


EVALS = ("round_0", "round_k", "start", "final")
"""The four greedy evals of a run's record: round 0 and round K at the training budget (the run's own
eval tables), the starting policy and round K's checkpoint at the larger budget."""


def run_record(run: dict, max_tokens: int, evals: dict[str, Items]) -> dict:
    """One run's per-item results, for the evidence file and for every figure: ``ids`` (the items all
    four evals share, sorted) and, per eval of :data:`EVALS`, ``{"greedy": "0110...", "format":
    "bbcp..."}`` (a letter per answer: :data:`pipeline.core.answer_format.FORMAT_CODE`).

    ``run``: a :func:`finished_runs` entry (its ``name``, ``arm`` label, ``seed``, ``round`` and the
    training ``budget``); ``evals``: the :func:`greedy_items` of each of :data:`EVALS`.

    Raises:
        ValueError: an eval is missing, or the four share no item.
    """
    if sorted(evals) != sorted(EVALS):
        raise ValueError(f"a run record needs the evals {list(EVALS)}, got {sorted(evals)}")
    ids = sorted(set.intersection(*(set(e) for e in evals.values())))
    if not ids:
        raise ValueError(f"the four evals of {run['name']} share no greedy item")
    sizes = {k: len(e) for k, e in evals.items()}
    if max(sizes.values()) > len(ids):
        log.warning("%s: the four evals share %d items (of %s); every figure counts only those",
                    run["name"], len(ids), sizes)
    return {"bench": "budget", "record": run["name"], "arm": run["arm"], "seed": run["seed"], "round": run["round"],
            "budget": run["budget"], "max_tokens": max_tokens, "ids": ids,
            **{k: {"greedy": "".join("1" if e[i][0] else "0" for i in ids),
                   "format": "".join(FORMAT_CODE[e[i][1]] for i in ids)} for k, e in evals.items()}}


def record_items(record: dict, which: str) -> Items:
    """The :data:`Items` of eval ``which`` (one of :data:`EVALS`) of a :func:`run_record`.

    Raises:
        ValueError: the record's strings do not match its ids (a damaged evidence line).
    """
    code = {v: k for k, v in FORMAT_CODE.items()}
    g, f, ids = record[which]["greedy"], record[which]["format"], record["ids"]
    if not (len(g) == len(f) == len(ids)) or set(g) - {"0", "1"} or set(f) - set(code):
        raise ValueError(f"{record.get('record')!r}: eval {which!r} does not match its {len(ids)} ids "
                         f"({len(g)} results, {len(f)} formats; results other than 0/1: {sorted(set(g) - {'0', '1'})}, "
                         f"formats other than {sorted(code)}: {sorted(set(f) - set(code))})")
    return {i: (c == "1", code[x]) for i, c, x in zip(ids, g, f)}


REPORT_KEYS = ("run", "summary", "verdict")
"""A key of the lines this script prints (a run, an arm's summary, a verdict): recomputed from the
records on every invocation, so an earlier file's copies are not kept."""


def carried_records(path: Path | None, max_tokens: int) -> dict[str, dict]:
    """The run records of an earlier ``--evidence`` file at the same ``max_tokens``, by run name
    (``{}`` when there is no file). The file is rewritten from these records, so a line that is
    neither a record nor a printed line of this script (another benchmark's file given by mistake,
    a record of an older format) stops the run instead of being dropped.

    Raises:
        SystemExit: a line that does not parse or is not this script's, a record without its fields,
            a record at another ``max_tokens`` (one file holds one budget), or two records of one run;
            each names the file and line.
    """
    if path is None or not Path(path).exists():
        return {}
    out: dict[str, dict] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{where} is not a JSON line ({e}): repair or remove it") from None
        if rec.get("bench") == "budget" and any(k in rec for k in REPORT_KEYS) and "record" not in rec:
            continue
        if rec.get("bench") != "budget" or "record" not in rec:
            raise SystemExit(f"{where} is not a run record of bench_budget.py (keys {sorted(rec)[:6]}): "
                             "give this script its own --evidence file; it would be overwritten")
        missing = [k for k in ("arm", "seed", "round", "budget", "max_tokens", "ids", *EVALS) if k not in rec]
        if missing:
            raise SystemExit(f"{where}: the record of {rec['record']} lacks {missing}")
        if rec["max_tokens"] != max_tokens:
            raise SystemExit(f"{where} holds {rec['record']} at {rec['max_tokens']} tokens, not {max_tokens}: "
                             "give each budget its own --evidence file")
        if rec["record"] in out:
            raise SystemExit(f"{where} is a second record of {rec['record']}: keep one")
        out[rec["record"]] = rec
    return out


def merge_records(carried: dict[str, dict], local: dict[str, dict]) -> dict[str, dict]:
    """The records to report and keep, by run name: a run evaluated here replaces its carried record,
    unless the carried one is of a later round (a copy of the run trained further elsewhere: kept,
    with a warning). Sorted by name.

    Raises:
        SystemExit: two records are the same seed of one arm label (the pooled figures would count
            the seed twice); names both and what to remove.
    """
    out = dict(carried)
    for name, rec in local.items():
        old = carried.get(name)
        if old is not None and old["round"] > rec["round"]:
            log.warning("%s: the evidence records round %d, here only round %d is evaluated; keeping the "
                        "recorded one", name, old["round"], rec["round"])
            continue
        out[name] = rec
    seen: dict[tuple[str, int], str] = {}
    for name in sorted(out):
        key = (out[name]["arm"], out[name]["seed"])
        if key in seen:
            raise SystemExit(f"{seen[key]} and {name} are both seed {key[1]} of {key[0]!r}: remove one of their "
                             "records from --evidence (a run evaluated here is written there first)")
        seen[key] = name
    return dict(sorted(out.items()))


def verdicts(per_arm: dict[str, dict], max_tokens: int) -> list[dict]:
    """CAPO against GRPO, random credit and the critic-free rivals (GRPO-λ, FIPO) at the larger
    budget, for every CAPO label (``capo <settings>``) whose other arm ran under the same settings
    (the CAPO signal apart): the difference of their
    greedy changes from round 0, paired by seed and item, with the seeds x items interval
    (:func:`pooled`), over all answers and within answers boxed at both ends; ``capo_beat_<other>``
    true only where that interval lies above 0, None below 2 shared seeds.

    ``per_arm``: ``{label: {"seeds": {seed: {"big": budget_change(...)}}}}``."""
    out = []
    for label, d in per_arm.items():
        arm, _, settings = label.partition(" ")
        if arm != "capo":
            continue
        for other in ("grpo", "random-credit", "grpo-lambda", "fipo", "vineppo", "densr"):
            shared = settings if other == "random-credit" else " ".join(
                p for p in settings.split() if not p.startswith("signal="))  # the critic-free arms have no signal
            o = per_arm.get(f"{other} {shared}".strip())
            name = other.replace("-", "_")
            row = {"bench": "budget", "verdict": f"capo_vs_{name}", "settings": settings, "max_tokens": max_tokens}
            if o is None:
                out.append({**row, f"capo_beat_{name}": "not run"})
                continue
            seeds = sorted(set(d["seeds"]) & set(o["seeds"]))
            for key, tag in (("item_change", ""), ("boxed_item_change", "boxed_")):
                diffs = []
                for sd in seeds:
                    c, g = d["seeds"][sd]["big"][key], o["seeds"][sd]["big"][key]
                    diffs.append({i: c[i] - g[i] for i in set(c) & set(g)})
                head = pooled(diffs)
                row[f"{tag}capo_minus_{name}"] = head
                row[f"{tag}capo_beat_{name}"] = (bool(head["lo"] > 0) if len(seeds) >= 2 else None) if head else None
            out.append({**row, "seeds": seeds})
    return out


def eval_key(policy: str, rc: dict, max_tokens: int) -> dict:
    """What a recheck eval depends on: the policy's fingerprint, the held-out problems, the budget,
    the engine, the instruction and the verifier rule (``rc``: round K's resolved config)."""
    from pipeline.config import CAPOConfig
    from pipeline.stages.base import model_fingerprint

    cfg = CAPOConfig.model_validate(rc)
    ec = cfg.eval
    return {"policy": model_fingerprint(policy), "benchmarks": ec.benchmarks, "sample_size": ec.sample_size,
            "seed": ec.seed, "max_tokens": max_tokens, "engine": (ec.engine or cfg.rollout.engine).model_dump(mode="json"),
            "instruction": cfg.instruction(), "verify": cfg.verify.model_dump(mode="json")}


def evaluate_here(policy: str, rc: dict, max_tokens: int, out: Path) -> None:
    """Greedy eval of ``policy`` on round K's held-out problems at ``max_tokens`` -> ``out`` (with its
    manifest; an earlier table there is superseded, not overwritten)."""
    from pipeline import storage
    from pipeline.config import CAPOConfig
    from pipeline.stages.eval import evaluate_policy

    cfg = CAPOConfig.model_validate(rc)
    ec = cfg.eval
    table = evaluate_policy(policy, ec.benchmarks, ec.sample_size, ec.seed, ec.engine or cfg.rollout.engine,
                            max_tokens, 1, cfg.instruction(), run_id=cfg.run_id,
                            eval_root=Path(cfg.data_dir).resolve() / "eval", answer=cfg.verify.answer,
                            truncated=cfg.verify.truncated)
    storage.write_parquet(table, out, stage="eval", key=eval_key(policy, rc, max_tokens), extra={"policy": policy})


def evaluate(policy: str, config_of: Path, max_tokens: int, out: Path) -> list[dict]:
    """The rows of ``policy``'s greedy eval at ``max_tokens`` (the settings of the eval table
    ``config_of``'s resolved config): read from ``out`` when current, else computed in a child
    process (vLLM's memory and threads end with it; the environment the pipeline gives its eval
    stage) and written there."""
    import os
    import subprocess

    import pyarrow.parquet as pq

    from pipeline import storage
    from pipeline.engines.base import engine_process_env

    rc = storage.read_manifest(config_of)["resolved_config"]
    if not storage.is_current(out, eval_key(policy, rc, max_tokens)).current:
        out.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **engine_process_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        subprocess.run([sys.executable, __file__, "--child", policy, str(config_of), str(max_tokens), str(out)],
                       cwd=ROOT, check=True, env=env, stdout=sys.stderr)  # stdout: this script's JSON lines only
    return pq.read_table(out).to_pylist()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs-dir", default="runs/bench_learning", help="where bench_learning.py wrote its runs")
    ap.add_argument("--max-tokens", type=int, default=512, help="the larger budget of the second eval")
    ap.add_argument("--runs", nargs="*", default=None,
                    help="the finished runs here to evaluate (default: every one); runs recorded in --evidence "
                         "are kept and pooled either way")
    ap.add_argument("--evidence", default=None,
                    help="also write every JSON line printed, plus each run's per-item results, to this "
                         "JSON-lines file (e.g. under docs/data/); runs recorded there and absent here are "
                         "read back and kept")
    return ap


def main(argv: list[str] | None = None) -> None:
    import pyarrow.parquet as pq

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # one eval, in the child process evaluate() starts
        from pipeline import storage

        policy, config_of, max_tokens, out = argv[1:5]
        evaluate_here(policy, storage.read_manifest(Path(config_of))["resolved_config"], int(max_tokens), Path(out))
        return
    a = parser().parse_args(argv)
    runs_dir = Path(a.runs_dir)
    runs = [r for r in finished_runs(runs_dir) if a.runs is None or r["name"] in a.runs]
    carried = carried_records(Path(a.evidence) if a.evidence else None, a.max_tokens)
    if not runs and not carried:
        raise SystemExit(f"no finished learning run with its last checkpoint under {runs_dir}"
                         + (f", and no run recorded in {a.evidence}" if a.evidence else ""))
    from pipeline.precision import bench_context

    ctx = bench_context() if runs else {}  # where this invocation's evals ran; a carried record keeps its own
    folder = runs_dir / f"budget-{a.max_tokens}"
    start: dict[str, Items] = {}  # the starting policy's eval at the larger budget, per starting policy
    records: dict[str, dict] = {}
    for r in runs:
        if a.max_tokens <= r["budget"]:
            raise SystemExit(f"--max-tokens {a.max_tokens} is not above {r['name']}'s own budget {r['budget']}")
        rows0, rowsk = pq.read_table(r["eval0"]).to_pylist(), pq.read_table(r["evalK"]).to_pylist()
        policy0 = rows0[0]["policy"]
        t0 = time.perf_counter()
        if policy0 not in start:
            start[policy0] = greedy_items(evaluate(policy0, r["evalK"], a.max_tokens, folder / "start.parquet"))
        final = greedy_items(evaluate(str(r["checkpoint"]), r["evalK"], a.max_tokens, folder / f"{r['name']}.parquet"))
        records[r["name"]] = {**run_record(r, a.max_tokens, {"round_0": greedy_items(rows0), "round_k": greedy_items(rowsk),
                                                             "start": start[policy0], "final": final}), **ctx}
        log.info("%s evaluated at %d tokens in %.0f s", r["name"], a.max_tokens, time.perf_counter() - t0)
    def write(lines: list[dict], recs: dict[str, dict]) -> None:
        if a.evidence:  # the printed lines and each run's per-item results, as committed evidence
            out = Path(a.evidence)
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_text("".join(json.dumps(line) + "\n" for line in [*lines, *recs.values()]))
            tmp.replace(out)

    try:
        every = merge_records(carried, records)
    except SystemExit:  # keep what was evaluated here before stopping
        write([], dict(sorted({**carried, **{k: v for k, v in records.items() if k not in carried}}.items())))
        raise
    shown = [n for n in every if n not in records or every[n] is not records[n]]
    write(report(every, a.max_tokens, shown), every)


def report(records: dict[str, dict], max_tokens: int, carried: list[str]) -> list[dict]:
    """Print (and return) the JSON lines of the runs ``records`` (:func:`run_record`, by run name):
    one line per run, one summary per arm label pooled over its seeds, the verdicts (:func:`verdicts`).
    ``carried``: the names whose record came from the evidence file.

    Raises:
        SystemExit: two runs are the same seed of one arm label (:func:`merge_records` checks first).
    """
    lines: list[dict] = []

    def emit(line: dict) -> None:
        print(json.dumps(line), flush=True)
        lines.append(line)

    hidden = ("item_change", "boxed_item_change")
    per_arm: dict[str, dict] = {}
    for name, rec in sorted(records.items()):
        small = budget_change(record_items(rec, "round_0"), record_items(rec, "round_k"))
        big = budget_change(record_items(rec, "start"), record_items(rec, "final"))
        emit({"bench": "budget", "run": name, "arm": rec["arm"], "seed": rec["seed"], "round": rec["round"],
              "carried": name in carried, "cpu_model": rec.get("cpu_model"),
              f"at_{rec['budget']}": {k: v for k, v in small.items() if k not in hidden},
              f"at_{max_tokens}": {k: v for k, v in big.items() if k not in hidden}})
        arm = per_arm.setdefault(rec["arm"], {"budget": rec["budget"], "seeds": {}, "runs": {}})
        if rec["seed"] in arm["seeds"]:
            raise SystemExit(f"{arm['runs'][rec['seed']]} and {name} are both seed {rec['seed']} of {rec['arm']!r}: "
                             "remove one of their records from --evidence")
        arm["seeds"][rec["seed"]] = {"small": small, "big": big}
        arm["runs"][rec["seed"]] = name
    for label, d in per_arm.items():
        seeds = d["seeds"].values()
        emit({"bench": "budget", "summary": label, "seeds": len(d["seeds"]),
              f"pooled_at_{d['budget']}": pooled([x["small"]["item_change"] for x in seeds]),
              f"pooled_at_{max_tokens}": pooled([x["big"]["item_change"] for x in seeds]),
              f"pooled_boxed_at_{max_tokens}": pooled([x["big"]["boxed_item_change"] for x in seeds])})
    for line in verdicts(per_arm, max_tokens):
        emit(line)
    return lines

if __name__ == "__main__":
    main()
