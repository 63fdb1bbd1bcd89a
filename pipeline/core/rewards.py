"""Per-token rewards and group-normalized advantages (pure numpy).

CAPO (arXiv 2508.02298) §3 "asymmetric reward shaping": each token gets the outcome reward
scaled by ``C`` (W_whole) minus a process penalty ``P`` (W_process) times its step's voted
weight, ``R[i, t] = C * r_v[i] - P * w[i, step(t)]`` (docs/design.md §1.7). Advantages are
normalized over ALL tokens of ALL responses of a prompt's group, never over per-response sums
(docs/design.md §1.8).

Flat layout: the tokens of B responses are concatenated into (N,) arrays; ``offsets`` (B+1,)
int64 are the row boundaries (as in a pyarrow list array): response ``b`` owns tokens
``offsets[b]:offsets[b+1]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _check_offsets(offsets: np.ndarray, n_rows: int | None, n_tokens: int | None) -> np.ndarray:
    """(B+1,) int64 offsets, checked: starts at 0, non-decreasing, matches the sizes given."""
    off = np.asarray(offsets, dtype=np.int64)
    if off.ndim != 1 or off.size == 0 or off[0] != 0 or np.any(np.diff(off) < 0):
        raise ValueError(
            f"offsets must be 1-D (B+1,), start at 0 and never decrease; got {off.tolist()[:8]}"
        )
    if n_rows is not None and off.size != n_rows + 1:
        raise ValueError(f"offsets has {off.size} entries; expected B+1 = {n_rows + 1}")
    if n_tokens is not None and off[-1] != n_tokens:
        raise ValueError(f"offsets[-1] = {int(off[-1])} but there are {n_tokens} tokens")
    return off


def check_reward_weights(C: float, P: float) -> None:
    """Check the reward weights keep the paper's ordering (CAPO §3; docs/design.md §1.7).

    With ``C > P`` a right answer with a flawed step (``C - P``) still beats a wrong answer with
    clean steps (0). Kept apart from ``token_rewards`` so callers (the config) decide to enforce.

    Raises:
        ValueError: ``C`` or ``P`` negative, or ``P > 0`` and ``C <= P``.
    """
    if C < 0 or P < 0:
        raise ValueError(f"reward weights must be >= 0, got C={C}, P={P}")
    if P > 0 and C <= P:
        raise ValueError(
            f"C={C} <= P={P}: keep C > P so a right answer with a flawed step still beats a "
            "wrong answer with clean steps (paper default C=2, P=1)"
        )


def broadcast_to_tokens(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Repeat one value per response over that response's tokens.

    Args:
        values: (B,) any dtype.
        offsets: (B+1,) int64 row boundaries.

    Returns:
        (N,) with ``values.dtype``, ``N = offsets[-1]``.

    Raises:
        ValueError: ``offsets`` is not (B+1,), does not start at 0, or decreases.
    """
    values_B = np.asarray(values)
    off = _check_offsets(offsets, n_rows=len(values_B), n_tokens=None)
    return np.repeat(values_B, np.diff(off))


def token_rewards(
    outcome: np.ndarray, token_weight: np.ndarray, offsets: np.ndarray, C: float, P: float
) -> np.ndarray:
    """Per-token reward ``R = C * r_v[response] - P * w_token`` (CAPO §3; docs/design.md §1.7).

    With C=2, P=1: right answer + right step 2, right + wrong step 1, wrong + right step 0,
    wrong + wrong step -1. ``P = 0`` gives plain outcome rewards ``C * r_v``.

    Args:
        outcome: (B,) verifier reward ``r_v`` per response, in [0, 1] (0 or 1 from the rule
            verifier).
        token_weight: (N,) voted weight in [0, 1] of the step owning each token.
        offsets: (B+1,) int64 row boundaries.
        C: outcome weight (W_whole), >= 0.
        P: process penalty weight (W_process), >= 0. ``check_reward_weights`` enforces C > P.

    Returns:
        (N,) float32 rewards, in ``[C*r_v - P, C*r_v]``.

    Raises:
        ValueError: bad offsets, ``C`` or ``P`` negative, ``outcome`` or ``token_weight``
            outside [0, 1].
    """
    outcome_B = np.asarray(outcome, dtype=np.float64)
    weight_N = np.asarray(token_weight, dtype=np.float64)
    off = _check_offsets(offsets, n_rows=len(outcome_B), n_tokens=len(weight_N))
    if C < 0 or P < 0:
        raise ValueError(f"reward weights must be >= 0, got C={C}, P={P}")
    for name, arr in (("outcome", outcome_B), ("token_weight", weight_N)):
        if arr.size and not (np.all(arr >= 0) and np.all(arr <= 1)):
            raise ValueError(f"{name} must lie in [0, 1], got range [{arr.min()}, {arr.max()}]")
    outcome_N = np.repeat(outcome_B, np.diff(off))  # (N,)
    return (C * outcome_N - P * weight_N).astype(np.float32)


def group_token_advantages(
    rewards: np.ndarray,
    offsets: np.ndarray,
    group_ids: np.ndarray,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> np.ndarray:
    """Token-level group-normalized advantage (CAPO §3; docs/design.md §1.8).

    ``A[i, t] = (R[i, t] - mean_g(R)) / (std_g(R) + eps)``, where the mean and std run over ALL
    tokens of ALL responses in response ``i``'s group ``g`` (std with Bessel's correction,
    ddof=1, like ``torch.std``; 0 for a group with < 2 tokens). A response's rewards are never
    summed first: that would erase the per-step credit. ``scale_by_std=False`` skips the
    division (Dr.GRPO).

    Args:
        rewards: (N,) token rewards (``token_rewards``).
        offsets: (B+1,) int64 row boundaries.
        group_ids: (B,) int, the prompt group of each response (any labels).
        scale_by_std: divide by ``std_g + eps``.
        eps: added to the std, > 0 avoids division by zero.

    Returns:
        (N,) float32 advantages.

    Raises:
        ValueError: bad offsets, or ``group_ids`` not of length B.
    """
    rewards_N = np.asarray(rewards, dtype=np.float64)
    groups_B = np.asarray(group_ids)
    off = _check_offsets(offsets, n_rows=None, n_tokens=len(rewards_N))
    if groups_B.shape != (off.size - 1,):
        raise ValueError(f"group_ids has shape {groups_B.shape}; expected (B,) = ({off.size - 1},)")
    group_N = np.repeat(groups_B, np.diff(off))  # (N,)
    return group_run_advantages(rewards_N, np.ones(len(rewards_N), np.int64), group_N, scale_by_std, eps)


def group_run_advantages(
    values: np.ndarray,
    lengths: np.ndarray,
    group_ids: np.ndarray,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> np.ndarray:
    """Token-level group-normalized advantage on run-length encoded tokens (CAPO §3; docs/design.md §1.8).

    Each run ``s`` stands for ``lengths[s]`` consecutive tokens that share the reward
    ``values[s]`` (in CAPO: the tokens of one step). The group mean and std are those of the
    expanded tokens, exactly: ``mean_g = sum_s L_s R_s / sum_s L_s`` and
    ``std_g^2 = sum_s L_s (R_s - mean_g)^2 / (sum_s L_s - 1)`` (ddof=1; 0 below 2 tokens). So the
    per-token work is one ``np.repeat`` of the result, whatever the round size.

    Args:
        values: (S,) reward of each run.
        lengths: (S,) int >= 0, tokens in each run (0-length runs are allowed and weigh nothing).
        group_ids: (S,) group of each run (any labels).
    Returns:
        (S,) float32 advantage of each run's tokens; ``np.repeat(result, lengths)`` is (N,).
    Raises:
        ValueError: shapes differ or a length is negative.
    """
    v_S = np.asarray(values, dtype=np.float64)
    len_S = np.asarray(lengths, dtype=np.int64)
    g = np.asarray(group_ids)
    if not (v_S.shape == len_S.shape == g.shape) or v_S.ndim != 1:
        raise ValueError(f"values {v_S.shape}, lengths {len_S.shape}, group_ids {g.shape} must be equal 1-D shapes")
    if len_S.size and len_S.min() < 0:
        raise ValueError(f"run lengths must be >= 0, got {len_S.min()}")
    if v_S.size == 0:
        return np.zeros(0, dtype=np.float32)
    _, dense_S = np.unique(g, return_inverse=True)
    dense_S = dense_S.reshape(-1)
    w_S = len_S.astype(np.float64)
    count_G = np.bincount(dense_S, weights=w_S)
    mean_G = np.bincount(dense_S, weights=w_S * v_S) / np.maximum(count_G, 1.0)
    centered_S = v_S - mean_G[dense_S]
    if not scale_by_std:
        return centered_S.astype(np.float32)
    sq_dev_G = np.bincount(dense_S, weights=w_S * centered_S * centered_S)
    var_G = np.where(count_G >= 2, sq_dev_G / np.maximum(count_G - 1.0, 1.0), 0.0)
    return (centered_S / (np.sqrt(var_G)[dense_S] + eps)).astype(np.float32)


def overlong_penalty(num_tokens: np.ndarray, max_tokens: int, buffer: int, factor: float = 1.0) -> np.ndarray:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476 §3.4, eq. 13), one value per
    response, added to its reward (verl's ``overlong_buffer``, ``penalty_factor``):

    ``0`` for ``|y| <= L_max - L_cache``; ``factor * ((L_max - L_cache) - |y|) / L_cache`` inside the
    last ``L_cache`` tokens of the budget; ``-factor`` at the budget or beyond (a response cut at
    ``max_tokens``). ``L_max = max_tokens``, ``L_cache = buffer``. Example (L_max 100, L_cache 20,
    factor 1): 50 and 80 tokens -> 0, 90 -> -0.5, 100 -> -1.

    Args:
        num_tokens: (B,) response lengths in tokens.
        max_tokens: the sampling budget ``L_max`` (``rollout.sampling.max_tokens``), > 0.
        buffer: ``L_cache``, in ``(0, max_tokens)``.
        factor: the penalty at the budget, >= 0 (in units of reward; DAPO's correct reward is 1).

    Returns:
        (B,) float32 penalties in ``[-factor, 0]``.

    Raises:
        ValueError: ``buffer`` not in ``(0, max_tokens)`` or ``factor`` negative.
    """
    if not 0 < buffer < max_tokens:
        raise ValueError(f"overlong buffer={buffer} must lie in (0, max_tokens={max_tokens})")
    if factor < 0:
        raise ValueError(f"overlong penalty factor={factor} must be >= 0")
    n_B = np.asarray(num_tokens, dtype=np.float64)
    exceed = n_B - (max_tokens - buffer)
    return (-factor * np.clip(exceed / buffer, 0.0, 1.0)).astype(np.float32)


def shuffle_within_groups(values: np.ndarray, group_ids: np.ndarray, seed: int | list[int]) -> np.ndarray:
    """Permute each group's values among its own responses at random: the shuffled-outcome control.

    Each group keeps its multiset of values (so the same number of right answers, the same group
    mean and std, hence the same set of advantages), but which response gets which value no longer
    depends on the response: a run trained on it receives updates of GRPO's size and noise with no
    information about correctness (a placebo, in the spirit of the random-reward baselines of
    Shao et al. 2025, "Spurious Rewards", arXiv 2506.10947). Vectorized: responses are ordered by
    (group, random key) and their values written back in (group, original position) order.
    Example: values ``[1, 0, 0, 1, 1]``, groups ``[0, 0, 1, 1, 1]`` -> ``[1, 0]`` or ``[0, 1]``
    for group 0 and a permutation of ``[0, 1, 1]`` for group 1; a group of one or with equal
    values is unchanged.

    Args:
        values: (B,) one value per response (e.g. the outcome reward ``r_v``).
        group_ids: (B,) int, the prompt group of each response.
        seed: seed of the permutation (the reward stage uses ``[cfg.seed, round]``); the same seed
            and inputs give the same result.

    Returns:
        (B,) array of ``values``' dtype.

    Raises:
        ValueError: ``values`` and ``group_ids`` differ in shape or are not 1-D.
    """
    v_B, g_B = np.asarray(values), np.asarray(group_ids)
    if v_B.ndim != 1 or v_B.shape != g_B.shape:
        raise ValueError(f"values {v_B.shape} and group_ids {g_B.shape} must be 1-D of the same length")
    rng = np.random.default_rng(seed)
    shuffled = np.lexsort((rng.random(len(v_B)), g_B))  # by group, then at random
    in_place = np.lexsort((np.arange(len(v_B)), g_B))  # by group, then by position
    out_B = v_B.copy()
    out_B[in_place] = v_B[shuffled]
    return out_B


def grpo_sequence_advantages(
    outcome_reward: np.ndarray,
    group_ids: np.ndarray,
    scale_by_std: bool = True,
    eps: float = 1e-4,
) -> np.ndarray:
    """Standard GRPO advantage, one per response (the GRPO-Rule / GenORM baselines; Shao et al. 2024,
    DeepSeekMath, arXiv 2402.03300 §4.1.2, outcome supervision).

    ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` with ddof=1 and eps 1e-4, as in TRL's
    GRPOTrainer (``rewards.view(-1, G).mean(1)``, ``.std(1)``). Unlike TRL, a group of one gives
    advantage 0 rather than NaN (``torch.std`` of one value is NaN). Broadcast to tokens with
    ``broadcast_to_tokens``.

    Args:
        outcome_reward: (B,) reward per response.
        group_ids: (B,) int, the prompt group of each response.
        scale_by_std: divide by ``std_g + eps`` (False: Dr.GRPO).
        eps: added to the std.

    Returns:
        (B,) float32 advantages.

    Raises:
        ValueError: ``outcome_reward`` and ``group_ids`` differ in shape or are not 1-D.
    """
    reward_B = np.asarray(outcome_reward, dtype=np.float64)
    groups_B = np.asarray(group_ids)
    if reward_B.ndim != 1 or groups_B.shape != reward_B.shape:
        raise ValueError(
            f"outcome_reward {reward_B.shape} and group_ids {groups_B.shape} must both be (B,)"
        )
    return group_run_advantages(reward_B, np.ones(len(reward_B), np.int64), groups_B, scale_by_std, eps)


@dataclass(frozen=True)
class RoundRewards:
    """What an advantage estimator reads: one round's rewards in run-length form (a run is a step
    of a response under a process signal, the whole response otherwise).

    Attributes:
        run_rewards: (S,) float, each run's token reward (:func:`token_rewards`, plus any overlong penalty).
        run_lengths: (S,) int, tokens per run.
        run_response: (S,) int, the response (index into the B responses) each run belongs to; sorted.
        outcome: (B,) float, each response's outcome reward r_v in [0, 1].
        length_penalty: (B,) float, each response's overlong penalty (0 without it).
        groups: (B,) int, each response's prompt group.
        correct_weight: C, the reward of a right answer (``reward.correct_weight``).
        scale_by_std: divide by the group's std (``reward.scale_by_std``).
        eps: added to that std (``reward.eps``).
        state_values: (sum M_b,) float, Monte Carlo values of each response's valued states
            ``S_0 .. S_{M_b - 1}`` (the ``mc`` stage; :mod:`pipeline.core.mc`), None without them.
        n_states: (B,) int, ``M_b``, None without them.
        token_weights: (S,) float, DenseR's weight of each run (then one token each;
            :func:`pipeline.core.densr.densr_weights`), None without them.
    """

    run_rewards: np.ndarray
    run_lengths: np.ndarray
    run_response: np.ndarray
    outcome: np.ndarray
    length_penalty: np.ndarray
    groups: np.ndarray
    correct_weight: float
    scale_by_std: bool
    eps: float
    state_values: np.ndarray | None = None
    n_states: np.ndarray | None = None
    token_weights: np.ndarray | None = None


def capo_token_group(r: RoundRewards) -> np.ndarray:
    """CAPO's token-level group normalization (§3; docs/design.md §1.8): each run's reward
    normalized over every token of its group (:func:`group_run_advantages`). Returns (S,) float32."""
    return group_run_advantages(r.run_rewards, r.run_lengths, r.groups[r.run_response], r.scale_by_std, r.eps)


def grpo_outcome(r: RoundRewards) -> np.ndarray:
    """GRPO's sequence-level advantage (arXiv 2402.03300 §4.1.2): ``C * r_v`` (plus the overlong
    penalty) normalized over the group's responses (:func:`grpo_sequence_advantages`), the same for
    every run of a response; process penalties do not enter. Returns (S,) float32."""
    return grpo_sequence_advantages(r.correct_weight * r.outcome + r.length_penalty, r.groups, r.scale_by_std,
                                    r.eps)[r.run_response]


GRPO_LAMBDA_ADVANTAGE_FLOOR = -0.1
"""GRPO-λ's floor on negative advantages (arXiv 2510.00194): a traced ratio sums many log-ratios,
and a large negative advantage on it gives destructive updates."""


def grpo_lambda(r: RoundRewards) -> np.ndarray:
    """GRPO-λ's advantage (Parthasarathi et al. 2025, arXiv 2510.00194): GRPO's sequence-level
    advantage (:func:`grpo_outcome`) with negative values raised to
    :data:`GRPO_LAMBDA_ADVANTAGE_FLOOR`; the credit over tokens comes from the traced ratio in the
    loss (``train.ratio_trace``). Returns (S,) float32."""
    return np.maximum(grpo_outcome(r), np.float32(GRPO_LAMBDA_ADVANTAGE_FLOOR)).astype(np.float32)


def fipo(r: RoundRewards) -> np.ndarray:
    """FIPO's advantage as the reward stage writes it (Ma et al. 2026, arXiv 2603.19835): GRPO's
    sequence-level advantage (:func:`grpo_outcome`), unchanged. FIPO's credit over tokens, each
    token's advantage times the clipped exponential of its discounted future KL, depends on the
    policy being updated, so it is applied in the loss (``train.future_kl``,
    :func:`train.loss.future_kl_weights`) and recorded by the train stage in ``token_credit``. The
    estimator has its own name so that ``token_rewards`` and its manifest name the method. Returns
    (S,) float32."""
    return grpo_outcome(r)


def trace_credit(advantages: np.ndarray, offsets: np.ndarray, kappa: float, style: str = "recent") -> np.ndarray:
    """Where GRPO-λ's traced ratio puts the credit at the start of an update: each token's weight on
    its own log-prob gradient. The traced log-ratio of :func:`train.loss.traced_log_ratio`,
    ``z_t = sum_{j <= t} w(t, j) * log_ratio_j``, carries the advantage of every later token back
    to token j (arXiv 2510.00194, §3.2 eq. 2, differentiated at ratio 1):

        credit_j = sum_{t >= j} A_t * w(t, j),   w(t, j) = kappa^(t-j)              (``recent``)
                                                 w(t, j) = max(kappa^(t-j), kappa^j)  (``both``)

    With GRPO's advantage A on every token and the ``recent`` trace: ``A * (1 - kappa^(T-j)) /
    (1 - kappa)``, up to ``1 / (1 - kappa)`` times A on a response's first tokens and A on its last.
    It is ``-d(loss)/d(log pi_j)`` times the number of tokens of the first mini-batch's PPO loss
    under ``token-mean`` aggregation without a KL term (at ratio 1 the clip is inactive; other
    aggregations scale each response's credits by its weight in the loss; later mini-batches move
    with the ratio). The critique browser draws it for a variant with ``train.ratio_trace``.

    Linear in the tokens: ``D_j = A_j + kappa * D_{j+1}`` (``recent``), and for ``both``, where
    ``kappa^(t-j)`` is the larger weight exactly for ``t <= 2j``,
    ``credit_j = D_j - kappa^(j+1) * D_{2j+1} + kappa^j * S_{2j+1}`` with ``S_k = sum_{t >= k} A_t``.

    Args:
        advantages: (N,) per-token advantages of B responses laid end to end.
        offsets: (B+1,) int, response b's tokens are ``advantages[offsets[b]:offsets[b+1]]``.
        kappa: gamma * lambda, in [0, 1].
        style: ``recent`` or ``both``.

    Returns:
        (N,) float32 credits.

    Raises:
        ValueError: ``kappa`` outside [0, 1], another ``style``, offsets that do not cover ``advantages``.
    """
    if not 0.0 <= kappa <= 1.0:
        raise ValueError(f"kappa={kappa}: the trace decay gamma * lambda must be in [0, 1]")
    if style not in ("recent", "both"):
        raise ValueError(f"unknown ratio trace style {style!r}; valid: ('recent', 'both')")
    offsets = np.asarray(offsets, np.int64)
    if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(advantages) or np.any(np.diff(offsets) < 0):
        shown = offsets.tolist() if len(offsets) <= 8 else [*offsets[:4].tolist(), "...", *offsets[-2:].tolist()]
        raise ValueError(f"offsets must rise from 0 to {len(advantages)} (the number of advantages), got {shown}")
    A_all = np.asarray(advantages, np.float64)
    out = np.zeros(len(A_all), np.float32)
    n = np.diff(offsets)
    k = float(kappa)
    for length in np.unique(n[n > 0]):  # responses of one length together: (R, length)
        idx = offsets[:-1][n == length][:, None] + np.arange(length)[None, :]
        A = A_all[idx]
        D = np.zeros((len(idx), length + 1))  # D[:, length] = 0
        for j in range(length - 1, -1, -1):
            D[:, j] = A[:, j] + k * D[:, j + 1]
        credit = D[:, :length]
        if style == "both":
            S = np.concatenate([np.cumsum(A[:, ::-1], axis=1)[:, ::-1], np.zeros((len(idx), 1))], axis=1)
            j = np.arange(length)
            far = np.minimum(2 * j + 1, length)  # 2j+1, or past the end (D and S are 0 there)
            credit = credit - k ** (j + 1) * D[:, far] + k ** j * S[:, far]
        out[idx] = credit
    return out


def vineppo(r: RoundRewards) -> np.ndarray:
    """VinePPO's advantage (Kazemnejad et al. 2025, arXiv 2410.01679): each step's change of Monte Carlo
    value (:func:`pipeline.core.mc.mc_step_advantages`, the final reward ``r_v`` plus any overlong
    penalty divided by ``C``: values and ``r_v`` are in units of a right answer), whitened over every
    token of the round (:func:`pipeline.core.mc.whiten_runs`). The runs must be the responses' steps.
    Returns (S,) float32.

    Raises:
        ValueError: the round has no Monte Carlo values (run the ``mc`` stage), or they do not fit the
            runs; an overlong penalty with ``correct_weight`` 0.
    """
    from pipeline.core.mc import mc_step_advantages, whiten_runs

    if r.state_values is None or r.n_states is None:
        raise ValueError("reward.estimator=vineppo needs the round's Monte Carlo state values (the mc stage's "
                         "mc_values table); none were given")
    n_steps = np.bincount(r.run_response, minlength=len(r.outcome))
    # values are shares of continuations that reach the gold answer, so the final reward is r_v in {0, 1};
    # the overlong penalty is in reward units, where a right answer is worth C: divided by C, it is in the
    # values' units, as GRPO weighs it against C * r_v
    if np.any(r.length_penalty) and r.correct_weight <= 0:
        raise ValueError(f"vineppo: an overlong penalty needs correct_weight > 0 to put it in units of a right answer, "
                         f"got correct_weight={r.correct_weight}")
    penalty = r.length_penalty / r.correct_weight if np.any(r.length_penalty) else r.length_penalty
    adv = mc_step_advantages(r.state_values, r.n_states, n_steps, r.outcome + penalty)
    return whiten_runs(adv, r.run_lengths, r.eps)


def densr(r: RoundRewards) -> np.ndarray:
    """DenseR's advantage (Bansal 2026, "DenseR: Dense Rewards For Free in LLM Reasoning"): GRPO's
    sequence-level advantage (:func:`grpo_outcome`) times each token's weight from the hidden-state
    divergence of its response from the group's responses with the other outcome
    (:mod:`pipeline.core.densr`; mean weight 1 per response, so each response's total ``sum_t |A|`` is
    GRPO's). The runs must be single tokens. Returns (S,) float32.

    Raises:
        ValueError: the round has no DenseR weights (run the ``densr`` stage), or they do not fit the runs.
    """
    if r.token_weights is None:
        raise ValueError("reward.estimator=densr needs the round's hidden-state divergences (the densr stage's "
                         "token_divergence table); none were given")
    w = np.asarray(r.token_weights, np.float32)
    if w.shape != r.run_lengths.shape or np.any(r.run_lengths != 1):
        raise ValueError(f"densr weights {w.shape} must be one per token run; got {r.run_lengths.shape} runs of "
                         f"{int(r.run_lengths.max()) if r.run_lengths.size else 0} tokens at most")
    return (grpo_outcome(r) * w).astype(np.float32)


ADVANTAGE_ESTIMATORS = {
    "capo-token-group": capo_token_group,
    "grpo": grpo_outcome,
    "grpo-lambda": grpo_lambda,
    "fipo": fipo,
    "vineppo": vineppo,
    "densr": densr,
}
"""``reward.estimator`` -> the function from a round's rewards (:class:`RoundRewards`) to one
advantage per run, (S,) float32; the reward stage repeats it over each run's tokens. A new credit
assignment method that works from the round's tables registers here."""
