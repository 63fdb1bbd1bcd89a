"""Generation engines behind one small interface (:class:`pipeline.engines.base.Engine`): vLLM
(default), transformers, an OpenAI-compatible HTTP server; :mod:`pipeline.engines.host` keeps the
policy's vLLM engine alive across stages.

Every engine takes chat conversations and a number of samples ``n`` per conversation and returns,
per conversation, the prompt token ids and ``n`` samples (text, token ids, per-token log-probs,
finish reason). The ``n`` samples of one conversation are ONE request, so engines with a prefix
cache (vLLM) compute the shared prompt once: this is how the N critiques of a response are drawn.
"""

from __future__ import annotations

import logging

from pipeline.engines.base import Engine
from pipeline.engines.openai_engine import OpenAIEngine
from pipeline.engines.transformers_engine import TransformersEngine
from pipeline.engines.vllm_engine import VLLMEngine

log = logging.getLogger("capo.engines")

ENGINES = {"vllm": VLLMEngine, "transformers": TransformersEngine, "openai": OpenAIEngine}


def make_engine(model: str, cfg, seed: int = 0) -> Engine:
    """Build the engine named by ``cfg.type`` for ``model`` (a checkpoint dir or model id).

    Raises:
        ValueError: unknown engine type (lists the valid ones).
    """
    if cfg.type not in ENGINES:
        raise ValueError(f"unknown engine {cfg.type!r}; valid: {sorted(ENGINES)}")
    log.info("loading %s engine for %s", cfg.type, model)
    return ENGINES[cfg.type](model, cfg, seed=seed)
