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


def call_seed(seed: int, prompts: list[list[int]]) -> int:
    """The torch seed of one ``generate`` call: a function of the engine seed and the prompts.

    Args:
        seed: the engine's seed.
        prompts: the call's prompt token ids, one list per conversation, in order.

    Returns:
        An int in [0, 2**63): equal for equal (seed, prompts), independent streams otherwise
        (numpy's SeedSequence over the seed and a BLAKE2b digest of the token ids).
    """
    import hashlib

    import numpy as np

    h = hashlib.blake2b(digest_size=16)
    for p in prompts:
        h.update(np.asarray(p, dtype=np.int64).tobytes())
        h.update(b"|")
    words = np.frombuffer(h.digest(), dtype=np.uint32).tolist()
    return int(np.random.default_rng([seed, *words]).integers(0, 2**63 - 1))


class TransformersEngine(Engine):
    """Hugging Face ``generate``: the reference engine; deterministic on CPU given the seed.

    Randomness: every :meth:`generate` call draws from its own stream, seeded by :func:`call_seed`
    from the engine's ``seed`` and the call's prompt token ids. A call's samples therefore depend only
    on the seed and the prompts (a critique shard's critiques are the same whether the stage runs
    locally, resumes or fans out), and calls on different prompts (dynamic sampling's extra batches,
    a critique stage's shards) do not reuse one stream. The process's global torch RNG is left as it
    was.

    Log-probs: those of the distribution sampled from, ``log_softmax(logits / T)`` at temperature
    ``T > 0`` (vLLM's ``processed_logprobs``; what the trainer recomputes for the PPO ratio), the raw
    ``log_softmax(logits)`` when greedy. With ``top_p < 1`` the tokens outside the nucleus are not
    renormalized away (the rollout/trainer mismatch is reported only at ``top_p == 1``).
    """

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
        cuda = self.device == "cuda"
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):  # global RNG restored after
            torch.manual_seed(call_seed(self.seed, prompts))
            bs = self.cfg.batch_size
            for start in tqdm(range(0, len(prompts), bs), desc=f"generate ({self.name})", unit="batch"):
                gens.extend(self._batch(prompts[start : start + bs], n, sampling))
        self._account(gens, time.perf_counter() - t0)
        return gens

    def token_probs(self, sequences: list[list[int]], positions: list[list[int]], token_ids: list[int]):
        """Next-token probabilities of ``token_ids`` at given positions of teacher-forced sequences
        (the log-prob readout, :mod:`pipeline.core.readout`): one forward pass per sequence, the
        LM head applied only at the positions asked for. The head is applied to the decoder's last
        hidden state directly: right for the embedded Qwen and SmolLM2 critics, not for a model
        that post-processes its logits (Gemma-2's soft-capping, Cohere's ``logit_scale``).

        Args:
            sequences: token ids, one list per sequence (no padding: one pass each).
            positions: per sequence, the indices whose next-token distribution is read.
            token_ids: the K candidate tokens.

        Returns:
            One float64 array per sequence, shape (len(positions[i]), K): ``softmax(logits)[token]``
            at each position (temperature 1).

        Raises:
            ValueError: ``sequences`` and ``positions`` differ in length, or a position lies outside
                its sequence.
        """
        import numpy as np
        import torch

        if len(sequences) != len(positions):
            raise ValueError(f"{len(sequences)} sequences but {len(positions)} position lists")
        head = self.lm.get_output_embeddings()
        out = []
        t0 = time.perf_counter()
        with torch.inference_mode():
            for ids, pos in zip(sequences, positions):
                if any(not 0 <= p < len(ids) for p in pos):
                    raise ValueError(f"positions {list(pos)} must lie in [0, {len(ids)})")
                x = torch.tensor([ids], device=self.device)
                hidden = self.lm.base_model(input_ids=x).last_hidden_state[0, list(pos)]
                probs = torch.softmax(head(hidden).float(), dim=-1)[:, list(token_ids)]
                out.append(probs.double().cpu().numpy())
                self.stats.extra["prefill_tokens"] = self.stats.extra.get("prefill_tokens", 0) + len(ids)
        self.stats.extra["readout_seconds"] = self.stats.extra.get("readout_seconds", 0.0) + time.perf_counter() - t0
        return [np.asarray(o) for o in out]

    def continue_prefixes(self, prefixes, n, sampling, max_tokens):
        """See :meth:`Engine.continue_prefixes`; prefixes with the same budget are batched together."""
        import torch

        gens: list[Generation | None] = [None] * len(prefixes)
        t0 = time.perf_counter()
        prompts = [list(map(int, p)) for p in prefixes]
        cuda = self.device == "cuda"
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
            torch.manual_seed(call_seed(self.seed, prompts))
            for m in sorted(set(int(x) for x in max_tokens)):
                idx = [i for i, x in enumerate(max_tokens) if int(x) == m]
                for start in range(0, len(idx), self.cfg.batch_size):
                    chunk = idx[start : start + self.cfg.batch_size]
                    for i, g in zip(chunk, self._batch([prompts[i] for i in chunk], n, sampling.model_copy(
                            update={"max_tokens": m}))):
                        gens[i] = g
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
        if not greedy:
            logits = logits / sampling.temperature  # the sampled distribution's log-probs (vLLM: processed_logprobs)
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
