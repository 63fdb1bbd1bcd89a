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
    retries with exponential backoff on transport errors, 429 and 5xx answers and malformed replies;
    every reply is validated (:func:`parse_reply`).
    """

    name = "openai"

    def __init__(self, model: str, cfg: OpenAIEngineConfig, seed: int = 0) -> None:
        super().__init__()
        self.model, self.cfg, self.seed = model, cfg, seed
        self.tokenizer = None

    def _one(self, client, conv, n, sampling, request: int = 0) -> Generation:
        """One conversation's ``n`` samples: one request, retried with exponential backoff (1, 2, 4 ...
        s, or the server's ``Retry-After`` up to 60 s) on a transport error, 429, a 5xx status or a
        malformed reply.

        Raises:
            EngineReplyError: the last attempt failed; names the request, the endpoint and why.
        """
        import httpx

        body = {"model": self.model, "messages": list(conv), "n": n, "temperature": sampling.temperature,
                "top_p": sampling.top_p, "max_tokens": sampling.max_tokens, "seed": self.seed, "logprobs": True}
        where = f"request {request} ({self.cfg.base_url}/chat/completions, model {self.model!r})"
        for attempt in range(self.cfg.max_retries + 1):
            wait = 2.0 ** attempt
            try:
                r = client.post("/chat/completions", json=body)
                if r.status_code == 429 or r.status_code >= 500:
                    wait = _retry_after(r, wait)
                    raise EngineReplyError(f"{where}: HTTP {r.status_code} {r.text[:200]!r}", retry=True)
                if r.status_code >= 400:
                    raise EngineReplyError(f"{where}: HTTP {r.status_code} {r.text[:300]!r}", retry=False)
                return parse_reply(r.content, n, where)
            except httpx.TransportError as e:
                err = EngineReplyError(f"{where}: {type(e).__name__}: {e}", retry=True)
            except EngineReplyError as e:
                err = e
            if not err.retry or attempt == self.cfg.max_retries:
                raise err
            log.warning("%s; retry %d of %d in %.0f s", err, attempt + 1, self.cfg.max_retries, wait)
            time.sleep(wait)
        raise AssertionError("unreachable")

    def generate(self, conversations, n, sampling):
        from concurrent.futures import ThreadPoolExecutor

        import httpx

        key = os.environ.get(self.cfg.api_key_env, "EMPTY")
        t0 = time.perf_counter()
        with httpx.Client(base_url=self.cfg.base_url, timeout=self.cfg.timeout_s,
                          headers={"Authorization": f"Bearer {key}"}) as client:
            with ThreadPoolExecutor(self.cfg.max_concurrency) as pool:
                gens = list(pool.map(lambda ic: self._one(client, ic[1], n, sampling, ic[0]), enumerate(conversations)))
        self._account(gens, time.perf_counter() - t0)
        return gens


class EngineReplyError(RuntimeError):
    """An OpenAI-compatible endpoint failed a request or answered something that is not a reply."""

    def __init__(self, message: str, retry: bool = False) -> None:
        super().__init__(message)
        self.retry = retry


def _retry_after(response, default: float) -> float:
    try:
        return min(60.0, max(default, float(response.headers.get("retry-after", default))))
    except ValueError:  # an HTTP date: wait the default
        return default


def parse_reply(content: bytes, n: int, where: str = "request") -> Generation:
    """A ``/chat/completions`` reply body -> a :class:`Generation` of its ``n`` choices, in index order.

    Raises:
        EngineReplyError (retryable): the body is not JSON, has no ``choices`` list, has another
            number of choices than ``n``, or a choice lacks its index or message text.
    """
    import json

    try:
        data = json.loads(content)
    except (ValueError, UnicodeDecodeError) as e:
        raise EngineReplyError(f"{where}: the reply is not JSON ({e}): {content[:200]!r}", retry=True) from None
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list):
        raise EngineReplyError(f"{where}: the reply has no 'choices' list: {str(data)[:200]}", retry=True)
    if len(choices) != n:
        raise EngineReplyError(f"{where}: asked for n={n} samples, the reply has {len(choices)}", retry=True)
    samples = []
    try:
        for ch in sorted(choices, key=lambda c: int(c["index"])):
            text = ch["message"]["content"]
            if text is not None and not isinstance(text, str):
                raise TypeError(f"message content is {type(text).__name__}")
            content_lps = ((ch.get("logprobs") or {}).get("content")) or []  # standard OpenAI per-token log-probs
            lps = [float(t["logprob"]) for t in content_lps] or None
            samples.append(Sample(text or "", [], lps, finish_reason(ch.get("finish_reason"))))
    except (KeyError, TypeError, ValueError) as e:
        raise EngineReplyError(f"{where}: a choice is malformed ({type(e).__name__}: {e})", retry=True) from None
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    return Generation([0] * int(usage.get("prompt_tokens") or 0), samples)
