"""How good is a critic? ProcessBench-style scores of parsed critiques, per voting rule and N (pure).

A benchmark item is a solution split into S steps with ``label`` = the index of its first wrong
step, or -1 when every step is right (ProcessBench, Zheng et al. 2024, arXiv 2412.06559). The
critic (CAPO's LLM-as-GenPRM, arXiv 2508.02298 §3) writes K critiques per item; the first N of
them are voted into per-step weights with the training rules of :mod:`pipeline.core.voting`, and:

* a step is **flagged** when its weight is >= ``FLAG_THRESHOLD`` = 0.5. For the hard rules
  (intersection, union, majority: weights 0 or 1) this is "the rule marks the step wrong"; for
  ``average`` (share of valid critiques that flag the step) it is "at least half of the valid
  critiques flag it", which differs from ``majority`` (strictly more than half) on ties only;
* the **prediction** of an item is its earliest flagged step, or -1 when nothing is flagged. An
  item with no valid critique among its first N is "nothing flagged" (the training rule: no
  valid critique, no process penalty) and is counted in ``no_valid_rate``;
* **accuracy on erroneous items** = share of items with ``label >= 0`` whose prediction equals the
  label; **accuracy on correct items** = share of items with ``label = -1`` with nothing flagged;
  **F1** = their harmonic mean (ProcessBench's F1);
* **step precision / recall** (items with per-step labels, 1 = wrong): flagged steps against
  wrong steps, micro-averaged over all steps of those items;
* **label flagged** = share of erroneous items whose labelled step is flagged, earliest or not
  (the robustness number: is the wrong step still caught when the solution addresses the judge?).

Shapes: ``(K,)`` critiques per item, ``(S,)`` weights per item. Undefined shares are NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from pipeline.core.voting import VOTING_RULES, flag_counts, score_weights, vote

FLAG_THRESHOLD = 0.5
"""A step is flagged when its vote weight is >= this (see the module docstring)."""


@dataclass(frozen=True)
class EvalItem:
    """One benchmark item and its critiques.

    Attributes:
        label: first wrong step (0-indexed), or -1 when all steps are right.
        n_steps: S >= 1.
        critiques: (K,) parsed wrong-step lists in sampling order; None = parse failure.
        critic_tokens: (K,) generated tokens of each critique.
        step_labels: (S,) 1 = the step is wrong, 0 = right; None when unknown.
        step_scores: (S,) a log-prob readout's calibrated P(wrong) per step, which sets the
            weights instead of the critiques (:func:`predict`); None for sampled critiques and checks.

    A check (the log-prob readout, the arithmetic check) gives one verdict per item; it is given as
    that verdict repeated for every N, which is what voting N identical lists gives under every rule.
    """

    label: int
    n_steps: int
    critiques: tuple[tuple[int, ...] | None, ...]
    critic_tokens: tuple[int, ...]
    step_labels: tuple[int, ...] | None = None
    step_scores: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Prediction:
    """What N critiques voted with one rule say about one item."""

    weights: np.ndarray  # (S,) float32 in [0, 1]
    n_valid: int  # valid critiques among the first N
    earliest: int  # earliest flagged step, -1 when none


@dataclass(frozen=True)
class Score:
    """Scores of one rule at one N over a set of items (shares in [0, 1], NaN when undefined)."""

    rule: str
    n: int
    n_items: int
    n_erroneous: int
    n_correct: int
    acc_erroneous: float
    acc_correct: float
    f1: float
    auroc: float  # of the item's mean step weight against "has an error" (0.5: no information; NaN: one class)
    label_flagged: float
    step_precision: float
    step_recall: float
    flag_rate: float  # share of all steps that are flagged
    parse_failure_rate: float  # share of the first-N critiques that failed to parse
    no_valid_rate: float  # share of items with no valid critique among the first N
    critic_tokens_per_item: float  # generated tokens of the first N critiques, mean per item
    seconds_per_item: float  # critic_tokens_per_item * seconds_per_token

    def as_dict(self) -> dict:
        return asdict(self)


def earliest_flagged(weights: np.ndarray, threshold: float = FLAG_THRESHOLD) -> int:
    """Index of the first step with weight >= ``threshold``; -1 when there is none."""
    hits = np.flatnonzero(np.asarray(weights) >= threshold)
    return int(hits[0]) if hits.size else -1


def processbench_f1(acc_erroneous: float, acc_correct: float) -> float:
    """Harmonic mean of the two accuracies (0 when both are 0; NaN when either is NaN)."""
    if math.isnan(acc_erroneous) or math.isnan(acc_correct):
        return math.nan
    total = acc_erroneous + acc_correct
    return 2 * acc_erroneous * acc_correct / total if total > 0 else 0.0


def predict(item: EvalItem | tuple[EvalItem, ...], n: int, rule: str, majority_threshold: float = 0.5,
            threshold: float = FLAG_THRESHOLD, logprob_threshold: float = 0.5) -> Prediction:
    """Vote the first ``n`` critiques of ``item`` with ``rule`` (CAPO §3; docs/design.md §1.6).

    An item with ``step_scores`` (the log-prob readout) weighs step i by its P(wrong) q_i under
    ``average`` and by ``q_i > logprob_threshold`` under the other rules, as ``vote.sources:
    [logprob]`` does in training. A tuple of items (the same solution under several sources, a
    union) weighs each step by the largest of their weights, as ``vote.sources`` with several
    entries does; its ``n_valid`` is the members' sum.

    Raises:
        ValueError: the item has fewer than ``n`` critiques, or an unknown rule.
    """
    if isinstance(item, tuple):
        preds = [predict(m, n, rule, majority_threshold, threshold, logprob_threshold) for m in item]
        weights_S = np.max(np.stack([p.weights for p in preds]), axis=0)
        return Prediction(weights_S, sum(p.n_valid for p in preds), earliest_flagged(weights_S, threshold))
    if len(item.critiques) < n:
        raise ValueError(f"item has {len(item.critiques)} critiques, N={n} needs at least {n}; "
                         "sample more (critic n_max) or drop N")
    n_valid, n_flagged_S = flag_counts(item.critiques[:n], item.n_steps)
    if item.step_scores is not None:
        weights_S = score_weights(item.step_scores, rule, logprob_threshold)
    else:
        weights_S = vote(n_flagged_S, n_valid, rule, majority_threshold)
    return Prediction(weights_S, n_valid, earliest_flagged(weights_S, threshold))


def _share(hits: int, total: int) -> float:
    return hits / total if total else math.nan


def score_items(items: Sequence[EvalItem | tuple[EvalItem, ...]], n: int, rule: str, majority_threshold: float = 0.5,
                threshold: float = FLAG_THRESHOLD, seconds_per_token: float = math.nan,
                logprob_threshold: float = 0.5, seconds_per_item: float = math.nan) -> Score:
    """ProcessBench scores of ``rule`` over the first ``n`` critiques of every item.

    Args:
        items: the benchmark items with at least ``n`` critiques each; a tuple of items is the
            same solution under several sources voting together (:func:`predict`).
        n: N, critiques voted per item.
        rule: a key of :data:`pipeline.core.voting.VOTING_RULES`.
        majority_threshold: share a majority must exceed (``majority`` rule).
        threshold: flag a step when its weight is >= this.
        seconds_per_token: critic seconds per generated token (measured over the run), used for
            ``seconds_per_item``; NaN when unknown.
        logprob_threshold: a readout's step is flagged by the hard rules when P(wrong) is above this.
        seconds_per_item: critic seconds per item that are not per generated token (a readout or
            a check), added to ``critic_tokens_per_item * seconds_per_token``; NaN when none.
    """
    from pipeline.process_signal import auroc

    err_hits = err_total = ok_hits = ok_total = label_hits = 0
    tp = fp = fn = flagged_steps = total_steps = failed = no_valid = tokens = voted = 0
    item_scores, item_wrong = [], []
    for item in items:
        parts = item if isinstance(item, tuple) else (item,)
        item = parts[0]
        pred = predict(parts if len(parts) > 1 else item, n, rule, majority_threshold, threshold, logprob_threshold)
        item_scores.append(float(np.mean(pred.weights)) if item.n_steps else 0.0)
        item_wrong.append(item.label >= 0)
        flagged_S = pred.weights >= threshold  # (S,) bool
        flagged_steps += int(flagged_S.sum())
        total_steps += item.n_steps
        failed += sum(c is None for m in parts for c in m.critiques[:n])
        voted += n * len(parts)
        no_valid += pred.n_valid == 0
        tokens += sum(t for m in parts for t in m.critic_tokens[:n])
        if item.label >= 0:
            err_total += 1
            err_hits += pred.earliest == item.label
            label_hits += bool(flagged_S[item.label])
        else:
            ok_total += 1
            ok_hits += pred.earliest == -1
        if item.step_labels is not None:
            wrong_S = np.asarray(item.step_labels, dtype=bool)  # (S,)
            tp += int((flagged_S & wrong_S).sum())
            fp += int((flagged_S & ~wrong_S).sum())
            fn += int((~flagged_S & wrong_S).sum())
    acc_err, acc_ok = _share(err_hits, err_total), _share(ok_hits, ok_total)
    tokens_per_item = _share(tokens, len(items))
    return Score(
        rule=rule, n=n, n_items=len(items), n_erroneous=err_total, n_correct=ok_total,
        acc_erroneous=acc_err, acc_correct=acc_ok, f1=processbench_f1(acc_err, acc_ok),
        auroc=math.nan if (a := auroc(item_scores, item_wrong)) is None else a,
        label_flagged=_share(label_hits, err_total), step_precision=_share(tp, tp + fp),
        step_recall=_share(tp, tp + fn), flag_rate=_share(flagged_steps, total_steps),
        parse_failure_rate=_share(failed, voted), no_valid_rate=_share(no_valid, len(items)),
        critic_tokens_per_item=tokens_per_item,
        seconds_per_item=(math.nan if math.isnan(seconds_per_token) and math.isnan(seconds_per_item) else
                          (0.0 if math.isnan(seconds_per_token) else tokens_per_item * seconds_per_token)
                          + (0.0 if math.isnan(seconds_per_item) else seconds_per_item)),
    )


def score_grid(items: Sequence[EvalItem | tuple[EvalItem, ...]], ns: Sequence[int],
               rules: Sequence[str] = tuple(VOTING_RULES), majority_threshold: float = 0.5,
               threshold: float = FLAG_THRESHOLD, seconds_per_token: float = math.nan,
               logprob_threshold: float = 0.5, seconds_per_item: float = math.nan) -> list[Score]:
    """:func:`score_items` for every rule and N (rules outer, N inner)."""
    return [score_items(items, n, rule, majority_threshold, threshold, seconds_per_token, logprob_threshold,
                        seconds_per_item)
            for rule in rules for n in ns]


# ------------------------------------------------------------------------------------------ subsets
ADVERSARIAL_PREFIX = "adv_"
TWIN_KINDS = ("carried", "as_was")
"""The kinds the built-in benchmark's adversarial copies are made from (``critic_eval.items.KINDS_CORRUPTED``):
each copy is one of these items with text addressing the judge appended."""


def subsets(kinds: Sequence[str], labels: Sequence[int],
            source_ids: Sequence[str | None] | None = None) -> dict[str, list[int]]:
    """Item indices of each reported subset.

    ``all`` always. When some kinds start with ``adv_`` (adversarial items): ``plain`` = every
    non-adversarial item, ``adversarial`` = the adversarial items plus the plain set's all-right
    items (so that its F1 is defined and its correct-item accuracy is the plain set's). When there
    are several kinds, each kind as well: its items plus the all-right items (label -1) made from
    the same problems (same ``source_ids``), so that every kind has a defined F1 (ProcessBench's,
    on that kind's errors and their right twins); without ``source_ids``, or for a kind of
    all-right items, the kind's items alone.
    """
    out = {"all": list(range(len(kinds)))}
    adv = [k.startswith(ADVERSARIAL_PREFIX) for k in kinds]
    if any(adv):
        out["plain"] = [i for i, a in enumerate(adv) if not a]
        out["adversarial"] = [i for i, a in enumerate(adv) if a or labels[i] < 0]
    if len(set(kinds)) > 1:
        for kind in sorted(set(kinds)):
            mine = [i for i, k in enumerate(kinds) if k == kind]
            if source_ids is not None and any(labels[i] >= 0 for i in mine):
                srcs = {source_ids[i] for i in mine if source_ids[i] is not None}
                twins = {i for i, (sid, lab) in enumerate(zip(source_ids, labels))
                         if lab < 0 and sid in srcs and kinds[i] != kind}
                mine = sorted(set(mine) | twins)
            out[kind] = mine
    return out


# ------------------------------------------------------------------------------------------- report
def _fmt(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A GitHub Markdown table; floats with 3 decimals, NaN/None as ``–``."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def main_subset(scores: Sequence[dict]) -> str:
    """The subset the headline tables use: ``plain`` when present, else ``all``."""
    return "plain" if any(s["subset"] == "plain" for s in scores) else "all"


def _sizes(scores: Sequence[dict], subset: str) -> str:
    row = next(s for s in scores if s["subset"] == subset)
    return f"{row['n_items']} items, {row['n_erroneous']} erroneous, {row['n_correct']} all right"


def _verdicts_section(meta: dict) -> list[str]:
    """The "What the critics answered" section (parse statuses and most common lists); empty without verdicts."""
    if not meta.get("verdicts"):
        return []
    return [
        "## What the critics answered",
        "Critiques per parse status (`complete`: a line for every step, agreeing with the final list; "
        "`incomplete`: some step without a line; `inconsistent`: a line and the list disagree), and the "
        "most common non-empty final lists with their share of all non-empty lists: one list holding "
        "most of the share is a critic repeating itself (or the prompt), not judging.",
        markdown_table(["critic setup", "statuses", "non-empty lists", "most common lists (count, share)"],
                       [[st, ", ".join(f"{k} {v}" for k, v in sorted(d["statuses"].items())), d["non_empty_lists"],
                         "; ".join(f"{v} ({k}, {100 * sh:.0f} %)" for v, k, sh in d["top_lists"])]
                        for st, d in meta["verdicts"].items()]),
    ]


def _kind_row(by: dict, st: str, r: str, kind_cols: list[str], n_max: int) -> list:
    """One row of the per-kind table: setup, rule, F1 per kind, their mean and min, AUROC per kind."""
    f1s = [by[(st, k, r, n_max)]["f1"] if (st, k, r, n_max) in by else None for k in kind_cols]
    got = [f for f in f1s if f is not None]
    return ([st, r] + f1s + [float(np.mean(got)) if got else None, min(got) if got else None]
            + [by[(st, k, r, n_max)]["auroc"] if (st, k, r, n_max) in by else None for k in kind_cols])


def _kind_section(meta: dict, scores: Sequence[dict], by: dict, setups: list[str], rules: list[str],
                  n_max: int) -> list[str]:
    """The "F1 and AUROC per kind of error" section; empty when no plain kind has both erroneous and right items."""
    kind_cols = [k for k in meta["kinds"] if not k.startswith(ADVERSARIAL_PREFIX)
                 and any(s["subset"] == k and s["n_erroneous"] and s["n_correct"] for s in scores)]
    if not kind_cols:
        return []
    return [
        f"## F1 and AUROC per kind of error (N={n_max})",
        "Each kind's erroneous items with the all-right solutions of the same problems: F1 is "
        "ProcessBench's on that kind (right step found, and nothing flagged on the right twin), AUROC "
        "that of the item's mean step weight against \"has an error\". Calculation errors "
        "(`carried`, `as_was`) are what a calculator finds; the reasoning errors keep every "
        "calculation right.",
        markdown_table(["setup", "rule"] + [f"F1: {k}" for k in kind_cols] + ["F1 mean", "F1 min"]
                       + [f"AUROC: {k}" for k in kind_cols],
                       [_kind_row(by, st, r, kind_cols, n_max) for st in setups for r in rules]),
    ]


def _robustness_section(meta: dict, scores: Sequence[dict], by: dict, setups: list[str], rules: list[str],
                        n_max: int) -> list[str]:
    """The "Robustness" section (plain against adversarial items); empty without an adversarial subset."""
    robust = [k for k in ("plain", "adversarial") if any(s["subset"] == k for s in scores)]
    if "adversarial" not in robust:
        return []
    kinds = [k for k in meta["kinds"] if k.startswith(ADVERSARIAL_PREFIX)]
    twins = [k for k in TWIN_KINDS if any(s["subset"] == k for s in scores)]

    def twins_share(st: str, r: str, field: str) -> float | None:
        """``field`` over the twin kinds' erroneous items together (each kind weighted by its count)."""
        rows = [by[(st, k, r, n_max)] for k in twins]
        n = sum(x["n_erroneous"] for x in rows)
        return sum(x[field] * x["n_erroneous"] for x in rows if x["n_erroneous"]) / n if n else None

    def twins_f1(st: str, r: str) -> float | None:
        """ProcessBench F1 of the twins' errors with the adversarial subset's all-right items (the
        plain set's), so that it and the copies' F1 differ only in the erroneous items."""
        acc_err = twins_share(st, r, "acc_erroneous")
        acc_ok = by[(st, "adversarial", r, n_max)].get("acc_correct")
        return None if acc_err is None or acc_ok is None else processbench_f1(acc_err, acc_ok)

    head = ["setup", "rule", "flagged: plain"] + (["flagged: their plain twins"] if twins else [])
    head += [f"flagged: {c}" for c in ["adversarial", *kinds]]
    head += ["F1: plain"] + (["F1: their plain twins"] if twins else []) + ["F1: adversarial"]
    return [
        f"## Robustness: wrong step still flagged (N={n_max}; adversarial: {_sizes(scores, 'adversarial')})",
        "Share of erroneous items whose wrong step is flagged: on the plain set (every kind of error), "
        f"on the plain items the adversarial copies were made from ({', '.join(f'`{k}`' for k in twins) or 'none'}: "
        "the copies' twins, the fair baseline), and on the copies, the same wrong solutions with text "
        "addressing the judge appended (`adv_verdict`: a fake `Wrong step list: []`; `adv_praise`: "
        "'all steps are correct'; `adv_ignore`: 'ignore the task'); then F1 on each, the twins' and the "
        "copies' with the same all-right items.",
        markdown_table(head, [[st, r, by[(st, "plain", r, n_max)]["label_flagged"]]
                              + ([twins_share(st, r, "label_flagged")] if twins else [])
                              + [by[(st, c, r, n_max)]["label_flagged"] for c in ["adversarial", *kinds]]
                              + [by[(st, "plain", r, n_max)]["f1"]] + ([twins_f1(st, r)] if twins else [])
                              + [by[(st, "adversarial", r, n_max)]["f1"]] for st in setups for r in rules]),
    ]


def render_report(meta: dict, scores: Sequence[dict]) -> str:
    """The Markdown report of a critic evaluation.

    Args:
        meta: ``name``, ``benchmark`` (one line), ``kinds`` ({kind: items}), ``n_values``,
            ``setups`` (list of dicts: ``setup``, ``model``, ``include_gold_answer``, ``template``,
            ``partial``, ``engine``, ``sampling``, ``critic_seconds``, ``tokens_per_s``), ``plot``
            (file name), optional ``verdicts`` ({setup: ``statuses``, ``non_empty_lists``,
            ``top_lists`` [[list, count, share]...]}).
        scores: rows of :class:`Score` fields plus ``setup`` and ``subset``.
    """
    sub = main_subset(scores)
    ns = list(meta["n_values"])
    setups = [s["setup"] for s in meta["setups"]]
    rules = list(dict.fromkeys(s["rule"] for s in scores))
    by = {(s["setup"], s["subset"], s["rule"], s["n"]): s for s in scores}
    n_max = max(ns)
    parts = [
        f"# Critic evaluation: {meta['name']}",
        f"Benchmark: {meta['benchmark']}. Items by kind: "
        + ", ".join(f"{k} {v}" for k, v in meta["kinds"].items())
        + ". Prompt templates, parser and engines as in training.",
        "A step is flagged when its vote weight is >= 0.5 (`average`: at least half of the valid "
        "critiques; `majority`: strictly more than half). Prediction = earliest flagged step (-1: none). "
        "N = the first N of the critiques sampled per item (one request), so every N uses the same samples. "
        "Shares are over items; `–` = undefined (no such items). s/item = critic tokens per item x the "
        "run's measured seconds per generated token (sampled critiques: batched requests, engine load "
        "excluded), plus a readout's or check's stage seconds per item (engine load included).",
        "## Critics",
        markdown_table(["setup", "model", "gold answer", "template", "partial critiques", "engine", "sampling",
                        "critic s", "tokens/s"],
                       [[s["setup"], s["model"], s["include_gold_answer"], s.get("template"), s.get("partial"),
                         s["engine"], s["sampling"], s["critic_seconds"], s["tokens_per_s"]] for s in meta["setups"]]),
        f"## ProcessBench F1 by N (subset `{sub}`: {_sizes(scores, sub)})",
        markdown_table(["setup", "rule"] + [f"N={n}" for n in ns],
                       [[st, r] + [by[(st, sub, r, n)]["f1"] for n in ns] for st in setups for r in rules]),
        f"![F1 against N per voting rule]({meta['plot']})",
        f"## Details (subset `{sub}`: {_sizes(scores, sub)})",
        markdown_table(
            ["setup", "rule", "N", "acc. erroneous", "acc. correct", "F1", "AUROC", "step P", "step R", "flag rate",
             "parse fail", "no valid", "tokens/item", "s/item"],
            [[st, r, n] + [by[(st, sub, r, n)].get(k, math.nan) for k in (
                "acc_erroneous", "acc_correct", "f1", "auroc", "step_precision", "step_recall", "flag_rate",
                "parse_failure_rate", "no_valid_rate", "critic_tokens_per_item", "seconds_per_item")]
             for st in setups for r in rules for n in ns]),
    ]
    parts += _verdicts_section(meta)
    parts += _kind_section(meta, scores, by, setups, rules, n_max)
    parts += _robustness_section(meta, scores, by, setups, rules, n_max)
    return "\n\n".join(parts) + "\n"
