"""PPO clipped surrogate on per-token advantages (pure torch: tensors in, tensors out).

CAPO (arXiv 2508.02298) §3 trains with a PPO-style clipped objective on per-token advantages;
docs/design.md §1.9 fixes the details: ratio against the policy that generated the round, clip
epsilon 0.2 (low/high separately), optional k3 KL to a frozen reference, and an explicit loss
aggregation mode (verl ``core_algos.agg_loss`` semantics), since per-token rewards make the
normalizer matter.

Shapes: B sequences (rows) by T padded token positions. Log-probs are in nats. ``mask`` marks
the response tokens that count; padded positions may hold anything (even -inf): they are
replaced by 0 before any arithmetic, so they never produce NaN values or gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass
class LossInputs:
    """One micro-batch of the PPO update, all (B, T).

    Attributes:
        logprobs: log-prob (nats) of each response token under the policy being trained
            (requires grad).
        old_logprobs: log-prob under the policy that generated the round (no grad).
        advantages: per-token advantage (``pipeline.core.rewards``).
        mask: bool/float, 1 where the token is a response token that counts.
        ref_logprobs: log-prob under the frozen reference, or None (no KL term).
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    ref_logprobs: Tensor | None = None


@dataclass
class LossOutputs:
    """Result of the PPO loss; every field is a 0-dim tensor.

    Attributes:
        loss: ``pg_loss + kl_coef * kl_ref`` with grad; backpropagate this.
        pg_loss: aggregated clipped policy-gradient loss (detached).
        clip_frac: share of masked tokens where the clipped branch was taken (detached).
        approx_kl: token mean over masked tokens of ``0.5 * (logp - old_logp)^2``, the
            quadratic estimate of KL(old || new) (detached).
        kl_ref: aggregated k3 estimate of KL(policy || reference), 0 when no reference
            (detached).
        ratio_mean: token mean of ``exp(logp - old_logp)`` over masked tokens (detached).
    """

    loss: Tensor
    pg_loss: Tensor
    clip_frac: Tensor
    approx_kl: Tensor
    kl_ref: Tensor
    ratio_mean: Tensor


def agg_loss(loss_mat: Tensor, mask: Tensor, loss_agg_mode: str) -> Tensor:
    """Aggregate a (B, T) per-token loss to a scalar (verl ``core_algos.agg_loss`` semantics).

    * ``token-mean``: ``sum(loss * mask) / sum(mask)``;
    * ``seq-mean-token-mean``: mean over sequences with >= 1 masked token of each sequence's
      token mean;
    * ``seq-mean-token-sum-norm``: ``sum(loss * mask) / (B * T)``, B the number of rows and T
      the padded length (``loss_mat.shape``): a constant normalizer (Dr.GRPO).

    An all-empty mask gives 0.0 (still attached to the graph), never NaN.

    Args:
        loss_mat: (B, T) per-token values; already 0 where ``mask`` is 0.
        mask: (B, T) bool.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.

    Raises:
        ValueError: unknown ``loss_agg_mode`` (lists the valid ones).
    """
    mask_f = mask.to(loss_mat.dtype)
    masked = loss_mat * mask_f
    if loss_agg_mode == "token-mean":
        return masked.sum() / mask_f.sum().clamp(min=1.0)
    if loss_agg_mode == "seq-mean-token-mean":
        tokens_B = mask_f.sum(dim=-1)  # (B,)
        seq_mean_B = masked.sum(dim=-1) / tokens_B.clamp(min=1.0)  # (B,)
        n_seqs = (tokens_B > 0).to(loss_mat.dtype).sum()
        return seq_mean_B.sum() / n_seqs.clamp(min=1.0)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return masked.sum() / max(loss_mat.shape[0] * loss_mat.shape[-1], 1)
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes: {LOSS_AGG_MODES}")


def _masked_token_mean(values: Tensor, mask_f: Tensor) -> Tensor:
    return (values * mask_f).sum() / mask_f.sum().clamp(min=1.0)


RATIO_TRACES = ("recent", "both")
TRACE_LOG_RATIO_BOUND = 20.0
"""|z| bound of a traced log-ratio before ``exp`` (a sum of up to ~1/(1-kappa) per-token log-ratios)."""


def _first_gap_row(mask: Tensor) -> int:
    """The first row of a (B, T) mask with a True after a False (not a prefix), or -1."""
    m = mask.bool()
    bad = (m[:, 1:] & ~m[:, :-1]).any(dim=-1)
    return int(bad.nonzero()[0, 0]) if bool(bad.any()) else -1


def traced_log_ratio(log_ratio: Tensor, mask: Tensor, kappa: float, style: str = "recent") -> Tensor:
    """GRPO-λ's eligibility-traced log-ratio (Parthasarathi et al. 2025, arXiv 2510.00194, §3.2 eq. 2):
    each response token's log-ratio replaced by a weighted sum over the response's tokens so far,

        z_t = sum_{l=0}^{t} w(t, l) * log_ratio_{t-l},   w(t, l) = kappa^l              (``recent``)
                                                          w(t, l) = max(kappa^l, kappa^(t-l))  (``both``)

    with ``kappa = gamma * lambda`` and t counted from the response's first token. ``recent`` is the
    classic accumulating trace (``z_t = log_ratio_t + kappa * z_{t-1}``); ``both`` also weighs the
    first tokens. The ratio of the clipped surrogate becomes ``exp(z_t)``, so credit for the outcome
    advantage reaches earlier tokens through the trace (docs/design.md, rival credit methods: the
    paper's text was read through two independent re-implementations that agree).

    Args:
        log_ratio: (B, T) ``logp - old_logp`` per response token (0 at padded positions).
        mask: (B, T) bool/float, response tokens (a prefix of each row: right-padded).
        kappa: gamma * lambda, in [0, 1].
        style: one of :data:`RATIO_TRACES`.

    Returns:
        (B, T) traced log-ratios, 0 at padded positions, bounded to
        ``[-TRACE_LOG_RATIO_BOUND, TRACE_LOG_RATIO_BOUND]``.

    Raises:
        ValueError: ``kappa`` outside [0, 1], unknown ``style``, shapes differ, or (``both``, which
            counts t by column) a row whose mask is not a prefix.
    """
    if not 0.0 <= kappa <= 1.0:
        raise ValueError(f"kappa={kappa}: the trace decay gamma * lambda must be in [0, 1]")
    if style not in RATIO_TRACES:
        raise ValueError(f"unknown ratio trace style {style!r}; valid: {RATIO_TRACES}")
    if mask.shape != log_ratio.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}; expected {tuple(log_ratio.shape)}")
    if style == "both" and (gap := _first_gap_row(mask)) >= 0:
        raise ValueError("ratio trace style 'both' counts a token's position by its column: each row's mask must be "
                         "a prefix (right-padded responses, as train.examples.collate makes them); row "
                         f"{gap} has a response token after a padded one")
    T = log_ratio.shape[-1]
    t = torch.arange(T, device=log_ratio.device, dtype=log_ratio.dtype)
    lag = t[:, None] - t[None, :]  # (T, T): l = t - j for the token j summed into position t
    below = lag >= 0
    k = torch.tensor(kappa, dtype=log_ratio.dtype, device=log_ratio.device)
    w = torch.where(below, k ** lag.clamp(min=0), torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device))
    if style == "both":  # max(kappa^l, kappa^(t-l)) = max(kappa^(t-j), kappa^j)
        w = torch.where(below, torch.maximum(w, k ** t[None, :].expand(T, T)), w)
    mask_b = mask.bool()
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    z = torch.where(mask_b, log_ratio, zero) @ w.T  # (B, T): z[b, t] = sum_j w[t, j] * lr[b, j]
    return torch.where(mask_b, z.clamp(-TRACE_LOG_RATIO_BOUND, TRACE_LOG_RATIO_BOUND), zero)


def future_kl_weights(log_ratio: Tensor, mask: Tensor, advantages: Tensor, half_life: float = 32.0, eps: float = 0.2,
                      clip_high_only: bool = True, participation_c: float = 10.0, safety: float = 4.0) -> Tensor:
    """FIPO's per-token influence weights (Ma et al. 2026, arXiv 2603.19835; read through ms-swift's
    docs and code and two ports of the official code, which agree): the discounted signed shift of
    each token's future,

        FutureKL_t = sum_{k >= t} gamma^(k - t) * P_k * log_ratio_k,   gamma = 2^(-1 / half_life),
        P_k = [log_ratio_k <= log c],   f_t = clip(exp(FutureKL_t), 1 - eps, 1 + eps)

    (``[1, 1 + eps]`` with ``clip_high_only``), capped at 1 where the advantage is negative and the
    token's ratio is above ``safety``. The advantage becomes ``A_t * f_t`` (f without gradient). At
    the first update of a round every log-ratio is 0 and f is 1: FIPO acts from the second
    mini-batch on.

    Args:
        log_ratio: (B, T) ``logp - old_logp`` (0 at padded positions).
        mask: (B, T) bool/float, response tokens.
        advantages: (B, T) per-token advantages (their sign picks the safety cap).
        half_life: tau, tokens for the discount to halve (> 0).
        eps: the weight's clip epsilon, in [0, 1).
        clip_high_only: clip to [1, 1 + eps] instead of [1 - eps, 1 + eps].
        participation_c: tokens whose ratio is above this add nothing to the future shift (> 1).
        safety: the ratio above which a negative-advantage token's weight is capped at 1.

    Returns:
        (B, T) weights, detached, 1 at padded positions.

    Raises:
        ValueError: a parameter out of range, shapes differ.
    """
    bad = [f"{name}={v} (valid: {rule})" for name, v, ok, rule in (
        ("half_life", half_life, half_life > 0, "> 0"), ("eps", eps, 0.0 <= eps < 1.0, "[0, 1)"),
        ("participation_c", participation_c, participation_c > 1.0, "> 1"), ("safety", safety, safety > 0, "> 0")) if not ok]
    if bad:
        raise ValueError("FIPO's future-KL weights: " + ", ".join(bad))
    if mask.shape != log_ratio.shape or advantages.shape != log_ratio.shape:
        raise ValueError(f"mask {tuple(mask.shape)} and advantages {tuple(advantages.shape)} must have the shape "
                         f"{tuple(log_ratio.shape)}")
    with torch.no_grad():
        mask_b = mask.bool()
        zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
        lr = torch.where(mask_b & (log_ratio <= torch.log(torch.tensor(participation_c, dtype=log_ratio.dtype))), log_ratio, zero)
        T = lr.shape[-1]
        t = torch.arange(T, device=lr.device, dtype=lr.dtype)
        ahead = t[None, :] - t[:, None]  # (T, T): k - t
        gamma = torch.tensor(2.0, dtype=lr.dtype) ** (-1.0 / half_life)
        w = torch.where(ahead >= 0, gamma ** ahead.clamp(min=0), zero)  # w[t, k] = gamma^(k-t) for k >= t
        future = lr @ w.T  # (B, T): sum_k w[t, k] * lr[b, k]
        f = torch.exp(future.clamp(max=20.0)).clamp(1.0 if clip_high_only else 1.0 - eps, 1.0 + eps)
        f = torch.where((advantages < 0) & (torch.exp(log_ratio) > safety), f.clamp(max=1.0), f)
        return torch.where(mask_b, f, torch.ones((), dtype=lr.dtype, device=lr.device))


def token_credit(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_low: float = 0.2,
                 clip_high: float = 0.2, ratio_trace: tuple[float, str] | None = None,
                 future_kl: dict | None = None) -> Tensor:
    """Where an update puts the credit: each response token's coefficient on its own log-prob
    gradient in the clipped surrogate of :func:`ppo_clip_loss`, before aggregation,

        credit_t = -d(sum_k pg_k) / d(log pi_t)

    with ``pg_k`` the per-token loss ``-min(ratio_k * A_k, clip(ratio_k) * A_k)`` (Schulman et al.
    2017 eq. 7). Plain PPO: ``credit_t = A_t * ratio_t`` where the token is not clipped, 0 where
    it is; FIPO (``future_kl``): ``A_t * f_t * ratio_t`` with the influence weights of
    :func:`future_kl_weights`; GRPO-λ (``ratio_trace``): ``sum_{k >= t} w(k, t) * A_k *
    exp(z_k)`` over the tokens k whose traced ratio ``exp(z_k)`` is not clipped (the trace carries
    later tokens' advantages back, :func:`pipeline.core.rewards.trace_credit` at ratio 1; a clipped
    token still gets credit from later unclipped ones). At the first step of a round every
    ratio is 1 and nothing is clipped, so the credit is the method's advantage (for GRPO-λ its
    trace credit); later steps move it with the ratio, FIPO's weights and the clip. The policy
    gradient is ``-sum_t credit_t * grad log pi_t`` divided by the aggregation's normalizer (the
    number of tokens under ``token-mean``); the KL term is not part of it. It builds a graph of its own,
    so it runs under ``torch.no_grad`` but not under ``torch.inference_mode``.

    Args:
        logprobs: (B, T) log-probs (nats) under the trained policy (read, never differentiated).
        old_logprobs: (B, T) log-probs under the rollout policy.
        advantages: (B, T) per-token advantages.
        mask: (B, T) bool/float, response tokens.
        clip_low: epsilon below 1, in [0, 1) (as in :func:`ppo_clip_loss`).
        clip_high: epsilon above 1, >= 0.
        ratio_trace: ``(kappa, style)`` of GRPO-λ's traced ratio, or None (:func:`ppo_clip_loss`).
        future_kl: keyword arguments of :func:`future_kl_weights` (FIPO), or None.

    Returns:
        (B, T) float credits, detached, 0 at padded positions.

    Raises:
        ValueError: shapes differ, clip values out of range (:func:`ppo_clip_loss`'s checks).
    """
    _check_loss_args(logprobs, old_logprobs, advantages, mask, None, clip_low, clip_high, 0.0, "token-mean")
    mask_b = mask.bool()
    with torch.enable_grad():  # a graph of its own over the (B, T) log-ratios: the model's graph is never touched
        zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
        log_ratio = torch.where(mask_b, logprobs.detach() - old_logprobs.detach(), zero).requires_grad_(True)
        adv = torch.where(mask_b, advantages.detach().to(logprobs.dtype), zero)
        if future_kl is not None:
            adv = adv * future_kl_weights(log_ratio.detach(), mask_b, adv, **future_kl)
        _, pg_unclipped, pg_clipped = _pg_surrogate(log_ratio, adv, mask_b, clip_low, clip_high, ratio_trace)
        pg = torch.where(mask_b, torch.maximum(pg_unclipped, pg_clipped), zero)
        (grad,) = torch.autograd.grad(pg.sum(), log_ratio)
    return torch.where(mask_b, -grad, zero).detach()


def _check_loss_args(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                     ref_logprobs: Tensor | None, clip_low: float, clip_high: float, kl_coef: float,
                     loss_agg_mode: str) -> None:
    """Raise ValueError on the argument errors :func:`ppo_clip_loss` lists (all tensors (B, T))."""
    shape = logprobs.shape
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages), ("mask", mask),
                    ("ref_logprobs", ref_logprobs)):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}")
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if kl_coef < 0.0 or (kl_coef > 0.0 and ref_logprobs is None):
        raise ValueError(f"kl_coef={kl_coef}: must be >= 0, and > 0 needs ref_logprobs")
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes: {LOSS_AGG_MODES}")


def _pg_surrogate(log_ratio: Tensor, adv: Tensor, mask_b: Tensor, clip_low: float, clip_high: float,
                  ratio_trace: tuple[float, str] | None) -> tuple[Tensor, Tensor, Tensor]:
    """The (B, T) ratio (traced with ``ratio_trace``) and the unclipped and clipped per-token PG losses."""
    ratio = torch.exp(log_ratio if ratio_trace is None else traced_log_ratio(log_ratio, mask_b, *ratio_trace))  # (B, T)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return ratio, pg_unclipped, pg_clipped


def _k3_kl_ref(logprobs: Tensor, ref_logprobs: Tensor, mask_b: Tensor, zero: Tensor, loss_agg_mode: str) -> Tensor:
    """The k3 estimate of KL(policy || reference) from (B, T) log-probs (nats), aggregated to a scalar with grad."""
    delta = torch.where(mask_b, ref_logprobs.detach() - logprobs, zero)  # (B, T)
    kl_mat = torch.exp(delta) - delta - 1.0  # k3 >= 0
    return agg_loss(kl_mat, mask_b, loss_agg_mode)


def _ratio_stats(log_ratio: Tensor, ratio: Tensor, pg_unclipped: Tensor, pg_clipped: Tensor,
                 mask_f: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Detached token means over the (B, T) ``mask_f``: clip fraction, approx. KL and mean ratio."""
    with torch.no_grad():
        clip_frac = _masked_token_mean((pg_clipped > pg_unclipped).to(mask_f.dtype), mask_f)
        approx_kl = _masked_token_mean(0.5 * log_ratio.square(), mask_f)
        ratio_mean = _masked_token_mean(ratio, mask_f)
    return clip_frac, approx_kl, ratio_mean


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    ratio_trace: tuple[float, str] | None = None,
    future_kl: dict | None = None,
) -> LossOutputs:
    """PPO clipped surrogate on per-token advantages (Schulman et al. 2017 eq. 7; CAPO §3).

    Per token: ``ratio = exp(logp - old_logp)``,
    ``pg = -min(ratio * A, clamp(ratio, 1 - clip_low, 1 + clip_high) * A)``, aggregated by
    ``agg_loss``. With a reference, the k3 estimator ``exp(ref - logp) - (ref - logp) - 1``
    (Schulman's "Approximating KL divergence"), aggregated the same way and weighted by
    ``kl_coef``, is added to the loss.

    Args:
        logprobs: (B, T) log-probs (nats) under the trained policy, with grad.
        old_logprobs: (B, T) log-probs under the rollout policy.
        advantages: (B, T) per-token advantages.
        mask: (B, T) bool/float, response tokens that count.
        clip_low: epsilon below 1, in [0, 1).
        clip_high: epsilon above 1, >= 0.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.
        ref_logprobs: (B, T) log-probs under the frozen reference, or None.
        kl_coef: weight of the KL term, >= 0; > 0 needs ``ref_logprobs``.
        ratio_trace: ``(kappa, style)``: the ratio is ``exp`` of GRPO-λ's traced log-ratio
            (:func:`traced_log_ratio`), clipped as the plain one; None: the per-token ratio.
            ``approx_kl`` stays that of the per-token ratio.
        future_kl: keyword arguments of :func:`future_kl_weights` (FIPO): the advantages are
            weighted by each token's future influence; None: as given.

    Returns:
        ``LossOutputs`` (scalars; only ``loss`` carries grad).

    Raises:
        ValueError: shapes differ, clip or kl values out of range, ``kl_coef > 0`` without
            ``ref_logprobs``, unknown ``loss_agg_mode``.
    """
    _check_loss_args(logprobs, old_logprobs, advantages, mask, ref_logprobs, clip_low, clip_high, kl_coef,
                     loss_agg_mode)

    mask_b = mask.bool()
    mask_f = mask_b.to(logprobs.dtype)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # Padded positions -> 0 before exp, so they give ratio 1, advantage 0 and zero gradient.
    log_ratio = torch.where(mask_b, logprobs - old_logprobs.detach(), zero)  # (B, T)
    adv = torch.where(mask_b, advantages.detach().to(logprobs.dtype), zero)  # (B, T)
    if future_kl is not None:  # FIPO: each token's advantage weighted by its future's influence
        adv = adv * future_kl_weights(log_ratio.detach(), mask_b, adv, **future_kl)
    ratio, pg_unclipped, pg_clipped = _pg_surrogate(log_ratio, adv, mask_b, clip_low, clip_high, ratio_trace)
    pg_mat = torch.maximum(pg_unclipped, pg_clipped)  # = -min(ratio*A, clip(ratio)*A)
    pg_loss = agg_loss(pg_mat, mask_b, loss_agg_mode)

    kl_ref = _k3_kl_ref(logprobs, ref_logprobs, mask_b, zero, loss_agg_mode) if ref_logprobs is not None else zero
    loss = pg_loss + kl_coef * kl_ref if kl_coef > 0.0 else pg_loss

    clip_frac, approx_kl, ratio_mean = _ratio_stats(log_ratio, ratio, pg_unclipped, pg_clipped, mask_f)
    return LossOutputs(
        loss=loss,
        pg_loss=pg_loss.detach(),
        clip_frac=clip_frac,
        approx_kl=approx_kl,
        kl_ref=kl_ref.detach(),
        ratio_mean=ratio_mean,
    )


def compute_loss(
    inputs: LossInputs,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
    kl_coef: float = 0.0,
    ratio_trace: tuple[float, str] | None = None,
    future_kl: dict | None = None,
) -> LossOutputs:
    """``ppo_clip_loss`` on a ``LossInputs`` bundle (prime-rl style entry point): every tensor of
    ``inputs`` is (B, T) over response tokens; shapes, formulas (PPO-clip, Schulman et al. 2017,
    eq. 7; the aggregation modes) and errors as :func:`ppo_clip_loss`."""
    return ppo_clip_loss(
        inputs.logprobs,
        inputs.old_logprobs,
        inputs.advantages,
        inputs.mask,
        clip_low=clip_low,
        clip_high=clip_high,
        loss_agg_mode=loss_agg_mode,
        ref_logprobs=inputs.ref_logprobs,
        kl_coef=kl_coef,
        ratio_trace=ratio_trace,
        future_kl=future_kl,
    )
