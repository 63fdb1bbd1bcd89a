"""Held-out evaluation: pass@k by hand, seeded subsets, summaries, the stage, and a real tiny model."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 (pa.compute)
import pyarrow.parquet as pq
import pytest

import pipeline.engines
from pipeline import storage
from pipeline.config import DEFAULT_INSTRUCTIONS, TransformersEngineConfig, load_config
from pipeline.engines.base import EngineStats, Generation, Sample
from pipeline.schemas import EVAL_SCHEMA
from pipeline.stages import eval as evaluate
from pipeline.stages.base import policy_messages
from pipeline.stages.eval import (
    eval_path,
    eval_stage,
    evaluate_policy,
    pass_at_k,
    select_problems,
    summarize_eval,
)

INSTRUCTION = DEFAULT_INSTRUCTIONS["blank_line"]


# ------------------------------------------------------------------------------------------ math
def test_pass_at_k_hand_numbers():
    assert pass_at_k(4, 1, 1) == 1 / 4
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - (3 * 2 / 2) / (5 * 4 / 2))  # 1 - C(3,2)/C(5,2) = 0.7
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    # n == k (what evaluate_policy draws): any right sample
    assert [pass_at_k(4, c, 4) for c in range(5)] == [0.0, 1.0, 1.0, 1.0, 1.0]
    for n, c, k in [(1, 0, 1), (1, 1, 1), (8, 0, 3), (8, 6, 3), (20, 7, 10), (100, 1, 50)]:
        naive = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(naive, abs=1e-12)
    with pytest.raises(ValueError, match="n=2, c=3, k=1"):
        pass_at_k(2, 3, 1)


def test_select_problems_seeded_nested_and_stable():
    a = select_problems(1319, 10, 0, "gsm8k")
    assert a.tolist() == select_problems(1319, 10, 0, "gsm8k").tolist() == sorted(set(a.tolist()))
    assert set(select_problems(1319, 5, 0, "gsm8k")) <= set(a)  # a bigger sample keeps the smaller one
    assert a.tolist() != select_problems(1319, 10, 1, "gsm8k").tolist()
    assert a.tolist() != select_problems(1319, 10, 0, "svamp").tolist()
    assert select_problems(30, None, 0, "aime24").tolist() == select_problems(30, 64, 0, "aime24").tolist() == list(range(30))


def _row(bench, pid, decoding, j, correct, tokens, finish="stop", rnd=1, variant="v"):
    return {"run_id": "r", "round": rnd, "variant": variant, "policy": "p", "benchmark": bench, "prompt_id": pid,
            "decoding": decoding, "sample_idx": j, "gold_answer": "1", "response_text": "", "num_tokens": tokens,
            "finish_reason": finish, "extracted_answer": None, "correct": correct, "verify_status": "ok"}


def _hand_rows() -> list[dict]:
    rows = [_row("gsm8k", "g0", "greedy", 0, True, 10), _row("gsm8k", "g1", "greedy", 0, False, 30, "length"),
            _row("gsm8k", "g2", "greedy", 0, True, 20)]
    # aime24: greedy 0 of 2; 3 samples each: a0 right 1 of 3, a1 right 0 of 3
    rows += [_row("aime24", "a0", "greedy", 0, False, 5), _row("aime24", "a1", "greedy", 0, False, 7)]
    rows += [_row("aime24", "a0", "sample", j, j == 2, 9) for j in range(3)]
    rows += [_row("aime24", "a1", "sample", j, False, 9) for j in range(3)]
    return rows


def test_summarize_eval_hand_counts():
    s = {r["benchmark"]: r for r in summarize_eval(pa.Table.from_pylist(_hand_rows(), schema=EVAL_SCHEMA)).to_pylist()}
    assert s["gsm8k"] == {"run_id": "r", "round": 1, "variant": "v", "benchmark": "gsm8k", "n_problems": 3,
                          "accuracy": 2 / 3, "mean_response_tokens": (10 + 30 + 20) / 3, "share_truncated": 1 / 3,
                          "pass_k": None, "pass_at_k": None, "sampled_accuracy": None}
    assert (s["aime24"]["accuracy"], s["aime24"]["pass_k"]) == (0.0, 3)
    assert s["aime24"]["pass_at_k"] == (1.0 + 0.0) / 2
    assert s["aime24"]["sampled_accuracy"] == pytest.approx((1 / 3 + 0 / 3) / 2)
    assert s["aime24"]["mean_response_tokens"] == (5 + 7) / 2  # greedy rows only


def test_catalog_view_matches_summarize_eval(tmp_path):
    """The catalog's ``eval`` view finds round 0 and variant tables (not superseded ones), and its
    ``eval_summary`` view equals :func:`summarize_eval`."""
    import duckdb

    rows = _hand_rows() + [_row("gsm8k", "g0", "greedy", 0, False, 4, rnd=0, variant=None)]
    table = pa.Table.from_pylist(rows, schema=EVAL_SCHEMA)
    runs = tmp_path / "runs"
    for path, rnd in ((runs / "r" / "round_000" / "eval.parquet", 0),
                      (runs / "r" / "round_001" / "variants" / "v" / "eval.parquet", 1),
                      (runs / "r" / "round_001" / "variants" / "v" / "superseded" / "eval-1.parquet", 1)):
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table.filter(pa.compute.equal(table.column("round"), rnd)), path)
    con = duckdb.connect(str(storage.refresh_catalog(runs)), read_only=True)
    assert con.execute("SELECT count(*) FROM eval").fetchone()[0] == len(rows)
    cur = con.execute("SELECT * FROM eval_summary")
    sql = {(r["round"], r["benchmark"]): r for r in (dict(zip([d[0] for d in cur.description], x)) for x in cur.fetchall())}
    con.close()
    py = summarize_eval(table).to_pylist()
    assert len(sql) == len(py) == 3
    for r in py:
        got = sql[(r["round"], r["benchmark"])]
        for col in ("variant", "n_problems", "accuracy", "mean_response_tokens", "share_truncated", "pass_k",
                    "pass_at_k", "sampled_accuracy"):
            assert got[col] == pytest.approx(r[col]) if r[col] is not None else got[col] is None, col


# ------------------------------------------------------------------------------------- fake engine
class ScriptedEngine:
    """Answers ``\\boxed{<gold>}`` for the problems in ``right`` (sample 0 only), else ``\\boxed{-1}``."""

    def __init__(self, golds: dict[str, str], right: set[str]):
        self.golds, self.right, self.calls, self.tokenizer = golds, right, [], None
        self.stats, self.closed = EngineStats(), False

    def generate(self, convs, n, sampling):
        self.calls.append((convs, n, sampling))
        out = []
        for conv in convs:
            q = conv[0]["content"].split("\n\n" + INSTRUCTION)[0]
            samples = [Sample(f"\\boxed{{{self.golds[q] if q in self.right and j == 0 else -1}}}", [1, 2, 3], None, "stop")
                       for j in range(n)]
            out.append(Generation([0], samples))
        return out

    def close(self):
        self.closed = True


@pytest.fixture()
def scripted(monkeypatch, data_dir):
    """The engine factory replaced by a ScriptedEngine that knows every gsm8k and aime24 gold."""
    golds, right, box = {}, set(), {}
    for name in ("gsm8k", "aime24"):
        for i, r in enumerate(pq.read_table(evaluate.ensure_benchmark(name, data_dir / "eval")).to_pylist()):
            golds[r["question"]] = r["gold_answer"]
            if i % 2 == 0:
                right.add(r["question"])

    def factory(model, cfg, seed=0):
        box["engine"] = ScriptedEngine(golds, right)
        box["model"], box["seed"] = model, seed
        return box["engine"]

    monkeypatch.setattr(pipeline.engines, "make_engine", factory)
    return box


def test_evaluate_policy_prompts_calls_and_pass_k(scripted, data_dir):
    t = evaluate_policy("m", ["gsm8k", "aime24"], 4, 7, TransformersEngineConfig(), 32, pass_k=3,
                        instruction=INSTRUCTION, pass_k_benchmarks=["aime24"], eval_root=data_dir / "eval",
                        run_id="r", round_idx=2, variant="v", workers=1)
    eng = scripted["engine"]
    assert eng.closed and [(n, s.temperature, s.max_tokens) for _, n, s in eng.calls] == [(1, 0.0, 32), (3, 1.0, 32)]
    problems = evaluate.load_problems(["gsm8k", "aime24"], 4, 7, data_dir / "eval")
    assert eng.calls[0][0] == [policy_messages(p["question"], INSTRUCTION) for p in problems]  # as the rollout stage
    assert eng.calls[1][0] == [policy_messages(p["question"], INSTRUCTION) for p in problems if p["benchmark"] == "aime24"]
    assert t.schema == EVAL_SCHEMA and t.num_rows == 4 + 4 + 4 * 3
    ids = pq.read_table(data_dir / "eval" / "gsm8k.parquet").column("prompt_id").to_pylist()
    greedy = [r for r in t.to_pylist() if r["decoding"] == "greedy"]
    assert [r["prompt_id"] for r in greedy[:4]] == [ids[i] for i in select_problems(1319, 4, 7, "gsm8k")]
    assert {(r["run_id"], r["round"], r["variant"], r["policy"]) for r in t.to_pylist()} == {("r", 2, "v", "m")}
    # the scripted engine is right on even-numbered source rows, sample 0 only
    even = {p["prompt_id"] for p in problems if int(p["prompt_id"][-5:]) % 2 == 0}
    assert all(r["correct"] == (r["prompt_id"] in even and r["sample_idx"] == 0) for r in t.to_pylist())
    s = {r["benchmark"]: r for r in summarize_eval(t).to_pylist()}
    aime = [p for p in problems if p["benchmark"] == "aime24"]
    n_even = sum(p["prompt_id"] in even for p in aime)
    assert s["aime24"]["pass_at_k"] == n_even / 4 and s["aime24"]["sampled_accuracy"] == pytest.approx(n_even / 4 / 3)
    assert s["gsm8k"]["pass_k"] is None and s["aime24"]["pass_k"] == 3


def test_sample_seed_seeds_the_engine_and_keeps_the_problems(scripted, data_dir):
    """The noise floor's re-evaluations: ``sample_seed`` reseeds the engine only; the problems are
    the subset of ``seed``, as in the eval they are compared with."""
    args = (["gsm8k"], 4, 7, TransformersEngineConfig(), 32)
    kw = {"instruction": INSTRUCTION, "eval_root": data_dir / "eval", "workers": 1}
    base = evaluate_policy("m", *args, **kw)
    assert scripted["seed"] == 7
    again = evaluate_policy("m", *args, sample_seed=3, **kw)
    assert scripted["seed"] == 3
    assert again.column("prompt_id").to_pylist() == base.column("prompt_id").to_pylist()


# ------------------------------------------------------------------------------------------- stage
def test_eval_stage_round0_skip_rerun_and_round1(scripted, tmp_path, data_dir, repo):
    from pipeline.report import write_report

    over = [f"runs_dir={tmp_path}", f"data_dir={data_dir}", "run_id=ev", "eval.benchmarks=[gsm8k, aime24]"]
    cfg = load_config(repo / "configs" / "tiny.yaml", over + ["eval.sample_size=2"])
    res = eval_stage(cfg, 0)
    out = tmp_path / "ev" / "round_000" / "eval.parquet"
    assert not res.skipped and res.rows == 4 and res.path == str(out) == str(eval_path(cfg, 0))
    assert storage.read_manifest(out)["stage"] == "eval"
    assert scripted["model"].endswith("smollm2-135m-instruct")  # round 0 = the starting policy
    t = pq.read_table(out)
    assert t.column("variant").null_count == 4 and set(t.column("round").to_pylist()) == {0}
    assert eval_stage(cfg, 0).skipped  # current: no engine
    cfg = load_config(repo / "configs" / "tiny.yaml", over + ["eval.sample_size=3"])
    again = eval_stage(cfg, 0)
    assert not again.skipped and again.rows == 6 and "changed: ['eval']" in again.reason
    assert len(list((out.parent / "superseded").glob("eval-*.parquet"))) == 1
    with pytest.raises(FileNotFoundError, match="run round 1 first"):
        eval_stage(cfg, 1)
    ckpt = tmp_path / "ev" / "round_001" / "variants" / cfg.variant / "checkpoint"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    storage.commit_manifest(ckpt, stage="train", key={}, rows=None)
    r1 = eval_stage(cfg, 1)
    assert r1.path == str(ckpt.parent / "eval.parquet") and scripted["model"] == str(ckpt)
    assert set(pq.read_table(r1.path).column("variant").to_pylist()) == {cfg.variant}
    html = write_report(tmp_path, "ev")["report_html"].read_text()
    assert "<td>start policy</td><td>0</td>" in html and f"<td>{cfg.variant}</td><td>1</td>" in html


# the graded problems: (question, gold, greedy reply, three sampled replies); a reply is (text, finish_reason)
_GRADED = [
    ("Ann has 10 apples and eats 2. How many apples are left?", "8",
     ("10 - 2 = 8, so \\boxed{8}.", "stop"),
     [("\\boxed{9}", "stop"), ("She has \\boxed{8} left.", "stop"), ("8 apples.", "stop")]),
    ("Bob reads 4 pages a day for 5 days. How many pages does he read?", "20",
     ("4 * 5 = 21, so \\boxed{21}.", "stop"),
     [("\\boxed{9}", "stop"), ("\\boxed{45}", "stop"), ("20", "stop")]),
    ("A pen costs 3 dollars. What do 6 pens cost?", "18",
     ("6 * 3 = 18 dollars.", "stop"),  # the right number, not boxed: no answer
     [("\\boxed{18}", "stop"), ("So \\boxed{18} dollars.", "stop"), ("\\boxed{18.0}", "stop")]),
    ("Cara has 100 stamps and gives 40 away. How many stamps are left?", "60",
     ("100 - 40 = 60, \\boxed{60}", "length"),  # cut at the budget: wrong however right its answer
     [("\\boxed{60}", "stop"), ("\\boxed{60}", "length"), ("\\boxed{40}", "stop")]),
    ("Half of a cake is eaten. What fraction of the cake is left?", "0.5",
     ("\\boxed{\\frac{1}{2}}", "stop"),  # another form of the gold answer
     [("one half", "stop"), ("1/2", "stop"), ("0.5", "stop")]),
]


class GradedEngine:
    """Answers each question of :data:`_GRADED` with its scripted reply: greedy (temperature 0) or sampled."""

    def __init__(self):
        self.calls, self.tokenizer, self.stats = [], None, EngineStats()

    def generate(self, convs, n, sampling):
        self.calls.append((len(convs), n, sampling.temperature))
        out = []
        for conv in convs:
            (item,) = [g for g in _GRADED if conv[-1]["content"].startswith(g[0] + "\n\n")]
            replies = [item[2]] if sampling.temperature == 0 else item[3][:n]
            assert len(replies) == n
            out.append(Generation([0], [Sample(text, [1, 2, 3], None, fin) for text, fin in replies]))
        return out

    def close(self):
        pass


def test_eval_stage_grades_right_wrong_unboxed_and_cut_replies_by_hand(monkeypatch, tmp_path, repo):
    """Scripted replies at the engine boundary, through the eval stage and read back from its table:
    a boxed gold answer (also in another form: 1/2 for 0.5, 18.0 for 18) is right; a boxed wrong
    answer is wrong (status ok); an unboxed right number has no answer; a reply cut at the token
    budget is wrong with status truncated, its answer kept. The flags, the accuracy, pass@3 and the
    sampled accuracy are counted by hand, in the table as written and in its manifest's summary."""
    from pipeline.assets.prompts import PROMPTS_SCHEMA
    from pipeline.stages.base import round_paths

    rows = [{"prompt_id": f"gsm8k-test-{i:05d}", "source": "gsm8k", "split": "test", "question": q, "gold_answer": gold,
             "gold_solution": None} for i, (q, gold, _, _) in enumerate(_GRADED)]
    (tmp_path / "data" / "eval").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=PROMPTS_SCHEMA), tmp_path / "data" / "eval" / "gsm8k.parquet")
    engine = GradedEngine()
    monkeypatch.setattr(pipeline.engines, "make_engine", lambda model, cfg, seed=0: engine)
    cfg = load_config(repo / "configs" / "tiny.yaml", [f"runs_dir={tmp_path / 'runs'}", f"data_dir={tmp_path / 'data'}",
                                                       "run_id=graded", "eval.benchmarks=[gsm8k]", "eval.sample_size=null",
                                                       "eval.pass_k=3"])
    ckpt = round_paths(cfg, 1)["checkpoint"]  # round 1's policy: a stand-in checkpoint (the engine is scripted)
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text("{}")
    storage.commit_manifest(ckpt, stage="train", key={}, rows=None)
    res = eval_stage(cfg, 1)
    assert engine.calls == [(5, 1, 0.0), (5, 3, 1.0)]
    t = pq.read_table(res.path)
    got = {(r["prompt_id"][-1], r["decoding"], r["sample_idx"]): (r["correct"], r["verify_status"], r["extracted_answer"])
           for r in t.to_pylist()}
    assert t.num_rows == len(got) == 5 + 5 * 3
    assert {k: v for k, v in got.items() if k[1] == "greedy"} == {
        ("0", "greedy", 0): (True, "ok", "8"),
        ("1", "greedy", 0): (False, "ok", "21"),
        ("2", "greedy", 0): (False, "no_answer", None),
        ("3", "greedy", 0): (False, "truncated", "60"),
        ("4", "greedy", 0): (True, "ok", "\\frac{1}{2}"),
    }
    right = {k for k, v in got.items() if k[1] == "sample" and v[0]}
    assert right == {("0", "sample", 1), ("2", "sample", 0), ("2", "sample", 1), ("2", "sample", 2), ("3", "sample", 0)}
    assert got[("3", "sample", 1)] == (False, "truncated", "60") and got[("4", "sample", 2)] == (False, "no_answer", None)
    stored = {r["prompt_id"][-1] + r["decoding"] + str(r["sample_idx"]): (r["response_text"], r["gold_answer"])
              for r in t.to_pylist()}
    assert stored["4greedy0"] == ("\\boxed{\\frac{1}{2}}", "0.5") and stored["1sample2"] == ("20", "20")
    by_hand = {"n_problems": 5, "accuracy": 2 / 5, "pass_k": 3, "pass_at_k": 3 / 5, "sampled_accuracy": (1 / 3 + 0 + 1 + 1 / 3 + 0) / 5}
    (s,) = summarize_eval(t).to_pylist()
    (m,) = storage.read_manifest(Path(res.path))["summary"]
    for summary in (s, m):
        assert {k: summary[k] for k in by_hand} == pytest.approx(by_hand)


def test_eval_config_names_valid_benchmarks():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"unknown benchmark 'math'; valid: \['aime24'"):
        load_config(None, ["eval.benchmarks=[gsm8k, math]"])
    cfg = load_config(None, ["eval.engine.type=transformers", "eval.sample_size=null"])
    assert cfg.eval.engine.type == "transformers" and cfg.eval.sample_size is None


# ------------------------------------------------------------------------------------- real model
@pytest.fixture()
def one_torch_thread():
    """One intra-op thread: on a shared 2-core machine two OpenMP threads that spin against other
    processes made this 16-token generation 20-40x slower (100 s instead of 3 s)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_evaluate_policy_real_tiny_model(data_dir, one_torch_thread):
    """SmolLM2-135M through the transformers engine: 2 GSM8K problems, 16 greedy tokens. Every row is
    graded again here by the project's checker (:func:`pipeline.grading.verify_answer`) on its stored
    text and gold (the benchmark's), and the accuracy is the mean of those flags. At 16 tokens the
    model is likely wrong on both: the scripted test above grades right, wrong, unboxed and cut
    replies by hand."""
    from pipeline.assets.models import ensure_model
    from pipeline.grading import verify_answer

    model = str(ensure_model("smollm2-135m-instruct", root=data_dir / "models"))
    t = evaluate_policy(model, ["gsm8k"], 2, 0, TransformersEngineConfig(dtype="float32", batch_size=2), 16,
                        instruction=INSTRUCTION, eval_root=data_dir / "eval", run_id="tiny", workers=1)
    rows = t.to_pylist()
    assert t.schema == EVAL_SCHEMA and len(rows) == 2
    assert [r["decoding"] for r in rows] == ["greedy", "greedy"] and [r["sample_idx"] for r in rows] == [0, 0]
    assert all(0 < r["num_tokens"] <= 16 and r["finish_reason"] in ("stop", "length") for r in rows)
    # a response cut at the 16-token budget is wrong and says why (verify.truncated=zero, the default)
    assert all(r["verify_status"] == "truncated" if r["finish_reason"] == "length" else r["verify_status"] in ("ok", "no_answer")
               for r in rows)
    assert not any(r["correct"] for r in rows if r["finish_reason"] == "length")
    (s,) = summarize_eval(t).to_pylist()
    assert s["n_problems"] == 2
    assert s["accuracy"] == sum(r["correct"] for r in rows) / 2
    assert s["mean_response_tokens"] == (rows[0]["num_tokens"] + rows[1]["num_tokens"]) / 2
    assert s["share_truncated"] == sum(r["finish_reason"] == "length" for r in rows) / 2
    assert np.isclose(s["accuracy"], np.mean([r["correct"] for r in rows]))
    # graded again: the stored gold is the benchmark's, and each stored flag, status and extracted
    # answer is the checker's on the stored text under the default rule (boxed; a cut reply is wrong)
    golds = {r["prompt_id"]: r["gold_answer"] for r in pq.read_table(data_dir / "eval" / "gsm8k.parquet").to_pylist()}
    regraded = []
    for r in rows:
        assert r["gold_answer"] == golds[r["prompt_id"]]
        ext, ok, status = verify_answer(r["gold_answer"], r["response_text"], "boxed")
        if r["finish_reason"] == "length":
            ok, status = False, "truncated"
        assert (r["extracted_answer"], r["correct"], r["verify_status"]) == (ext, ok, status), r["response_text"]
        regraded.append(ok)
    assert s["accuracy"] == sum(regraded) / len(regraded)
