"""The incremental-decoding path of ``token_bytes`` (tokenizers that are not byte-level), on
hand-built decoders whose outputs are written out below."""

from __future__ import annotations

import logging

from pipeline.core.tokenization import decode_with_bytes, token_bytes


class _PieceTokenizer:
    """Decodes by joining byte pieces (UTF-8, invalid bytes as U+FFFD), like a SentencePiece
    tokenizer with byte fallback; ``rewrite`` maps a decoded prefix to another text."""

    all_special_ids = [0]
    added_tokens_decoder: dict = {}

    def __init__(self, pieces: dict[int, bytes], rewrite: dict[str, str] | None = None):
        self.pieces, self.rewrite = pieces, rewrite or {}

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        text = b"".join(self.pieces[i] for i in ids if not (skip_special_tokens and i == 0)).decode("utf-8", errors="replace")
        return self.rewrite.get(text, text)


def test_each_token_gets_the_bytes_it_adds_and_a_split_character_waits_for_its_second_byte():
    e_acute = "é".encode()  # b"\xc3\xa9": one character in two tokens
    tok = _PieceTokenizer({0: b"</s>", 1: b"Caf", 2: e_acute[:1], 3: e_acute[1:], 4: b" 3"})
    assert token_bytes(tok, [1, 2, 3, 4, 0]) == [b"Caf", b"", b"\xc3\xa9", b" 3", b""]
    # the same split at the end of a cut response: the half character is kept as the last token's bytes
    assert token_bytes(tok, [1, 2]) == [b"Caf", b"\xef\xbf\xbd"]
    text, raw, lengths = decode_with_bytes(tok, [1, 2, 3, 4, 0])
    assert (text, raw, lengths.tolist()) == ("Café 3", "Café 3".encode(), [3, 0, 2, 2, 0])


def test_a_decoder_that_rewrites_earlier_text_is_counted_in_a_warning(caplog):
    # from the third token on the decoder capitalizes the first letter: text already given to token 1 changes
    tok = _PieceTokenizer({1: b"a", 2: b"b", 3: b" c", 4: b"!"}, rewrite={"ab c": "Ab c", "ab c!": "Ab c!"})
    with caplog.at_level(logging.WARNING, logger="capo.tokenization"):
        pieces = token_bytes(tok, [1, 2, 3, 4])
    assert pieces == [b"a", b"b", b"", b""]
    assert "rewrote earlier text at 2 of 4 tokens" in caplog.text
