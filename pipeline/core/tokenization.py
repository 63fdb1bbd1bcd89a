"""Exact bytes of every generated token, so steps map to tokens correctly (multi-byte safe).

Byte-level BPE tokenizers (Qwen2.5, SmolLM2, Llama 3, GPT-2) write each token as characters of
the GPT-2 ``bytes_to_unicode`` alphabet; inverting that table gives the token's raw UTF-8 bytes,
even for a token that holds half of a multi-byte character. Other tokenizers fall back to
incremental decoding (slower, exact for whole characters).
"""

from __future__ import annotations

import logging
from functools import lru_cache

import numpy as np

log = logging.getLogger("capo.tokenization")


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    # GPT-2's reversible byte <-> printable-unicode table (openai/gpt-2 encoder.py).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def token_bytes(tokenizer, token_ids: list[int] | np.ndarray) -> list[bytes]:
    """UTF-8 bytes of each token as it appears in the decoded text (special tokens -> ``b""``).

    Args:
        tokenizer: a Hugging Face tokenizer.
        token_ids: (T,) generated token ids.
    Returns:
        T byte strings whose concatenation is the response text's UTF-8 encoding. A tokenizer
        that is not byte-level is decoded prefix by prefix; where its decoder rewrites text
        already assigned to earlier tokens, the token is given ``b""`` and a warning counts them.
    """
    ids = [int(i) for i in token_ids]
    added_tokens = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    # Every token that decode(skip_special_tokens=True) drops, as the engines do for response_text:
    # the named special tokens AND added tokens marked special (Qwen's <|im_start|> is not named).
    special = set(getattr(tokenizer, "all_special_ids", []) or []) | {i for i, t in added_tokens.items() if t.special}
    if _is_byte_level(tokenizer):
        table = _unicode_to_byte()
        added = {t.content for t in added_tokens.values()}
        out = []
        for tid, piece in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
            if tid in special or piece is None:
                out.append(b"")
            elif piece in added:
                out.append(piece.encode("utf-8"))
            else:
                try:
                    out.append(bytes(table[ch] for ch in piece))
                except KeyError:
                    out.append(piece.encode("utf-8"))
        return out
    # Fallback: decode growing prefixes; each token gets the new bytes it adds.
    out, prev, rewrote = [], b"", 0
    for i in range(len(ids)):
        cur = tokenizer.decode(ids[: i + 1], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        cur_b = cur.encode("utf-8")
        if cur_b.endswith("\ufffd".encode()) and i + 1 < len(ids):
            cur_b = cur_b[: -len("\ufffd".encode())]  # incomplete character: wait for its next byte
        if cur_b.startswith(prev):
            out.append(cur_b[len(prev):])
            prev = cur_b
        else:  # the decoder rewrote text already assigned: this token is given no bytes
            out.append(b"")
            rewrote += 1
    if rewrote:
        log.warning("%s's decoder rewrote earlier text at %d of %d tokens; those tokens were given no bytes, so "
                    "the response text is the concatenation of the others (it may differ from decode())",
                    type(tokenizer).__name__, rewrote, len(ids))
    return out


def decode_with_bytes(tokenizer, token_ids) -> tuple[str, bytes, np.ndarray]:
    """Response text, its raw UTF-8 bytes, and (T,) int32 byte length of each token.

    The text is the UTF-8 decoding (invalid trailing bytes of a truncated response become U+FFFD)
    of the concatenated token bytes, so ``sum(lengths) == len(text_bytes)``.

    Args:
        tokenizer: a Hugging Face tokenizer (its byte-level vocabulary decides each token's bytes,
            :func:`token_bytes`).
        token_ids: (T,) the response's token ids, prompt excluded.
    """
    pieces = token_bytes(tokenizer, token_ids)
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int32, count=len(pieces))
    raw = b"".join(pieces)
    return raw.decode("utf-8", errors="replace"), raw, lengths
