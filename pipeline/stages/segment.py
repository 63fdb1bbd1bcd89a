"""Stage ``segment``: split every response into steps and map its tokens to them -> ``steps.parquet``.

The split itself is :func:`pipeline.core.segment.segment_response` (docs/design.md §1, item 3); the token of
each byte comes from decoding the response's token ids (:func:`pipeline.core.tokenization.decode_with_bytes`).
"""

from __future__ import annotations

import pyarrow as pa

from pipeline import storage
from pipeline.config import CAPOConfig
from pipeline.core.segment import segment_response
from pipeline.schemas import STEPS_SCHEMA
from pipeline.stages.base import (
    Stage,
    StageResult,
    input_fp,
    provenance,
    round_paths,
    run_table_stage,
)


def segment_key(cfg: CAPOConfig, round_idx: int) -> dict:
    """What the steps depend on: the rollouts and the ``steps`` settings."""
    return {"rollouts": input_fp(round_paths(cfg, round_idx)["rollouts"]), "steps": cfg.model_dump(mode="json")["steps"]}


def segment_stage(cfg: CAPOConfig, round_idx: int, force: bool = False) -> StageResult:
    """Split responses into steps and map tokens to steps -> ``steps.parquet`` (one row per step:
    its text, character span and token span ``[token_start, token_end)`` of the response; design
    notes §1.2 for the splitting rules, ``steps.mode``).

    Raises:
        FileNotFoundError: the round has no committed ``rollouts.parquet`` (run the rollout stage).
        ValueError: a response's tokens do not decode to its text byte for byte
            (:func:`pipeline.core.segment.segment_response`).
    """
    from pipeline.core.tokenization import decode_with_bytes
    from pipeline.engines.base import load_tokenizer

    p = round_paths(cfg, round_idx)
    key = segment_key(cfg, round_idx)

    def compute():
        ro = storage.read_table(p["rollouts"], "rollouts").select(["rollout_id", "policy", "response_token_ids"])
        tokenizers: dict = {}
        rows = []
        for r in ro.to_pylist():
            tok = tokenizers.get(r["policy"]) or tokenizers.setdefault(r["policy"], load_tokenizer(r["policy"]))
            text, raw, nbytes = decode_with_bytes(tok, r["response_token_ids"])
            seg = segment_response(text, nbytes, cfg.steps.mode, text_bytes=raw)
            for s, ((cs, ce), st) in enumerate(zip(seg.step_spans, seg.step_texts)):
                rows.append({"run_id": cfg.run_id, "round": round_idx, "rollout_id": r["rollout_id"], "step_idx": s,
                             "n_steps": seg.n_steps, "char_start": cs, "char_end": ce,
                             "token_start": int(seg.token_start[s]), "token_end": int(seg.token_end[s]),
                             "step_text": st, "empty_response": seg.empty})
        return pa.Table.from_pylist(rows, schema=STEPS_SCHEMA), provenance(cfg)

    return run_table_stage("segment", p["steps"], "steps", key, compute, force)


STAGE = Stage("segment", ("rollouts",), ("steps",), False, segment_key, "pipeline.stages.segment:segment_stage")
