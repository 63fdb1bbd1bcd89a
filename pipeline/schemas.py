"""The tables stages hand to each other: one explicit ``pyarrow.schema`` each (single source).

Every stage writes exactly these columns and every reader checks them with :func:`check_schema`.
Per-token arrays are list columns (one row per response) so a round of 1e7 tokens stays a few
hundred MB and DuckDB can still ``UNNEST`` them. Ids are strings, counts int32, rewards float32.

Layout of one run (``<runs_dir>/<run_id>/``)::

    round_001/rollouts.parquet        one row per response
    round_001/outcomes.parquet        one row per response (math-verify result)
    round_001/steps.parquet           one row per step
    round_001/critiques.parquet       one row per step critique (GenPRM, N per response, source 'llm';
                                      plus one arithmetic check per response, source 'arithmetic',
                                      and with the log-prob readout one row per response, 'logprob')
    round_001/genorm_critiques.parquet  one row per outcome critique (GenORM baseline)
    round_001/variants/<variant>/step_verdicts.parquet   one row per step x voting rule
    round_001/variants/<variant>/token_rewards.parquet   one row per response
    round_001/variants/<variant>/train_metrics.parquet   one row per optimizer step x metric
    round_001/variants/<variant>/token_credit.parquet    one row per trained response: where the update put the credit
    round_001/variants/<variant>/checkpoint/             next policy (save_pretrained)
    round_001/variants/<variant>/eval.parquet            one row per benchmark problem x sample (that policy)
    round_000/eval.parquet            the starting policy's eval (round 0, shared by every variant)

Each ``X.parquet`` has a ``X.manifest.json`` beside it (see :mod:`pipeline.storage`).
"""

from __future__ import annotations

import pyarrow as pa

from pipeline.assets.prompts import PROMPTS_SCHEMA

_RUN = [pa.field("run_id", pa.string(), nullable=False), pa.field("round", pa.int32(), nullable=False)]

ROLLOUTS_SCHEMA = pa.schema(
    _RUN
    + [
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("sample_idx", pa.int32(), nullable=False),
        pa.field("policy", pa.string()),  # checkpoint path or model id that sampled it
        pa.field("prompt_token_ids", pa.list_(pa.int32())),  # chat-templated prompt
        pa.field("response_text", pa.string()),
        pa.field("response_token_ids", pa.list_(pa.int32())),  # includes EOS when it stopped
        pa.field("rollout_logprobs", pa.list_(pa.float32())),  # sampler's log-prob per token, nats (vLLM: after temperature/top-p)
        pa.field("finish_reason", pa.string()),  # stop | length
        pa.field("num_tokens", pa.int32()),
    ]
)

OUTCOMES_SCHEMA = pa.schema(
    _RUN
    + [
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("gold_answer", pa.string()),
        pa.field("extracted_answer", pa.string()),  # what math-verify parsed from the response
        pa.field("outcome_correct", pa.bool_(), nullable=False),  # r_v
        pa.field("verify_status", pa.string()),  # ok | no_answer | no_gold | truncated | error:<type>
    ]
)

STEPS_SCHEMA = pa.schema(
    _RUN
    + [
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("step_idx", pa.int32(), nullable=False),
        pa.field("n_steps", pa.int32()),
        pa.field("char_start", pa.int32()),  # character offsets in response_text, end exclusive
        pa.field("char_end", pa.int32()),
        pa.field("token_start", pa.int32()),  # index into response_token_ids, end exclusive
        pa.field("token_end", pa.int32()),
        pa.field("step_text", pa.string()),
        pa.field("empty_response", pa.bool_()),
    ]
)

MC_VALUES_SCHEMA = pa.schema(
    _RUN
    + [
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("state_idx", pa.int32(), nullable=False),  # k: the response cut after its k-th step (k >= 1)
        pa.field("token_end", pa.int32()),  # the state's end in response_token_ids (exclusive)
        pa.field("value", pa.float32()),  # share of the continuations with the right answer
        pa.field("n_continuations", pa.int32()),
        pa.field("n_correct", pa.int32()),
        pa.field("continuations", pa.list_(pa.string())),  # the continuations' texts
        pa.field("correct", pa.list_(pa.bool_())),  # each continuation's outcome (the verify stage's rules)
        pa.field("finish_reasons", pa.list_(pa.string())),  # stop | length
    ]
)

TOKEN_DIVERGENCE_SCHEMA = pa.schema(
    _RUN
    + [
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string()),
        pa.field("outcome_correct", pa.bool_()),  # the rule verifier's grade (right / wrong decides the contrast)
        pa.field("layer", pa.int32()),  # densr.layer: index into the policy's hidden_states
        pa.field("n_opposite", pa.int32()),  # responses of the group with the other outcome (0: no contrast)
        pa.field("divergence", pa.list_(pa.float32())),  # (T,) 1 - max cos to the other outcome; null without one
    ]
)

CRITIQUES_SCHEMA = pa.schema(
    _RUN
    + [
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("critique_idx", pa.int32(), nullable=False),
        pa.field("source", pa.string(), nullable=False),  # llm (the critic's N critiques) | arithmetic (one, exact check) | logprob (one, readout)
        pa.field("mode", pa.string()),  # process (GenPRM, every step) | outcome (GenORM, final answer)
        pa.field("critic_model", pa.string()),
        pa.field("template_version", pa.string()),
        pa.field("include_gold_answer", pa.bool_()),
        pa.field("n_steps", pa.int32()),
        pa.field("raw_text", pa.string()),
        pa.field("wrong_steps", pa.list_(pa.int32())),  # process mode: the final list; null when it did not parse
        pa.field("steps_judged", pa.list_(pa.int32())),  # process mode: steps with a line of their own
        pa.field("steps_wrong_lines", pa.list_(pa.int32())),  # process mode: steps their own line calls wrong
        pa.field("step_scores", pa.list_(pa.float32())),  # logprob source: calibrated P(wrong) per step; else null
        pa.field("outcome_verdict", pa.bool_()),  # outcome mode: "final answer correct", null unless ok
        # the parser's status (pipeline.core.critique.PARSE_STATUSES / OUTCOME_PARSE_STATUSES), or
        # skipped_empty_response (nothing judged) | malformed_reply (the served critic's reply stayed
        # malformed after its retries; raw_text keeps why and the body's excerpt; votes nothing);
        # a logprob row: complete | readout_nonfinite (a NaN/inf readout: step_scores null, no score)
        pa.field("parse_status", pa.string(), nullable=False),
        pa.field("critic_tokens", pa.int32()),  # generated tokens
        pa.field("finish_reason", pa.string()),
    ]
)

STEP_VERDICTS_SCHEMA = pa.schema(
    _RUN
    + [
        pa.field("variant", pa.string(), nullable=False),
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("step_idx", pa.int32(), nullable=False),
        pa.field("rule", pa.string(), nullable=False),
        pa.field("n_valid", pa.int32()),
        pa.field("n_flagged", pa.int32()),
        pa.field("weight", pa.float32()),  # w_s in [0, 1]: the sources' verdicts combined (the larger)
        pa.field("majority_threshold", pa.float32()),
        pa.field("sources", pa.string()),  # the sources whose verdicts vote (vote.sources), "+"-joined: e.g. llm, arithmetic+logprob
        pa.field("llm_weight", pa.float32()),  # the LLM critiques voted under the rule (whether or not they vote)
        pa.field("arithmetic_flag", pa.bool_()),  # the arithmetic check flags the step (null: no arithmetic row)
        pa.field("logprob_score", pa.float32()),  # the log-prob readout's calibrated P(wrong) (null: no readout)
    ]
)

TOKEN_REWARDS_SCHEMA = pa.schema(
    _RUN
    + [
        pa.field("variant", pa.string(), nullable=False),
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("outcome_correct", pa.bool_()),  # rule verifier (math-verify), whatever trained
        pa.field("outcome_reward", pa.float32()),  # r_v that trained: rule verifier or GenORM majority
        pa.field("rule", pa.string()),
        pa.field("n_valid_critiques", pa.int32()),
        pa.field("n_penalized_tokens", pa.int32()),  # tokens whose step the vote marked wrong (w > 0)
        pa.field("rewards", pa.list_(pa.float32())),  # R[t] = C*r_v - P*w[step(t)]
        pa.field("advantages", pa.list_(pa.float32())),  # A[t]
        pa.field("reward_config_hash", pa.string()),
    ]
)

TOKEN_CREDIT_SCHEMA = pa.schema(
    _RUN
    + [
        pa.field("variant", pa.string(), nullable=False),
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("credit", pa.list_(pa.float32())),  # (T,) -d(per-token PG loss)/d(log pi_t), mean over passes
        pa.field("passes", pa.int32()),  # passes of the update over the response (ppo_epochs)
    ]
)

TRAIN_METRICS_SCHEMA = pa.schema(
    _RUN
    + [
        pa.field("variant", pa.string(), nullable=False),
        pa.field("step", pa.int32(), nullable=False),  # optimizer step within the round
        pa.field("name", pa.string(), nullable=False),
        pa.field("value", pa.float64()),
    ]
)

EVAL_SCHEMA = pa.schema(
    _RUN  # round 0 = the starting policy, k = the policy round k's update wrote
    + [
        pa.field("variant", pa.string()),  # null for round 0 (the starting policy every variant shares)
        pa.field("policy", pa.string()),  # checkpoint path or model id evaluated
        pa.field("benchmark", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("decoding", pa.string(), nullable=False),  # greedy (T=0, n=1) | sample (T=1, n=k, pass@k)
        pa.field("sample_idx", pa.int32(), nullable=False),
        pa.field("gold_answer", pa.string()),
        pa.field("response_text", pa.string()),
        pa.field("num_tokens", pa.int32()),  # generated tokens (EOS included); null when the engine gives none
        pa.field("finish_reason", pa.string()),  # stop | length
        pa.field("extracted_answer", pa.string()),  # what math-verify parsed from the response
        pa.field("correct", pa.bool_(), nullable=False),
        pa.field("verify_status", pa.string()),  # ok | no_answer | no_gold | truncated | error:<type>
    ]
)

# --------------------------------------------------------------------- critic-eval (critic_eval/)
CRITIC_EVAL_BENCHMARK_SCHEMA = pa.schema([
    pa.field("id", pa.string(), nullable=False),
    pa.field("problem", pa.string(), nullable=False),
    pa.field("steps", pa.list_(pa.string()), nullable=False),  # shown to the critic
    pa.field("label", pa.int32(), nullable=False),  # first wrong step, -1 when all are right
    pa.field("gold_answer", pa.string()),
    pa.field("step_labels", pa.list_(pa.int32())),  # 1 = the step is wrong; null when unknown
    pa.field("kind", pa.string(), nullable=False),  # original | carried | as_was | wrong_operation | wrong_quantity | missing_step | misread_relation | adv_* | external
    pa.field("source_id", pa.string()),  # prompt_id of the GSM8K problem
    pa.field("annotated_steps", pa.list_(pa.string())),  # steps with <<expr=result>>; audit only
    pa.field("corruption", pa.string()),  # e.g. "step 1: 18 -> 180 (x10)"
])

CRITIC_EVAL_CRITIQUES_SCHEMA = pa.schema([
    pa.field("eval_name", pa.string(), nullable=False),  # critic_eval.stages.CriticEvalConfig.name (for SQL across runs)
    pa.field("setup", pa.string(), nullable=False),
    pa.field("item_id", pa.string(), nullable=False),
    pa.field("critique_idx", pa.int32(), nullable=False),
    pa.field("critic_model", pa.string()),
    pa.field("template_version", pa.string()),
    pa.field("include_gold_answer", pa.bool_()),
    pa.field("n_steps", pa.int32()),
    pa.field("raw_text", pa.string()),
    pa.field("wrong_steps", pa.list_(pa.int32())),  # the final list; null when it did not parse
    pa.field("steps_judged", pa.list_(pa.int32())),  # steps with a line of their own
    pa.field("steps_wrong_lines", pa.list_(pa.int32())),  # steps their own line calls wrong
    pa.field("parse_status", pa.string(), nullable=False),
    pa.field("critic_tokens", pa.int32()),
    pa.field("finish_reason", pa.string()),
    pa.field("source", pa.string()),  # llm (a sampled critique), logprob (the readout) or arithmetic (the check)
    pa.field("step_scores", pa.list_(pa.float32())),  # logprob: calibrated P(wrong) per step; else null
])

CRITIC_EVAL_SCORES_SCHEMA = pa.schema(
    [pa.field("eval_name", pa.string(), nullable=False),
     pa.field("setup", pa.string(), nullable=False), pa.field("partial", pa.string()),
     pa.field("subset", pa.string(), nullable=False),
     pa.field("rule", pa.string(), nullable=False), pa.field("n", pa.int32(), nullable=False)]
    + [pa.field(k, pa.int32()) for k in ("n_items", "n_erroneous", "n_correct")]
    + [pa.field(k, pa.float64()) for k in (
        "acc_erroneous", "acc_correct", "f1", "auroc", "label_flagged", "step_precision", "step_recall", "flag_rate",
        "parse_failure_rate", "no_valid_rate", "critic_tokens_per_item", "seconds_per_item")]
)

CRITIC_EVAL_PREDICTIONS_SCHEMA = pa.schema([
    pa.field("eval_name", pa.string(), nullable=False),
    pa.field("setup", pa.string(), nullable=False),
    pa.field("partial", pa.string()),
    pa.field("item_id", pa.string(), nullable=False),
    pa.field("kind", pa.string()),
    pa.field("rule", pa.string(), nullable=False),
    pa.field("n", pa.int32(), nullable=False),
    pa.field("label", pa.int32()),
    pa.field("earliest_flagged", pa.int32()),  # -1 = nothing flagged
    pa.field("n_valid", pa.int32()),
    pa.field("weights", pa.list_(pa.float32())),  # (S,) vote weight per step
])


SCHEMAS: dict[str, pa.Schema] = {
    "prompts": PROMPTS_SCHEMA,
    "rollouts": ROLLOUTS_SCHEMA,
    "outcomes": OUTCOMES_SCHEMA,
    "steps": STEPS_SCHEMA,
    "critiques": CRITIQUES_SCHEMA,
    "mc_values": MC_VALUES_SCHEMA,
    "token_divergence": TOKEN_DIVERGENCE_SCHEMA,
    "step_verdicts": STEP_VERDICTS_SCHEMA,
    "token_rewards": TOKEN_REWARDS_SCHEMA,
    "token_credit": TOKEN_CREDIT_SCHEMA,
    "train_metrics": TRAIN_METRICS_SCHEMA,
    "eval": EVAL_SCHEMA,
    "critic_eval_benchmark": CRITIC_EVAL_BENCHMARK_SCHEMA,
    "critic_eval_critiques": CRITIC_EVAL_CRITIQUES_SCHEMA,
    "critic_eval_scores": CRITIC_EVAL_SCORES_SCHEMA,
    "critic_eval_predictions": CRITIC_EVAL_PREDICTIONS_SCHEMA,
}



ADDED_COLUMNS: dict[str, dict[str, object]] = {
    "critiques": {"source": "llm", "step_scores": None, "mode": "process", "steps_wrong_lines": None},
    "critic_eval_critiques": {"source": "llm", "step_scores": None},
}
"""Columns added to a table since earlier releases wrote it, and the value they take in an older table
(:func:`fill_added_columns`): a table whose stage key did not change (GenORM critiques) stays readable."""


def fill_added_columns(table: pa.Table, name: str) -> pa.Table:
    """``table`` with every column of :data:`ADDED_COLUMNS` it lacks, at that column's value."""
    for col, value in ADDED_COLUMNS.get(name, {}).items():
        if col not in table.column_names:
            typ = SCHEMAS[name].field(col).type
            table = table.append_column(col, pa.array([value] * table.num_rows, typ) if value is not None
                                        else pa.nulls(table.num_rows, typ))
    return table


def check_schema(table: pa.Table, name: str, source: str = "", cast: bool = False) -> pa.Table:
    """Check that ``table`` has the columns and types of table ``name``; return it in schema order.

    With ``cast=True`` (writers), columns of another type are cast safely to the schema's type
    (e.g. int64 ids to int32); a cast that would lose data raises.

    Raises:
        KeyError: unknown table name (lists the valid ones).
        ValueError: a missing column or a column of another type (names both).
    """
    if name not in SCHEMAS:
        raise KeyError(f"unknown table {name!r}; valid: {sorted(SCHEMAS)}")
    schema = SCHEMAS[name]
    where = f" in {source}" if source else ""
    missing = [f.name for f in schema if f.name not in table.column_names]
    if missing:
        raise ValueError(f"table {name!r}{where} lacks columns {missing}; expected {schema.names}")
    table = table.select(schema.names)
    if cast:
        try:
            return table.cast(schema, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise ValueError(f"table {name!r}{where} does not fit its schema {schema}: {e}") from e
    for f in schema:
        got = table.schema.field(f.name).type
        if got != f.type:
            raise ValueError(f"table {name!r}{where}: column {f.name!r} is {got}, expected {f.type}")
    return table
