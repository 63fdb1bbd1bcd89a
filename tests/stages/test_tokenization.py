"""Exact bytes of generated tokens with the real byte-level BPE tokenizers (pipeline/core/tokenization.py).

Uses the converted checkpoints of both embedded tokenizer families (``capo setup``; the fixtures convert
them where absent).
"""


import numpy as np
import pytest

from pipeline.core import tokenization
from pipeline.core.segment import segment_response
from pipeline.core.tokenization import decode_with_bytes, token_bytes

NAMES = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]

TEXTS = [
    "Step 1: 12 + 30 = 42.\n\nStep 2: so the answer is \\boxed{42}.",
    "Un café coûte 3 €, donc 4 cafés coûtent 12 €.\n\n\\boxed{12}",
    "日本語の問題です。\n\n答えは 7 です。\n\n\\boxed{7}",
    "Great job 🎉👍🏽! 🧮 gives 3 × 4 = 12\n\n\n\n\\boxed{12}",
    "é\n\n€\n\n日\n\n🎉",
    "  leading spaces\n\n\ttab\n \nend\n\n",
]


@pytest.fixture(scope="module", params=NAMES)
def tok(request):
    import transformers

    path = request.getfixturevalue("tiny_model" if request.param == NAMES[0] else "qwen_model")
    return transformers.AutoTokenizer.from_pretrained(str(path))


def _encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_tokenizers_take_the_byte_level_path(tok):
    assert tokenization._is_byte_level(tok)


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_text(tok, text):
    ids = _encode(tok, text)
    pieces = token_bytes(tok, ids)
    assert len(pieces) == len(ids)
    assert b"".join(pieces) == text.encode("utf-8")
    assert all(p for p in pieces)  # ordinary tokens are never empty


def test_some_tokens_hold_part_of_a_character(tok):
    # Otherwise the prefix tests below would not test anything.
    pieces = [p for text in TEXTS for p in token_bytes(tok, _encode(tok, text))]
    partial = [p for p in pieces if p.decode("utf-8", errors="replace") != p.decode("utf-8", errors="ignore")]
    assert partial


@pytest.mark.parametrize("text", TEXTS)
def test_every_token_prefix_gives_a_byte_prefix(tok, text):
    ids = _encode(tok, text)
    full = text.encode("utf-8")
    for k in range(len(ids) + 1):
        raw = b"".join(token_bytes(tok, ids[:k]))
        assert full.startswith(raw), k
        dtext, draw, lengths = decode_with_bytes(tok, ids[:k])
        assert draw == raw and int(lengths.sum()) == len(raw)
        assert lengths.dtype == np.int32 and lengths.shape == (k,)
        assert dtext == raw.decode("utf-8", errors="replace")


def test_special_tokens_have_no_bytes(tok):
    ids = _encode(tok, TEXTS[2]) + [tok.eos_token_id]
    pieces = token_bytes(tok, ids)
    assert token_bytes(tok, [tok.eos_token_id]) == [b""]
    assert pieces[-1] == b"" and b"".join(pieces) == TEXTS[2].encode()
    text, raw, lengths = decode_with_bytes(tok, ids)
    assert text == TEXTS[2] and lengths[-1] == 0
    for sid in tok.all_special_ids:
        assert token_bytes(tok, [sid]) == [b""]


def test_added_tokens_match_what_the_engines_decode(tok):
    # The engines write response_text with decode(skip_special_tokens=True): an added token marked
    # special (Qwen's <|im_start|>, SmolLM2's <file_sep>, not all of them named special tokens)
    # vanishes there, so it must have no bytes here; a non-special added token keeps its text.
    for tid, added in tok.added_tokens_decoder.items():
        assert token_bytes(tok, [tid]) == [b"" if added.special else added.content.encode()], added.content
    mixed = _encode(tok, "a 日") + sorted(tok.added_tokens_decoder) + _encode(tok, "\n\nb €")
    text, raw, lengths = decode_with_bytes(tok, mixed)
    assert text == tok.decode(mixed, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert int(lengths.sum()) == len(raw) == len(text.encode())


def test_decode_with_bytes_agrees_with_the_tokenizer(tok):
    for text in TEXTS:
        ids = _encode(tok, text)
        got, raw, lengths = decode_with_bytes(tok, ids)
        assert got == text == tok.decode(ids, clean_up_tokenization_spaces=False)
        assert raw == text.encode()
        assert lengths.tolist() == [len(p) for p in token_bytes(tok, ids)]


def test_response_cut_inside_a_character_segments(tok):
    # A response stopped by max_tokens in the middle of a multi-byte character, plus one whose
    # EOS follows a complete text.
    text = TEXTS[3]
    ids = _encode(tok, text)
    cut = next(k for k in range(1, len(ids)) if not _decodes(b"".join(token_bytes(tok, ids[:k]))))
    resp, raw, lengths = decode_with_bytes(tok, ids[:cut])
    assert resp.endswith("\ufffd") and text.encode().startswith(raw)
    seg = segment_response(resp, lengths, "blank_line", text_bytes=raw)
    assert seg.token_step.shape == (cut,)
    assert int(seg.token_end[-1]) == cut and int(seg.token_start[0]) == 0
    assert np.all(seg.token_end[:-1] == seg.token_start[1:])  # the steps tile the tokens
    # complete response + EOS: the EOS token (0 bytes) belongs to the last step
    full_ids = _encode(tok, TEXTS[4]) + [tok.eos_token_id]
    resp, raw, lengths = decode_with_bytes(tok, full_ids)
    seg = segment_response(resp, lengths, "blank_line", text_bytes=raw)
    assert seg.step_texts == ("é", "€", "日", "🎉")
    assert int(seg.token_step[-1]) == 3 and int(seg.token_end[-1]) == len(full_ids)


def test_incremental_decoding_fallback_on_whole_characters(tok, monkeypatch):
    # The path for non-byte-level tokenizers, forced on a real tokenizer: exact for whole characters.
    monkeypatch.setattr(tokenization, "_is_byte_level", lambda _: False)
    for text in TEXTS:
        ids = _encode(tok, text) + [tok.eos_token_id]
        pieces = token_bytes(tok, ids)
        assert b"".join(pieces) == text.encode(), text
        assert pieces[-1] == b""


def _decodes(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False
