"""The OpenAI engine: any OpenAI-compatible ``/chat/completions`` endpoint (e.g. ``vllm serve``)."""

from __future__ import annotations

import logging
import os
import time

from pipeline.config import OpenAIEngineConfig
from pipeline.engines.base import (
    Engine,
    Generation,
    Sample,
    finish_reason,
)

log = logging.getLogger("capo.engines")


class OpenAIEngine(Engine):
    """Any OpenAI-compatible ``/chat/completions`` endpoint (e.g. ``vllm serve`` of a large critic).

    Returns the text and the standard per-token log-probs (``logprobs: true``), so the number of
    generated tokens is known; token ids are not part of the OpenAI API and stay empty (critiques
    need the text only). Requests run concurrently (``max_concurrency``), each with a timeout and
    retries with exponential backoff on transport errors and 5xx answers.
    """

    name = "openai"

    def __init__(self, model: str, cfg: OpenAIEngineConfig, seed: int = 0) -> None:
        super().__init__()
        self.model, self.cfg, self.seed = model, cfg, seed
        self.tokenizer = None

    def _one(self, client, conv, n, sampling) -> Generation:
        import httpx

        body = {"model": self.model, "messages": list(conv), "n": n, "temperature": sampling.temperature,
                "top_p": sampling.top_p, "max_tokens": sampling.max_tokens, "seed": self.seed, "logprobs": True}
        for attempt in range(self.cfg.max_retries + 1):
            try:
                r = client.post("/chat/completions", json=body)
                r.raise_for_status()
                break
            except (httpx.TransportError, httpx.HTTPStatusError) as e:
                if attempt == self.cfg.max_retries or (isinstance(e, httpx.HTTPStatusError) and e.response.status_code < 500):
                    raise
                time.sleep(2 ** attempt)
        data = r.json()
        samples = []
        for ch in sorted(data["choices"], key=lambda c: c["index"]):
            content = ((ch.get("logprobs") or {}).get("content")) or []  # standard OpenAI per-token log-probs
            lps = [float(t["logprob"]) for t in content] or None
            samples.append(Sample(ch["message"]["content"] or "", [], lps, finish_reason(ch.get("finish_reason"))))
        usage = data.get("usage") or {}
        return Generation([0] * int(usage.get("prompt_tokens", 0)), samples)

    def generate(self, conversations, n, sampling):
        from concurrent.futures import ThreadPoolExecutor

        import httpx

        key = os.environ.get(self.cfg.api_key_env, "EMPTY")
        t0 = time.perf_counter()
        with httpx.Client(base_url=self.cfg.base_url, timeout=self.cfg.timeout_s,
                          headers={"Authorization": f"Bearer {key}"}) as client:
            with ThreadPoolExecutor(self.cfg.max_concurrency) as pool:
                gens = list(pool.map(lambda c: self._one(client, c, n, sampling), conversations))
        self._account(gens, time.perf_counter() - t0)
        return gens
