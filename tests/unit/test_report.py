"""The run report on hand-built tables: plots are PNGs, the paper-style table has the hand means."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flows.artifacts import publish_artifacts
from pipeline.report import collect, write_report
from pipeline.schemas import (
    CRITIQUES_SCHEMA,
    EVAL_SCHEMA,
    STEP_VERDICTS_SCHEMA,
    TOKEN_REWARDS_SCHEMA,
    TRAIN_METRICS_SCHEMA,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN = "r1"
CAPO, GRPO = "capo-intersection", "grpo"


def _write(path: Path, rows: list[dict], schema: pa.Schema) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def _eval_rows(rnd: int, variant: str | None, bench: str, correct: list[int], decoding: str = "greedy",
               per_problem: int = 1) -> list[dict]:
    return [{"run_id": RUN, "round": rnd, "variant": variant, "policy": "p", "benchmark": bench,
             "prompt_id": f"{bench}-test-{i // per_problem:05d}", "decoding": decoding, "sample_idx": i % per_problem,
             "gold_answer": "1", "response_text": "x", "num_tokens": 10 * (i + 1), "finish_reason": "stop",
             "extracted_answer": "1", "correct": bool(c), "verify_status": "ok"} for i, c in enumerate(correct)]


def _token_rewards(variant: str, rule: str | None, rewards: list[list[float]]) -> list[dict]:
    return [{"run_id": RUN, "round": 1, "variant": variant, "rollout_id": f"{variant}-{i}", "prompt_id": "p0",
             "outcome_correct": r[0] > 0, "outcome_reward": 1.0 if r[0] > 0 else 0.0, "rule": rule,
             "n_valid_critiques": 2, "n_penalized_tokens": 0, "rewards": r, "advantages": [0.0] * len(r),
             "reward_config_hash": "h"} for i, r in enumerate(rewards)]


def make_run(tmp_path: Path) -> Path:
    """Run ``r1``: the starting policy, then one round of a CAPO and a GRPO variant; returns runs_dir."""
    rd = tmp_path / "runs" / RUN
    r0, r1 = rd / "round_000", rd / "round_001"
    _write(r0 / "eval.parquet", _eval_rows(0, None, "gsm8k", [1, 1, 0, 0]) + _eval_rows(0, None, "math500", [1, 0]), EVAL_SCHEMA)
    _write(r1 / "variants" / CAPO / "eval.parquet",
           _eval_rows(1, CAPO, "gsm8k", [1, 1, 1, 0]) + _eval_rows(1, CAPO, "math500", [1, 1])
           # pass@2 on math500: problem 0 has one right sample of 2, problem 1 none
           + _eval_rows(1, CAPO, "math500", [0, 1, 0, 0], "sample", per_problem=2), EVAL_SCHEMA)
    _write(r1 / "variants" / GRPO / "eval.parquet",
           _eval_rows(1, GRPO, "gsm8k", [1, 0, 0, 0]) + _eval_rows(1, GRPO, "math500", [0, 0]), EVAL_SCHEMA)
    # CAPO rewards with C=2, P=1: right answer + clean steps 2, right + flagged 1, wrong + flagged -1
    _write(r1 / "variants" / CAPO / "token_rewards.parquet",
           _token_rewards(CAPO, "intersection", [[2.0, 2.0, 1.0], [0.0, -1.0]]), TOKEN_REWARDS_SCHEMA)
    _write(r1 / "variants" / GRPO / "token_rewards.parquet", _token_rewards(GRPO, None, [[2.0], [0.0, 0.0, 0.0]]),
           TOKEN_REWARDS_SCHEMA)
    verdicts = [{"run_id": RUN, "round": 1, "variant": CAPO, "rollout_id": "x", "step_idx": s, "rule": rule,
                 "n_valid": 2, "n_flagged": 1, "weight": w, "majority_threshold": 0.5,
                 "sources": "llm", "llm_weight": w, "arithmetic_flag": None}
                for rule, ws in (("intersection", [0.0, 1.0, 0.0, 0.0]), ("union", [1.0, 1.0, 0.0, 0.0]))
                for s, w in enumerate(ws)]
    _write(r1 / "variants" / CAPO / "step_verdicts.parquet", verdicts, STEP_VERDICTS_SCHEMA)
    crit = [{"run_id": RUN, "round": 1, "rollout_id": "x", "critique_idx": i, "source": "llm", "mode": "process", "critic_model": "c",
             "template_version": "v", "include_gold_answer": True, "n_steps": 2, "raw_text": "", "wrong_steps": None,
             "outcome_verdict": None, "parse_status": st, "critic_tokens": 1, "finish_reason": "stop"}
            for i, st in enumerate(["ok", "ok", "no_verdict", "skipped_empty_response"])]
    _write(r1 / "critiques.parquet", crit, CRITIQUES_SCHEMA)
    for v, clips in ((CAPO, [0.1, 0.3]), (GRPO, [0.0, 0.2])):
        _write(r1 / "variants" / v / "train_metrics.parquet",
               [{"run_id": RUN, "round": 1, "variant": v, "step": s, "name": n, "value": val}
                for s, c in enumerate(clips) for n, val in (("clip_frac", c), ("approx_kl", 0.01), ("kl_ref", 0.0))],
               TRAIN_METRICS_SCHEMA)
    return tmp_path / "runs"


@pytest.fixture()
def runs(tmp_path) -> Path:
    return make_run(tmp_path)


def test_report_plots_and_paper_table(runs, tmp_path):
    out = write_report(runs, RUN, tmp_path / "report")
    plots = ["accuracy", "response_length", "token_reward", "steps_flagged", "critic_parse_failures", "clip_kl"]
    for name in plots:
        data = out[name].read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000, name
    page = out["report_html"].read_text()
    # start policy: gsm8k 2/4, math500 1/2; capo round 1: 3/4, 2/2; grpo round 1: 1/4, 0/2
    start, capo, grpo = (100 * 2 / 4 + 100 * 1 / 2) / 2, (100 * 3 / 4 + 100 * 2 / 2) / 2, (100 * 1 / 4 + 0) / 2
    assert (start, capo, grpo) == (50.0, 87.5, 12.5)
    assert "<th>GSM8K</th><th>MATH500</th><th>Avg.</th>" in page
    assert f"<td>start policy</td><td>0</td><td>50.0</td><td>50.0</td><td>{start:.1f}</td>" in page
    assert f"<td>{CAPO}</td><td>1</td><td>75.0</td><td>100.0</td><td>{capo:.1f}</td>" in page
    assert f"<td>{GRPO}</td><td>1</td><td>25.0</td><td>0.0</td><td>{grpo:.1f}</td>" in page
    md = out["report_md"].read_text()
    assert f"| {CAPO} | 1 | 75.0 | 100.0 | {capo:.1f} |" in md
    # pass@2 of capo on math500: problem 0 any-right, problem 1 none -> 50%; only that cell, so Avg. is 50.0
    assert "pass@2 (%)" in md and f"| {CAPO} | 1 | 50.0 | 50.0 |" in md
    assert "![accuracy](accuracy.png)" in md and "<img src='accuracy.png'" in page
    assert json.loads(out["accuracy_json"].read_text())[1]["mean"] == capo


def test_report_training_numbers(runs):
    data, notes = collect(runs / RUN)
    assert notes == []
    ro = {r["variant"]: r for r in data["rollout"]}
    assert ro[CAPO]["mean_response_tokens"] == (3 + 2) / 2
    assert ro[CAPO]["mean_token_reward"] == pytest.approx((2 + 2 + 1 + 0 - 1) / 5)
    assert ro[CAPO]["train_accuracy"] == 1 / 2
    flagged = {(r["variant"], r["rule"]): r["share_flagged"] for r in data["flagged"]}
    assert flagged[(CAPO, "intersection")] == 1 / 4 and flagged[(CAPO, "union")] == 2 / 4
    # skipped_empty_response is not a critic failure: 1 failure in 3 critiques
    assert data["parse"][0]["failure_rate"] == pytest.approx(1 / 3)
    tm = {r["variant"]: r for r in data["train"]}
    assert tm[CAPO]["clip_frac"] == pytest.approx((0.1 + 0.3) / 2)
    assert tm[GRPO]["clip_frac"] == pytest.approx((0.0 + 0.2) / 2)
    md = write_report(runs, RUN)["report_md"].read_text()
    # capo round 1: train acc 50.0, (3 + 2) / 2 tokens, reward 4 / 5, flagged 1 of 4 steps (intersection, not union)
    # one group (p0) per variant, one right and one wrong response: 1 of 1 groups with signal
    assert f"| {CAPO} | 1 | 50.0 | 1 / 1 | 2.5 | 0.800 | 25.0 | 33.3 | 0.2000 |" in md
    assert f"| {GRPO} | 1 | 50.0 | 1 / 1 | 2.0 | 0.500 | – | 33.3 | 0.1000 |" in md
    # the critic-signal table: by hand from the four critiques of rollout x (the "ok" rows carry no list)
    assert "### Critic signal (process critiques)" in md
    assert "| 1 | 0 % of 1 | no_verdict 1, ok 2, skipped_empty_response 1 | – |" in md


def test_report_missing_tables_never_crash(tmp_path):
    rd = tmp_path / "runs" / "empty"
    (rd / "round_001").mkdir(parents=True)
    out = write_report(tmp_path / "runs", "empty")
    md = out["report_md"].read_text()
    assert "no eval table yet" in md and "accuracy.png not drawn" in md and "clip_kl.png not drawn" in md
    assert not any(p.suffix == ".png" for p in out.values())
    assert "<h1>CAPO run <code>empty</code></h1>" in out["report_html"].read_text()
    # eval only (a run before its first round): accuracy and eval lengths, the rest noted
    _write(rd / "round_000" / "eval.parquet", _eval_rows(0, None, "aime24", [0, 1, 0]), EVAL_SCHEMA)
    out = write_report(tmp_path / "runs", "empty")
    assert out["accuracy"].read_bytes()[:8] == PNG_MAGIC and out["response_length"].exists()
    assert "<td>start policy</td><td>0</td><td>33.3</td><td>33.3</td>" in out["report_html"].read_text()
    assert "steps_flagged.png not drawn" in out["report_md"].read_text()
    with pytest.raises(FileNotFoundError, match="no run 'nope'"):
        write_report(tmp_path / "runs", "nope")


def test_one_unreadable_table_file_is_a_note_not_a_crash(runs, tmp_path):
    """A truncated or overwritten Parquet file is left out and named in the report's notes; the
    table's other files (and every other table) are still read and shown."""
    bad_eval = runs / RUN / "round_001" / "variants" / GRPO / "eval.parquet"
    bad_eval.write_bytes(b"PAR1x")
    (runs / RUN / "round_001" / "critiques.parquet").write_bytes(b"PAR1x")  # every file of a table
    data, notes = collect(runs / RUN)
    assert {r["variant"] for r in data["accuracy"]} == {None, CAPO}  # the start policy and CAPO still read
    assert "critique_rows" not in data and "parse" not in data
    assert any(n.startswith("eval: round_001/variants/grpo/eval.parquet left out, unreadable") for n in notes), notes
    assert any(n.startswith("critiques: round_001/critiques.parquet left out, unreadable") for n in notes), notes
    out = write_report(runs, RUN, tmp_path / "rep")
    page = out["report_html"].read_text()
    assert f"<td>{CAPO}</td><td>1</td><td>75.0</td><td>100.0</td>" in page and f"<td>{GRPO}</td><td>1</td><td>25.0</td>" not in page
    assert "round_001/variants/grpo/eval.parquet left out, unreadable" in out["report_md"].read_text()


def test_publish_artifacts(runs, tmp_path, monkeypatch, caplog):
    import prefect.artifacts
    from prefect.context import FlowRunContext

    report = write_report(runs, RUN, tmp_path / "rep")
    with caplog.at_level("INFO", logger="capo.report"):
        assert publish_artifacts(report, "x") == []
    assert "no Prefect flow run context" in caplog.text
    made = []
    monkeypatch.setattr(FlowRunContext, "get", classmethod(lambda cls: object()))
    monkeypatch.setattr(prefect.artifacts, "create_markdown_artifact", lambda md, key, description: made.append((key, md)) or 1)
    monkeypatch.setattr(prefect.artifacts, "create_table_artifact", lambda rows, key, description: made.append((key, rows)) or 2)
    assert publish_artifacts(report, "Run r1/Round_1") == [1, 2]
    (k1, md), (k2, rows) = made
    assert (k1, k2) == ("run-r1-round-1-report", "run-r1-round-1-accuracy")
    assert md.count("data:image/png;base64,") == 6 and f"| {CAPO} | 1 | 75.0 | 100.0 | 87.5 |" in md
    assert rows[0]["variant"] == "start policy"


def test_round_changes_are_paired_and_noise_is_called_noise(tmp_path):
    """3 -> 5 of 16 with six flips (what a report could take for a gain) is within noise;
    0 -> 40 of 40 is significant; both appear in the report with their interval."""
    rd = tmp_path / "runs" / RUN
    before = [1, 1, 1] + [0] * 13
    after = [1, 0, 0, 1, 1, 1, 1] + [0] * 9
    _write(rd / "round_000" / "eval.parquet", _eval_rows(0, None, "gsm8k", before) + _eval_rows(0, None, "svamp", [0] * 40),
           EVAL_SCHEMA)
    _write(rd / "round_001" / "variants" / CAPO / "eval.parquet",
           _eval_rows(1, CAPO, "gsm8k", after) + _eval_rows(1, CAPO, "svamp", [1] * 40), EVAL_SCHEMA)
    _write(rd / "round_001" / "variants" / CAPO / "train_metrics.parquet",
           [{"run_id": RUN, "round": 1, "variant": CAPO, "step": 0, "name": n, "value": v}
            for n, v in (("clip_frac", 0.0), ("approx_kl", 0.0), ("engine_logprob_diff_mean", 0.0125),
                         ("engine_logprob_diff_max", 0.5), ("export_update_share", 0.14),
                         ("export_update_share_from_start", 0.386))], TRAIN_METRICS_SCHEMA)
    rep = write_report(tmp_path / "runs", RUN)
    md = rep["report_md"].read_text()
    section = md.split("### Changes between rounds")[1].split("###")[0]
    gsm = next(line for line in section.splitlines() if "| GSM8K" in line)
    svamp = next(line for line in section.splitlines() if "| SVAMP" in line)
    assert "+12.5" in gsm and "within noise" in gsm and "2 / 4" in gsm
    assert "+100.0" in svamp and "significant" in svamp and "within noise" not in svamp
    assert "1.25e-02 / 5.00e-01" in md  # the rollout/trainer log-prob mismatch of the round
    assert "| 14 / 39 |" in md  # the share of the fp32 update the bf16 checkpoint carries: round / run
    assert rep["accuracy"].read_bytes()[:8] == PNG_MAGIC


def test_sampled_accuracy_and_its_paired_change_in_the_report(tmp_path):
    """8 problems x 4 samples at T = 1: problems 0-3 go from 1 to 3 right samples of 4, the rest
    stay at 0. Sampled accuracy 12.5 -> 37.5 %; the paired change +25.0 points rests on 4 problems
    moving the same way (sign-flip p = 2/16 = 0.125): within noise although the bootstrap CI
    excludes 0, the verdict needs both."""
    rd = tmp_path / "runs" / RUN
    r0 = [1, 0, 0, 0] * 4 + [0] * 16
    r1 = [1, 1, 1, 0] * 4 + [0] * 16
    _write(rd / "round_000" / "eval.parquet",
           _eval_rows(0, None, "gsm8k", [0] * 8) + _eval_rows(0, None, "gsm8k", r0, "sample", 4), EVAL_SCHEMA)
    _write(rd / "round_001" / "variants" / CAPO / "eval.parquet",
           _eval_rows(1, CAPO, "gsm8k", [0] * 8) + _eval_rows(1, CAPO, "gsm8k", r1, "sample", 4), EVAL_SCHEMA)
    md = write_report(tmp_path / "runs", RUN)["report_md"].read_text()
    acc = md.split("### Sampled accuracy")[1].split("###")[0]
    assert "| 12.5 |" in acc and "| 37.5 |" in acc
    section = md.split("### Changes between rounds (paired, sampled)")[1].split("###")[0]
    line = next(x for x in section.splitlines() if "| GSM8K" in x)
    assert "+25.0" in line and "0.125" in line and "0 / 4" in line and "within noise" in line
    greedy = md.split("### Changes between rounds (paired, greedy)")[1].split("###")[0]
    assert "+0.0" in greedy  # the greedy answers did not change


def test_groups_with_signal_count_groups_whose_outcomes_differ(tmp_path):
    # three groups of two: p0 right+wrong (signal), p1 right+right, p2 wrong+wrong (none) -> 1 of 3
    rows = _token_rewards(GRPO, None, [[2.0], [0.0], [2.0], [2.0], [0.0], [0.0]])
    for i, r in enumerate(rows):
        r["prompt_id"] = f"p{i // 2}"
    _write(tmp_path / RUN / "round_001" / "variants" / GRPO / "token_rewards.parquet", rows, TOKEN_REWARDS_SCHEMA)
    data, _ = collect(tmp_path / RUN)
    assert data["groups"] == [{"round": 1, "variant": GRPO, "groups_with_signal": 1, "groups": 3}]
    md = write_report(tmp_path, RUN)["report_md"].read_text()
    assert f"| {GRPO} | 1 | 50.0 | 1 / 3 | 1.0 |" in md


def test_report_shows_each_rounds_process_signal(runs):
    """The round summary's process_signal rows (pipeline/process_signal.py) become a table: shares in %, the
    AUROC with its interval, the trained source starred and the groups by what they train on."""
    row = {"round": 1, "variant": CAPO, "source": "vote+arithmetic", "scope": "before_answer", "trains": True,
           "right_penalized": 0.25, "wrong_penalized": 0.5, "auroc": 0.6234, "auroc_low": 0.551, "auroc_high": 0.70,
           "groups": 8, "groups_outcome": 3, "groups_process_only": 4, "groups_other_signal": 0, "groups_no_signal": 1}
    summary = runs / RUN / "round_001" / "variants" / CAPO / "round_summary.json"
    summary.write_text(json.dumps({"process_signal": [row, {**row, "source": "arithmetic", "trains": False,
                                                             "auroc": None}]}))
    md = write_report(runs, RUN)["report_md"].read_text()
    assert "### Process signal (does the penalty land on wrong responses?)" in md
    assert f"| 1 | {CAPO} | vote+arithmetic * | before answer | 25 % | 50 % | 0.62 [0.55, 0.70] | 3 / 4 / 1 |" in md
    assert f"| 1 | {CAPO} | arithmetic | before answer | 25 % | 50 % | – | 3 / 4 / 1 |" in md


def test_a_variants_rows_are_one_family_under_holm():
    """Two benchmarks, rounds 0-2: six rows for the variant (round 1 vs 0, round 2 vs 1 and vs 0, per
    benchmark). On GSM8K round 1 gains 7 of 20 problems and loses none: McNemar p = 2 / 2^7 = 0.0156
    and the interval excludes 0, significant alone. Holm over the six rows: SVAMP's two rows against
    round 0 (40 of 40 gained, p = 2 / 2^40) come first, GSM8K's two against round 0 third and fourth:
    (6 - 3 + 1) x 0.0156 = 0.0625 > 0.05, so the row reads "not after Holm"; SVAMP stays significant."""
    from pipeline.report import paired_changes

    def rows(rnd, variant, bench, correct):
        return [{"variant": variant, "round": rnd, "benchmark": bench, "prompt_id": f"{bench}-{i}", "correct": c}
                for i, c in enumerate(correct)]

    items = (rows(0, None, "gsm8k", [0] * 20) + rows(1, CAPO, "gsm8k", [1] * 7 + [0] * 13)
             + rows(2, CAPO, "gsm8k", [1] * 7 + [0] * 13) + rows(0, None, "svamp", [0] * 40)
             + rows(1, CAPO, "svamp", [1] * 40) + rows(2, CAPO, "svamp", [1] * 40))
    out = {(r["benchmark"], r["round"], r["vs_round"]): r for r in paired_changes(items)}
    assert len(out) == 6 and {r["tests"] for r in out.values()} == {6}
    g = out[("gsm8k", 1, 0)]
    assert g["p_mcnemar"] == pytest.approx(2 / 2**7) and g["lo"] > 0 and g["significant_unadjusted"]
    assert g["p_holm"] == pytest.approx(4 * 2 / 2**7) and not g["significant"]
    assert out[("svamp", 1, 0)]["significant"] and out[("svamp", 2, 1)]["p_holm"] == pytest.approx(1.0)


def test_a_given_report_folder_with_a_users_files_is_refused_and_a_report_folder_is_rewritten(runs, tmp_path):
    """--out-dir pointing at a folder with the user's own report.md: refused, the file untouched;
    a folder a report wrote (it holds the marker) is written again; the default folder always is."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("my notes")
    with pytest.raises(FileExistsError, match=r"already holds report\.md, not written by `capo report`"):
        write_report(runs, RUN, mine)
    assert (mine / "report.md").read_text() == "my notes" and not list(mine.glob("*.png"))
    first = write_report(runs, RUN, tmp_path / "ours")
    again = write_report(runs, RUN, tmp_path / "ours")
    assert again["report_md"] == first["report_md"] and (tmp_path / "ours" / ".capo-report").read_text() == f"{RUN}\n"
    assert not list((tmp_path / "ours").glob(".*.tmp*"))  # no temporary file left behind
    write_report(runs, RUN)
    write_report(runs, RUN)
