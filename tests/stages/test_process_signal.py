"""Process-signal quality (pipeline/process_signal.py, ``capo signal``): AUROC and its bootstrap interval by
hand, and every source and scope on the hand-built round of tests/toy_round.py as written to disk."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline.process_signal import (
    auroc,
    auroc_interval,
    final_answer_step,
    first_penalty_at,
    measure_run,
    penalty_share,
)
from pipeline.stages.base import round_paths
from pipeline.stages.reward import reward_stage
from pipeline.stages.vote import vote_stage
from tests.toy_round import SPANS, toy_config, write_round, write_rows


def test_auroc_by_hand():
    # wrong scores 0.5, 1.0 against right 0.0, 0.5: pairs (0.5>0.0)=1, (0.5=0.5)=0.5, (1>0)=1, (1>0.5)=1 -> 3.5/4
    assert auroc([0.0, 0.5, 0.5, 1.0], [False, False, True, True]) == pytest.approx(0.875)
    assert auroc([1.0, 0.0], [False, True]) == 0.0  # the signal points the wrong way
    assert auroc([0.2, 0.2, 0.2], [True, False, False]) == 0.5  # all tied: no information
    assert auroc([0.1, 0.3], [False, False]) is None  # one class only
    with pytest.raises(ValueError, match="1-D of one length"):
        auroc([0.1, 0.2], [True])


def test_auroc_interval_covers_the_point_and_narrows_with_items():
    import numpy as np

    rng = np.random.default_rng(3)
    wrong = rng.random(400) < 0.5
    scores = np.where(wrong, rng.normal(1.0, 1.0, 400), rng.normal(0.0, 1.0, 400))  # true AUROC = Phi(1/sqrt 2) = 0.760
    auc, lo, hi = auroc_interval(scores, wrong, n_boot=1000)
    assert lo < auc < hi and lo < 0.760 < hi and hi - lo < 0.12
    _, lo20, hi20 = auroc_interval(scores[:40], wrong[:40], n_boot=1000)
    assert hi20 - lo20 > hi - lo
    assert auroc_interval([0.1], [True]) == (None, None, None)
    with pytest.raises(ValueError, match="level"):
        auroc_interval(scores, wrong, level=1.5)


def test_cluster_bootstrap_over_prompts_is_wider_when_responses_of_a_prompt_agree():
    """8 responses of each of 30 prompts: a prompt is hard (all wrong, score 0.6 + noise) or easy
    (all right, 0.4 + noise). Resampling responses treats 240 items as independent; resampling
    prompts knows there are 30, so its interval is wider."""
    import numpy as np

    rng = np.random.default_rng(0)
    hard = np.repeat(rng.random(30) < 0.5, 8)
    groups = np.repeat(np.arange(30), 8)
    scores = np.where(hard, 0.6, 0.4) + np.repeat(rng.normal(0, 0.15, 30), 8) + rng.normal(0, 0.02, 240)
    auc, lo, hi = auroc_interval(scores, hard, n_boot=1000)
    auc_c, lo_c, hi_c = auroc_interval(scores, hard, n_boot=1000, groups=groups)
    assert auc_c == auc and lo_c <= auc <= hi_c
    assert hi_c - lo_c > 1.5 * (hi - lo)
    # one group of each class: no resample with both classes is possible except the original draw
    assert auroc_interval([0.9, 0.1], [True, False], n_boot=50, groups=["a", "b"])[0] == 1.0
    with pytest.raises(ValueError, match="one entry per item"):
        auroc_interval(scores, hard, groups=groups[:10])


def test_first_penalty_at_by_hand():
    assert first_penalty_at([0, 1, 0.5], [4, 1, 6]) == pytest.approx(4 / 11)  # 4 tokens before step 1
    assert first_penalty_at([1, 0], [3, 5]) == 0.0
    assert first_penalty_at([0, 0], [3, 5]) is None and first_penalty_at([1], [0]) is None
    with pytest.raises(ValueError, match="1 step weights for 2 steps"):
        first_penalty_at([1], [1, 2])


def test_penalty_share_and_final_answer_step():
    assert penalty_share([0, 1, 0.5], [4, 1, 6]) == pytest.approx((1 * 1 + 0.5 * 6) / 11)
    assert penalty_share([], []) == 0.0
    with pytest.raises(ValueError, match="2 step weights for 3 steps"):
        penalty_share([0, 1], [1, 2, 3])
    assert final_answer_step(["a", "so \\boxed{5}", "Done."]) == 1
    assert final_answer_step(["a", "b"]) == 1 and final_answer_step([]) == 0


STEP_TEXTS = {"A": ["Half of 6 is 3.", "3 + 2 = 5 apples.", "So the answer is \\boxed{5}."],
              "B": ["6 - 2 = 3.", "Hmm.", "\\boxed{4}"],  # its first step's arithmetic is wrong (is 4)
              "C": ["\\boxed{1000}"], "D": ["\\boxed{1000}"]}


@pytest.fixture
def toy_run(tmp_path):
    """The toy round (groups A right / B wrong, and C, D both right) with real step texts, voted by
    majority and rewarded as the stages write them."""
    cfg = toy_config(tmp_path)
    write_round(cfg, extra_group=True)
    steps = []
    for rid, texts in STEP_TEXTS.items():
        spans = SPANS.get(rid, [(0, 3 if rid == "C" else 2)])
        for s, (text, (a, b)) in enumerate(zip(texts, spans)):
            steps.append({"rollout_id": rid, "step_idx": s, "n_steps": len(texts), "char_start": 0, "char_end": len(text),
                          "token_start": a, "token_end": b, "step_text": text, "empty_response": False})
    write_rows(cfg, "steps", steps, "segment")
    vote_stage(cfg, 1)
    reward_stage(cfg, 1)
    return cfg


def _by(rows, source, scope):
    (row,) = [r for r in rows if r["source"] == source and r["scope"] == scope]
    return row


def test_every_source_and_scope_on_the_toy_round(toy_run):
    """Majority weights (tests/toy_round.py): A [0, 1, 0] (step 1 is 1 of A's 11 tokens), B, C, D none;
    the arithmetic check flags B's step 0 (2 of B's 7 tokens). Right: A, C, D; wrong: B."""
    rows = measure_run(toy_run.run_dir())
    assert {r["variant"] for r in rows} == {"capo-majority"} and {r["rule"] for r in rows} == {"majority"}
    vote = _by(rows, "vote", "all_steps")
    # B scores 0 against A's 1/11 (0), C's 0 (tie, 1/2), D's 0 (tie, 1/2): AUROC (0 + 0.5 + 0.5) / 3
    assert vote["auroc"] == pytest.approx(1 / 3)
    assert vote["right_penalized"] == pytest.approx(1 / 3) and vote["wrong_penalized"] == 0.0
    assert (vote["right_penalty_starts"], vote["wrong_penalty_starts"]) == (pytest.approx(4 / 11), None)  # A at step 1
    arith = _by(rows, "arithmetic", "all_steps")
    assert arith["auroc"] == 1.0 and arith["right_penalized"] == 0.0 and arith["wrong_penalized"] == 1.0
    assert (arith["right_penalty_starts"], arith["wrong_penalty_starts"]) == (None, 0.0)  # B at its first token
    both = _by(rows, "vote+arithmetic", "all_steps")  # A 1/11, B 2/7, C = D = 0
    assert both["auroc"] == 1.0 and both["right_penalized"] == pytest.approx(1 / 3)
    # before the step stating the answer (each one's \boxed step): A keeps steps 0, 1 (w [0, 1] over 4 + 1
    # tokens), B steps 0, 1 (vote none; arithmetic step 0), C and D nothing
    assert _by(rows, "vote", "before_answer")["auroc"] == pytest.approx(1 / 3)
    assert _by(rows, "vote", "before_answer")["right_penalty_starts"] == pytest.approx(4 / 5)  # 4 of A's first 5 tokens
    assert _by(rows, "arithmetic", "before_answer")["auroc"] == 1.0
    for r in rows:
        assert r["run"] == toy_run.run_dir().name
        assert (r["n_responses"], r["n_wrong"], r["steps"]) == (4, 1, 8)
        assert r["steps_flagged_by_arithmetic"] == 1 and r["steps_with_checkable_arithmetic"] == 2
        # group toy-train-00000 has a right and a wrong response; toy-train-00001 two right ones and no flag
        assert (r["groups"], r["groups_outcome"], r["groups_process_only"], r["groups_other_signal"],
                r["groups_no_signal"]) == (2, 1, 0, 0, 1)
        assert r["auroc_low"] <= r["auroc"] <= r["auroc_high"]


def test_capo_signal_command(toy_run, tmp_path):
    out = subprocess.run([sys.executable, "-m", "flows.cli", "signal", "toy", "--runs-dir", toy_run.runs_dir,
                          "--json", "--n-boot", "200"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 6 and _by(rows, "arithmetic", "all_steps")["auroc"] == 1.0
    table = subprocess.run([sys.executable, "-m", "flows.cli", "signal", "toy", "--runs-dir", toy_run.runs_dir],
                           capture_output=True, text=True, timeout=120)
    assert table.returncode == 0 and "AUROC" in table.stdout and "vote+arithmetic" in table.stdout
    bad = subprocess.run([sys.executable, "-m", "flows.cli", "signal", "nope", "--runs-dir", toy_run.runs_dir],
                         capture_output=True, text=True, timeout=120)
    said = " ".join(bad.stderr.replace("│", " ").split())  # typer boxes and wraps the message
    assert bad.returncode == 2 and "no run 'nope' in" in said and "runs there: ['toy']" in said, said
    assert round_paths(toy_run, 1)["token_rewards"].exists()


def test_a_random_credit_variant_is_measured_on_what_it_trained(toy_run):
    """Beside capo-majority, a random-credit variant: its starred row is its own (permuted) weights,
    which penalize the same responses as the true vote (a permutation within a response keeps
    whether any step is penalized) on other steps; the true sources are still reported, unstarred."""
    cfg = toy_config(toy_run.run_dir().parent.parent, "vote.random_credit=true", "variant=rc")
    vote_stage(cfg, 1)
    reward_stage(cfg, 1)
    rows = [r for r in measure_run(toy_run.run_dir()) if r["variant"] == "rc"]
    rc, vote = _by(rows, "random-credit", "all_steps"), _by(rows, "vote", "all_steps")
    assert rc["trains"] and not vote["trains"]
    assert (rc["right_penalized"], rc["wrong_penalized"]) == (vote["right_penalized"], vote["wrong_penalized"])
