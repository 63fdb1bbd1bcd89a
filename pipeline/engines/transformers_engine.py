"""The transformers engine: Hugging Face ``generate``, the reference engine (deterministic on CPU)."""

from __future__ import annotations

import logging
import time

from pipeline.config import SamplingConfig, TransformersEngineConfig
from pipeline.engines.base import (
    Engine,
    Generation,
    Sample,
    apply_chat_template,
    check_constraints,
    load_tokenizer,
)

log = logging.getLogger("capo.engines")


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

    def generate(self, conversations, n, sampling, constraints=None):
        """See :meth:`Engine.generate`; ``constraints`` are not supported (ValueError)."""
        import torch
        from tqdm.auto import tqdm

        check_constraints(self, conversations, constraints)
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
