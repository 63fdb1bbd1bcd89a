"""The persistent policy engine (``scale.policy_engine=persistent``) with real vLLM and SmolLM2-135M.

Slow: it starts vLLM twice. It checks that one host engine serves several stages, that loading a
new checkpoint reloads the weights in place instead of restarting, and that what the reloaded
engine generates equals what a fresh engine of the new checkpoint generates (greedy), which also
proves the prefix cache of the old weights was dropped (the same prompt is sent before and after).
Then the ``capo-run`` flow over two rounds of the tiny config: one engine start serves both rounds
(``capo run`` holds the same session around its rounds).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import SamplingConfig, load_config

pytestmark = pytest.mark.slow

GREEDY = SamplingConfig(temperature=0.0, top_p=1.0, max_tokens=24)
# vLLM on CPU caches whole blocks of 128 tokens: the shared system prompt is longer than one block
SYSTEM = {"role": "system", "content": " ".join(["You are a careful assistant who answers briefly."] * 30)}
CONVS = [[SYSTEM, {"role": "user", "content": "What is 12 + 30? Answer with a number."}],
         [SYSTEM, {"role": "user", "content": "Name three prime numbers."}]]


def _tiny(repo: Path, data_dir: Path, runs: Path, *extra: str):
    return load_config(repo / "configs" / "tiny.yaml",
                       [f"runs_dir={runs}", f"data_dir={data_dir}", "scale.policy_engine=persistent", *extra])


@pytest.fixture(scope="module")
def perturbed_checkpoint(data_dir, module_tmp) -> tuple[str, str]:
    """(the tiny model, a copy whose weights moved enough to change greedy answers)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = str(data_dir / "models" / "smollm2-135m-instruct")
    out = module_tmp("ckpt") / "perturbed"
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.3)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return src, str(out)


def test_host_reloads_weights_in_place_matches_a_fresh_engine_and_survives_a_bad_checkpoint(repo, data_dir, tmp_path, perturbed_checkpoint):
    from pipeline.engines.host import (
        ADDRESS_ENV,
        RemoteEngine,
        policy_engine,
        policy_engine_session,
    )

    base, moved = perturbed_checkpoint
    cfg = _tiny(repo, data_dir, tmp_path)
    ecfg = cfg.rollout.engine
    with policy_engine_session(cfg) as address:
        assert address and Path(address).exists()
        e1 = policy_engine(base, ecfg, seed=1)  # what the rollout stage gets
        assert isinstance(e1, RemoteEngine) and e1.stats.extra["host_action"] == "started"
        before = [g.samples[0].token_ids for g in e1.generate(CONVS, 1, GREEDY)]
        e1.close()
        e2 = RemoteEngine(base, ecfg, seed=2)  # the next stage, same checkpoint
        assert e2.stats.extra["host_action"] == "reused"
        again = [g.samples[0].token_ids for g in e2.generate(CONVS, 1, GREEDY)]
        assert e2.stats.cached_prompt_tokens > 0  # the prefix cache served the repeated prompts
        e2.close()
        e3 = RemoteEngine(moved, ecfg, seed=3)  # the next round's checkpoint
        assert e3.stats.extra["host_action"] == "reloaded"
        assert e3.stats.extra["host_engine_starts"] == 1 and e3.stats.extra["host_reloads"] == 1
        after = [g.samples[0].token_ids for g in e3.generate(CONVS, 1, GREEDY)]
        # the old weights' KV entries were dropped: fewer hits than the same prompts got before
        assert e3.stats.cached_prompt_tokens < e2.stats.cached_prompt_tokens
        e3.close()
    assert ADDRESS_ENV not in __import__("os").environ and not Path(address).exists()
    assert again == before
    assert after != before  # the perturbation changes the greedy answers

    # a fresh host at the moved weights gives the reloaded host's answers; then (the same host, one
    # engine start less than a session of its own) a checkpoint that does not load is reported as the
    # host's failure and the host keeps serving the weights it had
    with policy_engine_session(_tiny(repo, data_dir, tmp_path / "fresh")):
        fresh = RemoteEngine(moved, ecfg, seed=3)
        assert fresh.stats.extra["host_action"] == "started"
        expected = [g.samples[0].token_ids for g in fresh.generate(CONVS, 1, GREEDY)]
        fresh.close()
        with pytest.raises(RuntimeError, match="policy engine host failed on 'load'"):
            RemoteEngine(str(tmp_path / "no-such-checkpoint"), ecfg)
        e = RemoteEngine(moved, ecfg)
        assert len(e.generate(CONVS[:1], 2, SamplingConfig(max_tokens=4))[0].samples) == 2
        e.close()
    assert after == expected
    assert "reloaded" in (tmp_path / "tiny" / "policy_engine.log").read_text()


def test_capo_run_flow_keeps_one_host_for_its_rounds(repo, data_dir, tmp_path, harness):
    """The ``capo-run`` Prefect flow over two rounds starts the host once and its nested ``capo-round``
    flows reuse it: round 1's rollouts start the engine, round 0's eval reuses it, round 1's eval
    reloads the new checkpoint, round 2's rollouts reuse that (the same policy) and its eval reloads
    again."""
    from flows.round import capo_run
    from pipeline.stages.base import round_paths
    from pipeline.storage import read_manifest

    runs = tmp_path / "runs"
    # GRPO: no critic, whose engine is not the policy's host and tests nothing here (two critique
    # children of about 13 s each on a 2-core CPU)
    over = [f"runs_dir={runs}", f"data_dir={data_dir}", "scale.policy_engine=persistent",
            "data.prompts_per_round=1", "eval.benchmarks=[gsm8k]", "rollout.sampling.max_tokens=24",
            "eval.max_tokens=16"]
    capo_run(rounds=2, config=str(repo / "configs" / "tiny.yaml"), overrides=over, preset="grpo")
    cfg = load_config(repo / "configs" / "tiny.yaml", over, preset="grpo")
    log = (runs / "tiny" / "policy_engine.log").read_text()
    actions = [w for line in log.splitlines() if "capo.engine_host: " in line
               for w in line.split("capo.engine_host: ")[1].split()[:1] if w in ("started", "reused", "reloaded")]
    assert actions[:3] == ["started", "reused", "reloaded"] and actions.count("started") == 1, actions

    def engine(path):
        return read_manifest(path)["engine"]

    r1, r2 = round_paths(cfg, 1), round_paths(cfg, 2)
    assert engine(r1["rollouts"])["host_action"] == "started"
    assert engine(r2["rollouts"])["host_action"] == "reused"
    assert engine(r2["rollouts"])["host_engine_starts"] == 1
    assert log.count("engine starts 1, reloads 2") >= 1 and "engine starts 2" not in log
    summary = json.loads(r2["run_summary"].read_text())
    assert not any(s["skipped"] for s in summary["stages"] if s["stage"] in ("rollout", "train"))


def test_capo_run_command_holds_one_host_session_for_all_its_rounds(repo, tmp_path, monkeypatch):
    """``capo run --rounds 3`` enters :func:`policy_engine_session` once, around every round (the flow
    above runs the real host through the same session; here the rounds are recorded, not run)."""
    from contextlib import contextmanager

    from typer.testing import CliRunner

    import flows.cli as cli
    import pipeline.engines.host as host

    events = []

    @contextmanager
    def session(cfg, *a, **k):
        events.append(("enter", cfg.scale.policy_engine))
        yield None
        events.append(("exit", None))

    monkeypatch.setattr(host, "policy_engine_session", session)
    monkeypatch.setattr(cli, "_run_round", lambda cfg, k, force: events.append(("round", k)))
    monkeypatch.setattr(cli, "_setup_logging", lambda: None)
    res = CliRunner().invoke(cli.app, ["run", "--rounds", "3", "--config", str(repo / "configs" / "tiny.yaml"),
                                       f"runs_dir={tmp_path}", "scale.policy_engine=persistent"])
    assert res.exit_code == 0, res.output
    assert events == [("enter", "persistent"), ("round", 1), ("round", 2), ("round", 3), ("exit", None)]
