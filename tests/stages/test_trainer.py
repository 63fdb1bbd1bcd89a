"""The PPO update on the real tiny model (SmolLM2-135M): micro-batching must not change the update,
and LoRA trains adapters that merge into a plain checkpoint."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import LoraConfig, TrainConfig
from train.examples import Example
from train.trainer import ppo_update

DEFAULT = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"


@pytest.fixture(scope="module")
def tiny(tiny_model):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


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


def test_learning_rate_zero_runs_no_backward_and_moves_no_weight(tiny):
    """The no-update control: AdamW at lr 0 (weight decay on) keeps every weight bit-identical,
    takes no step (no moments), and still reports the forward metrics of a real update."""
    from accelerate import Accelerator

    m = copy.deepcopy(tiny)
    before = {k: v.detach().clone() for k, v in m.named_parameters()}
    opt = torch.optim.AdamW(m.parameters(), lr=0.0, weight_decay=0.1)
    metrics = ppo_update(m, opt, _examples(), TrainConfig(micro_batch_size=2, num_mini_batches=2), pad_id=0, seed=0,
                         accelerator=Accelerator(cpu=True))
    assert all(torch.equal(v, before[k]) for k, v in m.named_parameters())
    assert all(p.grad is None for p in m.parameters()) and not opt.state
    assert len(metrics) == 2 and all(np.isnan(x["grad_norm"]) for x in metrics)
    # policy == old policy: ratio exactly 1, nothing clipped
    assert all(x["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and x["clip_frac"] == 0.0 for x in metrics)


def test_lora_trains_adapters_and_its_export_reloaded_from_disk_is_the_merged_model(tiny, tmp_path, tiny_model):
    """LoRA trains only its adapters; the checkpoint the train stage exports (``save_checkpoint``, the
    adapters merged) reloaded from disk in fp32 is a plain model whose logits on a fixed input equal
    the trained model's, with the adapters as trained (unmerged) and merged in memory, and differ from
    the starting model's: an export that wrote the base weights or dropped the adapters fails. In
    the file only the targeted projections moved; every other tensor is the start's, bit for bit."""
    from accelerate import Accelerator
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.state import save_checkpoint

    lc = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    m = get_peft_model(copy.deepcopy(tiny), PeftLoraConfig(r=lc.r, lora_alpha=lc.alpha, target_modules=lc.target_modules,
                                                           task_type="CAUSAL_LM"))
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    cfg = TrainConfig(micro_batch_size=2, num_mini_batches=2, lora=lc)
    metrics = ppo_update(m, opt, _examples(), cfg, pad_id=0, seed=0, accelerator=Accelerator(cpu=True))
    assert len(metrics) == 2 and all(np.isfinite(x["loss"]) for x in metrics)

    ids = torch.tensor([np.random.default_rng(2).integers(10, 2000, 24).tolist()])  # a fixed input
    m.eval()
    with torch.no_grad():
        adapters = m(input_ids=ids).logits  # the model as trained: base weights plus the adapters' path
        merged = copy.deepcopy(m).merge_and_unload()(input_ids=ids).logits  # merged in memory
        start = tiny.eval()(input_ids=ids).logits
    ckpt = tmp_path / "ckpt"
    save_checkpoint(m, AutoTokenizer.from_pretrained(tiny_model), ckpt, "float32")  # merges, as the train stage exports
    saved, start_file = load_file(str(ckpt / "model.safetensors")), load_file(f"{tiny_model}/model.safetensors")
    assert not (ckpt / "adapter_config.json").exists() and not (ckpt / "adapter_model.safetensors").exists()
    assert set(saved) == set(start_file) and {t.dtype for t in saved.values()} == {torch.float32}  # plain weights
    targeted = {k for k in saved if k.endswith(("q_proj.weight", "v_proj.weight"))}
    assert len(targeted) == 2 * tiny.config.num_hidden_layers
    for k, v in saved.items():  # only the targeted projections moved, every one of them
        assert torch.equal(v, start_file[k].to(v.dtype)) != (k in targeted), k

    reloaded = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        got = reloaded(input_ids=ids).logits
    # fp32 file: the same weights as the in-memory merge, so the same logits up to kernel order; the
    # unmerged adapters' path differs from the merged weights by fp32 rounding only
    torch.testing.assert_close(got, merged, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, adapters, atol=1e-3, rtol=1e-4)
    moved = float((got - start).abs().max())
    assert moved > 1e-2, f"the reloaded export's logits are within {moved:.1e} of the starting model's"


def _accelerator(mixed_precision: str = "no"):
    """A fresh Accelerator (Accelerate keeps one process-wide state; another precision needs a reset)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    return Accelerator(cpu=True, mixed_precision=mixed_precision)


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_kl_to_a_frozen_reference_is_measured_and_pulls_back(tiny, mixed_precision):
    """With kl_coef > 0 the k3 KL to the reference is reported, and it is exactly 0 before any update,
    also under bf16 autocast (the reference's forward runs under the policy's autocast)."""
    acc = _accelerator(mixed_precision)
    m = copy.deepcopy(tiny)
    ref = copy.deepcopy(tiny).eval().requires_grad_(False)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    m, opt = acc.prepare(m, opt)
    cfg = TrainConfig(micro_batch_size=2, num_mini_batches=2, kl_coef=0.1, max_grad_norm=1e12)
    metrics = ppo_update(m, opt, _examples(), cfg, pad_id=0, seed=0, accelerator=acc, ref_model=ref)
    _accelerator("no")
    assert metrics[0]["kl_ref"] == 0.0  # policy == reference at the first step, in the same precision
    assert metrics[1]["kl_ref"] > 0  # the first update moved the policy away from the reference


def test_the_kl_term_alone_pulls_the_policy_back_to_its_reference(tiny):
    """Zero advantages leave the k3 KL to the reference as the only gradient: against a reference
    one perturbation away, the KL measured at the second optimizer step is below the first's (a KL
    term of the wrong sign would push it up); without the term (kl_coef 0) no weight moves."""
    acc = _accelerator("no")
    m = copy.deepcopy(tiny)
    ref = copy.deepcopy(tiny).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02 * p.abs().mean())
    examples = [Example(e.prompt_ids, e.response_ids, np.zeros_like(e.advantages)) for e in _examples()]
    opt = torch.optim.SGD(m.parameters(), lr=1e-4)  # at 1e-2 the step overshoots to a larger KL
    m, opt = acc.prepare(m, opt)
    cfg = TrainConfig(micro_batch_size=4, num_mini_batches=1, ppo_epochs=2, kl_coef=0.1, max_grad_norm=1e12)
    metrics = ppo_update(m, opt, examples, cfg, pad_id=0, seed=0, accelerator=acc, ref_model=ref)
    first, second = metrics[0]["kl_ref"], metrics[1]["kl_ref"]
    assert first > 0 and second < 0.9 * first, (first, second)  # measured here: 0.234 -> 0.157
    before = {k: v.detach().clone() for k, v in m.named_parameters()}
    off = TrainConfig(micro_batch_size=4, num_mini_batches=1, ppo_epochs=2, kl_coef=0.0, max_grad_norm=1e12)
    ppo_update(m, opt, examples, off, pad_id=0, seed=0, accelerator=acc, ref_model=None)
    assert all(torch.equal(v, before[k]) for k, v in m.named_parameters())
    _accelerator("no")


def test_temperature_is_applied_to_the_trainer_logprobs(tiny):
    """The old log-probs (and so the ratio) are of logits / T: at T = 0.5 they equal
    log_softmax(2 * logits), computed here by hand."""
    from train.examples import collate
    from train.logprobs import token_logprobs

    ex = _examples()[:2]
    mb = collate(ex, pad_id=0)
    with torch.no_grad():
        lp = token_logprobs(tiny, mb, temperature=0.5)
        logits = tiny(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits.float()
    for i, e in enumerate(ex):
        P, R = len(e.prompt_ids), len(e.response_ids)
        ref = torch.log_softmax(2.0 * logits[i, P - 1:P + R - 1], -1).gather(-1, torch.tensor(e.response_ids)[:, None])[:, 0]
        torch.testing.assert_close(lp[i, :R], ref, atol=1e-5, rtol=1e-5)
    assert float((lp - token_logprobs(tiny, mb, temperature=1.0).detach()).abs().max()) > 0.1


def test_exported_bf16_checkpoint_reloaded_from_disk_moves_logprobs_with_the_advantage(tiny, tmp_path, tiny_model):
    """A real update, exported as the engines get it (bf16 cast of the fp32 master weights), reloaded
    from disk: tokens with a positive advantage gained log-prob, tokens with a negative one lost it.
    The train stage's export diagnostic (train/drift.py) counts the moved elements the file has."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.drift import checkpoint_drift
    from train.examples import collate
    from train.logprobs import token_logprobs
    from train.state import save_checkpoint

    rng = np.random.default_rng(1)
    ex = []
    for _ in range(4):  # two repeated patterns, one pushed up and one down at every position
        ex.append(Example(rng.integers(10, 2000, 6).tolist(), rng.integers(10, 2000, 8).tolist(), np.ones(8, np.float32)))
        ex.append(Example(rng.integers(10, 2000, 6).tolist(), rng.integers(10, 2000, 8).tolist(), -np.ones(8, np.float32)))
    acc = _accelerator("no")
    m = copy.deepcopy(tiny)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    m, opt = acc.prepare(m, opt)
    ppo_update(m, opt, ex, TrainConfig(micro_batch_size=4, num_mini_batches=1, ppo_epochs=2), pad_id=0, seed=0,
               accelerator=acc)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    drift = checkpoint_drift(acc.unwrap_model(m).state_dict().items(), "bfloat16", tiny_model)
    save_checkpoint(acc.unwrap_model(m), tok, tmp_path / "ckpt", "bfloat16")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    start = tiny.eval()
    from safetensors.torch import load_file

    saved, start_file = load_file(str(tmp_path / "ckpt" / "model.safetensors")), load_file(f"{tiny_model}/model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    moved = sum(int((saved[k] != start_file[k]).sum()) for k in saved)
    assert drift["export_moved_frac"] == moved / sum(saved[k].numel() for k in saved) > 0
    assert drift["master_moved_frac"] > drift["export_moved_frac"]  # lr 1e-4, 2 epochs: the dead zone holds some back
    assert 0 < drift["export_update_share"] == drift["export_update_share_from_start"]
    mb = collate(ex, pad_id=0)
    with torch.no_grad():
        delta = (token_logprobs(reloaded, mb) - token_logprobs(start, mb))[mb["mask"]]
    adv = mb["advantages"][mb["mask"]]
    assert float(delta[adv > 0].mean()) > 0 > float(delta[adv < 0].mean())
    agree = float(((delta > 0) == (adv > 0)).float().mean())
    assert agree > 0.8, f"only {agree:.0%} of the tokens moved with their advantage"


def _kernel_state() -> tuple:
    import os

    cuda = torch.backends.cuda
    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.cudnn_sdp_enabled(),
            os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


def test_deterministic_kernels_are_on_inside_the_block_and_restored_after(monkeypatch):
    """``train.deterministic``: deterministic algorithms, a fixed cuBLAS workspace and only the math
    attention inside; the caller's settings back afterwards, also when the block raises."""
    from train.trainer import deterministic_kernels

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = _kernel_state()
    assert before[0] is False and before[5] is None
    with deterministic_kernels(False):
        assert _kernel_state() == before
    with pytest.raises(RuntimeError, match="boom"):
        with deterministic_kernels(True):
            assert _kernel_state() == (True, True, False, False, False, ":4096:8")
            raise RuntimeError("boom")
    assert _kernel_state() == before
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # a user's own setting is kept, and kept after
    with deterministic_kernels(True):
        assert _kernel_state()[5] == ":16:8"
    assert _kernel_state()[5] == ":16:8"


def test_train_stage_runs_its_update_under_train_deterministic(monkeypatch, tmp_path, tiny_model):
    """The whole update (old log-probs, reference, update, export) runs inside the kernels' block
    when ``train.deterministic`` is set, and outside it by default. The update is replaced by a
    probe here (the round's tables too): what is tested is the stage around it; the update has its
    own tests."""
    import pipeline.stages.train as S
    import train.trainer as T
    from pipeline.config import load_config

    class Probed(Exception):
        pass

    seen = []

    def probe(job):
        seen.append(torch.are_deterministic_algorithms_enabled())
        raise Probed

    monkeypatch.setattr(S, "train_key", lambda *a: {"probe": 1})  # no round on disk: nothing to fingerprint
    monkeypatch.setattr(S, "load_examples", lambda *a: [object()])
    monkeypatch.setattr(T, "update_policy", probe)
    for over in (["train.deterministic=true"], []):
        with pytest.raises(Probed):
            S.train_stage(load_config(DEFAULT, [f"runs_dir={tmp_path}", f"rollout.policy={tiny_model}", *over]), 1)
    assert seen == [True, False] and not torch.are_deterministic_algorithms_enabled()


def test_train_deterministic_enters_the_stage_key_only_when_on():
    """Runs trained before a setting existed keep their train key (no re-training on resume):
    ``deterministic``, ``ratio_trace`` (GRPO-λ) and ``future_kl`` (FIPO) enter it only when set."""
    from pipeline.config import load_config
    from pipeline.stages.train import train_settings_key

    default = load_config(DEFAULT, [])
    old_rule = {k: v for k, v in default.model_dump(mode="json")["train"].items()
                if k not in ("launcher", "keep_states", "deterministic", "ratio_trace", "future_kl")}
    assert train_settings_key(default) == old_rule
    on = train_settings_key(load_config(DEFAULT, ["train.deterministic=true"]))
    assert on == {**old_rule, "deterministic": True}
    lam = train_settings_key(load_config(DEFAULT, [], preset="grpo-lambda"))
    assert lam["ratio_trace"] == {"kappa": 0.99, "style": "recent"} and "future_kl" not in lam
    assert train_settings_key(load_config(DEFAULT, [], preset="fipo"))["future_kl"]["half_life"] == 32.0
    # where the metrics are logged changes no output: the key of the default (report_to=[]) stays
    assert train_settings_key(load_config(DEFAULT, ["train.report_to=[tensorboard]"])) == old_rule


def test_a_second_in_process_train_stage_may_use_another_mixed_precision(monkeypatch):
    """Accelerate keeps one state per process and refuses an Accelerator of another precision; the
    train stage clears it first when the process is alone (a notebook running a bf16 run, then an
    fp32 one, failed at the second before), and leaves a launched process's state alone."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from train.distributed import allow_precision_change

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    try:
        _accelerator("no")
        with pytest.raises(ValueError, match="already been initialized"):
            Accelerator(cpu=True, mixed_precision="bf16")  # the defect, without the helper
        allow_precision_change("no")  # same precision: the state is kept
        assert AcceleratorState._shared_state
        allow_precision_change("bf16")
        assert Accelerator(cpu=True, mixed_precision="bf16").mixed_precision == "bf16"
        monkeypatch.setenv("WORLD_SIZE", "2")  # launched: never touched
        allow_precision_change("no")
        assert AcceleratorState._shared_state["_mixed_precision"] == "bf16"
    finally:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        _accelerator("no")


def test_train_stage_lets_the_precision_change_before_it_builds_its_accelerator(monkeypatch, tmp_path, tiny_model):
    """The stage calls :func:`allow_precision_change` with its resolved precision, before the
    Accelerator is built (the build is stopped there: what is tested is the order)."""
    import accelerate

    import train.trainer as T
    from pipeline.config import load_config

    calls = []

    class Built(Exception):
        pass

    def accelerator(*a, **k):
        calls.append(("Accelerator", k.get("mixed_precision")))
        raise Built

    import pipeline.stages.train as S

    monkeypatch.setattr(S, "train_key", lambda *a: {"probe": 1})  # no round on disk: nothing to fingerprint
    monkeypatch.setattr(S, "load_examples", lambda *a: [object()])
    monkeypatch.setattr(T, "allow_precision_change", lambda m: calls.append(("allow", m)))
    monkeypatch.setattr(accelerate, "Accelerator", accelerator)
    with pytest.raises(Built):
        S.train_stage(load_config(DEFAULT, [f"runs_dir={tmp_path}", f"rollout.policy={tiny_model}",
                                            "train.mixed_precision=no"]), 1)
    assert calls == [("allow", "no"), ("Accelerator", "no")]


_TRAIN_RUNS = (("plain", []), ("k0", ["train.ratio_trace.kappa=0"]), ("k09", ["train.ratio_trace.kappa=0.9"]),
               ("fipo", ["train.future_kl.half_life=32"]))
"""The train-stage runs of :func:`train_rounds`: configs/default.yaml as shipped ("plain"), GRPO-λ at
kappa 0 and 0.9, FIPO."""


@pytest.fixture(scope="module")
def train_rounds(module_tmp, tiny_model) -> dict:
    """Round 1 of configs/default.yaml with the tiny policy, trained by the real train stage as a round
    runs it (:func:`flows.runner.run_stage`: a child process) under each setting of :data:`_TRAIN_RUNS`,
    on the toy round of :func:`tests.toy_round.write_train_round`. Returns ``{name: (cfg, result)}``.

    One real run per setting, shared: the defaults' precision test reads the "plain" run (the
    shipped defaults), the GRPO-λ / FIPO test all four. The children run two at a time with one
    intra-op thread each (``OMP_NUM_THREADS=1``): on 2 cores that keeps both busy through the
    single-threaded parts (imports, loading, saving, hashing) that one 2-thread child after another
    leaves half idle; every run has the same thread count, so the bit-for-bit comparison of two runs
    (kappa 0 against plain) compares the same float sums."""
    from concurrent.futures import ThreadPoolExecutor

    from flows.runner import run_stage
    from pipeline.config import load_config
    from tests.toy_round import write_train_round

    tmp = module_tmp("train-rounds")
    cfgs = {}
    for name, over in _TRAIN_RUNS:
        cfgs[name] = load_config(DEFAULT, [f"runs_dir={tmp / 'runs'}", f"data_dir={tmp / 'data'}", f"run_id={name}",
                                           f"rollout.policy={tiny_model}", *over])
        write_train_round(cfgs[name], tiny_model)
    with pytest.MonkeyPatch.context() as mp, ThreadPoolExecutor(2) as pool:
        mp.setenv("OMP_NUM_THREADS", "1")  # read by each child when it starts (this process keeps its threads)
        running = {name: pool.submit(run_stage, "train", cfg, 1) for name, cfg in cfgs.items()}
        done = {name: f.result() for name, f in running.items()}
    return {name: (cfgs[name], done[name]) for name in cfgs}


def test_default_precision_checkpoint_reloaded_from_disk_is_the_master_and_carries_the_whole_update(train_rounds,
                                                                                                     tiny_model):
    """configs/default.yaml's precision (``rollout.engine.dtype: float32``, ``train.mixed_precision:
    no``, ``train.save_dtype: auto``) with the tiny policy, one train stage run as a round runs it
    (the "plain" run of :func:`train_rounds`):

    - the engine checkpoint, reloaded from disk, is bit for bit the training state's fp32 master
      weights, so it carries the round's whole update (``export_update_share`` 1; under the old
      ``auto`` defaults a CPU with native bf16 exported bf16 and carried 11 % of it, README);
    - the round moved most of the checkpoint's elements at the default learning rate;
    - tokens with a positive advantage gained log-prob under the reloaded checkpoint and tokens with
      a negative one lost it (the sign test of the bf16 export above, on the defaults' artifact).

    In the fast suite on purpose (one 135M train stage, shared with the GRPO-λ / FIPO test): it
    guards the shipped defaults.
    """
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pipeline import storage
    from pipeline.stages.base import round_paths
    from pipeline.stages.train import load_examples
    from train.examples import collate
    from train.logprobs import token_logprobs

    cfg, res = train_rounds["plain"]
    assert (cfg.rollout.engine.dtype, cfg.train.mixed_precision, cfg.train.save_dtype) == ("float32", "no", "auto")
    assert not res.skipped
    p = round_paths(cfg, 1)
    prec = storage.read_manifest(p["checkpoint"])["precision"]
    assert (prec["rollout_dtype"], prec["train_mixed_precision"], prec["train_save_dtype"]) == ("float32", "no", "float32")

    saved, master = load_file(str(p["checkpoint"] / "model.safetensors")), load_file(str(p["train_state"] / "model.safetensors"))
    start = load_file(f"{tiny_model}/model.safetensors")
    assert saved.keys() <= master.keys() and saved.keys() == start.keys()
    assert {t.dtype for t in saved.values()} == {t.dtype for t in master.values()} == {torch.float32}
    for k, v in saved.items():
        assert torch.equal(v, master[k]), f"{k}: the checkpoint is not the master weights"
    moved = sum(int((saved[k] != start[k].float()).sum()) for k in saved) / sum(v.numel() for v in saved.values())
    metrics = {m["name"]: m["value"] for m in storage.read_table(p["train_metrics"], "train_metrics").to_pylist()
               if m["name"].startswith(("export", "master"))}
    assert metrics["export_update_share"] == 1.0 == metrics["export_update_share_from_start"]
    assert metrics["export_moved_frac"] == pytest.approx(moved, abs=1e-9) == metrics["master_moved_frac"]
    assert moved > 0.5, f"round 1 moved only {moved:.1%} of the checkpoint's elements"

    reloaded = AutoModelForCausalLM.from_pretrained(p["checkpoint"], dtype=torch.float32).eval()
    before = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    mb = collate(load_examples(cfg, 1), pad_id=0)
    with torch.no_grad():
        delta = (token_logprobs(reloaded, mb) - token_logprobs(before, mb))[mb["mask"]]
    adv = mb["advantages"][mb["mask"]]
    agree = float(((delta > 0) == (adv > 0)).float().mean())
    print(f"moved {moved:.1%} of elements; mean dlogp: adv>0 {float(delta[adv > 0].mean()):.2e}, "
          f"adv<0 {float(delta[adv < 0].mean()):.2e}; agree {agree:.0%}")  # measured: 98.2 %, +0.033, -0.117, 82 %
    assert float(delta[adv > 0].mean()) > 0 > float(delta[adv < 0].mean())
    assert agree > 0.7, f"only {agree:.0%} of the tokens moved with their advantage"


def test_grpo_lambda_and_fipo_reach_the_update(train_rounds):
    """The train stage under ``train.ratio_trace`` (GRPO-λ) and ``train.future_kl`` (FIPO) on the real
    tiny model and a toy round (the runs of :func:`train_rounds`): kappa 0 is the plain per-token
    ratio (the same checkpoint, bit for bit); kappa 0.9 and FIPO start from the plain loss (every
    ratio is exp(0) = 1 and every FIPO weight 1 before the first step) and end at other weights
    (GRPO-λ: earlier tokens get later tokens' advantages through the trace; FIPO: the second step's
    advantages are weighted by the first step's future shift)."""
    from safetensors.torch import load_file

    from pipeline import storage
    from pipeline.stages.base import round_paths

    out, credits = {}, {}
    for name, _ in _TRAIN_RUNS:
        cfg, res = train_rounds[name]
        assert (cfg.train.ratio_trace is None) == (name in ("plain", "fipo"))
        assert not res.skipped
        p = round_paths(cfg, 1)
        loss0 = [m["value"] for m in storage.read_table(p["train_metrics"], "train_metrics").to_pylist()
                 if m["name"] == "loss" and m["step"] == 0]
        out[name] = (load_file(str(p["checkpoint"] / "model.safetensors")), loss0[0])
        adv = {r["rollout_id"]: r["advantages"] for r in storage.read_table(p["token_rewards"], "token_rewards").to_pylist()}
        rows = storage.read_table(p["token_credit"], "token_credit").to_pylist()
        assert sorted(r["rollout_id"] for r in rows) == sorted(adv) and {r["passes"] for r in rows} == {1}
        assert all(len(r["credit"]) == len(adv[r["rollout_id"]]) and r["variant"] == cfg.variant for r in rows)
        credits[name] = {r["rollout_id"]: np.array(r["credit"], np.float64) for r in rows}
    plain, k0, k09 = out["plain"], out["k0"], out["k09"]
    # where each update put the credit (token_credit): the first mini-batch runs at ratio 1, so its
    # responses carry their advantage (GRPO-λ: the advantage traced back); later ones move with the ratio
    from pipeline.core.rewards import trace_credit

    A = {rid: np.array(a, np.float64) for rid, a in adv.items()}  # the same toy advantages in every run
    at_start = [rid for rid in A if np.allclose(credits["plain"][rid], A[rid], rtol=1e-5, atol=1e-7)]
    moved = {rid: float(np.max(np.abs(credits["plain"][rid] - A[rid]))) for rid in A}
    print(f"plain credit vs advantage, max |diff| per response: {moved}")
    assert 2 <= len(at_start) < len(A), f"one of two mini-batches runs at ratio 1: {moved}"
    assert all(np.array_equal(credits["plain"][rid], credits["k0"][rid]) for rid in A)
    traced = {rid: trace_credit(A[rid], np.array([0, len(A[rid])]), 0.9, "recent") for rid in A}
    assert all(np.allclose(credits["k09"][rid], traced[rid], rtol=1e-4, atol=1e-6) for rid in at_start)
    assert all(not np.allclose(credits["k09"][rid], A[rid], rtol=1e-2) for rid in at_start), "the trace moved no credit"
    # FIPO after its first step: the same ratios as the plain run (the same first step), each token's
    # credit multiplied by its influence weight f in [1, 1.2]
    for rid in A:
        on = credits["plain"][rid] != 0
        f = credits["fipo"][rid][on] / credits["plain"][rid][on]
        assert np.all((f > 1 - 1e-5) & (f < 1.2 + 1e-5)), f"{rid}: FIPO weights {f.min()}..{f.max()}"
    assert all(np.allclose(credits["fipo"][rid], A[rid], rtol=1e-5, atol=1e-7) for rid in at_start)
    assert any(not np.allclose(credits["fipo"][rid], credits["plain"][rid], rtol=1e-7, atol=0) for rid in A)
    assert all(torch.equal(plain[0][k], k0[0][k]) for k in plain[0]), "kappa 0 must be the plain ratio"
    assert k09[1] == pytest.approx(plain[1], abs=1e-4)
    assert any(not torch.equal(plain[0][k], k09[0][k]) for k in plain[0]), "the trace changed no weight"
    fipo = out["fipo"]
    assert fipo[1] == pytest.approx(plain[1], abs=1e-4)
    assert any(not torch.equal(plain[0][k], fipo[0][k]) for k in plain[0]), "FIPO's weights changed no update"


def test_retraining_a_round_moves_its_earlier_state_and_checkpoint_to_superseded(tmp_path):
    """A round trained again (same variant, other settings) keeps what the first training wrote: its
    checkpoint and its training state, each with its manifest, move to ``superseded/``; the new ones
    are committed in their place. (The trainer's output is written by hand: the commit is under test.)"""
    import json
    from types import SimpleNamespace

    from pipeline import storage
    from pipeline.stages.base import round_paths
    from pipeline.stages.train import commit_round
    from tests.toy_round import toy_config

    cfg = toy_config(tmp_path, "critique.enabled=false", "reward.process_weight=0", "reward.estimator=grpo", "variant=grpo")
    p = round_paths(cfg, 1)

    p["train_state"].parent.mkdir(parents=True)

    def train_once(tag: str) -> None:
        job = SimpleNamespace(state_out=tmp_path / f"state-{tag}", checkpoint_out=tmp_path / f"ckpt-{tag}",
                              policy="start", examples=[])
        for d, name in ((job.state_out, "optimizer.bin"), (job.checkpoint_out, "config.json")):
            d.mkdir()
            (d / name).write_text(json.dumps({"tag": tag}))
        out = SimpleNamespace(metrics=[{"loss": 0.5}], layout={}, credit=None, optimizer_steps=1)
        commit_round(cfg, 1, {"train": tag}, job, out, 1.0)

    train_once("first")
    train_once("second")
    assert json.loads((p["train_state"] / "optimizer.bin").read_text())["tag"] == "second"
    assert json.loads((p["checkpoint"] / "config.json").read_text())["tag"] == "second"
    assert storage.read_manifest(p["train_state"])["key"] == {"train": "second"}
    for path, name in ((p["train_state"], "optimizer.bin"), (p["checkpoint"], "config.json")):
        (old,) = [d for d in (path.parent / "superseded").iterdir() if d.name.startswith(path.name) and d.is_dir()]
        assert json.loads((old / name).read_text())["tag"] == "first", path  # kept, not deleted
        assert storage.read_manifest(old)["key"] == {"train": "first"}, path  # with its manifest
