"""Stage ``densr``: each response token's hidden-state divergence (DenseR) -> ``token_divergence.parquet``.

The round's policy (the model that sampled the responses) reads every prompt + response once
(transformers, one sequence per forward pass, so no padding enters a hidden state); the hidden
state ``densr.layer`` at each response token is compared with the responses of the other outcome in
its group at the aligned position (:func:`pipeline.core.densr.aligned_divergence`). The reward stage
turns the divergences into per-token weights of GRPO's advantage (``reward.estimator: densr``,
:func:`pipeline.core.rewards.densr`). Runs only for that estimator; the table is cached like the
rollouts, so training again on it (another ``densr.mix``) reads no model.
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import storage
from pipeline.config import CAPOConfig
from pipeline.schemas import TOKEN_DIVERGENCE_SCHEMA
from pipeline.stages.base import (
    Stage,
    StageResult,
    input_fp,
    model_fingerprint,
    policy_for_round,
    provenance,
    round_paths,
    run_table_stage,
)

log = logging.getLogger("capo.stages")


def no_densr(cfg: CAPOConfig) -> str | None:
    """Why the densr stage has nothing to do under ``cfg`` (None: it has)."""
    return None if cfg.reward.estimator == "densr" else f"reward.estimator is {cfg.reward.estimator}, not densr"


def densr_key(cfg: CAPOConfig, round_idx: int) -> dict:
    """What the divergences depend on: the rollouts, their outcomes, the policy, its dtype and the layer."""
    from pipeline.precision import precision_record

    p = round_paths(cfg, round_idx)
    return {"rollouts": input_fp(p["rollouts"]), "outcomes": input_fp(p["outcomes"]), "layer": cfg.densr.layer,
            "dtype": precision_record(cfg)["rollout_dtype"], "policy": model_fingerprint(policy_for_round(cfg, round_idx))}


def response_hidden_states(model, sequences: list[tuple[list[int], list[int]]], layer: int) -> list[np.ndarray]:
    """Hidden state ``layer`` at every response token, one forward pass per (prompt, response), on the
    model's device.

    Args:
        model: a transformers causal LM (eval mode).
        sequences: B pairs ``(prompt_token_ids, response_token_ids)``.
        layer: index into the model's ``hidden_states`` (0 the embeddings, -1 the last layer).

    Returns:
        B float32 arrays (T_i, d): row ``t`` is the state at response token ``t`` (after reading it).

    Raises:
        ValueError: ``layer`` is out of range for the model (names its number of hidden states).
    """
    import torch

    n_states = model.config.num_hidden_layers + 1
    if not -n_states <= layer < n_states:
        raise ValueError(f"densr.layer={layer} is out of range: the policy has {n_states} hidden states "
                         f"(valid: {-n_states} .. {n_states - 1})")
    dev = next(model.parameters()).device
    out = []
    with torch.inference_mode():
        for prompt, response in sequences:
            if not response:
                out.append(np.zeros((0, model.config.hidden_size), np.float32))
                continue
            ids = torch.tensor([list(prompt) + list(response)], device=dev)
            # logits of the last position only: the states are what is read, not the vocabulary
            hs = model(input_ids=ids, output_hidden_states=True, use_cache=False, logits_to_keep=1).hidden_states[layer]
            out.append(hs[0, len(prompt):].float().cpu().numpy())  # (T, d)
    return out


def densr_stage(cfg: CAPOConfig, round_idx: int, force: bool = False) -> StageResult:
    """Each response token's hidden-state divergence from the other outcome -> ``token_divergence``
    (module docstring). One prompt group at a time, so memory holds one group's hidden states.

    Raises:
        FileNotFoundError: the round's rollouts or outcomes table is missing.
        ValueError: a rollout has no outcome, ``densr.layer`` is out of range for the policy, or a
            hidden state is not finite.
    """
    p = round_paths(cfg, round_idx)
    key = densr_key(cfg, round_idx)

    def compute():
        import torch
        from transformers import AutoModelForCausalLM

        from pipeline.core.densr import aligned_divergence
        from pipeline.precision import precision_record

        ro = storage.read_table(p["rollouts"], "rollouts").select(
            ["rollout_id", "prompt_id", "prompt_token_ids", "response_token_ids"]).to_pylist()
        oc = storage.read_table(p["outcomes"], "outcomes").select(["rollout_id", "outcome_correct"])
        at = pc.index_in(pa.array([r["rollout_id"] for r in ro], pa.string()), value_set=oc.column("rollout_id"))
        if at.null_count:
            raise ValueError(f"{at.null_count} rollouts have no outcome in {p['outcomes']}; re-run the verify stage")
        correct = np.asarray(oc.column("outcome_correct").combine_chunks().take(at).to_pylist(), bool)
        dtype = precision_record(cfg)["rollout_dtype"]
        model = AutoModelForCausalLM.from_pretrained(policy_for_round(cfg, round_idx), dtype=getattr(torch, dtype))
        model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
        by_group: dict[str, list[int]] = {}
        for i, r in enumerate(ro):
            by_group.setdefault(r["prompt_id"], []).append(i)
        rows, total, n_tokens, contrasted = [None] * len(ro), 0.0, 0, 0
        for idx in by_group.values():  # one group's states in memory at a time
            hidden = response_hidden_states(
                model, [(ro[i]["prompt_token_ids"], ro[i]["response_token_ids"]) for i in idx], cfg.densr.layer)
            div = aligned_divergence(hidden, correct[idx], np.zeros(len(idx)))
            for i, d in zip(idx, div):
                # the responses of the other outcome that have a token to compare with
                n_opp = sum(1 for k, h in zip(idx, hidden) if correct[k] != correct[i] and len(h))
                if len(d) and n_opp:
                    contrasted, total, n_tokens = contrasted + 1, total + float(d.sum()), n_tokens + len(d)
                rows[i] = {"run_id": cfg.run_id, "round": round_idx, "rollout_id": ro[i]["rollout_id"],
                           "prompt_id": ro[i]["prompt_id"], "outcome_correct": bool(correct[i]),
                           "layer": cfg.densr.layer, "n_opposite": n_opp,
                           "divergence": d.tolist() if n_opp else None}
        hidden_size = int(model.config.hidden_size)
        del model
        log.info("[densr] %d of %d responses have a response of the other outcome in their group", contrasted, len(ro))
        return (pa.Table.from_pylist(rows, schema=TOKEN_DIVERGENCE_SCHEMA),
                provenance(cfg, {"contrasted_responses": contrasted, "hidden_size": hidden_size,
                                 "mean_divergence": total / n_tokens if n_tokens else None}))

    return run_table_stage("densr", p["token_divergence"], "token_divergence", key, compute, force)


def read_divergence(path, rollout_ids: list[str], n_tokens: np.ndarray, layer: int) -> np.ndarray:
    """``token_divergence.parquet`` as one (N,) float array in the order of ``rollout_ids`` (NaN for the
    tokens of a response without a response of the other outcome), for :func:`pipeline.core.densr.densr_weights`.

    Raises:
        ValueError: the table lacks a rollout or holds one not in ``rollout_ids``, was computed at another
            layer than ``layer``, or a response's divergences do not match its token count (re-run the
            densr stage).
    """
    rows = storage.read_table(path, "token_divergence").select(["rollout_id", "layer", "divergence"]).to_pylist()
    got = {r["rollout_id"]: r["divergence"] for r in rows}
    layers = {r["layer"] for r in rows}
    if layers - {layer}:
        raise ValueError(f"token_divergence.parquet was computed at layer(s) {sorted(layers)}, not densr.layer={layer}; "
                         "re-run the densr stage")
    extra = set(got) - set(rollout_ids)
    if extra:
        raise ValueError(f"token_divergence.parquet holds {len(extra)} rollouts not in rollouts.parquet, e.g. "
                         f"{sorted(extra)[0]}; re-run the densr stage")
    out = []
    for rid, n in zip(rollout_ids, n_tokens):
        if rid not in got:
            raise ValueError(f"token_divergence.parquet has no row for rollout {rid}; re-run the densr stage")
        d = got[rid]
        if d is not None and len(d) != n:
            raise ValueError(f"token_divergence.parquet holds {len(d)} divergences for rollout {rid} of {int(n)} "
                             "tokens; re-run the densr stage")
        out.append(np.full(int(n), np.nan) if d is None else np.asarray(d, np.float64))
    return np.concatenate(out) if out else np.zeros(0)


STAGE = Stage("densr", ("rollouts", "outcomes"), ("token_divergence",), True, densr_key,
              "pipeline.stages.densr:densr_stage", no_densr, engine_env=True)
