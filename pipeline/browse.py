"""The critique browser: what the critic saw, in one self-contained HTML page per round and variant.

Per prompt: the problem, the gold answer and its G responses side by side with their outcome; each
response split into the steps exactly as the critic saw them (``steps.step_text``), each step
shaded by the share of the N critiques that flagged it and marked when the vote flagged it; a click
on a step opens the N raw critiques with their parse status and judged steps; a strip under each
response shows its token rewards and advantages as a heat map (values on hover). On top: the
round's overview (accuracy, flagged-step rate, parse-status counts, the most common verdict lists)
and filters (wrong answer but nothing flagged, right answer but steps flagged, split votes, parse
failures, text search). Every view names the DuckDB query it came from: the queries run against
views named as in the catalog (``capo sql``) and can be pasted there unchanged.

Output: ``runs/<run>/browse/round_<k>-<variant>/index.html`` (data inlined as JSON; no server, no
network). All model text reaches the page as JSON inside a ``<script type="application/json">``
(Jinja2's ``tojson``: ``<``, ``>``, ``&`` and ``'`` escaped) and is put into the page with
``textContent`` only, never parsed as HTML: a response or critique cannot inject markup or script.
"""

from __future__ import annotations

import functools
import http.server
import logging
import shutil
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb
import numpy as np

from pipeline import storage
from pipeline.core.critique import OUTCOME_PARSE_STATUSES, VERDICT_STATUSES
from pipeline.core.rewards import trace_credit
from pipeline.schemas import SCHEMAS
from pipeline.storage import sql_literal

log = logging.getLogger("capo.browse")

TEMPLATE = "browse.html.j2"


def browser_queries(run_id: str, round_idx: int, variant: str, rule: str) -> dict[str, str]:
    """The DuckDB queries behind every view of the browser, over the catalog's view names
    (``rollouts``, ``outcomes``, ``steps``, ``critiques``, ``step_verdicts``, ``token_rewards``,
    ``token_credit``, ``prompts``): paste any of them into ``capo sql``."""
    run, k, v, r = sql_literal(run_id), int(round_idx), sql_literal(variant), sql_literal(rule)
    this_round = f"SELECT prompt_id FROM rollouts WHERE run_id = {run} AND round = {k}"
    return {
        "prompts": f"SELECT prompt_id, question, gold_answer FROM prompts\nWHERE prompt_id IN ({this_round})\n"
                   "ORDER BY prompt_id",
        "responses": (
            "SELECT r.prompt_id, r.rollout_id, r.sample_idx, r.response_text, r.num_tokens, r.finish_reason,\n"
            "       o.outcome_correct, o.extracted_answer, o.verify_status, t.outcome_reward, t.n_penalized_tokens\n"
            "FROM rollouts r\n"
            "JOIN outcomes o ON o.run_id = r.run_id AND o.round = r.round AND o.rollout_id = r.rollout_id\n"
            "LEFT JOIN token_rewards t ON t.run_id = r.run_id AND t.round = r.round AND t.rollout_id = r.rollout_id\n"
            f"     AND t.variant = {v}\n"
            f"WHERE r.run_id = {run} AND r.round = {k}\nORDER BY r.prompt_id, r.sample_idx"),
        "steps": (
            "SELECT s.rollout_id, s.step_idx, s.step_text, s.token_start, s.token_end, v.n_valid, v.n_flagged, v.weight,\n"
            "       v.llm_weight, v.arithmetic_flag, v.logprob_score\n"
            "FROM steps s\n"
            "LEFT JOIN step_verdicts v ON v.run_id = s.run_id AND v.round = s.round AND v.rollout_id = s.rollout_id\n"
            f"     AND v.step_idx = s.step_idx AND v.variant = {v} AND v.rule = {r}\n"
            f"WHERE s.run_id = {run} AND s.round = {k}\nORDER BY s.rollout_id, s.step_idx"),
        "critiques": (
            "SELECT rollout_id, source, critique_idx, parse_status, wrong_steps, steps_judged, steps_wrong_lines,\n"
            "       raw_text, critic_tokens, finish_reason\n"
            f"FROM critiques\nWHERE run_id = {run} AND round = {k}\nORDER BY rollout_id, source = 'llm' DESC, source, critique_idx"),
        "token_rewards": (
            "SELECT rollout_id, rewards, advantages\n"
            f"FROM token_rewards\nWHERE run_id = {run} AND round = {k} AND variant = {v}"),
        "token_credit": (  # where each variant's update put the credit (written by the train stage)
            "SELECT rollout_id, variant, credit\n"
            f"FROM token_credit\nWHERE run_id = {run} AND round = {k}\nORDER BY variant, rollout_id"),
        "other_variants": (  # where each other method trained on the same responses puts its credit
            "SELECT rollout_id, variant, advantages\n"
            f"FROM token_rewards\nWHERE run_id = {run} AND round = {k} AND variant <> {v}\nORDER BY variant, rollout_id"),
        "parse_status": (f"SELECT parse_status, count(*) AS critiques\nFROM critiques\n"
                         f"WHERE run_id = {run} AND round = {k} AND source = 'llm'\n"
                         "GROUP BY parse_status ORDER BY critiques DESC"),
        "verdict_lists": (f"SELECT wrong_steps::VARCHAR AS wrong_steps, count(*) AS critiques\nFROM critiques\n"
                          f"WHERE run_id = {run} AND round = {k} AND source = 'llm' AND len(wrong_steps) > 0\n"
                          "GROUP BY 1 ORDER BY critiques DESC, 1 LIMIT 5"),
        "across_rounds": (
            "SELECT r.prompt_id, r.round, count(*) AS responses, sum(o.outcome_correct::INT) AS correct,\n"
            "       (SELECT count(*) FROM step_verdicts v WHERE v.run_id = r.run_id AND v.round = r.round\n"
            f"          AND v.variant = {v} AND v.rule = {r} AND v.weight > 0\n"
            "          AND v.rollout_id IN (SELECT rollout_id FROM rollouts x WHERE x.run_id = r.run_id\n"
            "                               AND x.round = r.round AND x.prompt_id = r.prompt_id)) AS flagged_steps\n"
            "FROM rollouts r\n"
            "JOIN outcomes o ON o.run_id = r.run_id AND o.round = r.round AND o.rollout_id = r.rollout_id\n"
            f"WHERE r.run_id = {run} AND r.prompt_id IN ({this_round})\n"
            "GROUP BY r.run_id, r.prompt_id, r.round ORDER BY r.prompt_id, r.round"),
    }


def _register_views(con: duckdb.DuckDBPyConnection, run_dir: Path, prompts: Path | None) -> list[str]:
    """Views named as in the catalog over this run's tables (every round); an absent table is an
    empty view of its schema (a GRPO variant has no critiques). A Parquet file whose footer does
    not read (truncated, overwritten) is left out of its view and logged. Returns the absent
    tables, then one entry ``"<table>: <file> unreadable (<why>)"`` per file left out."""
    globs = {name: pattern.split("/", 1)[1] for name, pattern in storage.CATALOG_GLOBS.items()}
    missing, unreadable = [], []
    for name, pattern in [*globs.items(), ("prompts", None)]:
        files = sorted(run_dir.glob(pattern)) if pattern else ([prompts] if prompts and prompts.exists() else [])
        files, bad = storage.split_unreadable([f for f in files if "superseded" not in f.parts])
        for f, why in bad.items():
            log.warning("browse: view %s leaves out %s (%s); recompute its stage (--force) or delete it", name, f, why)
            unreadable.append(f"{name}: {f} unreadable ({why})")
        con.register(f"_{name}_empty", SCHEMAS[name].empty_table())
        if files:  # over the current schema, columns an older table lacks filled as the catalog fills them
            paths = "[" + ", ".join(sql_literal(str(f)) for f in files) + "]"
            con.execute(f"CREATE VIEW {name} AS SELECT * FROM _{name}_empty UNION ALL BY NAME "
                        f"SELECT * FROM ({storage.view_select(con, name, paths)})")
        else:
            missing.append(name)
            con.execute(f"CREATE VIEW {name} AS SELECT * FROM _{name}_empty")
    return missing + unreadable


def _rows(con: duckdb.DuckDBPyConnection, sql: str) -> list[dict]:
    cur = con.execute(sql)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, row)) for row in cur.fetchall()]


def _token_texts(policy: str | None, token_ids: list[int], fallback: str | None = None) -> list[str]:
    """Each token's text in the tokenizer of the policy that sampled the round, else (its checkpoint
    pruned or moved) in that of ``fallback``, the run's starting policy: every round's checkpoint
    is saved with the starting policy's tokenizer. Ids as text when neither loads."""
    tok = _tokenizer(policy)
    if tok is None:
        tok = _tokenizer(fallback)
    if tok is None:
        return [f"#{t}" for t in token_ids]
    return [tok.decode([t]) for t in token_ids]


@functools.lru_cache(maxsize=4)
def _tokenizer(policy: str | None):
    if not policy:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(policy, local_files_only=True)  # never the network
    except Exception as e:  # a checkpoint pruned or moved: the caller falls back, else shows token ids
        log.warning("browse: cannot load the tokenizer of %s (%s)", policy, e)
        return None


def _starting_policy(cfg) -> str | None:
    """The run's starting policy (``rollout.policy``) as a local folder, without converting an
    embedded model that is not there yet; None when it is not on disk."""
    from pipeline.assets.models import EMBEDDED_MODELS
    from pipeline.stages.base import data_root

    name = cfg.rollout.policy
    path = data_root(cfg) / "models" / name if name in EMBEDDED_MODELS else Path(name)
    return str(path) if path.is_dir() else None


def _round_config(round_dir: Path, variant: str | None) -> dict:
    """The resolved config the round's variant ran under (from its table manifests)."""
    candidates = []
    if variant:
        candidates += [round_dir / "variants" / variant / f"{t}.parquet" for t in ("token_rewards", "step_verdicts")]
    candidates += [round_dir / "rollouts.parquet"]
    for path in candidates:
        man = storage.read_manifest(path)
        if man and man.get("resolved_config"):
            return man["resolved_config"]
    raise FileNotFoundError(f"{round_dir} has no committed rollouts; run the round first (capo round)")


def _resolve_variant(run_dir: Path, round_idx: int, variant: str | None) -> tuple[Path, list[str], str]:
    """The round's folder, its variants and the variant to show (the first one when ``variant`` is None)."""
    round_dir = run_dir / f"round_{round_idx:03d}"
    if not round_dir.is_dir():
        rounds = sorted(p.name for p in run_dir.glob("round_*") if p.name != "round_000")
        raise FileNotFoundError(f"{round_dir} does not exist; rounds of {run_dir}: {rounds or 'none'}")
    variants = sorted(p.name for p in (round_dir / "variants").glob("*") if p.is_dir())
    if variant is None:
        if not variants:
            raise FileNotFoundError(f"{round_dir} has no variant yet (no token rewards): run the round's stages")
        variant = variants[0]
        if len(variants) > 1:
            log.info("browse: round %d has variants %s; showing %s (--variant to choose)", round_idx, variants, variant)
    elif variant not in variants:
        raise ValueError(f"variant {variant!r} is not in {round_dir}; valid: {variants}")
    return round_dir, variants, variant


def _prompts_and_start(rc: dict, run_dir: Path) -> tuple[Path | None, str | None]:
    """The run's prompt table and starting policy folder from its resolved config ``rc`` (None where unreadable)."""
    from pipeline.config import CAPOConfig
    from pipeline.stages.base import prompts_path

    prompts = start = None
    try:
        cfg = CAPOConfig.model_validate(rc)
    except Exception as e:  # a config of an older version
        cfg = None
        log.warning("browse: cannot read the resolved config of %s (%s); problems are not shown", run_dir, e)
    if cfg is not None:
        try:
            prompts = prompts_path(cfg)
        except Exception as e:  # data_dir relative to another working directory
            log.warning("browse: cannot find the prompt table of %s (%s); problems are not shown", run_dir, e)
        start = _starting_policy(cfg)
    return prompts, start


def _query_round(run_dir: Path, prompts: Path | None, queries: dict[str, str], run_id: str,
                 round_idx: int) -> tuple[dict[str, list[dict]], list[dict], list[str]]:
    """The rows of every query in ``queries``, the round's (rollout, policy, token ids) rows and the absent tables."""
    con = duckdb.connect()
    missing = _register_views(con, run_dir, prompts)
    data = {name: _rows(con, sql) for name, sql in queries.items()}
    policy_rows = _rows(con, f"SELECT rollout_id, policy, response_token_ids FROM rollouts "
                             f"WHERE run_id = {sql_literal(run_id)} AND round = {int(round_idx)}")
    con.close()
    return data, policy_rows, missing


def _other_rounds(data: dict[str, list[dict]], round_idx: int) -> dict[str, list[dict]]:
    """Per prompt, its counts in the run's other rounds."""
    across: dict[str, list[dict]] = {}
    for a in data["across_rounds"]:
        if a["round"] != round_idx:
            across.setdefault(a["prompt_id"], []).append(
                {"round": a["round"], "responses": a["responses"], "correct": a["correct"],
                 "flagged_steps": a["flagged_steps"]})
    return across


def _variants_on_these_rollouts(round_dir: Path, variants: list[str]) -> set[str]:
    """The variants whose token rewards were computed from the round's current rollouts (their manifest's
    key holds the rollouts' fingerprint): a variant computed before the rollouts were sampled again
    would show advantages of other text."""
    man = storage.read_manifest(round_dir / "rollouts.parquet")
    if man is None:
        return set()
    out = set()
    for v in variants:
        tr = storage.read_manifest(round_dir / "variants" / v / "token_rewards.parquet")
        if tr is not None and (tr.get("key") or {}).get("rollouts") == man["fingerprint"]:
            out.add(v)
    return out


def _ratio_trace(round_dir: Path, variant: str) -> dict | None:
    """The variant's ``train.ratio_trace`` (GRPO-λ) from the config its token rewards were made
    under (their manifest); None without one."""
    man = storage.read_manifest(round_dir / "variants" / variant / "token_rewards.parquet") or {}
    return ((man.get("resolved_config") or {}).get("train") or {}).get("ratio_trace")


def _recorded_credit(round_dir: Path, rows: list[dict]) -> dict[str, dict[str, list[float]]]:
    """Per FIPO variant, per rollout id: the credit its update recorded (``token_credit`` ``rows``),
    where that update is the variant's current one: the table's key holds the round's current
    rollouts and the variant's current token rewards, names ``train.future_kl``, and is the key of
    the committed checkpoint (a kill between the two writes, or token rewards made again since,
    leave it out: the page then shows the advantages)."""
    rollouts = storage.read_manifest(round_dir / "rollouts.parquet")
    current = set()
    for v in {r["variant"] for r in rows}:
        vd = round_dir / "variants" / v
        tc, tr, ck = (storage.read_manifest(vd / n) for n in ("token_credit.parquet", "token_rewards.parquet", "checkpoint"))
        if None in (rollouts, tc, tr, ck):
            continue
        key = tc.get("key") or {}
        if (key.get("rollouts") == rollouts["fingerprint"] and key.get("token_rewards") == tr["fingerprint"]
                and (key.get("train") or {}).get("future_kl") and ck.get("key_hash") == tc.get("key_hash")):
            current.add(v)
    out: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        if r["variant"] in current and r["credit"] is not None:
            out.setdefault(r["variant"], {})[r["rollout_id"]] = r["credit"]
    return out


def _add_credit(rows: list[dict], trace: dict | None, recorded: dict[str, list[float]]) -> None:
    """Give each token-rewards row of a variant its ``credit``, where its advantages are not its credit:
    under a traced ratio ``trace`` (GRPO-λ's ``train.ratio_trace``) where the loss puts the credit at
    the update's start (:func:`pipeline.core.rewards.trace_credit`); for FIPO the credit its current
    update recorded (``recorded``, per rollout id, from :func:`_recorded_credit`: FIPO's weights exist
    only during the update); else None. ``credit_kind`` says which: ``trace``, ``recorded`` or None."""
    for r in rows:
        adv = np.asarray(r.get("advantages") or [], np.float64)
        r["credit"], r["credit_kind"] = None, None
        if trace:
            r["credit"], r["credit_kind"] = trace_credit(adv, np.array([0, len(adv)]), trace["kappa"], trace["style"]).tolist(), "trace"
        elif len(recorded.get(r["rollout_id"]) or []) == len(adv) > 0:
            r["credit"], r["credit_kind"] = list(recorded[r["rollout_id"]]), "recorded"


def _response_entry(r: dict, st: list[dict], cs: list[dict], checks: list[dict], tr: dict, token_texts: list[str],
                    parsed_ok: set[str], others: list[dict] = ()) -> dict:
    """One response as the browser shows it: its steps, critiques, checks, tokens and filter flags, its
    credit where its advantages are not its credit (GRPO-λ's traced ratio, FIPO's recorded update:
    ``credit_kind``), and where ``others``, the round's other variants trained on the same response,
    put theirs (their credit, else their advantages; ``[variant, values, credit_kind or None]``)."""
    response = {
        "rollout_id": r["rollout_id"], "sample_idx": r["sample_idx"], "correct": bool(r["outcome_correct"]),
        "extracted": r["extracted_answer"], "verify_status": r["verify_status"],
        "finish_reason": r["finish_reason"], "num_tokens": r["num_tokens"], "text": r["response_text"] or "",
        "outcome_reward": r["outcome_reward"], "penalized_tokens": r["n_penalized_tokens"],
        "steps": [{"idx": s["step_idx"], "text": s["step_text"], "n_valid": s["n_valid"], "n_flagged": s["n_flagged"],
                   "weight": s["weight"], "llm_weight": s["llm_weight"], "arithmetic": s["arithmetic_flag"],
                   "logprob": s["logprob_score"],
                   "token_start": s["token_start"], "token_end": s["token_end"]} for s in st],
        "critiques": [{"idx": c["critique_idx"], "status": c["parse_status"], "wrong": c["wrong_steps"],
                       "judged": c["steps_judged"], "wrong_lines": c["steps_wrong_lines"], "raw": c["raw_text"] or "",
                       "tokens": c["critic_tokens"], "finish_reason": c["finish_reason"]} for c in cs],
        "checks": [{"source": c["source"], "status": c["parse_status"], "wrong": c["wrong_steps"],
                    "judged": c["steps_judged"], "raw": c["raw_text"] or ""} for c in checks],
        "tokens": token_texts,
        "rewards": tr.get("rewards") or [], "advantages": tr.get("advantages") or [], "credit": tr.get("credit") or [],
        "credit_kind": tr.get("credit_kind"),
        "other_advantages": [[o["variant"], o["credit"] or o["advantages"], o.get("credit_kind")] for o in others
                             if len(o["advantages"] or []) == len(tr.get("advantages") or [])],
    }
    flags = [s["n_flagged"] or 0 for s in st]
    valid = [s["n_valid"] or 0 for s in st]
    response["flagged_steps"] = sum(1 for s in st if (s["weight"] or 0) > 0)
    response["split"] = any(0 < f < v for f, v in zip(flags, valid))
    response["parse_failures"] = sum(1 for c in cs if c["parse_status"] not in parsed_ok)
    return response


def _group_prompts(data: dict[str, list[dict]], steps: dict[str, list[dict]], policy_rows: list[dict],
                   round_idx: int, start: str | None) -> dict[str, dict]:
    """Per prompt id: the problem, its gold answer, its responses (:func:`_response_entry`) and its other rounds."""
    crits: dict[str, list[dict]] = {}
    checks: dict[str, list[dict]] = {}
    for c in data["critiques"]:
        (crits if (c["source"] or "llm") == "llm" else checks).setdefault(c["rollout_id"], []).append(c)
    rewards = {t["rollout_id"]: t for t in data["token_rewards"]}
    others: dict[str, list[dict]] = {}
    for t in data["other_variants"]:
        others.setdefault(t["rollout_id"], []).append(t)
    tokens = {p["rollout_id"]: (p["policy"], p["response_token_ids"]) for p in policy_rows}
    across = _other_rounds(data, round_idx)
    problems = {p["prompt_id"]: p for p in data["prompts"]}

    parsed_ok = set(VERDICT_STATUSES) | {OUTCOME_PARSE_STATUSES[0], "skipped_empty_response"}
    out_prompts: dict[str, dict] = {}
    for r in data["responses"]:
        rid = r["rollout_id"]
        policy, ids = tokens.get(rid, (None, []))
        tr = rewards.get(rid) or {}
        response = _response_entry(r, steps.get(rid, []), crits.get(rid, []), checks.get(rid, []), tr,
                                   _token_texts(policy, ids, start) if tr else [], parsed_ok, others.get(rid, []))
        pid = r["prompt_id"]
        prob = problems.get(pid, {})
        p = out_prompts.setdefault(pid, {"prompt_id": pid, "question": prob.get("question"),
                                         "gold": prob.get("gold_answer"), "responses": [],
                                         "other_rounds": across.get(pid, [])})
        p["responses"].append(response)
    return out_prompts


def _overview(data: dict[str, list[dict]], steps: dict[str, list[dict]], out_prompts: dict[str, dict],
              rc: dict) -> dict:
    """The round's overview: accuracy, flagged-step rate, parse-status counts, verdict lists and filter counts."""
    all_steps = [s for ss in steps.values() for s in ss]
    n_resp = len(data["responses"])
    overview = {
        "prompts": len(out_prompts), "responses": n_resp,
        "accuracy": (sum(bool(r["outcome_correct"]) for r in data["responses"]) / n_resp) if n_resp else None,
        "steps": len(all_steps),
        "flagged_step_rate": (sum(1 for s in all_steps if (s["weight"] or 0) > 0) / len(all_steps)) if all_steps else None,
        "critiques": sum((c["source"] or "llm") == "llm" for c in data["critiques"]),
        "parse_status": [[r["parse_status"], r["critiques"]] for r in data["parse_status"]],
        "verdict_lists": [[r["wrong_steps"], r["critiques"]] for r in data["verdict_lists"]],
        "n_critiques": rc["critique"]["num_critiques"] if rc["critique"]["enabled"] else 0,
    }
    counts = Counter()
    for p in out_prompts.values():
        for r in p["responses"]:
            counts["wrong_unflagged"] += (not r["correct"]) and r["flagged_steps"] == 0
            counts["right_flagged"] += r["correct"] and r["flagged_steps"] > 0
            counts["split"] += r["split"]
            counts["parse_failures"] += r["parse_failures"] > 0
    overview["filters"] = dict(counts)
    return overview


def collect(run_dir: Path, round_idx: int, variant: str | None = None) -> dict:
    """Everything the browser of round ``round_idx`` of ``variant`` shows, as plain JSON data.

    Raises:
        FileNotFoundError: the run or round does not exist, or has no rollouts yet.
        ValueError: ``variant`` is not one of the round's variants (lists them).
    """
    run_dir = Path(run_dir)
    round_dir, variants, variant = _resolve_variant(run_dir, round_idx, variant)
    rc = _round_config(round_dir, variant)
    run_id, rule = rc["run_id"], rc["vote"]["rule"]
    prompts, start = _prompts_and_start(rc, run_dir)
    queries = browser_queries(run_id, round_idx, variant, rule)
    data, policy_rows, missing = _query_round(run_dir, prompts, queries, run_id, round_idx)
    same = _variants_on_these_rollouts(round_dir, variants)
    data["other_variants"] = [t for t in data["other_variants"] if t["variant"] in same]
    shown = {variant, *(t["variant"] for t in data["other_variants"])}
    traces = {v: _ratio_trace(round_dir, v) for v in shown}
    recorded = _recorded_credit(round_dir, [r for r in data.pop("token_credit") if r["variant"] in shown])
    _add_credit(data["token_rewards"], traces[variant], recorded.get(variant, {}))
    for t in data["other_variants"]:
        _add_credit([t], traces[t["variant"]], recorded.get(t["variant"], {}))

    steps: dict[str, list[dict]] = {}
    for s in data["steps"]:
        steps.setdefault(s["rollout_id"], []).append(s)
    out_prompts = _group_prompts(data, steps, policy_rows, round_idx, start)
    overview = _overview(data, steps, out_prompts, rc)
    return {"meta": {"run_id": run_id, "round": round_idx, "variant": variant, "variants": variants, "rule": rule,
                     "critique_enabled": rc["critique"]["enabled"], "critique_mode": rc["critique"]["mode"],
                     "missing_tables": missing, "run_dir": str(run_dir)},
            "queries": queries, "overview": overview, "prompts": list(out_prompts.values())}


def render(data: dict) -> str:
    """The browser page for :func:`collect`'s ``data`` (Jinja2, autoescaped; data as JSON)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("pipeline", "templates"),
                             autoescape=jinja2.select_autoescape(["html", "j2"]), undefined=jinja2.StrictUndefined)
    return env.get_template(TEMPLATE).render(data=data, meta=data["meta"], queries=data["queries"])


def browser_dir(run_dir: Path, round_idx: int, variant: str) -> Path:
    """Where the browser of a round and variant is written: ``<run>/browse/round_<k>-<variant>/``."""
    return Path(run_dir) / "browse" / f"round_{round_idx:03d}-{variant}"


BROWSER_MARKER = ".capo-browser"


def build_browser(run_dir: Path, round_idx: int, variant: str | None = None, out: Path | None = None) -> Path:
    """Write the browser of round ``round_idx`` (and ``variant``; default: the round's first) of the
    run at ``run_dir``; returns its ``index.html``. Written atomically (a temporary file, then a
    rename), so an open page is never half-written. The folder gets a ``.capo-browser`` marker; a
    given ``out`` folder whose ``index.html`` has no marker beside it (not a browser's) is refused.

    Raises:
        FileNotFoundError / ValueError: see :func:`collect`.
        FileExistsError: ``out`` holds an ``index.html`` the browser did not write.
    """
    if out is not None and (Path(out) / "index.html").exists() and not (Path(out) / BROWSER_MARKER).exists():
        raise FileExistsError(f"{Path(out) / 'index.html'} exists and was not written by `capo browse` (no "
                              f"{BROWSER_MARKER} marker beside it): give an empty or new folder as --out")
    data = collect(Path(run_dir), round_idx, variant)
    folder = Path(out) if out else browser_dir(run_dir, round_idx, data["meta"]["variant"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / BROWSER_MARKER).write_text(f"{Path(run_dir).name} round {round_idx}\n")
    page = folder / "index.html"
    tmp = folder / ".index.html.tmp"
    tmp.write_text(render(data), encoding="utf-8")
    tmp.replace(page)
    log.info("browse: wrote %s (%d prompts, %d responses)", page, data["overview"]["prompts"],
             data["overview"]["responses"])
    return page


def serve(folder: Path, port: int = 8765) -> http.server.ThreadingHTTPServer:
    """An HTTP server for ``folder`` bound to 127.0.0.1 only (call ``serve_forever``)."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    return http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)


CHROMIUM_NAMES = ("chromium", "chromium-browser")


def chromium_executable() -> str | None:
    """The path of a Chromium binary on ``PATH`` (Debian's ``chromium`` or Ubuntu's
    ``chromium-browser``; ``scripts/install.sh`` installs it with apt), or ``None`` when there is none."""
    for name in CHROMIUM_NAMES:
        if path := shutil.which(name):
            return path
    return None


@contextmanager
def headless_chromium() -> Iterator:
    """A headless Chromium (a ``playwright.sync_api.Browser``) to open browser pages with, closed on exit.

    Used by the tests that click through a page as a person does and by
    ``scripts/browser_screenshot.py``. Launched with ``--no-sandbox`` (root in a container has no
    user namespace for Chromium's sandbox); the pages it opens are local files.

    Raises:
        RuntimeError: no Chromium on ``PATH`` (install Debian's ``chromium``: ``apt-get install chromium``).
        ImportError: ``playwright`` is not installed (``pip install -e .[test]``).
    """
    exe = chromium_executable()
    if exe is None:
        raise RuntimeError(f"no Chromium on PATH (looked for {' or '.join(CHROMIUM_NAMES)}): apt-get install chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()
