"""The engines on a real (tiny) model: SmolLM2-135M-Instruct converted from its PyPI GGUF.

The transformers engine is the reference: its per-token log-probs must equal what the trainer
recomputes for the same prompt + response (this pins the prompt/response alignment of
``train.examples.collate``). vLLM's sampler log-probs must agree with both.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.config import SamplingConfig, TransformersEngineConfig, VLLMEngineConfig
from pipeline.engines import make_engine
from pipeline.engines.transformers_engine import TransformersEngine
from train.examples import Example, collate
from train.logprobs import token_logprobs

CONV = [{"role": "user", "content": "What is 7 * 8? Put the answer in \\boxed{}."}]


def _recompute(model_path: str, prompt_ids, samples, temperature: float = 1.0) -> list[np.ndarray]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ex = [Example(prompt_ids, s.token_ids, np.zeros(len(s.token_ids), np.float32)) for s in samples]
    mb = collate(ex, pad_id=0)
    with torch.no_grad():
        lp = token_logprobs(model, mb, temperature)
    return [lp[i, : len(s.token_ids)].numpy() for i, s in enumerate(samples)]


def test_transformers_engine_samples_and_logprobs_match_trainer(tiny_model):
    eng = TransformersEngine(tiny_model, TransformersEngineConfig(dtype="float32", batch_size=2), seed=3)
    gens = eng.generate([CONV, CONV], n=2, sampling=SamplingConfig(temperature=1.0, max_tokens=12))
    assert len(gens) == 2 and all(len(g.samples) == 2 for g in gens)
    s = gens[0].samples[0]
    assert 0 < len(s.token_ids) <= 12 and len(s.logprobs) == len(s.token_ids)
    assert s.finish_reason in ("stop", "length")
    assert eng.stats.samples == 4 and eng.stats.generated_tokens == sum(len(x.token_ids) for g in gens for x in g.samples)
    again = TransformersEngine(tiny_model, TransformersEngineConfig(dtype="float32", batch_size=2), seed=3)
    assert [x.token_ids for x in again.generate([CONV, CONV], 2, SamplingConfig(temperature=1.0, max_tokens=12))[0].samples] == \
        [x.token_ids for x in gens[0].samples], "transformers engine on CPU must be deterministic given the seed"
    recomputed = _recompute(tiny_model, gens[0].prompt_token_ids, gens[0].samples)
    for samp, lp in zip(gens[0].samples, recomputed):
        np.testing.assert_allclose(lp, samp.logprobs, atol=2e-3)


def test_transformers_engine_seeds_each_call_from_its_prompts(tiny_model):
    """A call's samples depend only on (seed, prompts): the same call on a fresh engine replays them
    (critique shards are runner-independent); a call on other prompts (dynamic sampling's extra
    batch, the next critique shard) gets another stream; the global torch RNG is left as it was."""
    from pipeline.engines.transformers_engine import call_seed

    assert call_seed(5, [[1, 2], [3]]) == call_seed(5, [[1, 2], [3]])
    assert len({call_seed(5, [[1, 2], [3]]), call_seed(5, [[1], [2, 3]]), call_seed(6, [[1, 2], [3]]),
                call_seed(5, [[1, 2]])}) == 4  # the split between prompts counts, and so does the seed
    cfg, sampling = TransformersEngineConfig(dtype="float32", batch_size=2), SamplingConfig(temperature=1.0, max_tokens=12)
    eng = TransformersEngine(tiny_model, cfg, seed=5)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = [s.token_ids for s in eng.generate([CONV], 4, sampling)[0].samples]
    assert torch.equal(torch.rand(3), expected_next), "generate must not reseed the process's torch RNG"
    other = [{"role": "user", "content": "What is 6 * 9? Put the answer in \\boxed{}."}]
    eng.generate([other], 4, sampling)
    assert [s.token_ids for s in TransformersEngine(tiny_model, cfg, seed=5).generate([CONV], 4, sampling)[0].samples] == first


def test_transformers_engine_logprobs_are_the_sampled_distributions(tiny_model):
    """At T = 0.7 the engine reports log_softmax(logits / T), what the trainer recomputes for the
    PPO ratio (and vLLM's processed_logprobs), not the raw model's log-probs."""
    eng = TransformersEngine(tiny_model, TransformersEngineConfig(dtype="float32"), seed=1)
    gen = eng.generate([CONV], 2, SamplingConfig(temperature=0.7, max_tokens=10))[0]
    at_t = _recompute(tiny_model, gen.prompt_token_ids, gen.samples, temperature=0.7)
    raw = _recompute(tiny_model, gen.prompt_token_ids, gen.samples, temperature=1.0)
    for samp, lp, lp_raw in zip(gen.samples, at_t, raw):
        np.testing.assert_allclose(samp.logprobs, lp, atol=2e-3)
        assert np.abs(np.asarray(samp.logprobs) - lp_raw).max() > 1e-2  # the two differ, so the check can fail


def test_the_transformers_engine_refuses_an_output_constraint(tiny_model):
    eng = TransformersEngine(tiny_model, TransformersEngineConfig(dtype="float32"), seed=0)
    with pytest.raises(ValueError, match="the transformers engine cannot constrain its output.*valid engines: vllm"):
        eng.generate([CONV], 1, SamplingConfig(max_tokens=4), constraints=["Step 0: correct"])
    assert eng.stats.requests == 0


@pytest.fixture(scope="module")
def vllm_engine(tiny_model):
    eng = make_engine(tiny_model, VLLMEngineConfig(dtype="float32", max_model_len=1024, kv_cache_gib=1), seed=0)
    yield eng
    eng.close()


@pytest.mark.slow
def test_structured_critiques_from_vllm_all_parse_with_every_step_judged(vllm_engine):
    """critique.structured_output on the real engine: every sample of a real (small, weak) critic
    matches the verdict format in full and parses with every step judged, while the same critic
    unconstrained rarely writes the format at all."""
    import re

    from pipeline.core.critique import STATUS_COMPLETE, STATUS_INCONSISTENT, build_critique_messages, critique_regex, parse_critique

    steps = [["Tom has 3 apples.", "He buys 4 more: 3 + 4 = 8.", "The answer is \\boxed{8}."],
             ["12 * 3 = 36.", "So the answer is \\boxed{36}."]]
    convs = [build_critique_messages("Tom has 3 apples and buys 4 more. How many?", steps[0], "7"),
             build_critique_messages("What is 12 * 3?", steps[1], "36")]
    sampling = SamplingConfig(temperature=0.7, top_p=0.95, max_tokens=200)
    regexes = [critique_regex(len(s)) for s in steps]
    gens = vllm_engine.generate(convs, 4, sampling, constraints=regexes)
    for g, s, rx in zip(gens, steps, regexes):
        assert len(g.samples) == 4
        for smp in g.samples:
            assert re.fullmatch(rx, smp.text), smp.text
            parsed = parse_critique(smp.text, len(s))
            assert parsed.status in (STATUS_COMPLETE, STATUS_INCONSISTENT) and parsed.judged == tuple(range(len(s)))
    free = vllm_engine.generate(convs, 4, sampling)
    judged_all = sum(parse_critique(smp.text, len(s)).judged == tuple(range(len(s)))
                     for g, s in zip(free, steps) for smp in g.samples)
    assert judged_all < 8, "the unconstrained 135M critic wrote the full format every time: this test shows nothing"


@pytest.mark.slow
def test_vllm_engine_matches_the_reference(tiny_model, vllm_engine):
    eng = vllm_engine
    gens = eng.generate([CONV], n=3, sampling=SamplingConfig(temperature=1.0, max_tokens=16))
    samples = gens[0].samples
    assert len(samples) == 3 and all(len(s.logprobs) == len(s.token_ids) > 0 for s in samples)
    greedy = eng.generate([CONV], n=1, sampling=SamplingConfig(temperature=0.0, max_tokens=16))[0].samples[0]
    ref = TransformersEngine(tiny_model, TransformersEngineConfig(dtype="float32"), seed=0)
    ref_greedy = ref.generate([CONV], 1, SamplingConfig(temperature=0.0, max_tokens=16))[0].samples[0]
    assert greedy.token_ids[:8] == ref_greedy.token_ids[:8]
    for samp, lp in zip(samples, _recompute(tiny_model, gens[0].prompt_token_ids, samples)):
        np.testing.assert_allclose(lp, samp.logprobs, atol=5e-2)
    # at T = 0.6 the engine reports the log-probs of the tempered distribution it sampled from, and
    # the trainer's log-probs at the same temperature match them; untempered ones do not
    hot = eng.generate([CONV], n=3, sampling=SamplingConfig(temperature=0.6, max_tokens=16))[0]
    tempered = _recompute(tiny_model, hot.prompt_token_ids, hot.samples, temperature=0.6)
    plain = _recompute(tiny_model, hot.prompt_token_ids, hot.samples, temperature=1.0)
    for samp, lp, lp1 in zip(hot.samples, tempered, plain):
        np.testing.assert_allclose(lp, samp.logprobs, atol=5e-2)
    worst_untempered = max(float(np.abs(lp1 - np.asarray(s.logprobs)).max()) for s, lp1 in zip(hot.samples, plain))
    assert worst_untempered > 0.1, worst_untempered


@pytest.mark.parametrize("fuse_head", [True, False], ids=["head-chunked", "logits-chunked"])
def test_chunked_logprobs_equal_the_full_log_softmax(tiny_model, fuse_head):
    """token_logprobs in small chunks (values and gradients) equals one full fp32 log-softmax, at
    T != 1, both with the output head applied chunk by chunk (the default: no (B, T, V) logits)
    and with the model's own logits chunked (the FSDP / ZeRO-3 path)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    ex = [Example(rng.integers(0, 1000, 5).tolist(), rng.integers(0, 1000, 9).tolist(), np.ones(9, np.float32)),
          Example(rng.integers(0, 1000, 8).tolist(), rng.integers(0, 1000, 4).tolist(), np.ones(4, np.float32))]
    mb = collate(ex, pad_id=0)
    lp = token_logprobs(model, mb, temperature=0.7, chunk=3, fuse_head=fuse_head)
    assert "forward" not in vars(model.lm_head)  # the head is restored after the bypass
    lp.sum().backward()
    g_chunked = model.lm_head.weight.grad.clone()
    model.zero_grad()
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits / 0.7
    full = torch.log_softmax(logits.float(), -1)
    ref = torch.stack([full[i, mb["pos"][i]].gather(-1, mb["target"][i].unsqueeze(-1)).squeeze(-1) for i in range(2)])
    ref = ref * mb["mask"]
    ref.sum().backward()
    torch.testing.assert_close(lp.detach(), ref.detach(), atol=1e-5, rtol=1e-5)
    g_full = model.lm_head.weight.grad
    # logits_to_keep changes the lm_head matmul's shape and so its fp32 rounding: 1.8e-5 relative here
    assert float((g_chunked - g_full).norm() / g_full.norm()) < 1e-4


def test_head_chunked_logprobs_keep_the_forwards_autocast(tiny_model):
    """Under bf16 autocast the chunked output head runs in bf16 as the model's own head would:
    the fused and unfused log-probs agree to bf16 rounding of the same computation (and differ
    from fp32 by far more), and entropies come out of the same pass."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    rng = np.random.default_rng(1)
    ex = [Example(rng.integers(0, 1000, 6).tolist(), rng.integers(0, 1000, 7).tolist(), np.ones(7, np.float32))]
    mb = collate(ex, pad_id=0)
    with torch.no_grad():
        fp32 = token_logprobs(model, mb, fuse_head=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fused, ent_f = token_logprobs(model, mb, chunk=4, with_entropy=True, fuse_head=True)
            plain, ent_p = token_logprobs(model, mb, chunk=4, with_entropy=True, fuse_head=False)
    torch.testing.assert_close(fused, plain, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent_f, ent_p, atol=1e-6, rtol=0)
    assert float((fused - fp32).abs().max()) > 1e-3  # the head really ran in bf16


def test_head_logprobs_backward_matches_autograd_in_float64():
    """The hand-written chunked backward of the output head (weight, bias and hidden gradients)
    equals autograd's on a tiny float64 problem (torch.autograd.gradcheck), with repeated and
    padded positions and T != 1."""
    from train.logprobs import HeadLogProbs

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(7, 3, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=True)
    idx = torch.tensor([[0, 1, 2, 3], [2, 3, 4, 0]])  # the second row's last entry: a clamped pad position
    target = torch.tensor([[1, 6, 0, 2], [3, 3, 5, 0]])
    assert torch.autograd.gradcheck(lambda h, w, b: HeadLogProbs.apply(h, w, b, idx, target, 1 / 0.7, 3, None),
                                    (hidden, weight, bias))


def test_head_bypass_restores_a_hook_and_skips_softcapped_heads(tiny_model):
    """An instance ``forward`` already on the head (Accelerate's device_map hooks) is put back after
    the bypass; a model that squashes logits after its head (Gemma 2's final_logit_softcapping)
    is not fused."""
    from transformers import AutoModelForCausalLM

    from train.logprobs import output_head

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    rng = np.random.default_rng(2)
    mb = collate([Example(rng.integers(0, 1000, 4).tolist(), rng.integers(0, 1000, 3).tolist(),
                          np.ones(3, np.float32))], pad_id=0)
    hook = model.lm_head.forward  # a bound method stored as an instance attribute, like a hook's wrapper
    model.lm_head.forward = hook
    with torch.no_grad():
        fused = token_logprobs(model, mb)
    assert model.lm_head.__dict__["forward"] is hook
    assert output_head(model) is model.lm_head
    model.config.final_logit_softcapping = 30.0
    assert output_head(model) is None
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(model, mb), fused)  # the unfused path, same numbers here


def test_head_logprobs_backward_inside_an_autocast_block_equals_outside():
    """``loss.backward()`` called inside ``with torch.autocast(...)`` (a common pattern) gives the
    hand-written backward the same fp32 gradients as outside it: the ambient autocast does not
    recast its accumulation (it used to turn ``G @ weight`` into bf16 and fail in ``scatter_add_``)."""
    from train.logprobs import HeadLogProbs

    g = torch.Generator().manual_seed(0)
    idx = torch.tensor([[0, 1, 2, 3], [2, 3, 4, 0]])
    target = torch.tensor([[1, 6, 0, 2], [3, 3, 5, 0]])
    grads = []
    for ambient in (False, True):
        g.manual_seed(0)
        hidden = torch.randn(2, 5, 3, generator=g, requires_grad=True)
        weight = torch.randn(7, 3, generator=g, requires_grad=True)
        bias = torch.randn(7, generator=g, requires_grad=True)
        lp = HeadLogProbs.apply(hidden, weight, bias, idx, target, 1 / 0.7, 3, None)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ambient):
            lp.sum().backward()
        grads.append([hidden.grad, weight.grad, bias.grad])
    for outside, inside in zip(*grads):
        assert inside.dtype == torch.float32
        torch.testing.assert_close(inside, outside, atol=0, rtol=0)
