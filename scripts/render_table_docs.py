"""Render docs/tables.md from the table schema registry (``pipeline.schemas.SCHEMAS``).

    .venv/bin/python scripts/render_table_docs.py            # write docs/tables.md
    .venv/bin/python scripts/render_table_docs.py --check    # exit 1 when docs/tables.md is stale

Every table, every column and its Arrow type come from the registry. A column's description is
the comment on its ``pa.field(...)`` line in the module that defines the schema (read from the
source with ``tokenize``; nothing is imported twice). A few columns whose definition carries no
comment get a note from :data:`COLUMN_NOTES`. The catalog's derived views (``variant_summary``,
``eval_summary``, ``manifests``) are described from the SQL that defines them: their columns and
types are what DuckDB reports for those views over empty tables of the registry's schemas. What
each table is and where it lives is written here, in :data:`TABLES` and :data:`INTRO`;
``tests/unit/test_table_docs.py`` fails when a table of the registry has no entry, or when
docs/tables.md differs from what this script renders.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "docs" / "tables.md"

INTRO = r"""
Every stage of a round reads and writes Parquet tables, and each table has one explicit Arrow
schema in `pipeline/schemas.py`. Writers cast to that schema, and readers check it, so a
missing column or a wrong type fails with both names. Per-token arrays (token ids, log-probs,
rewards, advantages) are list columns with one row per response. Ids are strings, counts
`int32`, rewards `float32`.

## Where the tables live

One folder per run, one per round, one per variant under `variants/`. The *variant* is the name
of a training method on the same round: `capo-readout` in `configs/default.yaml`, or a preset's name. Tables
that depend on how the critiques are used are kept per variant. The rollouts, outcomes, steps and
critiques are shared by every variant of the round.

```
runs/<run_id>/
  round_000/eval.parquet                       the starting policy's eval (round 0)
  round_001/
    rollouts.parquet  outcomes.parquet  steps.parquet
    critiques.parquet                          (genorm_critiques.parquet for the GenORM baseline)
    variants/<variant>/
      step_verdicts.parquet  token_rewards.parquet  train_metrics.parquet  token_credit.parquet
      eval.parquet  checkpoint/  train_state/  round_summary.json
runs/critic_eval/<name>/
  benchmark.parquet  critiques/<setup>.parquet  scores.parquet  predictions.parquet
runs/catalog.duckdb
data/prompts/<source>_<split>.parquet          training prompts (capo setup)
data/eval/<benchmark>.parquet                  held-out benchmarks, same schema as prompts
```

Each `X.parquet` has an `X.parquet.manifest.json` beside it. The manifest records what produced
the table: the stage and its key, the resolved config, the input fingerprints, the row count, the
seconds and the code version. A run's rows carry the `run_id` of the config that wrote them.

## The catalog and `capo sql`

`runs/catalog.duckdb` holds one view per table over every run and round, plus a few derived views.
Each round rebuilds it at the end, and `capo catalog` rebuilds it by hand. The file is built under
a temporary name and then renamed, and nothing keeps it open. You can therefore query it while a
round runs:

```bash
.venv/bin/capo sql "SELECT run_id, round, count(*) FROM rollouts GROUP BY ALL"
.venv/bin/capo sql --runs-dir /other/runs --max-rows 200 "SELECT * FROM variant_summary"
```

`capo sql` opens the catalog read-only and runs only statements that read: SELECT (DESCRIBE,
SHOW and SUMMARIZE are SELECTs too) and EXPLAIN [ANALYZE] of a SELECT; `COPY`, `PRAGMA`, `SET`,
`CREATE` and every other statement type are refused, naming the type (for `PRAGMA
table_info('v')` use `SELECT * FROM pragma_table_info('v')`). It can read files only in the
folders the views read (the runs folder and the prompt tables' folder). Reading any other file,
extensions and settings are refused. The DuckDB shell opens the file too
(`duckdb -readonly runs/catalog.duckdb`): the file is written with DuckDB's storage version
`v1.2.0`, which the PyPI `duckdb-cli` 1.5.x reads.

The views are unions over files (`read_parquet(..., union_by_name = true)`) and read file
patterns, so a table written after the last rebuild shows up in its view. A table whose Parquet
footer does not read is left out of its view and listed in the view `skipped_tables` (`view_name`,
`path`, `reason`). That view then reads an explicit list of files until the next rebuild. A
manifest that is not a JSON object with columns of the right types (torn, hand-edited) is left
out of `manifests` and listed in `skipped_tables` the same way. Rows identify their run by the `run_id` column, so a run folder copied under
another name shows its rows twice, with the same `run_id`. The critic-eval tables are not in the
catalog. Read them with `read_parquet`, which `capo sql` allows inside the runs folder:

```bash
.venv/bin/capo sql "SELECT setup, subset, rule, n, f1 FROM read_parquet('runs/critic_eval/default/scores.parquet') WHERE subset = 'plain'"
```

## Example queries

```sql
-- 1. Critiques by source and parse status: 'llm' rows are the critic's sampled critiques (none
--    under the main job's capo-readout), 'arithmetic' and 'logprob' rows one per response each
SELECT run_id, round, source, parse_status, count(*) AS critiques
FROM critiques
GROUP BY ALL ORDER BY run_id, round, source, critiques DESC;

-- 2. Share of steps flagged per variant and rule, and by each source: the sampled critiques'
--    vote (llm), the arithmetic check, the readout's P(wrong) above 0.8 (the default
--    vote.logprob_threshold); a source the variant does not vote on still shows what it says
SELECT run_id, round, variant, rule, sources, round(avg((weight > 0)::INT), 3) AS share_steps_flagged,
       round(avg((llm_weight > 0)::INT), 3) AS llm, round(avg(arithmetic_flag::INT), 3) AS arithmetic,
       round(avg((logprob_score > 0.8)::INT), 3) AS readout
FROM step_verdicts GROUP BY ALL ORDER BY ALL;

-- 3. Does a penalty land on wrong responses more than on right ones? Per outcome, the share of
--    responses with a penalized step (under the variant's rule and sources), and with a step the
--    arithmetic check or the readout (above 0.8) flags
WITH per_response AS (
    SELECT v.run_id, v.round, v.variant, v.rollout_id,
           bool_or(v.weight > 0) AS penalized,
           bool_or(coalesce(v.arithmetic_flag, false)) AS arithmetic_flags,
           bool_or(coalesce(v.logprob_score > 0.8, false)) AS readout_flags
    FROM step_verdicts v JOIN token_rewards t USING (run_id, round, variant, rollout_id)
    WHERE v.rule = t.rule
    GROUP BY ALL)
SELECT p.run_id, p.round, p.variant, o.outcome_correct, count(*) AS responses,
       round(avg(penalized::INT), 3) AS share_penalized,
       round(avg(arithmetic_flags::INT), 3) AS share_arithmetic_flagged,
       round(avg(readout_flags::INT), 3) AS share_readout_flagged
FROM per_response p JOIN outcomes o USING (run_id, round, rollout_id)
GROUP BY ALL ORDER BY ALL;

-- 4. Token rewards by outcome: how many tokens got each reward
SELECT run_id, round, variant, outcome_correct, r AS token_reward, count(*) AS tokens
FROM (SELECT run_id, round, variant, outcome_correct, unnest(rewards) AS r FROM token_rewards)
GROUP BY ALL ORDER BY ALL;

-- 5. One response's steps beside every verdict on them (each source's wrong steps; the readout's
--    P(wrong) per step in step_scores)
SELECT s.step_idx, s.step_text, c.source, c.critique_idx, c.parse_status, c.wrong_steps, c.step_scores
FROM steps s JOIN critiques c USING (run_id, round, rollout_id)
WHERE s.rollout_id = (SELECT any_value(rollout_id) FROM critiques WHERE parse_status = 'complete')
ORDER BY c.source, c.critique_idx, s.step_idx;

-- 6. Held-out accuracy per round, variant and benchmark (round 0: the starting policy, variant NULL)
SELECT run_id, round, variant, benchmark, n_problems, round(100 * accuracy, 1) AS accuracy_pct,
       pass_k, pass_at_k
FROM eval_summary ORDER BY run_id, round, variant NULLS FIRST, benchmark;

-- 7. What wrote each variant's token rewards: the advantage estimator and the reward weights C
--    and P, read from the key the reward stage committed
SELECT path, key->>'$.variant' AS variant, key->>'$.reward.estimator' AS estimator,
       key->>'$.reward.correct_weight' AS C, key->>'$.reward.process_weight' AS P
FROM manifests WHERE stage = 'reward' ORDER BY path;
```

The critique browser shows the queries behind each of its views, and they run unchanged in
`capo sql` ([The critique browser](browser.md)).
"""

TABLES: dict[str, dict[str, str]] = {
    "prompts": {
        "what": "Math problems with their gold answers: the training prompts, and the held-out benchmarks in the "
                "same schema.",
        "rows": "one per problem",
        "where": "`data/prompts/<source>_<split>.parquet` (`capo setup`, or the first round); benchmarks in "
                 "`data/eval/<benchmark>.parquet`, which the catalog view leaves out",
    },
    "rollouts": {
        "what": "The policy's sampled responses, G per prompt, with their token ids and the engine's log-prob of "
                "each sampled token.",
        "rows": "one per response",
        "where": "`runs/<run_id>/round_XXX/rollouts.parquet` (stage `rollout`)",
    },
    "outcomes": {
        "what": "The rule verifier's grade of each response: the outcome reward r_v.",
        "rows": "one per response",
        "where": "`runs/<run_id>/round_XXX/outcomes.parquet` (stage `verify`)",
    },
    "steps": {
        "what": "Each response split into steps, with the step's text (as the critic sees it) and its character "
                "and token spans. The steps of a response cover all its tokens.",
        "rows": "one per step",
        "where": "`runs/<run_id>/round_XXX/steps.parquet` (stage `segment`)",
    },
    "mc_values": {
        "what": "VinePPO's Monte Carlo state values (`reward.estimator: vineppo`): for each response's first "
                "steps, K continuations sampled by the round's policy from the end of the step, their texts and "
                "outcomes; `value` is the share that reach the right answer.",
        "rows": "one per response x valued state (k >= 1; the prompt's value comes from the group)",
        "where": "`runs/<run_id>/round_XXX/mc_values.parquet` (stage `mc`)",
    },
    "token_divergence": {
        "what": "DenseR's hidden-state divergence (`reward.estimator: densr`): for each response token, the cosine "
                "distance of the round's policy's hidden state from the nearest response of the other outcome in "
                "its group, at the aligned position. The reward stage turns it into per-token weights.",
        "rows": "one per response (the tokens are list elements; null where the group has no other outcome)",
        "where": "`runs/<run_id>/round_XXX/token_divergence.parquet` (stage `densr`)",
    },
    "critiques": {
        "what": "Every verdict on a response's steps, by source: the critic's N sampled critiques (`source = "
                "'llm'`), one exact arithmetic check per response (`'arithmetic'`) and, with "
                "`critique.logprob_readout`, one log-prob readout per response (`'logprob'`, its P(wrong) per step "
                "in `step_scores`). The GenORM baseline's outcome critiques (`mode = 'outcome'`) use the same "
                "schema.",
        "rows": "one per critique",
        "where": "`runs/<run_id>/round_XXX/critiques.parquet` (stage `critique`); GenORM: "
                 "`round_XXX/genorm_critiques.parquet`, both in the view `critiques`",
    },
    "step_verdicts": {
        "what": "The critiques voted into one weight per step under every rule. `weight` is the step weight w_s "
                "that the reward subtracts: the largest weight among the sources in `vote.sources`. The "
                "per-source verdicts sit beside it.",
        "rows": "one per response x step x voting rule",
        "where": "`runs/<run_id>/round_XXX/variants/<variant>/step_verdicts.parquet` (stage `vote`)",
    },
    "token_rewards": {
        "what": "The per-token rewards `R = C*r_v - P*w` and the group-normalized advantages the trainer uses, "
                "under the variant's rule.",
        "rows": "one per response (the tokens are list elements)",
        "where": "`runs/<run_id>/round_XXX/variants/<variant>/token_rewards.parquet` (stage `reward`)",
    },
    "train_metrics": {
        "what": "The PPO update's metrics in long format. Every optimizer step has `loss`, `pg_loss`, `clip_frac`, "
                "`approx_kl`, `kl_ref`, `ratio_mean`, `grad_norm`, `epoch`, `tokens`, `seconds`, `tokens_per_s`, "
                "and the round's `engine_logprob_diff_mean`, `engine_logprob_diff_max` and `entropy`. The last "
                "step also holds `master_moved_frac`, `export_moved_frac`, `export_update_share` and "
                "`export_update_share_from_start`: how much of the fp32 update the exported checkpoint carries.",
        "rows": "one per optimizer step x metric",
        "where": "`runs/<run_id>/round_XXX/variants/<variant>/train_metrics.parquet` (stage `train`)",
    },
    "token_credit": {
        "what": "Where the PPO update put the credit: each response token's coefficient on its own log-prob "
                "gradient in the clipped surrogate, `-d(per-token loss)/d(log pi_t)` (`train.loss.token_credit`), "
                "averaged over the update's passes over the response. At ratio 1 it is the advantage (GRPO-λ: the "
                "advantage traced back); a token whose ratio is clipped gets 0 (under GRPO-λ only what later tokens carry "
                "back); FIPO's future-KL weights multiply it. The policy "
                "gradient is minus the sum of credit times the log-prob gradients, divided by the loss's normalizer. "
                "Written with the checkpoint; a round trained before the table existed has none.",
        "rows": "one per trained response (the tokens are list elements)",
        "where": "`runs/<run_id>/round_XXX/variants/<variant>/token_credit.parquet` (stage `train`)",
    },
    "eval": {
        "what": "Held-out answers of a policy: greedy (`decoding = 'greedy'`, one sample) and, with "
                "`eval.pass_k` > 1, k samples at temperature 1 (`'sample'`).",
        "rows": "one per benchmark problem x sample",
        "where": "`runs/<run_id>/round_000/eval.parquet` (the starting policy, shared by every variant) and "
                 "`runs/<run_id>/round_XXX/variants/<variant>/eval.parquet` (stage `eval`)",
    },
    "critic_eval_benchmark": {
        "what": "The items of a critic evaluation in ProcessBench form: a problem, its steps and the index of the "
                "first wrong step (-1 when all are right), with the kind of error planted.",
        "rows": "one per item",
        "where": "`runs/critic_eval/<name>/benchmark.parquet` (`capo critic-eval`, stage `benchmark`)",
    },
    "critic_eval_critiques": {
        "what": "A critic setup's sampled critiques of every item, parsed as in training.",
        "rows": "one per critique",
        "where": "`runs/critic_eval/<name>/critiques/<setup>.parquet` (stage `critique`)",
    },
    "critic_eval_scores": {
        "what": "ProcessBench-style scores of every setup, subset of items, voting rule and N.",
        "rows": "one per setup x partial-critique policy x subset x rule x N",
        "where": "`runs/critic_eval/<name>/scores.parquet` (stage `score`)",
    },
    "critic_eval_predictions": {
        "what": "What the first N critiques voted under each rule say about each item: the step weights and "
                "the earliest flagged step.",
        "rows": "one per setup x partial-critique policy x item x rule x N",
        "where": "`runs/critic_eval/<name>/predictions.parquet` (stage `score`)",
    },
}
"""What each table of the registry is (written here; every registry table must have an entry)."""

COLUMN_NOTES: dict[tuple[str | None, str], str] = {
    (None, "run_id"): "the run (`run_id` of the config that wrote the row)",
    (None, "round"): "the round: 1 samples from the starting policy; round k from round k-1's checkpoint",
    (None, "variant"): "the training variant (`variant`, or the preset's name)",
    (None, "rollout_id"): "one response",
    (None, "prompt_id"): "the problem (`prompts.prompt_id`); the responses of one prompt form its group",
    (None, "eval_name"): "the critic evaluation's `name` (its folder under `runs/critic_eval/`)",
    (None, "setup"): "a critic with the gold answer on or off, `<critic>+gold` / `<critic>+nogold`; with several "
                     "partial-critique policies, `<setup>/<policy>`",
    (None, "partial"): "how incomplete and inconsistent critiques voted (`list`, `lines`, `drop`)",
    ("eval", "round"): "0 = the starting policy; k = the policy round k's update wrote",
    ("steps", "step_idx"): "step number from 0, as the critic saw it (`Step 0`, `Step 1`, ...)",
    ("steps", "step_text"): "the step's text as shown to the critic",
    ("critiques", "critique_idx"): "0..N-1 for the critic's critiques; 0 for the arithmetic and log-prob rows",
    ("critiques", "parse_status"): "complete | incomplete | inconsistent | empty | no_verdict | not_a_list | "
                                   "out_of_range | duplicate (GenORM: ok | not_yes_no | ...); "
                                   "skipped_empty_response (nothing to judge); malformed_reply (a served critic's "
                                   "reply stayed malformed after its retries: raw_text keeps why and an excerpt of "
                                   "the body; no vote); logprob rows: complete, or readout_nonfinite (a NaN/inf "
                                   "readout: null step_scores, no score)",
    ("critic_eval_critiques", "parse_status"): "as `critiques.parse_status`",
    ("step_verdicts", "rule"): "intersection | union | majority | average",
    ("step_verdicts", "n_valid"): "valid critiques of the response (those that vote)",
    ("step_verdicts", "n_flagged"): "valid critiques that list this step",
    ("token_rewards", "n_valid_critiques"): "valid critiques of the response",
    ("token_rewards", "rule"): "the variant's voting rule (null without a process penalty)",
    ("token_rewards", "reward_config_hash"): "hash of the reward stage's key",
    ("train_metrics", "name"): "the metric (see above)",
    ("critic_eval_benchmark", "id"): "the item",
    ("critic_eval_benchmark", "problem"): "the question shown to the critic",
    ("critic_eval_critiques", "item_id"): "`critic_eval_benchmark.id`",
    ("critic_eval_predictions", "item_id"): "`critic_eval_benchmark.id`",
    ("critic_eval_scores", "subset"): "items scored: all, plain, adversarial, or one kind",
    ("critic_eval_scores", "rule"): "the voting rule",
    ("critic_eval_scores", "n"): "N, the first N critiques of each item voted",
    ("critic_eval_scores", "n_items"): "items in the subset",
    ("critic_eval_scores", "n_erroneous"): "items with a wrong step (label >= 0)",
    ("critic_eval_scores", "n_correct"): "items with every step right (label = -1)",
    ("critic_eval_scores", "acc_erroneous"): "share of erroneous items whose earliest flagged step is the label",
    ("critic_eval_scores", "acc_correct"): "share of all-right items with nothing flagged",
    ("critic_eval_scores", "f1"): "ProcessBench F1: harmonic mean of acc_erroneous and acc_correct (null when the "
                                  "subset lacks one of the two kinds of items)",
    ("critic_eval_scores", "label_flagged"): "share of erroneous items whose labelled step is flagged, earliest or not",
    ("critic_eval_scores", "step_precision"): "flagged steps that are wrong, over items with per-step labels",
    ("critic_eval_scores", "step_recall"): "wrong steps that are flagged, over items with per-step labels",
    ("prompts", "split"): "train or test (a benchmark: test)",
    ("prompts", "question"): "the problem as the policy sees it (before the instruction is appended)",
    ("rollouts", "sample_idx"): "the response's index within its group, 0..G-1",
    ("rollouts", "response_text"): "the response, decoded",
    ("rollouts", "num_tokens"): "response tokens (`len(response_token_ids)`)",
    (None, "gold_answer"): "the gold final answer",
    ("steps", "n_steps"): "steps of the response",
    ("steps", "char_end"): "end of the step's characters (exclusive)",
    ("steps", "token_end"): "end of the step's tokens (exclusive)",
    ("steps", "empty_response"): "the response has no non-blank text: one step spans it, and no critic judges it "
                                 "(`critiques.parse_status = 'skipped_empty_response'`)",
    ("critiques", "critic_model"): "the critic; `arithmetic` for the arithmetic check",
    ("critiques", "template_version"): "the critic prompt template (the checker's version for arithmetic rows)",
    ("critiques", "include_gold_answer"): "the gold answer was in the critic prompt",
    ("critiques", "n_steps"): "steps of the judged response",
    ("critiques", "raw_text"): "the critique as generated (checks and readout: their verdict in the same line format)",
    ("critiques", "finish_reason"): "stop | length",
    ("step_verdicts", "step_idx"): "`steps.step_idx`",
    ("step_verdicts", "majority_threshold"): "`vote.majority_threshold`",
    ("train_metrics", "value"): "the metric's value",
    ("eval", "benchmark"): "gsm8k, math500, minerva, aime24, svamp, asdiv or mawps",
    ("eval", "sample_idx"): "0 for the greedy answer; 0..k-1 for sampled ones",
    ("eval", "response_text"): "the answer, decoded",
    ("eval", "correct"): "graded like the outcome reward (`verify` rules)",
    ("critic_eval_benchmark", "gold_answer"): "the gold final answer (shown to a critic with the gold answer on)",
    ("critic_eval_critiques", "critique_idx"): "0..n_max-1, in sampling order (N takes the first N)",
    ("critic_eval_critiques", "critic_model"): "the critic's model",
    ("critic_eval_critiques", "template_version"): "the critic prompt template",
    ("critic_eval_critiques", "include_gold_answer"): "the gold answer was in the critic prompt",
    ("critic_eval_critiques", "n_steps"): "steps of the item",
    ("critic_eval_critiques", "raw_text"): "the critique as generated",
    ("critic_eval_critiques", "critic_tokens"): "generated tokens",
    ("critic_eval_critiques", "finish_reason"): "stop | length",
    ("critic_eval_predictions", "kind"): "`critic_eval_benchmark.kind`",
    ("critic_eval_predictions", "label"): "`critic_eval_benchmark.label`",
    ("critic_eval_predictions", "n_valid"): "valid critiques among the first N",
    ("critic_eval_predictions", "rule"): "the voting rule",
    ("critic_eval_predictions", "n"): "N, the first N critiques voted",
}
"""Notes for columns whose definition has no comment: ``(table, column)``, or ``(None, column)`` for any table."""

ROW_CLASSES = {"critic_eval_scores": ("critic_eval/scores.py", "Score")}
"""Tables whose columns are the fields of a dataclass: its field comments describe them too."""

DERIVED_VIEWS = {
    "variant_summary": "Per run, round and variant: what the variant did to the tokens and to the update. It "
                       "reports accuracy, the share of tokens penalized, the mean token reward of right and of "
                       "wrong responses, advantage statistics, and the means over optimizer steps of loss, clip "
                       "fraction, approx. KL and KL to the start.",
    "eval_summary": "Per run, round, variant and benchmark: greedy accuracy, mean response length and share "
                    "truncated, and with sampled answers pass@k and the sampled accuracy.",
    "manifests": "One row per committed table or folder (superseded outputs left out): its stage, rows, key, "
                 "code version, creation time and seconds.",
}
"""The catalog's views that are not a table of the registry (from ``pipeline.storage``)."""


# ------------------------------------------------------------------------------------ source comments
def _field_comments(module_file: Path) -> dict[str, dict[str, str]]:
    """``{module-level name: {column: comment}}``: the comment on each ``pa.field("col", ...)`` line
    inside a top-level assignment (only lines with exactly one field)."""
    src = module_file.read_text()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = src.splitlines()
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(src).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if not names:
                continue
            found: dict[str, str] = {}
            for ln in range(node.lineno, node.end_lineno + 1):
                cols = re.findall(r"pa\.field\(\s*[\"']([^\"']+)[\"']", lines[ln - 1])
                if len(cols) == 1 and ln in comments:
                    found[cols[0]] = comments[ln]
            for name in names:
                out[name] = found
    return out


def _referenced_names(module_file: Path, var: str) -> list[str]:
    """Module-level names used inside the assignment of ``var`` (e.g. ``_RUN`` in a schema)."""
    for node in ast.parse(module_file.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == var for t in node.targets):
            return [n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)]
    return []


def _class_field_comments(module_file: Path, cls: str) -> dict[str, str]:
    """``{field: comment}`` for the annotated fields of class ``cls`` that carry a trailing comment."""
    src = module_file.read_text()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(src).readline) if tok.type == tokenize.COMMENT}
    for node in ast.parse(src).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {st.target.id: comments[st.lineno] for st in node.body
                    if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.lineno in comments}
    raise KeyError(f"no class {cls} in {module_file}")


def _registry_sources() -> dict[str, tuple[Path, str]]:
    """``{table: (module file, variable)}`` for every entry of ``SCHEMAS``, read from the source of
    ``pipeline/schemas.py`` (a schema imported from another module is looked up there)."""
    schemas_file = ROOT / "pipeline" / "schemas.py"
    tree = ast.parse(schemas_file.read_text())
    imported = {a.asname or a.name: node.module for node in tree.body if isinstance(node, ast.ImportFrom)
                for a in node.names}
    out: dict[str, tuple[Path, str]] = {}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "SCHEMAS" and isinstance(node.value, ast.Dict):
            for k, v in zip(node.value.keys, node.value.values):
                var = v.id
                module = imported.get(var)
                file = Path(importlib.import_module(module).__file__) if module else schemas_file
                out[k.value] = (file, var)
    return out


def column_descriptions() -> dict[str, dict[str, str]]:
    """``{table: {column: description}}`` from the source comments, then :data:`COLUMN_NOTES`."""
    from pipeline.schemas import SCHEMAS

    sources = _registry_sources()
    cache: dict[Path, dict[str, dict[str, str]]] = {}
    out: dict[str, dict[str, str]] = {}
    for table, schema in SCHEMAS.items():
        file, var = sources[table]
        per_var = cache.setdefault(file, _field_comments(file))
        found = dict(per_var.get(var, {}))
        for ref in _referenced_names(file, var):  # helper lists such as _RUN
            for col, text in per_var.get(ref, {}).items():
                found.setdefault(col, text)
        if table in ROW_CLASSES:
            rel, cls = ROW_CLASSES[table]
            for col, text in _class_field_comments(ROOT / rel, cls).items():
                found.setdefault(col, text)
        desc = {}
        for f in schema:
            text = found.get(f.name) or COLUMN_NOTES.get((table, f.name)) or COLUMN_NOTES.get((None, f.name), "")
            desc[f.name] = text
        out[table] = desc
    return out


# --------------------------------------------------------------------------------------- rendering
def _type(t) -> str:
    s = str(t)
    return re.sub(r"list<item: ([^>]+)>", r"list<\1>", s)


def _cell(text: str) -> str:
    """A description in a table cell: one line; outside code spans ``& < > *`` escaped (source
    comments hold ``<<expr=result>>`` and ``C*r_v - P*w``); ``|`` escaped everywhere (the table)."""
    parts = " ".join((text or "").split()).split("`")
    for i in range(0, len(parts), 2):  # even parts are outside code spans
        for a, b in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ("*", "\\*")):
            parts[i] = parts[i].replace(a, b)
    return "`".join(parts).replace("|", "\\|")


def _code(text: str) -> str:
    """A type or name in a table cell: code, with ``|`` escaped for the table."""
    return "`" + text.replace("|", "\\|") + "`"


def derived_view_columns() -> dict[str, list[tuple[str, str]]]:
    """``{view: [(column, DuckDB type)]}`` of the catalog's derived views, from their defining SQL
    run over empty tables of the registry's schemas (in memory)."""
    import duckdb

    from pipeline import storage
    from pipeline.schemas import SCHEMAS

    con = duckdb.connect()
    try:
        con.execute("ATTACH ':memory:' AS cat")
        for name in ("token_rewards", "train_metrics", "eval"):
            empty = SCHEMAS[name].empty_table()  # noqa: F841 (read by DuckDB by name)
            con.execute(f"CREATE TABLE cat.{name} AS SELECT * FROM empty")
        con.execute(storage.VARIANT_SUMMARY_SQL.format(metrics="cat.train_metrics"))
        con.execute(storage.EVAL_SUMMARY_SQL)
        out = {v: [(r[0], r[1]) for r in con.execute(f"DESCRIBE cat.{v}").fetchall()]
               for v in ("variant_summary", "eval_summary")}
    finally:
        con.close()
    out["manifests"] = list(storage._MANIFEST_COLUMNS.items())
    return out


def render() -> str:
    from pipeline import storage
    from pipeline.schemas import SCHEMAS

    missing = [t for t in SCHEMAS if t not in TABLES]
    if missing:
        raise KeyError(f"tables without an entry in TABLES of {Path(__file__).name}: {missing}")
    in_catalog = set(storage.CATALOG_GLOBS) | {"prompts"}
    descs = column_descriptions()
    lines = ["# Tables and SQL", "",
             "Generated from the schema registry `pipeline/schemas.py` by `scripts/render_table_docs.py`; "
             "do not edit by hand.", INTRO.rstrip(), "", "## The tables", "",
             "| table | rows | catalog view |", "| --- | --- | --- |"]
    for table in SCHEMAS:
        view = f"`{table}`" if table in in_catalog else "not in the catalog"
        lines.append(f"| [`{table}`](#{table}) | {TABLES[table]['rows']} | {view} |")
    lines.append("")
    for table, schema in SCHEMAS.items():
        t = TABLES[table]
        lines += [f"### {table}", "", t["what"], "",
                  f"**Rows:** {t['rows']}. **Where:** {t['where']}.", "",
                  (f"**Catalog view:** `{table}`." if table in in_catalog
                   else "**Catalog:** not in it; read the file with `read_parquet`."), "",
                  "| column | Arrow type | nullable | description |", "| --- | --- | --- | --- |"]
        for f in schema:
            lines.append(f"| `{f.name}` | {_code(_type(f.type))} | {'yes' if f.nullable else 'no'} | "
                         f"{_cell(descs[table][f.name])} |")
        lines.append("")
    lines += ["## Derived views", "",
              "Views of the catalog computed from the tables above (`pipeline/storage.py`). Their column types "
              "are DuckDB's.", ""]
    for view, cols in derived_view_columns().items():
        lines += [f"### {view}", "", DERIVED_VIEWS[view], "", "| column | type |", "| --- | --- |"]
        lines += [f"| `{c}` | {_code(ty)} |" for c, ty in cols]
        lines.append("")
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip("\n") + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/tables.md is stale")
    a = ap.parse_args()
    text = render()
    if a.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run .venv/bin/python scripts/render_table_docs.py", file=sys.stderr)
            sys.exit(1)
        return
    OUT.write_text(text)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
