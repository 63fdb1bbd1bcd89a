"""The log-prob readout's arithmetic (pipeline/core/readout.py), numbers worked by hand."""

import math

import pytest

from pipeline.core.readout import (
    binary_readout,
    binary_wrong,
    calibrate,
    calibrated_scores,
    forced_answer,
    nonfinite_text,
    readout_text,
    verdict_token_ids,
)


class CharTokenizer:
    """One token per character (id = code point): positions can be counted by hand."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_binary_readout_by_hand():
    assert binary_wrong(0.3, 0.1) == pytest.approx(0.25)  # 0.1 / (0.1 + 0.3)
    assert binary_wrong(0.0, 0.0) == 0.5
    with pytest.raises(ValueError, match="p_wrong"):
        binary_wrong(0.5, math.nan)


def test_calibration_by_hand():
    # an input read exactly like the content-free one carries no information: 0.5
    assert calibrate(0.8, 0.8) == pytest.approx(0.5)
    # p = 0.5, c = 0.2: w = 0.5 / 0.2 = 2.5, r = 0.5 / 0.8 = 0.625, q = 2.5 / 3.125 = 0.8
    assert calibrate(0.5, 0.2) == pytest.approx(0.8)
    # p = 0.3, c = 0.6: w = 0.5, r = 0.7 / 0.4 = 1.75, q = 0.5 / 2.25
    assert calibrate(0.3, 0.6) == pytest.approx(0.5 / 2.25)
    assert 0 < calibrate(0.0, 0.5) < 1e-5 and 1 - 1e-5 < calibrate(1.0, 0.5) < 1  # clipped, finite
    with pytest.raises(ValueError, match="content_free"):
        calibrate(0.5, 1.5)


def test_forced_answer_positions_by_hand():
    tok = CharTokenizer()
    ids, pos = forced_answer([1, 2, 3], 2, tok)
    text = "Step 0: correct\nStep 1: correct"
    assert ids == [1, 2, 3] + [ord(c) for c in text]
    # the verdict of step i is read where "Step i:" ends: its ':' is the last token before " correct"
    assert pos == [3 + len("Step 0:") - 1, 3 + len("Step 0: correct\nStep 1:") - 1]
    assert all(ids[p] == ord(":") and ids[p + 1] == ord(" ") for p in pos)
    with pytest.raises(ValueError, match="n_steps"):
        forced_answer([1], 0, tok)


def test_verdict_tokens_must_differ():
    with pytest.raises(ValueError, match="first token"):
        verdict_token_ids(CharTokenizer())  # " correct" and " wrong" both start with " "


def test_readout_text_lists_the_steps_above_the_threshold():
    text = readout_text([0.2, 0.9], [0.3, 0.7], [0.4, 0.4])
    assert text.splitlines() == ["Step 0: P(wrong) 0.200 (raw 0.300, content-free 0.400)",
                                 "Step 1: P(wrong) 0.900 (raw 0.700, content-free 0.400)", "Wrong step list: [1]"]


def test_a_nonfinite_readout_gives_no_scores_instead_of_an_error():
    raw = binary_readout([(0.3, 0.1), (math.nan, 0.2), (0.1, math.inf), (-0.1, 0.2)])
    assert raw[0] == pytest.approx(0.25) and all(math.isnan(x) for x in raw[1:])
    assert calibrated_scores([0.5, 0.3], [0.2, 0.6]) == pytest.approx([0.8, 0.5 / 2.25])
    assert calibrated_scores([0.5, math.nan], [0.2, 0.6]) is None
    assert calibrated_scores([0.5, 0.3], [0.2, math.inf]) is None  # the content-free input counts too
    assert nonfinite_text([0.25, math.nan], [0.5, 0.5]) == (
        "Step 0: raw P(wrong) 0.250, content-free 0.500\n"
        "Step 1: raw P(wrong) nan, content-free 0.500 (not finite)\nReadout not finite: no step scores")
