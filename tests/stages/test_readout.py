"""The critic's log-prob readout through the real transformers engine (pipeline/core/readout.py,
TransformersEngine.token_probs, the critique stage's ``logprob`` rows and their vote)."""

import pytest

from pipeline import storage
from pipeline.config import TransformersEngineConfig
from pipeline.core.critique import build_critique_messages
from pipeline.core.readout import CONTENT_FREE, binary_wrong, calibrate, forced_answer, verdict_token_ids
from pipeline.engines.base import apply_chat_template
from pipeline.engines.transformers_engine import TransformersEngine
from pipeline.stages.base import round_paths

# planted errors and their right twins; the step judged is the first
PAIRS = [
    ("What is 2 + 2?", "4", ["2 + 2 = 4. \\boxed{4}"], ["2 + 2 = 97. \\boxed{97}"]),
    ("Tom has 3 boxes of 10 pens. How many pens?", "30", ["3 * 10 = 30 pens.", "\\boxed{30}"],
     ["3 * 10 = 13 pens.", "\\boxed{13}"]),
    ("A shirt costs $20 and is 50% off. What is the price?", "10",
     ["50% of 20 is 10, so it costs 20 - 10 = 10.", "\\boxed{10}"],
     ["50% of 20 is 10, so it costs 20 + 10 = 30.", "\\boxed{30}"]),
]


@pytest.fixture(scope="module")
def critic(qwen_model):
    eng = TransformersEngine(qwen_model, TransformersEngineConfig(dtype="float32"))
    yield eng
    eng.close()


def _readout(eng, question, steps, gold, template):
    tok = eng.tokenizer
    ids, pos = forced_answer(apply_chat_template(tok, build_critique_messages(question, steps, gold, template)),
                             len(steps), tok)
    probs = eng.token_probs([ids], [pos], list(verdict_token_ids(tok)))[0]
    assert probs.shape == (len(steps), 2) and ((probs > 0) & (probs < 1)).all()
    return [binary_wrong(c, w) for c, w in probs]


def test_a_planted_wrong_step_scores_higher_than_its_right_twin(critic):
    """Measured with Qwen2.5-Coder-0.5B in fp32 under the default template: P(wrong) of the planted step
    exceeds its twin's by 5 to 33 % of its value in each pair (by 2 to 13 % under capo-genprm-v2);
    calibration by the content-free readout of the same step count keeps the order."""
    template = "capo-genprm-v1"
    cf: dict[int, float] = {}
    for question, gold, right, wrong in PAIRS:
        r, w = _readout(critic, question, right, gold, template)[0], _readout(critic, question, wrong, gold, template)[0]
        n = len(right)
        if n not in cf:
            cf[n] = _readout(critic, CONTENT_FREE, [CONTENT_FREE] * n, CONTENT_FREE, template)[0]
        assert w > r, (question, r, w)
        assert calibrate(w, cf[n]) > calibrate(r, cf[n])


def test_the_critique_stage_writes_and_votes_the_readout(tmp_path, monkeypatch, qwen_model):
    """``critique.logprob_readout``: one ``logprob`` row per rollout with a calibrated P(wrong) per step, read
    by the real engine from the critic's checkpoint; ``vote.sources=[logprob]`` turns it into weights
    (P(wrong) itself under average, above the threshold under the others). The sampled critiques come
    from a stand-in critic: they are not what this test is about."""
    import pipeline.stages.critique as sg
    from pipeline.stages.vote import vote_stage
    from tests.flows.test_fanout import EMPTY, RIDS, FakeCritic, _cfg, _write_round

    monkeypatch.setattr(sg, "make_engine", FakeCritic)
    cfg = _cfg(tmp_path, f"critique.critic={qwen_model}", "critique.engine.type=transformers",
               "critique.engine.dtype=float32", "critique.logprob_readout=true", "vote.sources=[logprob]",
               "vote.logprob_threshold=0.5")
    _write_round(cfg)
    assert "logprob" in sg.critique_key(cfg, 1)
    res = sg.critique_stage(cfg, 1)
    p = round_paths(cfg, 1)
    rows = {r["rollout_id"]: r for r in storage.read_table(p["critiques"], "critiques").to_pylist() if r["source"] == "logprob"}
    assert sorted(rows) == sorted(RIDS)
    assert rows[EMPTY]["parse_status"] == "skipped_empty_response" and rows[EMPTY]["step_scores"] is None
    live = [r for rid, r in rows.items() if rid != EMPTY]
    for r in live:
        assert len(r["step_scores"]) == r["n_steps"] == 2 and all(0 < q < 1 for q in r["step_scores"])
        assert r["wrong_steps"] == [i for i, q in enumerate(r["step_scores"]) if q > 0.5]
        assert r["raw_text"].startswith("Step 0: P(wrong) ")
    assert storage.read_manifest(p["critiques"])["readout"]["prefill_tokens"] > 0
    vote_stage(cfg, 1)
    sv = storage.read_table(p["step_verdicts"], "step_verdicts").to_pylist()
    for v in sv:
        q = rows[v["rollout_id"]]["step_scores"]
        if q is None:
            assert v["weight"] == 0 and v["logprob_score"] is None
            continue
        assert v["logprob_score"] == pytest.approx(q[v["step_idx"]])
        want = q[v["step_idx"]] if v["rule"] == "average" else float(q[v["step_idx"]] > 0.5)
        assert v["weight"] == pytest.approx(want), v
    # turning the readout off keeps the sampled critiques (no critic call) and drops the logprob rows
    calls = len(FakeCritic.calls)
    off = _cfg(tmp_path, f"critique.critic={qwen_model}", "critique.engine.type=transformers",
               "critique.engine.dtype=float32")
    assert not sg.critique_stage(off, 1).skipped and len(FakeCritic.calls) == calls
    assert {r["source"] for r in storage.read_table(p["critiques"], "critiques").to_pylist()} == {"llm", "arithmetic"}
    assert res.critic_calls == len(RIDS) - 1


class _CharTokenizer:
    """One token per character (id = code point; the two verdict words one token each, 1 and 2),
    with a chat template that joins the messages."""

    def encode(self, text, add_special_tokens=False):
        return {" correct": [1], " wrong": [2]}.get(text) or [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return self.encode("\n".join(m["content"] for m in messages) + "\nassistant:")


class _OverflowingCritic:
    """Stands in for the critic's forward pass (TransformersEngine.token_probs): P(correct) 0.6,
    P(wrong) 0.2 at every step, except NaN at step 1 of rollout ``r5`` (an fp16 overflow, say)."""

    def __init__(self, model, cfg):
        from pipeline.engines.base import EngineStats

        self.tokenizer, self.stats = _CharTokenizer(), EngineStats()

    def token_probs(self, ids, positions, candidates):
        import numpy as np

        out = []
        for seq, pos in zip(ids, positions):
            probs = np.tile([0.6, 0.2], (len(pos), 1))
            if "step 1 of r5" in "".join(map(chr, seq)):
                probs[1] = [np.nan, np.nan]
            out.append(probs)
        return out

    def close(self):
        pass


def test_a_nonfinite_readout_is_recorded_not_a_failed_round(tmp_path, monkeypatch):
    """A NaN from the critic's readout of one rollout: that rollout's ``logprob`` row is
    ``readout_nonfinite`` with no step scores (the raw text shows the NaN), the other rollouts are
    scored, the manifest counts it, and the vote gives it no score (weight 0, logprob_score null)."""
    import pipeline.engines.transformers_engine as te
    import pipeline.stages.critique as sg
    from pipeline.stages.vote import vote_stage
    from tests.flows.test_fanout import EMPTY, RIDS, FakeCritic, _cfg, _write_round

    monkeypatch.setattr(sg, "make_engine", FakeCritic)  # the sampled critiques: not what this test is about
    monkeypatch.setattr(te, "TransformersEngine", _OverflowingCritic)
    cfg = _cfg(tmp_path, "critique.engine.type=transformers", "critique.logprob_readout=true", "vote.sources=[logprob]")
    _write_round(cfg)
    sg.critique_stage(cfg, 1)
    p = round_paths(cfg, 1)
    rows = {r["rollout_id"]: r for r in storage.read_table(p["critiques"], "critiques").to_pylist() if r["source"] == "logprob"}
    assert sorted(rows) == sorted(RIDS)
    bad = rows["r5"]
    assert (bad["parse_status"], bad["step_scores"], bad["wrong_steps"]) == ("readout_nonfinite", None, None)
    assert "Step 1: raw P(wrong) nan, content-free 0.250 (not finite)" in bad["raw_text"]
    for rid in set(RIDS) - {"r5", EMPTY}:  # binary 0.2 / 0.8 = 0.25 on the input and the content-free one: q = 0.5
        assert rows[rid]["parse_status"] == "complete" and rows[rid]["step_scores"] == pytest.approx([0.5, 0.5])
    assert storage.read_manifest(p["critiques"])["readout"]["nonfinite"] == 1
    vote_stage(cfg, 1)
    sv = [v for v in storage.read_table(p["step_verdicts"], "step_verdicts").to_pylist() if v["rollout_id"] == "r5"]
    assert sv and all(v["logprob_score"] is None and v["weight"] == 0 for v in sv)


def test_critic_eval_records_a_nonfinite_readout_as_no_score(tmp_path, monkeypatch, data_dir):
    """critic-eval's readout setup: the item whose readout is NaN gets a ``readout_nonfinite`` row
    with no step scores; it counts as a parse failure and the scores are still written."""
    import json

    import pyarrow.parquet as pq

    import pipeline.engines.transformers_engine as te
    from critic_eval import stages as ces

    monkeypatch.setattr(te, "TransformersEngine", _OverflowingCritic)
    items = [{"id": f"q{i}", "problem": f"Problem {i}?", "steps": [f"step 0 of r{i}", f"step 1 of r{i}"],
              "label": -1 if i % 2 else 1, "step_labels": [0, 0] if i % 2 else [0, 1]} for i in (4, 5)]
    bench = tmp_path / "pb.jsonl"
    bench.write_text("\n".join(json.dumps(it) for it in items))
    conf = tmp_path / "ce.yaml"
    conf.write_text(json.dumps({"name": "ro", "runs_dir": str(tmp_path / "runs"), "benchmark": {"source": str(bench)},
                                "critics": [{"name": "ro", "source": "logprob", "model": "hand-critic"}],
                                "include_gold_answer": [False], "n_values": [1]}))
    cfg = ces.load_eval_config(conf, [f"data_dir={data_dir}"])
    ces.benchmark_stage(cfg)
    (setup,) = cfg.setups()
    rows = {r["item_id"]: r for r in pq.read_table(ces.critique_stage(cfg, setup).path).to_pylist()}
    assert (rows["q5"]["parse_status"], rows["q5"]["step_scores"]) == ("readout_nonfinite", None)
    assert rows["q4"]["parse_status"] == "complete" and rows["q4"]["step_scores"] == pytest.approx([0.5, 0.5])
    ces.score_stage(cfg)
    scores = pq.read_table(cfg.run_dir() / "scores.parquet").to_pylist()
    assert {s["parse_failure_rate"] for s in scores if s["subset"] == "all"} == {0.5}


def test_the_readout_needs_a_local_critic(tmp_path):
    from tests.flows.test_fanout import _cfg

    with pytest.raises(ValueError, match="critique.logprob_readout=true reads the critic"):
        _cfg(tmp_path, "critique.engine.type=openai", "critique.logprob_readout=true")
    with pytest.raises(ValueError, match="vote.sources names logprob, which needs critique.logprob_readout=true"):
        _cfg(tmp_path, "vote.sources=[llm,logprob]")
    with pytest.raises(ValueError, match="capo-genprm-v3's worked example changes"):
        _cfg(tmp_path, "critique.logprob_readout=true", "critique.template=capo-genprm-v3")
    with pytest.raises(ValueError, match="critique.include_reference=true shows the reference solution"):
        _cfg(tmp_path, "critique.include_reference=true", "critique.mode=outcome", "reward.process_weight=0")
