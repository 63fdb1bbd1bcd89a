"""The OpenAI engine: any OpenAI-compatible ``/chat/completions`` endpoint (e.g. ``vllm serve``)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from pipeline.config import OpenAIEngineConfig
from pipeline.engines.base import (
    Engine,
    Generation,
    Sample,
    check_constraints,
    finish_reason,
)

log = logging.getLogger("capo.engines")


class OpenAIEngine(Engine):
    """Any OpenAI-compatible ``/chat/completions`` endpoint (e.g. ``vllm serve`` of a large critic).

    Returns the text and the standard per-token log-probs (``logprobs: true``), so the number of
    generated tokens is known; token ids are not part of the OpenAI API and stay empty (critiques
    need the text only). Requests run concurrently (``max_concurrency``), each with a timeout and
    retries with exponential backoff on transport errors, 429 and 5xx answers and malformed replies;
    every reply is validated (:func:`parse_reply`). With :attr:`malformed_as_data` (a critic: the
    critique stages set it), a reply whose choices stay malformed after the retries is the judge's
    output, recorded as data: the request's ``n`` samples come back empty, with
    :attr:`~pipeline.engines.base.Sample.malformed` set (why, and an excerpt of the body).
    """

    name = "openai"

    def __init__(self, model: str, cfg: OpenAIEngineConfig, seed: int = 0) -> None:
        super().__init__()
        self.model, self.cfg, self.seed = model, cfg, seed
        self.tokenizer = None

    malformed_as_data: bool = False
    """Return a reply whose choices stay malformed after the retries as ``n`` empty samples marked
    :attr:`~pipeline.engines.base.Sample.malformed` instead of failing the request (set by the
    critique stages: a judge's malformed output is data). Off for a policy (rollouts, eval): its
    reply then fails the request as before."""

    supports_constraints = True
    """Sent as vLLM's ``structured_outputs: {"regex": ...}`` request field; a server without it
    answers 400, and the error then says so."""

    def _one(self, client, conv, n, sampling, request: int = 0, regex: str | None = None) -> Generation:
        """One conversation's ``n`` samples: one request, retried with exponential backoff (1, 2, 4 ...
        s, or the server's ``Retry-After`` up to 60 s) on a transport error, 429, a 5xx status or a
        malformed reply. With :attr:`malformed_as_data`, when the last attempt's reply is a chat
        completion whose choices are malformed (:attr:`EngineReplyError.malformed`), the ``n``
        samples are returned empty with :attr:`~pipeline.engines.base.Sample.malformed` set.

        Raises:
            EngineReplyError: the last attempt failed (with :attr:`malformed_as_data`: on a
                transport error, an HTTP status, or a body that is not a chat completion: not
                JSON, no ``choices`` list); names the request, the endpoint and why.
        """
        import httpx

        body = {"model": self.model, "messages": list(conv), "n": n, "temperature": sampling.temperature,
                "top_p": sampling.top_p, "max_tokens": sampling.max_tokens, "seed": self.seed, "logprobs": True}
        if regex is not None:
            body["structured_outputs"] = {"regex": regex}
        where = f"request {request} ({self.cfg.base_url}/chat/completions, model {self.model!r})"
        for attempt in range(self.cfg.max_retries + 1):
            wait = 2.0 ** attempt
            try:
                r = client.post("/chat/completions", json=body)
                if r.status_code == 429 or r.status_code >= 500:
                    wait = _retry_after(r, wait)
                    raise EngineReplyError(f"{where}: HTTP {r.status_code} {r.text[:200]!r}", retry=True)
                if r.status_code >= 400:
                    hint = ""
                    if regex is not None and r.status_code in (400, 422):
                        hint = ("; this request asked for structured output (vLLM's `structured_outputs: {regex}` "
                                "field, critique.structured_output=true): a server without vLLM's structured "
                                "outputs refuses it; serve the critic with vLLM >= 0.12 or set "
                                "critique.structured_output=false")
                    raise EngineReplyError(f"{where}: HTTP {r.status_code} {r.text[:300]!r}{hint}", retry=False)
                return parse_reply(r.content, n, where)
            except httpx.TransportError as e:
                err = EngineReplyError(f"{where}: {type(e).__name__}: {e}", retry=True)
            except EngineReplyError as e:
                err = e
            if not err.retry or attempt == self.cfg.max_retries:
                if err.malformed and self.malformed_as_data:
                    log.warning("%s after %d attempts; recorded as %d malformed_reply critiques", err, attempt + 1, n)
                    note = f"[malformed reply after {attempt + 1} attempts] {err}\n{err.body}"
                    return Generation([], [Sample("", [], None, None, malformed=note) for _ in range(n)])
                raise err
            log.warning("%s; retry %d of %d in %.0f s", err, attempt + 1, self.cfg.max_retries, wait)
            time.sleep(wait)
        raise AssertionError("unreachable")

    reply_cache: Path | None = None
    """A JSON-lines file of finished replies (set per critique shard by the critique stage): each
    request's reply is appended as it finishes, and a request already in the file is not sent again,
    so a request that fails after its retries does not cost the shard's other finished requests.
    A malformed reply recorded as data (:attr:`~pipeline.engines.base.Sample.malformed`) is not
    kept: a run after a failure asks for it again."""

    def request_key(self, conv, n: int, sampling, index: int, regex: str | None = None) -> str:
        """sha256 of what decides a reply: endpoint, model, messages, n, sampling, seed, the output
        constraint and the request's position in its batch (two equal conversations of a shard stay
        two requests)."""
        import hashlib
        import json

        body = {"url": self.cfg.base_url, "model": self.model, "messages": list(conv), "n": n, "seed": self.seed,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": sampling.max_tokens, "index": index}
        if regex is not None:  # free-text keys stay as they were
            body["regex"] = regex
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()

    def generate(self, conversations, n, sampling, constraints=None):
        """Every conversation's ``n`` samples, requests sent concurrently; with :attr:`reply_cache`,
        replies found there are reused (not sent again) and new ones appended as they finish. A
        conversation's constraint (a regex) is sent as vLLM's ``structured_outputs`` field.

        Raises:
            ValueError: ``constraints`` not one per conversation.
            EngineReplyError: a request failed after its retries; every other request still ran.
                The message names the failed requests (their index in ``conversations``), counts
                the finished ones (kept in :attr:`reply_cache` when there is one, so that running
                again sends only the failed requests) and gives the first failure; the error's
                ``failed`` (those indices) and ``kept`` (that count) say the same.
        """
        import threading
        from concurrent.futures import ThreadPoolExecutor

        import httpx

        regexes = list(constraints) if check_constraints(self, conversations, constraints) else [None] * len(conversations)
        keys = [self.request_key(c, n, sampling, i, regexes[i]) for i, c in enumerate(conversations)]
        cached = _read_replies(self.reply_cache) if self.reply_cache is not None else {}
        gens: list[Generation | None] = [cached.get(k) for k in keys]
        reused = sum(g is not None for g in gens)
        errors: list[tuple[int, EngineReplyError]] = []
        lock = threading.Lock()

        def run(i: int, client) -> None:
            try:
                g = self._one(client, conversations[i], n, sampling, i, regexes[i])
            except EngineReplyError as e:
                with lock:
                    errors.append((i, e))
                return
            gens[i] = g
            if self.reply_cache is not None and not any(s.malformed for s in g.samples):
                with lock:
                    _append_reply(self.reply_cache, keys[i], g)

        key = os.environ.get(self.cfg.api_key_env, "EMPTY")
        t0 = time.perf_counter()
        todo = [i for i, g in enumerate(gens) if g is None]
        if reused:
            log.info("%d of %d requests answered from %s (an earlier, interrupted run)", reused, len(gens), self.reply_cache)
        with httpx.Client(base_url=self.cfg.base_url, timeout=self.cfg.timeout_s,
                          headers={"Authorization": f"Bearer {key}"}) as client:
            with ThreadPoolExecutor(self.cfg.max_concurrency) as pool:
                list(pool.map(lambda i: run(i, client), todo))
        if errors:
            errors.sort(key=lambda ie: ie[0])
            failed = [i for i, _ in errors]
            kept = sum(g is not None for g in gens)
            names = ", ".join(map(str, failed[:20])) + (f" and {len(failed) - 20} more" if len(failed) > 20 else "")
            where = (f"the {kept} finished replies are kept in {self.reply_cache}; running the stage again sends only "
                     "the failed requests") if self.reply_cache is not None else f"{kept} requests had finished"
            err = EngineReplyError(f"{len(errors)} of {len(gens)} requests failed after their retries "
                                   f"(request{'s' if len(failed) > 1 else ''} {names}; {where}); "
                                   f"first failure: {errors[0][1]}")
            err.failed, err.kept = failed, kept
            raise err
        self._account([gens[i] for i in todo], time.perf_counter() - t0)
        bad = sum(any(s.malformed for s in gens[i].samples) for i in todo)
        if bad:
            self.stats.extra["malformed_replies"] = self.stats.extra.get("malformed_replies", 0) + bad
        return gens


def _append_reply(path: Path, key: str, gen: Generation) -> None:
    """Append one finished reply to a reply cache and fsync it (after a newline, should the file
    end in the torn line of a killed write: that line is then skipped, this one kept)."""
    import dataclasses
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        torn = False
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
        line = json.dumps({"key": key, "generation": dataclasses.asdict(gen)}) + "\n"
        f.write((("\n" if torn else "") + line).encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())


def _read_replies(path: Path) -> dict[str, Generation]:
    """The replies in a reply cache; a line that does not parse (a torn last line) is skipped."""
    import json

    out: dict[str, Generation] = {}
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8", errors="replace").split("\n"):
        try:
            row = json.loads(line)
            g = row["generation"]
            out[row["key"]] = Generation(g["prompt_token_ids"], [Sample(**s) for s in g["samples"]],
                                         g.get("cached_prompt_tokens"))
        except (ValueError, KeyError, TypeError):
            continue
    return out


class EngineReplyError(RuntimeError):
    """An OpenAI-compatible endpoint failed a request or answered something that is not a reply."""

    def __init__(self, message: str, retry: bool = False, malformed: bool = False, body: str = "") -> None:
        super().__init__(message)
        self.retry = retry
        self.malformed = malformed
        """The reply is a chat completion (JSON with a ``choices`` list) whose content is malformed:
        the judge's output, recorded as data after the retries (never a transport or HTTP error)."""
        self.body = body
        """For a malformed reply: an excerpt of its body (what the critique row keeps as raw text)."""
        self.failed: list[int] = []
        """For a batch (:meth:`OpenAIEngine.generate`): the indices of the requests that failed."""
        self.kept = 0
        """For a batch: how many requests had finished (and were kept in the reply cache, if any)."""


def _retry_after(response, default: float) -> float:
    try:
        return min(60.0, max(default, float(response.headers.get("retry-after", default))))
    except ValueError:  # an HTTP date: wait the default
        return default


MAX_PROMPT_TOKENS = 10_000_000
"""The largest ``usage.prompt_tokens`` read as a count (a larger one is a malformed reply)."""
MALFORMED_EXCERPT = 500
"""Characters of a malformed reply's body kept (in the critique row's raw text)."""


def parse_reply(content: bytes, n: int, where: str = "request") -> Generation:
    """A ``/chat/completions`` reply body -> a :class:`Generation` of its ``n`` choices, in index order.

    Raises:
        EngineReplyError (retryable): the body is not JSON or has no ``choices`` list (not a chat
            completion); or (``malformed`` set, with an excerpt of the body) it has another number
            of choices than ``n``, a choice lacks its index or message text, its text is not a
            string, or ``usage.prompt_tokens`` is not a count (a number in [0, MAX_PROMPT_TOKENS]).
    """
    import json

    try:
        data = json.loads(content)
    except (ValueError, UnicodeDecodeError) as e:
        raise EngineReplyError(f"{where}: the reply is not JSON ({e}): {content[:200]!r}", retry=True) from None
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list):
        raise EngineReplyError(f"{where}: the reply has no 'choices' list: {str(data)[:200]}", retry=True)
    excerpt = content[:MALFORMED_EXCERPT].decode("utf-8", errors="replace")

    def malformed(why: str) -> EngineReplyError:
        return EngineReplyError(f"{where}: {why}", retry=True, malformed=True, body=excerpt)

    if len(choices) != n:
        raise malformed(f"asked for n={n} samples, the reply has {len(choices)}")
    samples = []
    try:
        for ch in sorted(choices, key=lambda c: int(c["index"])):
            text = ch["message"]["content"]
            if text is not None and not isinstance(text, str):
                raise TypeError(f"message content is {type(text).__name__}")
            content_lps = ((ch.get("logprobs") or {}).get("content")) or []  # standard OpenAI per-token log-probs
            lps = [float(t["logprob"]) for t in content_lps] or None
            samples.append(Sample(text or "", [], lps, finish_reason(ch.get("finish_reason"))))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise malformed(f"a choice is malformed ({type(e).__name__}: {e})") from None
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    try:
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
    except (TypeError, ValueError, OverflowError) as e:
        raise malformed(f"usage.prompt_tokens is not a number ({type(e).__name__}: {e})") from None
    if not 0 <= prompt_tokens <= MAX_PROMPT_TOKENS:
        raise malformed(f"usage.prompt_tokens is {prompt_tokens}, not in [0, {MAX_PROMPT_TOKENS}]")
    return Generation([0] * prompt_tokens, samples)
