"""Monte Carlo step values and step advantages (VinePPO; pure: arrays in, arrays out).

VinePPO (Kazemnejad et al., arXiv 2410.01679, ICML 2025) replaces PPO's value network by Monte
Carlo estimates: the value of a state, a response cut after its k-th step, is the share of K
continuations sampled from it by the current policy that reach the right answer. A step's
advantage is the change of value it causes, ``A_k = V(S_k) - V(S_{k-1})``, with the last step's
``A_N = R - V(S_{N-1})`` (γ = 1, reward only at the end), so the advantages of a response telescope
to ``R - V(S_0)``. Every token of a step gets its step's advantage; the advantages are then whitened
over every token of the batch, as the official code does (``whiten_advantages``).

Decisions the paper leaves open (docs/method.md, "VinePPO"):

* **Steps** are the round's own steps (the segment stage), not VinePPO's sentence splitter, so the
  same steps are judged by the critic and valued here.
* **Step cap.** Only the first ``M = min(N, mc.max_states)`` states are valued; beyond the cap the
  value is the realized return ``R`` (the official ``max_step_for_value_estimation`` fill), so
  those steps get advantage 0 and the step at the cap gets ``R - V(S_{M-1})``.
* **The prompt's value** ``V(S_0)`` is the mean outcome of the *other* responses of the group:
  they are G - 1 samples from the same policy at the same state, independent of this response,
  and cost no generation (the official code samples K more).
"""

from __future__ import annotations

import numpy as np


def leave_one_out_means(outcome: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Each response's group mean of ``outcome`` without the response itself: ``V(S_0)``.

    Args:
        outcome: (B,) float, the responses' outcome rewards.
        groups: (B,) int, each response's prompt group.

    Returns:
        (B,) float64.

    Raises:
        ValueError: shapes differ, or a group has a single response (no other sample of its prompt).
    """
    outcome = np.asarray(outcome, np.float64)
    groups = np.asarray(groups)
    if outcome.shape != groups.shape or outcome.ndim != 1:
        raise ValueError(f"outcome {outcome.shape} and groups {groups.shape} must both be (B,)")
    _, inv = np.unique(groups, return_inverse=True)
    size = np.bincount(inv)
    if len(size) and size.min() < 2:
        lone = np.unique(groups)[size < 2].tolist()
        raise ValueError(f"groups {lone[:5]} have one response: the prompt's value needs the group's other "
                         "responses (rollout.group_size >= 2)")
    total = np.bincount(inv, weights=outcome)
    return (total[inv] - outcome) / (size[inv] - 1)


def mc_step_advantages(state_values: np.ndarray, n_states: np.ndarray, n_steps: np.ndarray,
                       final_reward: np.ndarray) -> np.ndarray:
    """VinePPO's step advantages from Monte Carlo state values (arXiv 2410.01679, §4; official
    ``advantages[i] = step_rewards[i] + values[i+1] - values[i]`` with γ = 1).

    Response b has ``N_b`` steps and ``M_b`` valued states ``S_0 .. S_{M_b - 1}`` (``S_0``: the
    prompt; ``S_k``: the response cut after step k). With ``V(S_k) = final_reward_b`` for every
    ``k >= M_b`` (the realized return past the cap, and ``V(S_N) = R`` at the end):
    ``A_k = V(S_k) - V(S_{k-1})`` for steps ``k = 1 .. N_b``.

    Args:
        state_values: (sum M_b,) float, ``V(S_0) .. V(S_{M_b - 1})`` of each response in turn.
        n_states: (B,) int, ``M_b`` with ``1 <= M_b <= N_b``.
        n_steps: (B,) int, ``N_b >= 1``.
        final_reward: (B,) float, ``R_b`` (the outcome reward, plus any overlong penalty).

    Returns:
        (sum N_b,) float64, the advantage of every step, response by response.

    Raises:
        ValueError: shapes disagree, or ``M_b`` outside ``[1, N_b]``.
    """
    state_values = np.asarray(state_values, np.float64)
    n_states, n_steps = np.asarray(n_states, np.int64), np.asarray(n_steps, np.int64)
    final_reward = np.asarray(final_reward, np.float64)
    if not (n_states.shape == n_steps.shape == final_reward.shape) or n_states.ndim != 1:
        raise ValueError(f"n_states {n_states.shape}, n_steps {n_steps.shape} and final_reward "
                         f"{final_reward.shape} must all be (B,)")
    if np.any(n_states < 1) or np.any(n_states > n_steps):
        b = int(np.nonzero((n_states < 1) | (n_states > n_steps))[0][0])
        raise ValueError(f"response {b} has {n_states[b]} valued states and {n_steps[b]} steps; "
                         "need 1 <= states <= steps")
    if state_values.shape != (int(n_states.sum()),):
        raise ValueError(f"state_values has shape {state_values.shape}; expected ({int(n_states.sum())},)")
    B = len(n_steps)
    # values V(S_0 .. S_N) per response, (sum (N_b + 1),): the valued states, then R up to S_N
    resp = np.repeat(np.arange(B), n_steps + 1)
    k = np.arange(len(resp)) - np.repeat(np.cumsum(n_steps + 1) - (n_steps + 1), n_steps + 1)
    valued = k < n_states[resp]
    full = final_reward[resp].copy()
    full[valued] = state_values
    diff = np.diff(full)  # V(S_k) - V(S_{k-1}), plus one cross-response entry per boundary
    keep = np.ones(len(diff), bool)
    keep[np.cumsum(n_steps + 1)[:-1] - 1] = False
    return diff[keep]


def mc_step_advantages_loop(state_values, n_states, n_steps, final_reward) -> np.ndarray:
    """:func:`mc_step_advantages` written as the plain loop of the definition (the tests' reference)."""
    out, at = [], 0
    for m, n, r in zip(n_states, n_steps, final_reward):
        v = list(state_values[at:at + m]) + [r] * (n + 1 - m)
        at += m
        out += [v[k] - v[k - 1] for k in range(1, n + 1)]
    return np.asarray(out, np.float64)


def whiten_runs(values: np.ndarray, lengths: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """Whiten run values over every token of the batch: ``(A - mean) / (std + eps)`` with the mean and
    the unbiased std taken over tokens (a run of L tokens counts L times), as VinePPO's official
    ``masked_whiten``.

    Args:
        values: (S,) float, one value per run of tokens.
        lengths: (S,) int, tokens per run.
        eps: added to the std.

    Returns:
        (S,) float32. All zeros when the batch has fewer than 2 tokens.

    Raises:
        ValueError: ``values`` and ``lengths`` are not 1-D of one length.
    """
    values = np.asarray(values, np.float64)
    lengths = np.asarray(lengths, np.float64)
    if values.ndim != 1 or values.shape != lengths.shape:
        raise ValueError(f"values {values.shape} and lengths {lengths.shape} must be 1-D, one length per run value")
    n = lengths.sum()
    if n < 2:
        return np.zeros(len(values), np.float32)
    mean = (values * lengths).sum() / n
    var = (lengths * (values - mean) ** 2).sum() / (n - 1)
    return ((values - mean) / (np.sqrt(var) + eps)).astype(np.float32)


def first_error_from_values(values, final: float, drop: float) -> int:
    """The first wrong step by Monte Carlo values (Math-Shepherd's idea, Wang et al. 2024, arXiv
    2312.08935, read as a first-error label): the first step ``i`` (from 0) whose move ``S_i -> S_{i+1}``
    lowers the value by at least ``drop``, with ``V(S_N) = final``; -1 when no step does.

    Args:
        values: ``V(S_0) .. V(S_{N-1})``, every state of an N-step response valued.
        final: the response's outcome ``R`` (``V(S_N)``).
        drop: the smallest fall of value that marks an error, in (0, 1].

    Raises:
        ValueError: no values, or ``drop`` outside (0, 1].
    """
    if not 0 < drop <= 1:
        raise ValueError(f"drop must be in (0, 1], got {drop}")
    v = [float(x) for x in values] + [float(final)]
    if len(v) < 2:
        raise ValueError("values is empty; a response has at least one state, S_0")
    return next((i for i in range(len(v) - 1) if v[i] - v[i + 1] >= drop - 1e-12), -1)

