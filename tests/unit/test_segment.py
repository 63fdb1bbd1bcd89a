"""Step splitting and the token -> step map (pipeline/core/segment.py), numbers worked by hand."""

import numpy as np
import pytest

from pipeline.core.segment import (
    STEP_SPLITTERS,
    assign_tokens_to_steps,
    segment_response,
    split_steps,
    step_token_spans,
    token_char_starts,
)


def texts(text, spans):
    return [text[s:e] for s, e in spans]


# --- split_steps ---------------------------------------------------------------------------


def test_blank_line_splits_on_runs_of_blank_lines_and_trims():
    text = "Step A\n\nStep B\n \t\n\nStep C  \n\n\n"
    # "Step A" = chars 0..6, "\n\n" = 6..8, "Step B" = 8..14, "\n \t\n\n" = 14..19,
    # "Step C" = 19..25, then trailing "  \n\n\n".
    spans = split_steps(text)
    assert spans == [(0, 6), (8, 8 + 6), (14 + 5, 19 + 6)]
    assert texts(text, spans) == ["Step A", "Step B", "Step C"]


def test_blank_line_keeps_single_newlines_inside_a_step():
    text = "a\nb\n\nc"
    assert split_steps(text, "blank_line") == [(0, 3), (5, 6)]


def test_line_mode_splits_every_newline_and_drops_blank_pieces():
    text = "a\n\n b \nc"  # a=0, \n=1, \n=2, ' '=3, b=4, ' '=5, \n=6, c=7
    assert split_steps(text, "line") == [(0, 1), (4, 5), (7, 8)]


def test_step_tag_mode_text_before_first_marker_is_a_step():
    text = "Intro.\n<step 1> Add 2.\n<step 2>Done"
    spans = split_steps(text, "step_tag")
    # "Intro." = 0..6; "<step 1>" = 7..15; " Add 2.\n" = 15..23 -> trimmed 16..22;
    # "<step 2>" = 23..31; "Done" = 31..35.
    assert spans == [(0, 6), (16, 22), (31, 35)]
    assert texts(text, spans) == ["Intro.", "Add 2.", "Done"]


def test_step_tag_mode_drops_empty_steps_and_blank_preamble():
    text = "  <step 1>a<step 2>  <Step 3>b"
    assert texts(text, split_steps(text, "step_tag")) == ["a", "b"]


@pytest.mark.parametrize("mode", sorted(STEP_SPLITTERS))
def test_blank_text_has_no_steps(mode):
    assert split_steps("", mode) == []
    assert split_steps(" \n\n\t\n", mode) == []


def test_unknown_mode_lists_valid_modes():
    with pytest.raises(ValueError, match="paragraph") as err:
        split_steps("a", "paragraph")
    for mode in ("blank_line", "line", "step_tag"):
        assert mode in str(err.value)


# --- token_char_starts ----------------------------------------------------------------------


def test_token_char_starts_ascii():
    text = "ab cd"
    # tokens "ab" (2 bytes), " c" (2), "d" (1), EOS (0)
    starts = token_char_starts(np.array([2, 2, 1, 0]), text.encode())
    assert starts.tolist() == [0, 2, 4, 5]
    assert starts.dtype == np.int64


def test_token_char_starts_boundary_inside_multibyte_char():
    text = "x€y"  # '€' is 3 bytes E2 82 AC: bytes x=0, €=1..3, y=4
    assert len(text.encode()) == 1 + 3 + 1
    # tokens: [x, E2] [82] [AC, y]: the 2nd and 3rd start inside '€' (char 1)
    starts = token_char_starts(np.array([2, 1, 2]), text.encode())
    assert starts.tolist() == [0, 1, 1]


def test_token_char_starts_invalid_utf8_matches_replace_decoding():
    cut = b"ab\xe2\x82"  # a response cut inside '€': decodes to "ab\ufffd" (one U+FFFD)
    assert cut.decode("utf-8", errors="replace") == "ab\ufffd"
    assert token_char_starts(np.array([2, 1, 1, 0]), cut).tolist() == [0, 2, 2, 3]
    stray = b"a\x80b"  # a lone continuation byte is one U+FFFD of its own
    assert stray.decode("utf-8", errors="replace") == "a\ufffdb"
    assert token_char_starts(np.array([1, 1, 1]), stray).tolist() == [0, 1, 2]


def test_token_char_starts_byte_count_mismatch_raises():
    with pytest.raises(ValueError, match="sum to 3 but the text has 4 bytes"):
        token_char_starts(np.array([1, 2]), b"abcd")


# --- assign_tokens_to_steps / step_token_spans ----------------------------------------------


def test_assign_tokens_gap_goes_to_next_step_and_tail_to_last():
    spans = [(2, 5), (7, 9)]
    chars = np.array([0, 2, 4, 5, 6, 7, 8, 9, 12])
    # before first -> 0; inside step 0 -> 0; gap 5..7 -> 1; inside 1 -> 1; after end -> last
    assert assign_tokens_to_steps(chars, spans).tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1]


def test_assign_tokens_needs_a_step():
    with pytest.raises(ValueError, match="empty"):
        assign_tokens_to_steps(np.array([0]), [])


def test_step_token_spans_with_a_tokenless_step():
    start, end = step_token_spans(np.array([0, 0, 2, 2, 2]), 4)
    assert start.tolist() == [0, 2, 2, 5]
    assert end.tolist() == [2, 2, 5, 5]
    assert start.dtype == np.int32 and end.dtype == np.int32


def test_step_token_spans_rejects_unsorted_or_out_of_range():
    with pytest.raises(ValueError, match="token 1 has step 0 after step 1"):
        step_token_spans(np.array([1, 0]), 2)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        step_token_spans(np.array([0, 2]), 2)


# --- segment_response -----------------------------------------------------------------------


def test_segment_multibyte_straddling_gap_and_eos():
    text = "a€b\n\nc d\n\n\ne"
    # chars: a0 €1 b2 \n3 \n4 c5 ' '6 d7 \n8 \n9 \n10 e11 (12 chars, 14 bytes)
    # steps: "a€b" (0,3), "c d" (5,8), "e" (11,12)
    num_bytes = np.array(
        [
            2,  # t0 [a, E2]: char 0 -> step 0
            2,  # t1 [82, AC]: starts inside '€' (char 1) -> step 0
            4,  # t2 [b, \n, \n, c]: starts at end of step 0 (char 2), spills into step 1 -> 0
            2,  # t3 [' ', d]: char 6 -> step 1
            1,  # t4 [\n]: char 8, in the gap -> next step 2
            3,  # t5 [\n, \n, e]: char 9, in the gap -> step 2
            0,  # t6 EOS: char 12 = len(text) -> last step 2
        ]
    )
    assert num_bytes.sum() == len(text.encode()) == 12 + 2
    seg = segment_response(text, num_bytes)
    assert seg.step_spans == ((0, 3), (5, 8), (11, 12))
    assert seg.step_texts == ("a€b", "c d", "e")
    assert seg.token_step.tolist() == [0, 0, 0, 1, 2, 2, 2]
    assert seg.token_start.tolist() == [0, 3, 4]
    assert seg.token_end.tolist() == [3, 4, 7]
    assert seg.n_steps == 3 and not seg.empty


def test_segment_step_swallowed_by_one_token_has_no_tokens():
    text = "x\n\ny\n\nz"
    seg = segment_response(text, np.array([6, 1]))  # "x\n\ny\n\n" then "z"
    assert seg.token_step.tolist() == [0, 2]
    assert seg.token_start.tolist() == [0, 1, 1]
    assert seg.token_end.tolist() == [1, 1, 2]


@pytest.mark.parametrize("text,num_bytes", [("", [0]), (" \n\n ", [4, 0]), ("", [])])
def test_segment_blank_text_is_one_step_owning_all_tokens(text, num_bytes):
    seg = segment_response(text, np.array(num_bytes, dtype=np.int64))
    assert seg.empty
    assert seg.step_spans == ((0, len(text)),)
    assert seg.token_step.tolist() == [0] * len(num_bytes)
    assert seg.token_start.tolist() == [0] and seg.token_end.tolist() == [len(num_bytes)]


def test_segment_with_raw_invalid_bytes():
    raw = "Step 1\n\nStep 2 costs 5".encode() + b"\xe2\x82"  # cut inside '€'
    text = raw.decode("utf-8", errors="replace")
    seg = segment_response(text, np.array([8, 14, 2]), text_bytes=raw)
    assert seg.step_texts == ("Step 1", "Step 2 costs 5\ufffd")
    assert seg.token_step.tolist() == [0, 1, 1]
    with pytest.raises(ValueError, match="differs from text"):
        segment_response("other", np.array([16]), text_bytes=raw)
