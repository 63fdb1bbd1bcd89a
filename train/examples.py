"""Training examples from a round's tables: each response with its prompt and per-token advantages
(:func:`load_examples`), padded into micro-batches (:func:`collate`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pipeline import storage
from pipeline.config import CAPOConfig
from pipeline.stages.base import round_paths

log = logging.getLogger("capo.train")


@dataclass
class Example:
    """One response to train on: prompt + response token ids and its per-token advantages."""

    prompt_ids: list[int]
    response_ids: list[int]  # (T,)
    advantages: np.ndarray  # (T,) float32
    engine_logprobs: np.ndarray | None = None  # (T,) float32: the sampler's log-prob of each token, if recorded


def load_examples(cfg: CAPOConfig, round_idx: int) -> list[Example]:
    """Join rollouts with the variant's token advantages (checks every length matches).

    The engine's log-probs ride along for the mismatch diagnostic only when the rollouts were
    sampled without top-p truncation (``rollout.sampling.top_p == 1``): the engine reports log-probs
    renormalized over the nucleus, the trainer the untruncated ones."""
    p = round_paths(cfg, round_idx)
    ro = storage.read_table(p["rollouts"], "rollouts").select(["rollout_id", "prompt_token_ids", "response_token_ids",
                                                               "rollout_logprobs"])
    tr = storage.read_table(p["token_rewards"], "token_rewards").select(["rollout_id", "advantages"])
    adv = {r["rollout_id"]: r["advantages"] for r in tr.to_pylist()}
    out = []
    for r in ro.to_pylist():
        a = adv.get(r["rollout_id"])
        if a is None or len(a) != len(r["response_token_ids"]):
            raise ValueError(f"rollout {r['rollout_id']}: {len(r['response_token_ids'])} tokens but "
                             f"{None if a is None else len(a)} advantages; re-run the reward stage")
        if r["response_token_ids"]:
            elp = r["rollout_logprobs"] if cfg.rollout.sampling.top_p >= 1.0 else None
            elp = np.asarray(elp, np.float32) if elp is not None and len(elp) == len(a) else None
            out.append(Example(r["prompt_token_ids"], r["response_token_ids"], np.asarray(a, np.float32), elp))
    return out


def collate(batch: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad prompt+response into (B, L); response positions as (B, T) index/mask tensors."""
    L = max(len(e.prompt_ids) + len(e.response_ids) for e in batch)
    T = max(len(e.response_ids) for e in batch)
    ids = torch.full((len(batch), L), pad_id, dtype=torch.long)  # (B, L)
    attn = torch.zeros((len(batch), L), dtype=torch.long)
    pos = torch.zeros((len(batch), T), dtype=torch.long)  # (B, T) logit position predicting each response token
    tgt = torch.zeros((len(batch), T), dtype=torch.long)  # (B, T) response token ids
    mask = torch.zeros((len(batch), T), dtype=torch.bool)
    adv = torch.zeros((len(batch), T), dtype=torch.float32)
    elp = torch.full((len(batch), T), float("nan"), dtype=torch.float32)  # (B, T) engine log-probs, NaN if unknown
    for i, e in enumerate(batch):
        P, R = len(e.prompt_ids), len(e.response_ids)
        ids[i, : P + R] = torch.tensor(e.prompt_ids + e.response_ids)
        attn[i, : P + R] = 1
        pos[i, :R] = torch.arange(P - 1, P + R - 1)
        tgt[i, :R] = torch.tensor(e.response_ids)
        mask[i, :R] = True
        adv[i, :R] = torch.from_numpy(e.advantages)
        if e.engine_logprobs is not None:
            elp[i, :R] = torch.from_numpy(e.engine_logprobs)
    return {"input_ids": ids, "attention_mask": attn, "pos": pos, "target": tgt, "mask": mask, "advantages": adv,
            "engine_logprobs": elp}
