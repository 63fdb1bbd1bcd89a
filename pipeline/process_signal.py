"""Does a round's process signal tell wrong responses from right ones? Measured where it is used.

CAPO's process penalty only helps when it lands on wrong reasoning more often than on right
reasoning. :func:`measure_run` reads a finished run's tables as written (``outcomes``, ``steps``,
each variant's ``step_verdicts`` and ``token_rewards``) and reports, per round, variant, signal
source and scope:

- the share of right and of wrong responses with at least one penalized step;
- the AUROC of the response's *penalized-token share* (``sum_s w_s * tokens(s) / tokens``, the
  mass of the process penalty, in [0, 1]) against a wrong outcome, with a 95 % interval from a
  bootstrap over prompts (:func:`auroc_interval`: the responses of one prompt are not independent);
  0.5 is a signal that carries no information about the outcome;
- per variant, how many groups train on the outcome (the reward that trained differs within the
  group), on the process signal alone (one outcome for the whole group, yet non-zero advantages),
  on something else, or on nothing.

Sources: ``vote`` (the variant's voting rule over the LLM critic's critiques, ``step_verdicts.llm_weight``;
absent for a variant without a process penalty), ``arithmetic`` (:func:`pipeline.core.arithmetic.step_verdict`:
a step whose written arithmetic is wrong, computed here from the step texts) and ``vote+arithmetic``
(a step is penalized by the larger of the two weights); where the round has the critic's log-prob
readout (``critique.logprob_readout``), ``logprob`` (its calibrated P(wrong) under the variant's rule:
itself under ``average``, above ``vote.logprob_threshold`` under the others) and
``logprob+arithmetic``. ``trains`` marks the source whose weights
the variant's token rewards subtract (``vote.sources``: ``[llm]`` is ``vote``, ``[arithmetic]``
is ``arithmetic``, both is ``vote+arithmetic``). Scopes: ``all_steps``, and ``before_answer``, the steps before the one
that states the final answer (the last step with ``\\boxed``, else the last step): a critic that
sees the gold answer can flag a wrong final answer without judging any reasoning, which adds
nothing to the outcome reward.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pipeline.core.arithmetic import count_checkable, step_verdict
from pipeline.core.voting import score_weights

SOURCES = ("vote", "arithmetic", "vote+arithmetic", "logprob", "logprob+arithmetic", "random-credit")
SCOPES = ("all_steps", "before_answer")


def auroc(scores, wrong) -> float | None:
    """Area under the ROC curve of ``scores`` for telling ``wrong`` items from right ones: the
    probability that a random wrong item scores higher than a random right one, ties counting one
    half (the Mann-Whitney U statistic over ``n_wrong * n_right``; Hanley & McNeil 1982).

    Args:
        scores: shape ``(n,)``, any real numbers (here: penalized-token shares).
        wrong: shape ``(n,)``, booleans (True: the response's outcome is wrong).
    Returns:
        The AUROC in [0, 1], or None when one of the two classes is empty.
    Raises:
        ValueError: the two vectors differ in length or are not 1-D.
    """
    s, w = np.asarray(scores, dtype=float), np.asarray(wrong, dtype=bool)
    if s.ndim != 1 or s.shape != w.shape:
        raise ValueError(f"scores and wrong must be 1-D of one length, got shapes {s.shape} and {w.shape}")
    n_w, n_r = int(w.sum()), int((~w).sum())
    if n_w == 0 or n_r == 0:
        return None
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s))
    sorted_s = s[order]
    i = 0
    while i < len(s):  # average ranks over ties (1-based)
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    u = ranks[w].sum() - n_w * (n_w + 1) / 2
    return float(u / (n_w * n_r))


def auroc_interval(scores, wrong, n_boot: int = 2000, level: float = 0.95, seed: int = 0,
                   groups=None) -> tuple[float | None, float | None, float | None]:
    """:func:`auroc` and its percentile bootstrap interval.

    Without ``groups`` the wrong and the right items are resampled separately with replacement
    (the stratified bootstrap of pROC; Carpenter & Bithell 2000), so every resample has both
    classes. With ``groups`` (shape ``(n,)``, e.g. the prompt of each response) whole groups are
    resampled with replacement (the cluster bootstrap: the G responses of one prompt share its
    difficulty, so resampling responses alone gives too narrow an interval); a resample that
    holds one class only is drawn again (at most ``10 * n_boot`` draws in all).

    Returns:
        ``(auroc, low, high)``; all None when a class is empty.
    Raises:
        ValueError: as :func:`auroc`, or ``level`` outside (0, 1), ``n_boot`` < 1, or ``groups``
            of another length.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    point = auroc(scores, wrong)
    if point is None:
        return None, None, None
    s, w = np.asarray(scores, dtype=float), np.asarray(wrong, dtype=bool)
    rng = np.random.default_rng(seed)

    def pairs(bw: np.ndarray, br: np.ndarray) -> float:  # P(wrong > right) + 0.5 P(tie)
        br = np.sort(br)
        lt = np.searchsorted(br, bw, side="left")
        le = np.searchsorted(br, bw, side="right")
        return float((lt.sum() + 0.5 * (le - lt).sum()) / (len(bw) * len(br)))

    stats: list[float] = []
    if groups is None:
        sw, sr = s[w], s[~w]
        for _ in range(n_boot):
            stats.append(pairs(sw[rng.integers(0, len(sw), len(sw))], sr[rng.integers(0, len(sr), len(sr))]))
    else:
        g = np.asarray(groups)
        if g.shape != s.shape:
            raise ValueError(f"groups must have one entry per item: shape {g.shape} for {s.shape}")
        members = [np.flatnonzero(g == u) for u in np.unique(g)]
        for _ in range(10 * n_boot):
            idx = np.concatenate([members[i] for i in rng.integers(0, len(members), len(members))])
            ws = w[idx]
            if ws.all() or not ws.any():
                continue
            stats.append(pairs(s[idx][ws], s[idx][~ws]))
            if len(stats) == n_boot:
                break
        if not stats:  # every group holds one class only and there is a single group of each
            return point, None, None
    alpha = (1 - level) / 2
    return point, float(np.quantile(stats, alpha)), float(np.quantile(stats, 1 - alpha))


def final_answer_step(step_texts: list[str]) -> int:
    """Index of the step that states the final answer: the last step containing ``\\boxed``, else
    the last step (0 for an empty list)."""
    for i in range(len(step_texts) - 1, -1, -1):
        if "\\boxed" in (step_texts[i] or ""):
            return i
    return max(len(step_texts) - 1, 0)


def penalty_share(weights: list[float], n_tokens: list[int]) -> float:
    """The mass of the process penalty on one response: ``sum_s w_s * n_tokens[s] / sum_s n_tokens[s]``
    (0 when the steps hold no tokens).

    Raises:
        ValueError: the two lists differ in length.
    """
    if len(weights) != len(n_tokens):
        raise ValueError(f"{len(weights)} step weights for {len(n_tokens)} steps")
    total = sum(n_tokens)
    return float(sum(w * n for w, n in zip(weights, n_tokens)) / total) if total else 0.0


def first_penalty_at(weights: list[float], n_tokens: list[int]) -> float | None:
    """Where one response's process penalty starts: the tokens before its first penalized step
    (weight > 0) over all its tokens, in [0, 1); None when no step is penalized or the steps hold
    no tokens. Early values say the signal blames a response's start, late ones its end.

    Raises:
        ValueError: the two lists differ in length.
    """
    if len(weights) != len(n_tokens):
        raise ValueError(f"{len(weights)} step weights for {len(n_tokens)} steps")
    total = sum(n_tokens)
    first = next((i for i, w in enumerate(weights) if w > 0), None)
    return None if first is None or not total else float(sum(n_tokens[:first]) / total)


def _mean(xs: list[float]) -> float | None:
    return float(sum(xs) / len(xs)) if xs else None


def _variant_key(variant_dir: Path) -> dict:
    man = variant_dir / "token_rewards.parquet.manifest.json"
    return json.loads(man.read_text()).get("key", {}) if man.exists() else {}


def _variant_rule(key: dict) -> str | None:
    """The voting rule whose weights the variant's token rewards subtract; None when it has no process
    penalty (critique off, GenORM outcome mode, or ``reward.process_weight`` = 0)."""
    if not key.get("critique_enabled") or key.get("critique_mode") != "process":
        return None
    if not key.get("reward", {}).get("process_weight", 1):
        return None
    return key["vote"]["rule"]


def _groups(variant_dir: Path, process: bool) -> dict:
    """The variant's groups (prompts) by what they train on, from its token rewards as written: the
    outcome (``outcome_reward``, the r_v that trained, differs within the group), the process signal
    alone (one outcome for the group, non-zero advantages, and the variant has a process penalty),
    something else (one outcome, non-zero advantages, no process penalty: e.g. the overlong
    penalty) or nothing (every advantage 0)."""
    tr = pq.read_table(variant_dir / "token_rewards.parquet", columns=["prompt_id", "outcome_reward", "advantages"])
    by: dict[str, list] = {}
    for pid, r, adv in zip(*(tr.column(c).to_pylist() for c in ("prompt_id", "outcome_reward", "advantages"))):
        by.setdefault(pid, []).append((r, any(abs(a) > 0 for a in adv or [])))
    out = {"groups": len(by), "groups_outcome": 0, "groups_process_only": 0, "groups_other_signal": 0,
           "groups_no_signal": 0}
    for g in by.values():
        if len({r for r, _ in g}) > 1:
            out["groups_outcome"] += 1
        elif not any(m for _, m in g):
            out["groups_no_signal"] += 1
        else:
            out["groups_process_only" if process else "groups_other_signal"] += 1
    return out


def _read_round(round_dir: Path) -> tuple[dict[str, bool], dict[str, str], dict[str, list[dict]]]:
    """The round's outcome, prompt and (unsorted) steps per rollout; FileNotFoundError without either table."""
    for name in ("outcomes", "steps"):
        if not (round_dir / f"{name}.parquet").exists():
            raise FileNotFoundError(f"{round_dir / (name + '.parquet')} is missing: the round's verify and segment "
                                    "stages have not run")
    out = pq.read_table(round_dir / "outcomes.parquet", columns=["rollout_id", "prompt_id", "outcome_correct"]).to_pylist()
    correct = {r["rollout_id"]: bool(r["outcome_correct"]) for r in out}
    prompt_of = {r["rollout_id"]: r["prompt_id"] for r in out}
    steps: dict[str, list[dict]] = {}
    for s in pq.read_table(round_dir / "steps.parquet",
                           columns=["rollout_id", "step_idx", "token_start", "token_end", "step_text"]).to_pylist():
        steps.setdefault(s["rollout_id"], []).append(s)
    return correct, prompt_of, steps


def _arithmetic_weights(steps: dict[str, list[dict]], rids: list[str]
                        ) -> tuple[dict[str, list[float]], dict[str, list[int]], dict[str, int], int]:
    """Per rollout: arithmetic step weights (0/1), tokens per step, final-answer step; and the steps flagged."""
    arith: dict[str, list[float]] = {}
    n_tok: dict[str, list[int]] = {}
    answer_at: dict[str, int] = {}
    flagged_steps = 0
    for rid in rids:
        ss = sorted(steps.get(rid, []), key=lambda s: s["step_idx"])
        verdicts = [step_verdict(s["step_text"] or "")[0] for s in ss]
        arith[rid] = [1.0 if v else 0.0 for v in verdicts]
        n_tok[rid] = [s["token_end"] - s["token_start"] for s in ss]
        answer_at[rid] = final_answer_step([s["step_text"] or "" for s in ss])
        flagged_steps += sum(verdicts)
    return arith, n_tok, answer_at, flagged_steps


def _rule_column(sv, rule: str, col: str, rids: list[str], n_tok: dict[str, list[int]]) -> dict[str, list[float]]:
    """Per rollout, the step weights in column ``col`` of the step verdicts ``sv`` under ``rule`` (0 where absent)."""
    by: dict[str, dict] = {}
    for rid, idx, r, w in zip(*(sv.column(c).to_pylist() for c in ("rollout_id", "step_idx", "rule", col))):
        if r == rule:
            by.setdefault(rid, {})[idx] = w
    return {rid: [float(by.get(rid, {}).get(i, 0.0) or 0.0) for i in range(len(n_tok[rid]))] for rid in rids}


def _trained_source(sv) -> str:
    """The source (as this module names it) whose weights the variant's token rewards subtract (``vote.sources``)."""
    used = sv.column("sources")[0].as_py() if "sources" in sv.column_names and sv.num_rows else "llm"
    # vote.sources as this module names its sources (a combination measured nowhere stars no row)
    parts = (used or "llm").split("+")
    return "+".join(("vote" if x == "llm" else x) for x in sorted(
        parts, key=lambda x: ["llm", "logprob", "arithmetic"].index(x) if x in ("llm", "logprob", "arithmetic") else 9))


def _logprob_weights(sv, vdir: Path, rule: str, rids: list[str],
                     n_tok: dict[str, list[int]]) -> dict[str, list[float]] | None:
    """Per rollout, the log-prob readout's step weights under ``rule``; None when the round has no readout."""
    lp: dict[str, dict] = {}
    if "logprob_score" in sv.column_names:
        thr = _variant_key(vdir).get("vote", {}).get("logprob_threshold", 0.5)
        for rid, idx, r, q in zip(*(sv.column(c).to_pylist() for c in ("rollout_id", "step_idx", "rule",
                                                                       "logprob_score"))):
            if r == rule and q is not None:
                lp.setdefault(rid, {})[idx] = float(score_weights(np.array([q]), rule, thr)[0])
    return {rid: [float(lp.get(rid, {}).get(i, 0.0)) for i in range(len(n_tok[rid]))] for rid in rids} \
        if lp else None


def _critic_weights(vdir: Path, rule: str, rids: list[str], n_tok: dict[str, list[int]]) -> tuple[
        dict[str, list[float]], str, dict[str, list[float]] | None, dict[str, list[float]] | None]:
    """The variant's vote weights, trained source, log-prob weights and random-credit weights (None if absent)."""
    sv = pq.read_table(vdir / "step_verdicts.parquet")
    # the LLM critiques' own vote (tables from before the arithmetic source: the weight, which was it)
    col = "llm_weight" if "llm_weight" in sv.column_names else "weight"
    vote = _rule_column(sv, rule, col, rids, n_tok)
    trains = _trained_source(sv)
    # the log-prob readout, where the round has one: its weights under the variant's rule
    logprob = _logprob_weights(sv, vdir, rule, rids, n_tok)
    # the random-credit control trains on its sources' weights moved to random steps: measure
    # what it trained on (the step_verdicts weight), not the true verdicts it was made from
    shuffled = None
    if _variant_key(vdir).get("vote", {}).get("random_credit"):
        shuffled = _rule_column(sv, rule, "weight", rids, n_tok)
        trains = "random-credit"
    return vote, trains, logprob, shuffled


def _signal_sources(arith: dict[str, list[float]], rids: list[str], rule: str | None,
                    vote: dict[str, list[float]] | None, logprob: dict[str, list[float]] | None,
                    shuffled: dict[str, list[float]] | None) -> dict[str, dict[str, list[float]]]:
    """Per source name, the step weights of every rollout: arithmetic always, the critic's sources with a rule."""
    sources = {"arithmetic": arith}
    if rule is not None:
        sources["vote"] = vote
        sources["vote+arithmetic"] = {rid: [max(a, b) for a, b in zip(vote[rid], arith[rid])] for rid in rids}
        if shuffled is not None:
            sources["random-credit"] = shuffled
        if logprob is not None:
            sources["logprob"] = logprob
            sources["logprob+arithmetic"] = {rid: [max(a, b) for a, b in zip(logprob[rid], arith[rid])]
                                             for rid in rids}
    return sources


def _scope_stats(w_all: dict[str, list[float]], scope: str, rids: list[str], n_tok: dict[str, list[int]],
                 answer_at: dict[str, int], correct: dict[str, bool], prompt_of: dict[str, str],
                 n_boot: int, seed: int) -> dict:
    """One source's penalized shares of right and wrong responses, where in them the penalty starts
    on average (:func:`first_penalty_at`, over the penalized ones), and its AUROC (with interval)
    over ``scope``."""
    scores, pen, starts = [], [], []
    for rid in rids:
        k = len(n_tok[rid]) if scope == "all_steps" else answer_at[rid]
        scores.append(penalty_share(w_all[rid][:k], n_tok[rid][:k]))
        pen.append(any(x > 0 for x in w_all[rid][:k]))
        starts.append(first_penalty_at(w_all[rid][:k], n_tok[rid][:k]))
    wrong = [not correct[r] for r in rids]
    auc, lo, hi = auroc_interval(scores, wrong, n_boot=n_boot, seed=seed,
                                 groups=[prompt_of[r] for r in rids])
    n_w = sum(wrong)
    n_r = len(rids) - n_w
    return {"right_penalized": _share(sum(p and not w for p, w in zip(pen, wrong)), n_r),
            "wrong_penalized": _share(sum(p and w for p, w in zip(pen, wrong)), n_w),
            "right_penalty_starts": _mean([x for x, w in zip(starts, wrong) if x is not None and not w]),
            "wrong_penalty_starts": _mean([x for x, w in zip(starts, wrong) if x is not None and w]),
            "auroc": auc, "auroc_low": lo, "auroc_high": hi}


def measure_round(round_dir: Path, n_boot: int = 2000, seed: int = 0, variant: str | None = None) -> list[dict]:
    """The rows of :func:`measure_run` for one round folder (``runs/<run>/round_<k>``); with
    ``variant``, for that variant only.

    Raises:
        FileNotFoundError: the round has no ``outcomes`` or ``steps`` table.
    """
    correct, prompt_of, steps = _read_round(round_dir)
    rids = sorted(correct)
    arith, n_tok, answer_at, flagged_steps = _arithmetic_weights(steps, rids)
    checkable = sum(count_checkable(s["step_text"] or "") > 0 for ss in steps.values() for s in ss)
    variants = sorted(p for p in (round_dir / "variants").glob(variant or "*")
                      if (p / "token_rewards.parquet").exists()) if (round_dir / "variants").is_dir() else []
    round_idx = int(round_dir.name.split("_")[-1])
    common = {"round": round_idx, "n_responses": len(rids), "n_wrong": sum(not correct[r] for r in rids),
              "steps": sum(len(v) for v in n_tok.values()), "steps_with_checkable_arithmetic": checkable,
              "steps_flagged_by_arithmetic": flagged_steps}
    rows = []
    for vdir in variants or [None]:
        rule = _variant_rule(_variant_key(vdir)) if vdir is not None else None
        vote = logprob = shuffled = trains = None
        if rule is not None:
            vote, trains, logprob, shuffled = _critic_weights(vdir, rule, rids, n_tok)
        groups = _groups(vdir, rule is not None) if vdir is not None else {}
        sources = _signal_sources(arith, rids, rule, vote, logprob, shuffled)
        for source in (s for s in SOURCES if s in sources):
            w_all = sources[source]
            for scope in SCOPES:
                stats = _scope_stats(w_all, scope, rids, n_tok, answer_at, correct, prompt_of, n_boot, seed)
                rows.append({
                    **common, "variant": vdir.name if vdir is not None else None, "rule": rule,
                    "source": source, "scope": scope, "trains": source == trains, **stats, **groups})
    return rows


def _share(k: int, n: int) -> float | None:
    return k / n if n else None


def measure_run(run_dir: Path, rounds: list[int] | None = None, n_boot: int = 2000, seed: int = 0) -> list[dict]:
    """Process-signal quality of every round (or ``rounds``) of a run, from its tables as written.

    Returns:
        One dict per round x variant x source x scope (module docstring): ``run`` (the folder's
        name), ``round``, ``variant``,
        ``rule``, ``source``, ``scope``, counts of responses, wrong ones and steps, ``right_penalized``
        and ``wrong_penalized`` (shares of right / wrong responses with a penalized step, None when
        there are none), ``right_penalty_starts`` and ``wrong_penalty_starts`` (the mean
        :func:`first_penalty_at` of the penalized right / wrong responses, None without any),
        ``auroc`` with ``auroc_low`` / ``auroc_high`` (None when a class is empty) and the variant's
        group counts.
    Raises:
        FileNotFoundError: ``run_dir`` has no finished round (names what is there), or a round asked
            for is missing.
        ValueError: ``n_boot`` below 1, or a round's tables that do not fit together (step weights
            for another number of steps).
    """
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1 (bootstrap resamples of the AUROC's interval), got {n_boot}")
    run_dir = Path(run_dir)
    have = sorted(p for p in run_dir.glob("round_*") if (p / "outcomes.parquet").exists())
    if not have:
        raise FileNotFoundError(f"{run_dir} has no round with an outcomes table "
                                f"(folders there: {sorted(p.name for p in run_dir.glob('*'))[:10]})")
    if rounds is not None:
        want = {f"round_{k:03d}" for k in rounds}
        missing = want - {p.name for p in have}
        if missing:
            raise FileNotFoundError(f"{run_dir}: no outcomes for {sorted(missing)}; rounds there: "
                                    f"{[p.name for p in have]}")
        have = [p for p in have if p.name in want]
    return [{"run": run_dir.name, **row} for p in have for row in measure_round(p, n_boot=n_boot, seed=seed)]


def format_rows(rows: list[dict]) -> str:
    """A plain-text table of :func:`measure_run`'s rows (shares in %, AUROC with its interval)."""
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}"

    def pos(x):
        return "-" if x is None else f"{x:.2f}"

    def auc(r):
        return "-" if r["auroc"] is None else f"{r['auroc']:.3f} [{r['auroc_low']:.3f}, {r['auroc_high']:.3f}]"

    head = f"{'round':>5} {'variant':<18} {'source':<19} {'scope':<13} {'n':>4} {'wrong':>5} " \
           f"{'right pen %':>11} {'wrong pen %':>11} {'starts at (right/wrong)':>23}  AUROC [95% CI]"
    lines = [head]
    for r in rows:
        src = r["source"] + ("*" if r.get("trains") else "")
        lines.append(f"{r['round']:>5} {str(r['variant'] or '-'):<18} {src:<19} {r['scope']:<13} "
                     f"{r['n_responses']:>4} {r['n_wrong']:>5} {pct(r['right_penalized']):>11} "
                     f"{pct(r['wrong_penalized']):>11} {pos(r['right_penalty_starts']) + ' / ' + pos(r['wrong_penalty_starts']):>23}"
                     f"  {auc(r)}")
    if any(r.get("trains") for r in rows):
        lines.append("* the source whose weights the variant's token rewards subtract (vote.sources)")
    return "\n".join(lines)
