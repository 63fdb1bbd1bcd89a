"""DenseR's per-token weights from hidden-state divergence (Bansal 2026, "DenseR: Dense Rewards For
Free in LLM Reasoning"; docs/method.md "DenseR").

Two responses of one prompt that begin alike and end apart (one right, one wrong) have nearly equal
hidden states until the token where they part; that is where the outcome was decided. DenseR reads
it from the policy itself: each token of a response is compared with the responses of the *opposite*
outcome in its group at the aligned position, and its GRPO advantage is reweighted by how far it is
from the nearest of them, the weights averaging 1 over the response so the update's total size
(``sum_t |A[i, t]|``) stays GRPO's.

Definitions (``h_i[t]``: the hidden state of response ``i`` at its ``t``-th token, ``T_i`` its
tokens, ``O_i`` the responses of its group with the other outcome, ``T_j > 0``):

- divergence ``d_i[t] = 1 - max_{j in O_i} cos(h_i[t], h_j[min(t, T_j - 1)])``, clipped to ``>= 0``
  (aligned by position; past the end of a shorter response, its last token stands in);
- weight ``w_i[t] = (1 - mix) + mix * d_i[t] / mean_t(d_i)``, so ``mean_t(w_i) = 1``; a response
  with no opposite (its group all right or all wrong, where GRPO's advantage is 0 unless the
  overlong penalty is on) or whose divergences are all 0 keeps GRPO's flat weights, ``w = 1``; a
  divergence below :data:`NOISE_BELOW` counts as 0 (the rounding of a cosine of equal states);
- advantage ``A[i, t] = A_i * w_i[t]``, ``A_i`` GRPO's sequence advantage
  (:func:`pipeline.core.rewards.densr`).

Flat layout as in :mod:`pipeline.core.rewards`: ``offsets`` (B+1,) are the row boundaries of the
concatenated (N,) token arrays.
"""

from __future__ import annotations

import numpy as np

NOISE_BELOW = 1e-4
"""A token's divergence below this counts as 0: two forward passes over one shared prefix. A cosine
of two bit-identical hidden states rounds to 1 - 1e-16 ... 1e-14 (fp32 or bf16 states, 896 to 4096
dims), fp32 kernel noise of 1e-6 relative to about 1e-13, and bf16 states of one prefix from two
forward passes of different lengths differ by 1e-6 to 1e-5; where responses part the divergence is 0.1
to 1. Without the floor a response that is a prefix of one with the other outcome (it never parts
from it) would divide that rounding by its own mean and get weights of order 1 from noise; with it,
its weights are flat."""

FLAT_BELOW = 1e-9
"""A response whose mean divergence (after :data:`NOISE_BELOW`) is below this keeps flat weights."""


def _unit_rows(h: np.ndarray) -> np.ndarray:
    """Rows of ``h`` scaled to unit L2 norm (a zero row stays zero)."""
    norm = np.linalg.norm(h, axis=-1, keepdims=True)
    return h / np.where(norm > 0, norm, 1.0)


def aligned_divergence(hidden: list[np.ndarray], correct: np.ndarray, groups: np.ndarray) -> list[np.ndarray]:
    """Each token's cosine distance to the nearest response of the other outcome in its group, at the
    aligned position (module docstring).

    Args:
        hidden: B arrays of shape (T_i, d), response ``i``'s hidden states, one row per response token
            (any float dtype; computed in float64).
        correct: (B,) bool, the outcome of each response (right / wrong).
        groups: (B,) the prompt group of each response (any labels).

    Returns:
        B float32 arrays of shape (T_i,), values in [0, 2]; NaN everywhere for a response with no
        response of the other outcome (and at least one token) in its group.

    Raises:
        ValueError: ``hidden``, ``correct`` and ``groups`` differ in length, a hidden state is not
            finite, or the hidden sizes differ.
    """
    correct_B, groups_B = np.asarray(correct, bool), np.asarray(groups)
    if not (len(hidden) == len(correct_B) == len(groups_B)):
        raise ValueError(f"hidden ({len(hidden)}), correct ({len(correct_B)}) and groups ({len(groups_B)}) "
                         "must have one entry per response")
    if any(np.ndim(h) != 2 for h in hidden):
        raise ValueError(f"each response's hidden states must be (T_i, d); got shapes {[np.shape(h) for h in hidden]}")
    dims = {h.shape[-1] for h in hidden if len(h)}
    if len(dims) > 1:
        raise ValueError(f"hidden states of one round must share one size; got {sorted(dims)}")
    bad = [i for i, h in enumerate(hidden) if not np.all(np.isfinite(h))]
    if bad:
        raise ValueError(f"the hidden states of response {bad[0]} (and {len(bad) - 1} more) are not finite (NaN or "
                         "inf, e.g. a float16 overflow): compute them in float32")
    unit = [_unit_rows(np.asarray(h, np.float64)) for h in hidden]
    out = []
    for i, u_i in enumerate(unit):
        opp = [j for j in range(len(unit)) if groups_B[j] == groups_B[i] and correct_B[j] != correct_B[i] and len(unit[j])]
        T = len(u_i)
        if not opp:
            out.append(np.full(T, np.nan, np.float32))
            continue
        t = np.arange(T)
        # (|O|, T): cosine of token t with each opposite response's token min(t, T_j - 1)
        cos = np.stack([np.einsum("td,td->t", u_i, unit[j][np.minimum(t, len(unit[j]) - 1)]) for j in opp])
        out.append(np.clip(1.0 - cos.max(axis=0), 0.0, 2.0).astype(np.float32))
    return out


def densr_weights(divergence: np.ndarray, offsets: np.ndarray, mix: float = 1.0) -> np.ndarray:
    """Per-token weights ``w = (1 - mix) + mix * d / mean_response(d)``, mean 1 over each response
    (module docstring): the size of each response's update is kept, only its placement changes.

    Args:
        divergence: (N,) per-token divergence (:func:`aligned_divergence`, concatenated); NaN for the
            tokens of a response without an opposite.
        offsets: (B+1,) int64 row boundaries.
        mix: share of the weight that follows the divergence, in [0, 1]; 0 is GRPO.

    Returns:
        (N,) float32 weights, >= 0; 1 for every token of a response whose divergences are NaN or all
        below :data:`NOISE_BELOW`.

    Raises:
        ValueError: bad offsets, ``mix`` outside [0, 1], or a negative divergence.
    """
    from pipeline.core.rewards import _check_offsets

    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"densr mix={mix} must lie in [0, 1] (0: GRPO's flat weights, 1: all from the divergence)")
    d = np.asarray(divergence, np.float64)
    off = _check_offsets(offsets, n_rows=None, n_tokens=len(d))
    if np.any(d < 0):
        raise ValueError(f"divergences must be >= 0, got {float(np.nanmin(d))}")
    lengths = np.diff(off)
    resp = np.repeat(np.arange(len(lengths)), lengths)
    valid = ~np.isnan(d)
    d = np.where(valid & (d < NOISE_BELOW), 0.0, d)  # one shared prefix, two forward passes: rounding, not parting
    total = np.bincount(resp, weights=np.where(valid, d, 0.0), minlength=len(lengths))
    has_nan = np.bincount(resp, weights=~valid, minlength=len(lengths)) > 0
    mean = total / np.maximum(lengths, 1)
    flat = has_nan | (mean < FLAT_BELOW)  # no opposite, or no token differs: GRPO's flat weights
    ratio = np.where(flat[resp], 1.0, np.where(valid, d, 0.0) / np.where(flat, 1.0, mean)[resp])
    return ((1.0 - mix) + mix * ratio).astype(np.float32)
