"""Training examples: each response with its prompt and per-token advantages (:class:`Example`;
the train stage reads them from the round's tables, :func:`pipeline.stages.train.load_examples`),
padded into micro-batches (:func:`collate`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch


log = logging.getLogger("capo.train")


@dataclass
class Example:
    """One response to train on: prompt + response token ids and its per-token advantages."""

    prompt_ids: list[int]
    response_ids: list[int]  # (T,)
    advantages: np.ndarray  # (T,) float32
    engine_logprobs: np.ndarray | None = None  # (T,) float32: the sampler's log-prob of each token, if recorded
    rollout_id: str | None = None  # the rollouts table's id, where the response came from one


def collate(batch: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad prompt+response into (B, L); response positions as (B, T) index/mask tensors.

    Returns a dict of: ``input_ids`` (B, L) long, prompt then response, ``pad_id`` after;
    ``attention_mask`` (B, L) long; ``pos`` (B, T) long, the logit position that predicts each
    response token (P - 1 + t); ``target`` (B, T) long, the response token ids; ``mask`` (B, T)
    bool, real response tokens; ``advantages`` (B, T) float32; ``engine_logprobs`` (B, T) float32,
    NaN where unknown. L is the longest prompt+response, T the longest response of the batch.

    Raises:
        ValueError: ``batch`` is empty (no longest sequence).
    """
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
