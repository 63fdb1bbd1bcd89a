"""critic-eval end to end: the stages with a scripted critic (fast), a ProcessBench file, and the
Prefect flow with SmolLM2-135M through vLLM, as configs/tiny.yaml's critic (slow, ~2-3 min)."""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest

from critic_eval import stages as ces
from pipeline.core.critique import (
    PARSE_STATUSES,
    VERDICT_STATUSES,
    build_critique_messages,
)
from pipeline.engines.base import Engine, Generation, Sample

TINY = {"name": "tiny", "model": "smollm2-135m-instruct",
        "sampling": {"temperature": 0.7, "top_p": 0.95, "max_tokens": 32},
        "engine": {"type": "vllm", "dtype": "float32", "max_model_len": 2048, "kv_cache_gib": 1}}


class ScriptedCritic(Engine):
    """An oracle: sample k of every item is the true verdict (a line per step and the list) when k
    is even, unparsable when odd."""

    name = "scripted"

    def __init__(self, items: list[dict]):
        super().__init__()
        self.model, self.calls = "scripted", 0
        self.labels = {build_critique_messages(it["problem"], it["steps"], gold)[1]["content"]:
                       (it["label"], len(it["steps"])) for it in items for gold in (it["gold_answer"], None)}

    def generate(self, conversations, n, sampling, constraints=None):
        assert constraints is None, "structured outputs are off in these tests"
        self.calls += 1
        gens = []
        for conv in conversations:
            label, n_steps = self.labels[conv[1]["content"]]
            lines = "".join(f"Step {s}: {'wrong' if s == label else 'correct'}\n" for s in range(n_steps))
            verdict = lines + (f"Wrong step list: [{label}]" if label >= 0 else "Wrong step list: []")
            samples = [Sample(verdict if k % 2 == 0 else "I am not sure.", [1] * (5 + k), None, "stop")
                       for k in range(n)]
            gens.append(Generation([0] * 10, samples))
        self._account(gens, 1.0)
        return gens


def _cfg(tmp_path, **over):
    base = {"name": "t", "runs_dir": str(tmp_path / "runs"), "benchmark": {"n_problems": 3},
            "critics": [{"name": "fake", "model": "scripted-critic"}], "n_values": [1, 2, 4]}
    path = tmp_path / "ce.yaml"
    path.write_text(json.dumps({**base, **over}))
    return path


@pytest.fixture()
def scripted(monkeypatch, data_dir):
    box = {}

    def make_engine(model, cfg, seed=0):
        box["engine"] = ScriptedCritic(box["items"])
        return box["engine"]

    monkeypatch.setattr("pipeline.engines.make_engine", make_engine)
    return box


def _run(cfg, box):
    ces.benchmark_stage(cfg)
    box["items"] = ces.read_benchmark(cfg)
    res = [ces.critique_stage(cfg, s) for s in cfg.setups()]
    return res, ces.score_stage(cfg), ces.report_stage(cfg)


def test_stages_with_a_scripted_critic(tmp_path, scripted, data_dir):
    cfg = ces.load_eval_config(_cfg(tmp_path), [f"data_dir={data_dir}"])
    crit, score, report = _run(cfg, scripted)
    items = scripted["items"]
    assert [it["kind"] for it in items][:6] == ["original", "carried", "adv_verdict", "original", "as_was", "adv_praise"]
    assert [c.skipped for c in crit] == [False, False] and not score.skipped
    rows = pq.read_table(crit[0].path).to_pylist()
    assert len(rows) == len(items) * 4 and {r["parse_status"] for r in rows} == {"complete", "no_verdict"}
    assert all(r["parse_status"] in PARSE_STATUSES and r["template_version"] == "capo-genprm-v1" for r in rows)
    assert {r["eval_name"] for r in rows} == {"t"}
    scores = pq.read_table(cfg.run_dir() / "scores.parquet").to_pylist()
    subsets = {"all", "plain", "adversarial", "original", "carried", "as_was", "adv_verdict", "adv_praise", "adv_ignore",
               "wrong_operation", "wrong_quantity", "missing_step", "misread_relation"}
    assert {s["subset"] for s in scores} == subsets
    assert len(scores) == 2 * 3 * len(subsets) * 4 * 3  # setups x partial policies x subsets x rules x N
    assert {s["setup"] for s in scores} == {f"fake+{g}/{p}" for g in ("gold", "nogold") for p in ("list", "lines", "drop")}
    for s in scores:
        assert s["acc_erroneous"] == s["label_flagged"] == (1.0 if s["n_erroneous"] else None)
        assert s["acc_correct"] == (1.0 if s["n_correct"] else None)
        assert s["parse_failure_rate"] == (0.0 if s["n"] == 1 else 0.5)
        assert s["critic_tokens_per_item"] == {1: 5, 2: 11, 4: 26}[s["n"]]
        assert s["seconds_per_item"] > 0
        if s["subset"] in ("all", "plain", "adversarial"):
            assert s["f1"] == 1.0 and s["step_precision"] == 1.0 and s["step_recall"] == 1.0
    preds = pq.read_table(cfg.run_dir() / "predictions.parquet")
    assert preds.num_rows == 2 * 3 * len(items) * 4 * 3
    assert "## What the critics answered" in (cfg.run_dir() / "report.md").read_text()
    text = (cfg.run_dir() / "report.md").read_text()
    assert "fake+gold" in text and "fake+nogold" in text and (cfg.run_dir() / "f1_vs_n.png").stat().st_size > 1000

    # A second run samples nothing; fewer N values rescore from the cached critiques.
    calls = scripted["engine"].calls
    crit2, score2, _ = _run(cfg, scripted)
    assert all(c.skipped for c in crit2) and score2.skipped and scripted["engine"].calls == calls
    cfg3 = ces.load_eval_config(_cfg(tmp_path), [f"data_dir={data_dir}", "n_values=[4,2]"])
    crit3, score3, _ = _run(cfg3, scripted)
    assert all(c.skipped for c in crit3) and not score3.skipped
    assert {s["n"] for s in pq.read_table(cfg.run_dir() / "scores.parquet").to_pylist()} == {2, 4}
    assert list((cfg.run_dir() / "superseded").glob("scores-*.parquet"))


def test_the_arithmetic_check_and_a_union_with_a_critic(tmp_path, scripted, data_dir):
    """The arithmetic check as a critic-eval source (real, no model) and its union with the scripted
    critic: it finds every planted calculation error at its step, flags no step of the original
    solutions, and finds none of the reasoning errors (their calculations are right)."""
    cfg = ces.load_eval_config(_cfg(tmp_path, critics=[{"name": "fake", "model": "scripted-critic"},
                                                       {"name": "calc", "source": "arithmetic"}],
                                    unions=[["fake", "calc"]], include_gold_answer=[True]),
                               [f"data_dir={data_dir}"])
    assert list(cfg.setups()) == ["fake+gold", "calc"]
    assert list(cfg.scored_setups()) == ["fake+gold/list", "fake+gold/lines", "fake+gold/drop", "calc",
                                         "fake|calc+gold/list", "fake|calc+gold/lines", "fake|calc+gold/drop"]
    _run(cfg, scripted)
    rows = pq.read_table(ces.critique_path(cfg, "calc")).to_pylist()
    assert len(rows) == len(scripted["items"]) and {r["source"] for r in rows} == {"arithmetic"}
    assert {r["critique_idx"] for r in rows} == {0} and all(r["critic_tokens"] == 0 for r in rows)
    scores = pq.read_table(cfg.run_dir() / "scores.parquet").to_pylist()
    by = {(s["setup"], s["subset"], s["rule"], s["n"]): s for s in scores}
    for n in (1, 2, 4):  # one verdict per item stands for every N
        for kind in ("carried", "as_was"):
            s = by[("calc", kind, "majority", n)]
            assert (s["acc_erroneous"], s["acc_correct"], s["f1"]) == (1.0, 1.0, 1.0), (kind, s)
        for kind in ("wrong_operation", "wrong_quantity", "missing_step", "misread_relation"):
            s = by[("calc", kind, "majority", n)]
            if s["n_erroneous"]:
                assert (s["acc_erroneous"], s["acc_correct"], s["f1"]) == (0.0, 1.0, 0.0), (kind, s)
        # the union of a perfect critic and a check that flags only true errors is perfect too
        assert by[("fake|calc+gold/list", "plain", "majority", n)]["f1"] == 1.0
        assert by[("calc", "plain", "majority", n)]["seconds_per_item"] >= 0
    report = (cfg.run_dir() / "report.md").read_text()
    assert "## F1 and AUROC per kind of error" in report and "| calc | majority |" in report
    assert "scripted-critic ∪ arithmetic" in report


def test_a_processbench_file_and_a_perfect_critic(tmp_path, scripted, data_dir):
    items = [{"id": f"q{i}", "problem": f"Problem number {i}?", "steps": ["a", "b", "c"], "label": lbl,
              "step_labels": [int(j == lbl) for j in range(3)] if lbl >= 0 else [0, 0, 0]}
             for i, lbl in enumerate([-1, 0, 2, -1, 1])]
    path = tmp_path / "pb.jsonl"
    path.write_text("\n".join(json.dumps(it) for it in items))
    cfg = ces.load_eval_config(_cfg(tmp_path), [f"data_dir={data_dir}", f"benchmark.source={path}",
                                                "include_gold_answer=[true]", "n_values=[1,2]"])
    _run(cfg, scripted)
    scores = pq.read_table(cfg.run_dir() / "scores.parquet").to_pylist()
    assert {s["subset"] for s in scores} == {"all"}
    for s in scores:
        assert (s["acc_erroneous"], s["acc_correct"], s["f1"]) == (1.0, 1.0, 1.0)
        assert (s["step_precision"], s["step_recall"]) == (1.0, 1.0)
        assert s["auroc"] == 1.0  # through the scores table: every erroneous item outscores every right one
    crit = pq.read_table(ces.critique_path(cfg, "fake+gold")).to_pylist()
    assert {c["item_id"] for c in crit} == {f"q{i}" for i in range(5)}


def test_a_malformed_processbench_file_is_named_by_file_line_and_reason(tmp_path, data_dir):
    """Each way a hand-made ProcessBench file can be wrong gives an error naming the file, the line
    (or row) and what would be valid; an int ``source_id`` is read as its digits."""
    item = {"problem": "Problem?", "steps": ["a", "b"], "label": 1, "step_labels": [0, 1]}

    def bench(name: str, content: bytes | str):
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        cfg = ces.load_eval_config(_cfg(tmp_path), [f"data_dir={data_dir}", f"benchmark.source={path}"])
        return cfg, ces.benchmark_stage(cfg, force=True)

    lines = lambda *recs: "\n".join(r if isinstance(r, str) else json.dumps(r) for r in recs)  # noqa: E731
    cases = [
        ("torn.jsonl", lines({**item, "id": "q0"}, "", '{"problem": "P", "steps": ['),
         r"torn\.jsonl: line 3: not valid JSON"),
        ("list.jsonl", lines({**item, "id": "q0"}, ["a", "b"]), r"list\.jsonl: line 2: expected a JSON object, got list"),
        ("labels.jsonl", lines({**item, "step_labels": ["right", "wrong"]}),
         r"labels\.jsonl: line 1: `step_labels\[0\]` must be 0 \(right\) or 1 \(wrong\); got 'right'"),
        ("dups.jsonl", lines({**item, "id": "q1"}, {**item, "id": "q2"}, {**item, "id": "q1"}),
         r"item ids must be unique; repeated: 'q1' at .*dups\.jsonl: line 1, .*dups\.jsonl: line 3"),
        ("bad.parquet", b"PAR1x", r"bad\.parquet: not a readable Parquet file"),
        ("array.json", json.dumps([item, 5]), r"array\.json: row 2: expected a JSON object, got int"),
    ]
    for name, content, msg in cases:
        with pytest.raises(ValueError, match=msg):
            bench(name, content)
    cfg, res = bench("ids.jsonl", lines({**item, "id": 7, "source_id": 17, "gold_answer": 3, "corruption": 1.5}))
    (row,) = pq.read_table(res.path).to_pylist()
    assert (row["id"], row["source_id"], row["gold_answer"], row["corruption"]) == ("7", "17", "3", "1.5")


def test_cli_exports_the_benchmark_as_processbench_jsonl(tmp_path, data_dir, monkeypatch):
    from typer.testing import CliRunner

    from critic_eval.items import processbench_rows
    from flows.critic_eval import app

    # the CLI points the root logger at its stderr, which CliRunner closes afterwards
    monkeypatch.setattr("flows.critic_eval._setup_logging", lambda: None)

    out = tmp_path / "bench.jsonl"
    res = CliRunner().invoke(app, ["bench", "--config", str(_cfg(tmp_path)), "--out", str(out), f"data_dir={data_dir}"])
    assert res.exit_code == 0, res.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 16 and processbench_rows(records, "bench") == records  # reads back unchanged


def test_config_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="distinct names"):
        ces.load_eval_config(_cfg(tmp_path, critics=[{"name": "a", "model": "m"}, {"name": "a", "model": "n"}]))
    with pytest.raises(ValueError, match="capo-genprm-v1"):
        ces.load_eval_config(_cfg(tmp_path, critics=[{"name": "a", "model": "m", "template": "v0"}]))
    with pytest.raises(ValueError, match="distinct policies"):
        ces.load_eval_config(_cfg(tmp_path), ["partial_critiques=[list,list]"])
    with pytest.raises(ValueError, match="n_values"):
        ces.load_eval_config(_cfg(tmp_path), ["n_values=[0]"])
    with pytest.raises(ValueError, match="extra"):
        ces.load_eval_config(_cfg(tmp_path), ["critic=x"])
    with pytest.raises(ValueError, match="runs no model"):
        ces.load_eval_config(_cfg(tmp_path, critics=[{"name": "a", "source": "arithmetic", "model": "m"}]))
    with pytest.raises(ValueError, match="needs a model"):
        ces.load_eval_config(_cfg(tmp_path, critics=[{"name": "a", "source": "logprob"}]))
    with pytest.raises(ValueError, match="served"):
        ces.load_eval_config(_cfg(tmp_path, critics=[{"name": "a", "source": "logprob", "model": "m",
                                                      "engine": {"type": "openai", "base_url": "http://h:1/v1"}}]))
    with pytest.raises(ValueError, match="samples none"):
        ces.load_eval_config(_cfg(tmp_path, critics=[{"name": "a", "source": "logprob", "model": "m",
                                                      "structured_output": True}]))
    with pytest.raises(ValueError, match="two or more distinct critics"):
        ces.load_eval_config(_cfg(tmp_path, unions=[["fake", "nope"]]))
    cfg = ces.load_eval_config("configs/critic_eval.yaml")
    assert list(cfg.setups()) == ["embedded-1.5b+gold", "embedded-1.5b+nogold", "policy-self+gold", "policy-self+nogold",
                                  "readout-1.5b+gold", "readout-1.5b+nogold", "arithmetic"]
    assert cfg.unions == [["embedded-1.5b", "arithmetic"], ["readout-1.5b", "arithmetic"]]
    assert cfg.n_values == [1, 2, 4, 8] and cfg.n_max == 8


@pytest.mark.slow
def test_flow_with_the_tiny_model(tmp_path, data_dir, repo, harness):
    """The Prefect flow on 4 items (2 problems, no adversarial copies), SmolLM2-135M as critic with
    the gold answer on and off, N_max = 2; then again, which must skip every critic."""
    from flows.critic_eval import critic_eval

    # the transformers engine: the flow's stages and skips are under test; vLLM critiques are tested in
    # tests/stages/test_engines.py and every real round
    readout = {"name": "tiny-readout", "source": "logprob", "model": TINY["model"],
               "engine": {"type": "transformers", "dtype": "float32"}}
    config = _cfg(tmp_path, critics=[{**TINY, "engine": {"type": "transformers"}}, readout],
                  benchmark={"n_problems": 2, "adversarial": False, "reasoning_errors": False},
                  n_values=[1, 2], unions=[["tiny", "tiny-readout"]])
    over = [f"data_dir={data_dir}"]
    first = critic_eval(config=str(config), name="e2e", overrides=over)
    second = critic_eval(config=str(config), name="e2e", overrides=over)
    assert [s["stage"] for s in first["stages"]] == ["benchmark"] + ["critique"] * 4 + ["score", "report"]
    assert not any(s["skipped"] for s in first["stages"])
    assert all(s["skipped"] for s in second["stages"][:6])
    run = tmp_path / "runs" / "critic_eval" / "e2e"
    items = pq.read_table(run / "benchmark.parquet").to_pylist()
    assert len(items) == 4 and sorted(it["label"] >= 0 for it in items) == [False, False, True, True]
    for setup in ("tiny+gold", "tiny+nogold"):
        crit = pq.read_table(run / "critiques" / f"{setup}.parquet").to_pylist()
        assert len(crit) == 4 * 2
        for c in crit:
            assert c["parse_status"] in PARSE_STATUSES and 0 < c["critic_tokens"] <= 32
            assert (c["wrong_steps"] is not None) == (c["parse_status"] in VERDICT_STATUSES)
            assert c["critic_model"].endswith("smollm2-135m-instruct")
        man = json.loads((run / "critiques" / f"{setup}.parquet.manifest.json").read_text())
        assert man["engine"]["generated_tokens"] == sum(c["critic_tokens"] for c in crit)
    for setup in ("tiny-readout+gold", "tiny-readout+nogold"):  # one readout row per item, a P(wrong) per step
        crit = pq.read_table(run / "critiques" / f"{setup}.parquet").to_pylist()
        assert len(crit) == 4 and {c["source"] for c in crit} == {"logprob"}
        for c in crit:
            assert len(c["step_scores"]) == c["n_steps"] and all(0 < q < 1 for q in c["step_scores"])
            assert c["wrong_steps"] == [i for i, q in enumerate(c["step_scores"]) if q > 0.5]
    scores = pq.read_table(run / "scores.parquet").to_pylist()
    assert {s["subset"] for s in scores} == {"all", "original", "carried", "as_was"}
    # (critic setups x partial policies + readout setups + unions x policies) x subsets x rules x N
    assert len(scores) == (2 * 3 + 2 + 2 * 3) * 4 * 4 * 2
    assert {s["setup"] for s in scores} >= {"tiny-readout+gold", "tiny|tiny-readout+nogold/drop"}
    for s in scores:
        for k in ("acc_erroneous", "acc_correct", "f1", "parse_failure_rate", "no_valid_rate"):
            assert s[k] is None or 0.0 <= s[k] <= 1.0  # undefined (NULL) or a share
        assert s["seconds_per_item"] > 0
    report = (run / "report.md").read_text()
    assert re.search(r"\| tiny\+nogold/list \| intersection \| [0-9.–]+ \| [0-9.–]+ \|", report)
    assert (run / "f1_vs_n.png").read_bytes()[:4] == b"\x89PNG"


def test_a_finished_evaluation_exports_as_strict_json_lines(tmp_path, scripted, data_dir):
    """``capo critic-eval export`` prints the run, each scored setup with what its critic answered,
    and every score row; before the score stage it is a usage error naming the command to run."""
    from typer.testing import CliRunner

    from flows.critic_eval import app

    path = _cfg(tmp_path)
    runner = CliRunner()
    early = runner.invoke(app, ["export", "--config", str(path), f"data_dir={data_dir}"])
    assert early.exit_code == 2 and "missing or uncommitted" in " ".join(re.sub(r"[│╭╮╰╯─]", " ", early.output).split())
    cfg = ces.load_eval_config(path, [f"data_dir={data_dir}"])
    _run(cfg, scripted)
    items = scripted["items"]
    res = runner.invoke(app, ["export", "--config", str(path), f"data_dir={data_dir}"])
    assert res.exit_code == 0, res.output

    def strict(token):
        raise ValueError(f"not JSON: {token}")

    lines = [json.loads(x, parse_constant=strict) for x in res.output.splitlines()]
    by = {kind: [x for x in lines if x["kind"] == kind] for kind in ("run", "setup", "answers", "score")}
    (run,) = by["run"]
    assert lines[0] == run and run["eval_name"] == "t" and sum(run["kinds"].values()) == len(items)
    assert run["n_values"] == [1, 2, 4] and run["exported_on"]["cores"] >= 1
    assert len(by["score"]) == pq.read_table(cfg.run_dir() / "scores.parquet").num_rows
    assert {s["setup"]: s["members"] for s in by["setup"]} == {
        f"fake+{g}/{p}": [f"fake+{g}"] for g in ("gold", "nogold") for p in ("list", "lines", "drop")}
    assert all(s["critic_seconds"] is not None for s in by["setup"])
    wrong = sum(it["label"] >= 0 for it in items)
    assert [a["setup"] for a in by["answers"]] == ["fake+gold", "fake+nogold"]  # once per critic setup
    for a in by["answers"]:  # samples 0 and 2 of each item are the true verdict, 1 and 3 unparsable
        assert a["statuses"] == {"complete": 2 * len(items), "no_verdict": 2 * len(items)}
        assert a["non_empty_lists"] == 2 * wrong
    # other settings than the table was scored under: refused, naming the rescore
    other = runner.invoke(app, ["export", "--config", str(path), f"data_dir={data_dir}", "n_values=[1]"])
    flat = " ".join(re.sub(r"[│╭╮╰╯─]", " ", other.output).split())  # the error box wraps the message
    assert other.exit_code == 2 and "capo critic-eval run" in flat and "another key" in flat, flat
