"""The PPO update on the real tiny model (SmolLM2-135M): micro-batching must not change the update,
and LoRA trains adapters that merge into a plain checkpoint."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from pipeline.config import LoraConfig, TrainConfig
from train.trainer import Example, ppo_update


@pytest.fixture(scope="module")
def tiny(data_dir):
    from transformers import AutoModelForCausalLM

    from pipeline.assets import ensure_model

    path = ensure_model("smollm2-135m-instruct", root=data_dir / "models")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _examples(seed: int = 0) -> list[Example]:
    rng = np.random.default_rng(seed)
    out = []
    for t in (5, 9, 3, 7):  # uneven lengths: padding and normalizers matter
        out.append(Example(rng.integers(10, 2000, 6).tolist(), rng.integers(10, 2000, t).tolist(),
                           rng.normal(size=t).astype(np.float32)))
    return out


def _delta(model, examples, **tc) -> dict[str, torch.Tensor]:
    from accelerate import Accelerator

    m = copy.deepcopy(model)
    before = {k: v.detach().clone() for k, v in m.named_parameters()}
    opt = torch.optim.SGD(m.parameters(), lr=1.0)  # the update is minus the gradient, exactly
    cfg = TrainConfig(max_grad_norm=1e12, num_mini_batches=1, **tc)
    ppo_update(m, opt, examples, cfg, pad_id=0, seed=0, accelerator=Accelerator(cpu=True))
    return {k: v.detach() - before[k] for k, v in m.named_parameters()}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batching_does_not_change_the_update(tiny, mode):
    ex = _examples()
    whole = _delta(tiny, ex, micro_batch_size=4, loss_agg_mode=mode)
    split = _delta(tiny, ex, micro_batch_size=1, loss_agg_mode=mode)
    num = sum(float((whole[k] - split[k]).norm() ** 2) for k in whole) ** 0.5
    den = sum(float(whole[k].norm() ** 2) for k in whole) ** 0.5
    assert den > 0 and num / den < 1e-4, f"{mode}: relative difference {num / den:.2e}"


def test_zero_advantages_leave_the_policy_unchanged(tiny):
    ex = [Example(e.prompt_ids, e.response_ids, np.zeros_like(e.advantages)) for e in _examples()]
    d = _delta(tiny, ex, micro_batch_size=2)
    assert max(float(v.abs().max()) for v in d.values()) == 0.0


def test_lora_trains_adapters_and_merges_into_plain_weights(tiny):
    from accelerate import Accelerator
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    lc = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    m = get_peft_model(copy.deepcopy(tiny), PeftLoraConfig(r=lc.r, lora_alpha=lc.alpha, target_modules=lc.target_modules,
                                                           task_type="CAUSAL_LM"))
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    cfg = TrainConfig(micro_batch_size=2, num_mini_batches=2, lora=lc)
    metrics = ppo_update(m, opt, _examples(), cfg, pad_id=0, seed=0, accelerator=Accelerator(cpu=True))
    assert len(metrics) == 2 and all(np.isfinite(x["loss"]) for x in metrics)
    merged = m.merge_and_unload()
    q0 = dict(tiny.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    q1 = dict(merged.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    k0 = dict(tiny.named_parameters())["model.layers.0.self_attn.k_proj.weight"]
    k1 = dict(merged.named_parameters())["model.layers.0.self_attn.k_proj.weight"]
    assert not torch.equal(q0, q1) and torch.equal(k0, k1)  # only targeted modules moved


def test_kl_to_a_frozen_reference_is_measured_and_pulls_back(tiny):
    """With kl_coef > 0 the k3 KL to the reference is reported, and it is 0 before any update."""
    from accelerate import Accelerator

    m = copy.deepcopy(tiny)
    ref = copy.deepcopy(tiny).eval().requires_grad_(False)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    cfg = TrainConfig(micro_batch_size=2, num_mini_batches=2, kl_coef=0.1, max_grad_norm=1e12)
    metrics = ppo_update(m, opt, _examples(), cfg, pad_id=0, seed=0, accelerator=Accelerator(cpu=True), ref_model=ref)
    assert metrics[0]["kl_ref"] == pytest.approx(0.0, abs=1e-7)  # policy == reference at the first step
    assert metrics[1]["kl_ref"] > 0  # the first update moved the policy away from the reference
