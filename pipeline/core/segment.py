"""Split a response into reasoning steps and map every response token to one step.

CAPO (arXiv 2508.02298) §3 judges a rollout step by step; docs/design.md §1.3 fixes the rules
the paper leaves open:

* steps come from the response text (default: split on blank lines), each trimmed of
  surrounding whitespace, empty pieces dropped, numbered from 0;
* every response token belongs to exactly one step: the step holding the token's first
  character; a token starting in the gap before a step belongs to that (next) step; a token
  starting after the last step (e.g. the end-of-sequence token) belongs to the last step.

Pure functions: strings and numpy arrays in, numpy arrays out. Units are stated per argument:
"char" means an index into the Python ``str`` (code points), "byte" an index into its UTF-8
encoding, "token" an index into the response's token sequence. All spans are end-exclusive.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Span = tuple[int, int]

_BLANK_LINE_SEP = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")  # a newline, then 1+ blank lines
_LINE_SEP = re.compile(r"\n")
_STEP_TAG = re.compile(r"<\s*step\s*\d+\s*>", re.IGNORECASE)  # `<step 1>`, `<Step 12>`


def _trimmed_pieces(text: str, separators: list[Span]) -> list[Span]:
    """Char spans of the text between ``separators`` (sorted, disjoint), each trimmed of
    surrounding whitespace; whitespace-only pieces are dropped."""
    spans: list[Span] = []
    cursor = 0
    for sep_start, sep_end in [*separators, (len(text), len(text))]:
        piece = text[cursor:sep_start]
        stripped = piece.strip()
        if stripped:
            start = cursor + (len(piece) - len(piece.lstrip()))
            spans.append((start, start + len(stripped)))
        cursor = sep_end
    return spans


def _split_regex(pattern: re.Pattern[str]) -> Callable[[str], list[Span]]:
    def split(text: str) -> list[Span]:
        return _trimmed_pieces(text, [m.span() for m in pattern.finditer(text)])

    return split


STEP_SPLITTERS: dict[str, Callable[[str], list[Span]]] = {
    # Runs of 2+ newlines; lines holding only spaces/tabs count as blank (docs/design.md §1.3).
    "blank_line": _split_regex(_BLANK_LINE_SEP),
    # Every newline ends a step.
    "line": _split_regex(_LINE_SEP),
    # The policy writes `<step 1>`, `<step 2>`, ...: a step is the text after one marker up to
    # the next; non-blank text before the first marker is a step of its own. The markers are
    # not part of any step span.
    "step_tag": _split_regex(_STEP_TAG),
}


def split_steps(text: str, mode: str = "blank_line") -> list[Span]:
    """Char spans ``(start, end)`` (end-exclusive) of the steps of ``text``, in order.

    Each span is trimmed of leading/trailing whitespace; empty and whitespace-only pieces are
    dropped, so a text with no non-blank content has zero steps. Step ``i`` of the result is
    step number ``i`` (numbered from 0). Source: docs/design.md §1.3 (the paper splits on
    ``"\\n\\n"``).

    Args:
        text: the response text.
        mode: a key of ``STEP_SPLITTERS``: ``blank_line`` (default), ``line``, ``step_tag``.

    Raises:
        ValueError: ``mode`` is not a registered splitter (the message lists the valid ones).
    """
    try:
        splitter = STEP_SPLITTERS[mode]
    except KeyError:
        raise ValueError(
            f"unknown step split mode {mode!r}; valid modes: {sorted(STEP_SPLITTERS)}"
        ) from None
    return splitter(text)


def _char_start_flags(text_bytes: bytes) -> np.ndarray:
    """(L,) bool: byte i is the first byte of a character of
    ``text_bytes.decode('utf-8', errors='replace')``.

    For valid UTF-8 these are the lead bytes ``(b & 0xC0) != 0x80``. Each invalid byte range
    that ``errors='replace'`` turns into one U+FFFD is found with strict decoding (same ranges
    as CPython's ``replace`` handler) and counted as one character.
    """
    arr = np.frombuffer(text_bytes, dtype=np.uint8)
    is_start = (arr & 0xC0) != 0x80  # (L,)
    pos = 0
    while pos < len(text_bytes):
        try:
            text_bytes[pos:].decode("utf-8")
            break
        except UnicodeDecodeError as err:
            bad_start, bad_end = pos + err.start, pos + err.end
            is_start[bad_start] = True
            is_start[bad_start + 1 : bad_end] = False
            pos = bad_end
    return is_start


def token_char_starts(token_num_bytes: np.ndarray, text_bytes: bytes) -> np.ndarray:
    """Char index at which each response token starts.

    Args:
        token_num_bytes: (T,) int, UTF-8 byte length of each response token (0 for special
            tokens such as EOS). Their concatenation must be ``text_bytes``.
        text_bytes: the UTF-8 bytes of the response text.

    Returns:
        (T,) int64, for each token the index, in characters of
        ``text_bytes.decode('utf-8', errors='replace')``, of the character holding the token's
        first byte. A token that starts inside a multi-byte character belongs to that character;
        a token starting at the end of the text (a 0-byte token at the end) gets ``len(text)``;
        a 0-byte token elsewhere gets the character where the next byte starts.

    Raises:
        ValueError: ``token_num_bytes`` is not 1-D, has a negative entry, or does not sum to
            ``len(text_bytes)``.
    """
    num_bytes_T = np.asarray(token_num_bytes, dtype=np.int64)
    if num_bytes_T.ndim != 1:
        raise ValueError(f"token_num_bytes must be 1-D (T,), got shape {num_bytes_T.shape}")
    if num_bytes_T.size and num_bytes_T.min() < 0:
        raise ValueError(f"token_num_bytes must be >= 0, got min {int(num_bytes_T.min())}")
    total = int(num_bytes_T.sum())
    if total != len(text_bytes):
        raise ValueError(
            f"token byte lengths sum to {total} but the text has {len(text_bytes)} bytes; "
            "pass the bytes of exactly the response tokens (prompt excluded)"
        )
    is_start_L = _char_start_flags(text_bytes)
    char_of_byte_L1 = np.append(np.cumsum(is_start_L) - 1, int(is_start_L.sum()))  # (L+1,)
    byte_start_T = np.cumsum(num_bytes_T) - num_bytes_T  # (T,) first byte of each token
    return char_of_byte_L1[byte_start_T].astype(np.int64)


def assign_tokens_to_steps(char_starts: np.ndarray, step_spans: list[Span]) -> np.ndarray:
    """Step index of each token (docs/design.md §1.3).

    Args:
        char_starts: (T,) int, char index where each token starts (``token_char_starts``).
        step_spans: S >= 1 char spans ``(start, end)``, end-exclusive, sorted and disjoint.

    Returns:
        (T,) int32 in ``[0, S)``: the step containing the token's first char; a token starting
        in a gap between steps (or before the first step) belongs to the next step; a token
        starting at or after the last step's end (e.g. EOS) belongs to the last step.

    Raises:
        ValueError: ``step_spans`` is empty (callers make at least one step; see
            ``segment_response``).
    """
    if len(step_spans) == 0:
        raise ValueError("step_spans is empty; a response needs >= 1 step to own its tokens")
    ends_S = np.asarray([end for _, end in step_spans], dtype=np.int64)
    chars_T = np.asarray(char_starts, dtype=np.int64)
    step_T = np.searchsorted(ends_S, chars_T, side="right")  # number of steps ending <= c
    return np.minimum(step_T, len(step_spans) - 1).astype(np.int32)


def step_token_spans(step_of_token: np.ndarray, n_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Token span of each step.

    Args:
        step_of_token: (T,) int, non-decreasing, values in ``[0, n_steps)``.
        n_steps: S, the number of steps.

    Returns:
        ``(token_start, token_end)``, each (S,) int32, end-exclusive token indices. A step that
        owns no token gets ``token_start == token_end`` at the position where it would be.

    Raises:
        ValueError: ``step_of_token`` decreases somewhere or holds a value outside
            ``[0, n_steps)``.
    """
    steps_T = np.asarray(step_of_token, dtype=np.int64)
    if steps_T.size:
        if np.any(np.diff(steps_T) < 0):
            i = int(np.flatnonzero(np.diff(steps_T) < 0)[0])
            raise ValueError(f"step_of_token must be non-decreasing (tokens are in text order); token {i + 1} has step "
                             f"{steps_T[i + 1]} after step {steps_T[i]}")
        if steps_T[0] < 0 or steps_T[-1] >= n_steps:
            raise ValueError(
                f"step_of_token values must lie in [0, {n_steps}), "
                f"got range [{int(steps_T[0])}, {int(steps_T[-1])}]"
            )
    step_ids_S = np.arange(n_steps)
    token_start_S = np.searchsorted(steps_T, step_ids_S, side="left").astype(np.int32)
    token_end_S = np.searchsorted(steps_T, step_ids_S, side="right").astype(np.int32)
    return token_start_S, token_end_S


@dataclass(frozen=True, eq=False)
class Segmentation:
    """Steps of one response and the token <-> step map (one row per step in the steps table).

    Attributes:
        step_spans: S char spans ``(start, end)``, end-exclusive.
        step_texts: S step texts, ``text[start:end]``.
        token_step: (T,) int32, step index of each response token.
        token_start: (S,) int32, first token of each step.
        token_end: (S,) int32, end-exclusive token index of each step.
        empty: True when the text has no non-blank content; then there is one step spanning
            the whole text ``(0, len(text))`` so every token still belongs to a step.
    """

    step_spans: tuple[Span, ...]
    step_texts: tuple[str, ...]
    token_step: np.ndarray
    token_start: np.ndarray
    token_end: np.ndarray
    empty: bool = False

    @property
    def n_steps(self) -> int:
        return len(self.step_spans)


def segment_response(
    text: str,
    token_num_bytes: np.ndarray,
    mode: str = "blank_line",
    *,
    text_bytes: bytes | None = None,
) -> Segmentation:
    """Split ``text`` into steps and assign each response token to a step.

    Args:
        text: the response text.
        token_num_bytes: (T,) int, UTF-8 byte length of each response token (0 for EOS etc.).
        mode: step split mode, a key of ``STEP_SPLITTERS``.
        text_bytes: the raw concatenated token bytes, when they are not valid UTF-8 (e.g. a
            response cut by max_tokens inside a multi-byte character) so that ``text`` is
            ``text_bytes.decode('utf-8', errors='replace')``. Default ``text.encode('utf-8')``.

    Returns:
        A ``Segmentation``; ``empty=True`` with one whole-text step when ``text`` is blank.

    Raises:
        ValueError: unknown ``mode``; token bytes that do not add up to the text's bytes;
            ``text_bytes`` that do not decode to ``text``.
    """
    if text_bytes is None:
        text_bytes = text.encode("utf-8")
    elif text_bytes.decode("utf-8", errors="replace") != text:
        raise ValueError(
            "text_bytes.decode('utf-8', errors='replace') differs from text; pass the bytes "
            "the text was decoded from"
        )
    spans = split_steps(text, mode)
    empty = len(spans) == 0
    if empty:
        spans = [(0, len(text))]
    char_starts_T = token_char_starts(token_num_bytes, text_bytes)
    token_step_T = assign_tokens_to_steps(char_starts_T, spans)
    token_start_S, token_end_S = step_token_spans(token_step_T, len(spans))
    return Segmentation(
        step_spans=tuple(spans),
        step_texts=tuple(text[s:e] for s, e in spans),
        token_step=token_step_T,
        token_start=token_start_S,
        token_end=token_end_S,
        empty=empty,
    )
