"""PPO clipped loss (train/loss.py), values and gradients worked by hand."""

import math

import pytest
import torch

from train.loss import LOSS_AGG_MODES, LossInputs, agg_loss, compute_loss, ppo_clip_loss


def one_token(ratio: float, adv: float, **kw):
    """Loss of a single masked token with the given ratio and advantage."""
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    out = ppo_clip_loss(logp, old, torch.tensor([[adv]], dtype=torch.float64),
                        torch.ones(1, 1, dtype=torch.bool), **kw)
    out.loss.backward()
    return out, logp.grad.item()


@pytest.mark.parametrize(
    "ratio,adv,expected_pg,clipped,expected_grad",
    [
        # A > 0, ratio above 1 + 0.2: min(1.5*1, 1.2*1) = 1.2 -> clipped, no gradient
        (1.5, 1.0, -min(1.5 * 1.0, 1.2 * 1.0), True, 0.0),
        # A < 0, ratio above range: min(1.5*-1, 1.2*-1) = -1.5 -> unclipped; d(-A r)/dlogp = -A r
        (1.5, -1.0, -min(1.5 * -1.0, 1.2 * -1.0), False, -(-1.0) * 1.5),
        # A > 0, ratio below 1 - 0.2: min(0.5*1, 0.8*1) = 0.5 -> unclipped
        (0.5, 1.0, -min(0.5 * 1.0, 0.8 * 1.0), False, -1.0 * 0.5),
        # A < 0, ratio below range: min(0.5*-1, 0.8*-1) = -0.8 -> clipped, no gradient
        (0.5, -1.0, -min(0.5 * -1.0, 0.8 * -1.0), True, 0.0),
        # inside the range both branches agree
        (1.1, 2.0, -(1.1 * 2.0), False, -2.0 * 1.1),
        (0.9, -2.0, -(0.9 * -2.0), False, 2.0 * 0.9),
    ],
)
def test_clip_cases(ratio, adv, expected_pg, clipped, expected_grad):
    out, grad = one_token(ratio, adv)
    assert out.loss.item() == pytest.approx(expected_pg)
    assert out.pg_loss.item() == pytest.approx(expected_pg)
    assert out.clip_frac.item() == (1.0 if clipped else 0.0)
    assert out.ratio_mean.item() == pytest.approx(ratio)
    assert out.approx_kl.item() == pytest.approx(0.5 * math.log(ratio) ** 2)
    assert grad == pytest.approx(expected_grad)


def test_sign_of_the_loss_follows_the_advantage():
    assert one_token(1.0, 3.0)[0].loss.item() == pytest.approx(-3.0)
    assert one_token(1.0, -3.0)[0].loss.item() == pytest.approx(3.0)


def test_asymmetric_clip():
    # clip_high 0.28: ratio 1.25 with A > 0 is inside the range, ratio 1.3 is clipped to 1.28
    assert one_token(1.25, 1.0, clip_high=0.28)[0].loss.item() == pytest.approx(-1.25)
    assert one_token(1.3, 1.0, clip_high=0.28)[0].loss.item() == pytest.approx(-1.28)
    # clip_low 0.1: ratio 0.85 with A < 0 is clipped to 0.9 -> loss 0.9
    assert one_token(0.85, -1.0, clip_low=0.1)[0].loss.item() == pytest.approx(0.9)


def test_clip_frac_and_metrics_over_tokens():
    ratios = torch.tensor([[1.5, 1.5, 0.5, 0.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    out = ppo_clip_loss(ratios.log(), torch.zeros_like(ratios), adv, torch.ones(1, 4))
    assert out.clip_frac.item() == pytest.approx(2 / 4)  # tokens 0 and 3 take the clipped branch
    assert out.loss.item() == pytest.approx((-1.2 + 1.5 - 0.5 + 0.8) / 4)
    assert out.ratio_mean.item() == pytest.approx((1.5 + 1.5 + 0.5 + 0.5) / 4)
    assert out.approx_kl.item() == pytest.approx(
        0.5 * (2 * math.log(1.5) ** 2 + 2 * math.log(0.5) ** 2) / 4
    )


# --- aggregation -------------------------------------------------------------------------------

# ratio 1 everywhere, so pg = -A on masked tokens
ADV = torch.tensor([[1.0, 2.0, 99.0], [4.0, 99.0, 99.0], [99.0, 99.0, 99.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)


def agg(mode, rows=3):
    logp = torch.zeros(rows, 3, dtype=torch.float64, requires_grad=True)
    out = ppo_clip_loss(logp, torch.zeros(rows, 3, dtype=torch.float64), ADV[:rows], MASK[:rows],
                        loss_agg_mode=mode)
    out.loss.backward()
    return out.loss.item(), logp.grad


@pytest.mark.parametrize("rows", [2, 3])  # 3 adds an all-empty row
def test_aggregation_modes_by_hand(rows):
    loss, grad = agg("token-mean", rows)
    assert loss == pytest.approx((-1 - 2 - 4) / 3)
    assert grad[0, 0].item() == pytest.approx(-1 / 3)  # d(-A r / 3)/dlogp at r = 1
    loss, grad = agg("seq-mean-token-mean", rows)  # the empty row is not a sequence here
    assert loss == pytest.approx(((-1 - 2) / 2 + (-4) / 1) / 2)
    assert grad[1, 0].item() == pytest.approx(-4 / 1 / 2)
    loss, grad = agg("seq-mean-token-sum-norm", rows)  # constant B * T normalizer
    assert loss == pytest.approx((-1 - 2 - 4) / (rows * 3))
    assert grad[0, 1].item() == pytest.approx(-2 / (rows * 3))
    for mode in LOSS_AGG_MODES:
        _, grad = agg(mode, rows)
        assert torch.all(grad[~MASK[:rows]] == 0)  # padding gets no gradient


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_all_empty_mask_is_zero_with_grad(mode):
    logp = torch.zeros(2, 3, requires_grad=True)
    out = ppo_clip_loss(logp, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3),
                        loss_agg_mode=mode, ref_logprobs=torch.zeros(2, 3), kl_coef=0.1)
    assert out.loss.item() == 0.0 and out.loss.requires_grad
    out.loss.backward()
    assert torch.all(logp.grad == 0)
    for value in (out.clip_frac, out.approx_kl, out.kl_ref, out.ratio_mean):
        assert not torch.isnan(value)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_padding_holding_inf_gives_no_nan(mode):
    logp = torch.tensor([[-0.5, -float("inf")], [-1.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[-0.7, -float("inf")], [-1.0, 0.0]])
    mask = torch.tensor([[1, 0], [1, 0]])
    out = ppo_clip_loss(logp, old, torch.tensor([[1.0, float("nan")], [-1.0, 5.0]]), mask,
                        loss_agg_mode=mode, ref_logprobs=old, kl_coef=0.01)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.all(torch.isfinite(logp.grad))
    assert torch.all(logp.grad[:, 1] == 0)


def test_agg_loss_unknown_mode_lists_valid_ones():
    with pytest.raises(ValueError, match="'seq-sum'.*token-mean.*seq-mean-token-sum-norm"):
        agg_loss(torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), "seq-sum")
    with pytest.raises(ValueError, match="'seq-sum'"):
        ppo_clip_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1),
                      loss_agg_mode="seq-sum")


# --- KL to the reference ---------------------------------------------------------------------


def test_k3_kl_by_hand():
    # ref - logp = ln 2 -> k3 = e^{ln 2} - ln 2 - 1 = 1 - ln 2; ratio 1, A = 0.5 -> pg = -0.5
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.0 + math.log(2.0)]], dtype=torch.float64)
    out = ppo_clip_loss(logp, logp.detach().clone(), torch.tensor([[0.5]], dtype=torch.float64),
                        torch.ones(1, 1), ref_logprobs=ref, kl_coef=0.1)
    assert out.kl_ref.item() == pytest.approx(1 - math.log(2.0))
    assert out.loss.item() == pytest.approx(-0.5 + 0.1 * (1 - math.log(2.0)))
    out.loss.backward()
    # d/dlogp [-A r] = -0.5; d/dlogp k3 = -e^{d} + 1 = -2 + 1 = -1 -> times 0.1
    assert logp.grad.item() == pytest.approx(-0.5 + 0.1 * (-2.0 + 1.0))


def test_kl_is_a_metric_only_with_zero_coef_and_zero_without_ref():
    logp = torch.zeros(1, 2, dtype=torch.float64)
    ref = torch.full((1, 2), math.log(2.0), dtype=torch.float64)
    adv = torch.ones(1, 2, dtype=torch.float64)
    out = ppo_clip_loss(logp, logp, adv, torch.ones(1, 2), ref_logprobs=ref)
    assert out.kl_ref.item() == pytest.approx(1 - math.log(2.0))
    assert out.loss.item() == pytest.approx(-1.0)
    assert ppo_clip_loss(logp, logp, adv, torch.ones(1, 2)).kl_ref.item() == 0.0


def test_argument_validation():
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        ppo_clip_loss(z, z, z, z, kl_coef=0.1)
    with pytest.raises(ValueError, match=r"advantages has shape \(1, 3\)"):
        ppo_clip_loss(z, z, torch.zeros(1, 3), z)
    with pytest.raises(ValueError, match="clip_low"):
        ppo_clip_loss(z, z, z, z, clip_low=1.0)


def test_compute_loss_matches_ppo_clip_loss():
    g = torch.Generator().manual_seed(0)
    logp, old, adv = (torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.rand(3, 5, generator=g) > 0.3
    a = compute_loss(LossInputs(logp, old, adv, mask), loss_agg_mode="seq-mean-token-mean")
    b = ppo_clip_loss(logp, old, adv, mask, loss_agg_mode="seq-mean-token-mean")
    assert a.loss.item() == b.loss.item()


def test_compute_loss_forwards_every_setting_by_hand():
    one = torch.ones(1, 1)
    # ratio 1.3, A = 1: clipped at 1 + clip_high -> loss -1.28 under clip_high 0.28 (-1.2 under the default 0.2)
    up = LossInputs(torch.tensor([[math.log(1.3)]], dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64),
                    torch.ones(1, 1, dtype=torch.float64), one)
    assert compute_loss(up, clip_high=0.28).loss.item() == pytest.approx(-1.28)
    assert compute_loss(up).loss.item() == pytest.approx(-1.2)
    # ratio 1, A = 0.5, ref - logp = ln 2: -0.5 + 0.1 * (1 - ln 2) = -0.469315
    kl = LossInputs(torch.tensor([[-1.0]], dtype=torch.float64), torch.tensor([[-1.0]], dtype=torch.float64),
                    torch.tensor([[0.5]], dtype=torch.float64), one, torch.tensor([[-1.0 + math.log(2.0)]], dtype=torch.float64))
    assert compute_loss(kl, kl_coef=0.1).loss.item() == pytest.approx(-0.469315, abs=1e-6)
    # the trace and FIPO's weights reach the loss (each changes it from the plain one on this batch)
    g = torch.Generator().manual_seed(1)
    logp, old = (torch.randn(2, 4, generator=g, dtype=torch.float64) * 0.1 for _ in range(2))
    adv, mask = torch.tensor([[1.0] * 4, [-1.0] * 4], dtype=torch.float64), torch.ones(2, 4)
    inputs, plain = LossInputs(logp, old, adv, mask), ppo_clip_loss(logp, old, adv, mask).loss.item()
    for kw in ({"ratio_trace": (0.9, "recent")}, {"future_kl": {"half_life": 2.0, "eps": 0.2}}):
        got = compute_loss(inputs, **kw).loss.item()
        assert got == ppo_clip_loss(logp, old, adv, mask, **kw).loss.item() and got != plain, kw


def naive_loss(logp, old, adv, mask, mode, eps=0.2):
    """Reference: per-token Python loops."""
    B, T = len(logp), len(logp[0])
    per_seq, total, count = [], 0.0, 0
    for b in range(B):
        seq_total, seq_count = 0.0, 0
        for t in range(T):
            if mask[b][t]:
                r = math.exp(logp[b][t] - old[b][t])
                pg = -min(r * adv[b][t], min(max(r, 1 - eps), 1 + eps) * adv[b][t])
                seq_total, seq_count = seq_total + pg, seq_count + 1
        total, count = total + seq_total, count + seq_count
        if seq_count:
            per_seq.append(seq_total / seq_count)
    if mode == "token-mean":
        return total / max(count, 1)
    if mode == "seq-mean-token-mean":
        return sum(per_seq) / max(len(per_seq), 1)
    return total / (B * T)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_vectorized_matches_naive_loop(seed, mode):
    g = torch.Generator().manual_seed(seed)
    B, T = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.4
    got = ppo_clip_loss(logp, old, adv, mask, loss_agg_mode=mode).loss.item()
    want = naive_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), mode)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)


# --- GRPO-λ's traced ratio ------------------------------------------------------------------------
def test_traced_log_ratio_by_hand():
    """log-ratios 0.1, -0.2, 0.3 and a padded position, kappa 0.5.
    recent: z0 = 0.1; z1 = -0.2 + 0.5 * 0.1 = -0.15; z2 = 0.3 + 0.5 * -0.15 = 0.225.
    both:   w(t, l) = max(0.5^l, 0.5^(t-l)): z1 = -0.2 + max(0.5, 1) * 0.1 = -0.1;
            z2 = 0.3 + max(0.5, 0.5) * -0.2 + max(0.25, 1) * 0.1 = 0.3."""
    from train.loss import traced_log_ratio

    lr = torch.tensor([[0.1, -0.2, 0.3, 7.0]])
    mask = torch.tensor([[True, True, True, False]])
    torch.testing.assert_close(traced_log_ratio(lr, mask, 0.5, "recent"), torch.tensor([[0.1, -0.15, 0.225, 0.0]]))
    torch.testing.assert_close(traced_log_ratio(lr, mask, 0.5, "both"), torch.tensor([[0.1, -0.1, 0.3, 0.0]]))
    # kappa 0: no trace, the per-token log-ratio; the bound holds a long trace's sum
    torch.testing.assert_close(traced_log_ratio(lr, mask, 0.0), torch.tensor([[0.1, -0.2, 0.3, 0.0]]))
    big = traced_log_ratio(torch.full((1, 50), 1.0), torch.ones(1, 50, dtype=torch.bool), 1.0)
    assert big[0, 0] == 1.0 and big[0, -1] == 20.0
    with pytest.raises(ValueError, match="kappa=1.5"):
        traced_log_ratio(lr, mask, 1.5)
    with pytest.raises(ValueError, match="unknown ratio trace style 'old'"):
        traced_log_ratio(lr, mask, 0.5, "old")
    # 'both' counts t by column: a left-padded row would weigh its first token as if it were the second
    left = torch.tensor([[True, True, True, True], [False, True, True, True]])
    with pytest.raises(ValueError, match="row 1 has a response token after a padded one"):
        traced_log_ratio(torch.zeros(2, 4), left, 0.5, "both")
    traced_log_ratio(torch.zeros(2, 4), left, 0.5, "recent")  # 'recent' depends on lags only


def test_traced_log_ratio_matches_the_recursion_on_random_rows():
    """The vectorized trace equals the naive loop z_t = lr_t + kappa * z_{t-1} (recent) and the
    double sum (both), row by row, with rows of different lengths."""
    from train.loss import traced_log_ratio

    g = torch.Generator().manual_seed(0)
    lr = torch.randn(3, 9, generator=g, dtype=torch.float64) * 0.1
    lengths = [9, 4, 1]
    mask = torch.zeros(3, 9, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
    kappa = 0.9
    for style in ("recent", "both"):
        want = torch.zeros_like(lr)
        for b, n in enumerate(lengths):
            for t in range(n):
                want[b, t] = sum((kappa ** l if style == "recent" else max(kappa ** l, kappa ** (t - l))) * lr[b, t - l]
                                 for l in range(t + 1))
        torch.testing.assert_close(traced_log_ratio(lr, mask, kappa, style), want)


def test_a_traced_ratio_credits_earlier_tokens():
    """At the first update (logp = old logp) the plain and the traced ratio are both 1, so the loss is
    the same; the gradient is not: with the trace, token j's log-prob gets the advantage summed over
    every later token's weight, sum_{t>=j} kappa^(t-j) * A_t (recent), not A_j alone."""
    from train.loss import ppo_clip_loss

    old = torch.tensor([[-1.0, -2.0, -0.5]])
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    grads = {}
    for trace in (None, (0.5, "recent")):
        lp = old.clone().requires_grad_(True)
        out = ppo_clip_loss(lp, old, adv, mask, loss_agg_mode="token-mean", ratio_trace=trace)
        assert out.loss.item() == pytest.approx(-1.0)
        out.loss.backward()
        grads[trace] = lp.grad
    torch.testing.assert_close(grads[None], torch.tensor([[-1 / 3, -1 / 3, -1 / 3]]))
    # token 0: (1 + 0.5 + 0.25) / 3, token 1: (1 + 0.5) / 3, token 2: 1 / 3, each negated
    torch.testing.assert_close(grads[(0.5, "recent")], torch.tensor([[-1.75 / 3, -1.5 / 3, -1 / 3]]))


# --- FIPO's future-KL weights -----------------------------------------------------------------------
def test_future_kl_weights_by_hand():
    """log-ratios 0.1, -0.2, 0.3 and a padded position; half-life 1 token (gamma 0.5):
    F2 = 0.3, F1 = -0.2 + 0.5 * 0.3 = -0.05, F0 = 0.1 + 0.5 * -0.05 = 0.075."""
    from train.loss import future_kl_weights

    lr = torch.tensor([[0.1, -0.2, 0.3, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    pos = torch.ones(1, 4, dtype=torch.float64)
    f = future_kl_weights(lr, mask, pos, half_life=1.0, clip_high_only=False)
    torch.testing.assert_close(f, torch.tensor([[math.exp(0.075), math.exp(-0.05), 1.2, 1.0]], dtype=torch.float64))
    # clip-high only: [1, 1.2]
    f = future_kl_weights(lr, mask, pos, half_life=1.0)
    torch.testing.assert_close(f, torch.tensor([[math.exp(0.075), 1.0, 1.2, 1.0]], dtype=torch.float64))
    # a negative advantage on a token whose ratio exp(0.3) = 1.35 is above the safety threshold 1.3: capped at 1
    neg = torch.tensor([[1.0, 1.0, -1.0, 1.0]], dtype=torch.float64)
    assert future_kl_weights(lr, mask, neg, half_life=1.0, safety=1.3)[0, 2] == 1.0
    # participation: a ratio above c = 1.2 (log 0.182 < 0.3) adds nothing: F2 = 0, F1 = -0.2, F0 = 0.1 - 0.1 = 0
    f = future_kl_weights(lr, mask, pos, half_life=1.0, clip_high_only=False, participation_c=1.2)
    torch.testing.assert_close(f, torch.tensor([[1.0, math.exp(-0.2), 1.0, 1.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"half_life=0.0 \(valid: > 0\)"):
        future_kl_weights(lr, mask, pos, half_life=0.0)
    with pytest.raises(ValueError, match=r"participation_c=0.5 \(valid: > 1\)$"):  # only the bad one named
        future_kl_weights(lr, mask, pos, participation_c=0.5)


def test_future_kl_weights_match_the_naive_sum_and_leave_the_first_update_alone():
    from train.loss import future_kl_weights, ppo_clip_loss

    g = torch.Generator().manual_seed(1)
    lr = torch.randn(2, 7, generator=g, dtype=torch.float64) * 0.05
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 4:] = False
    lr[1, 4:] = 0.0
    adv = torch.ones(2, 7, dtype=torch.float64)
    gamma = 2 ** (-1 / 3.0)
    want = torch.ones_like(lr)
    for b in range(2):
        n = int(mask[b].sum())
        for t in range(n):
            fut = sum(gamma ** (k - t) * float(lr[b, k]) for k in range(t, n))
            want[b, t] = min(max(math.exp(fut), 0.8), 1.2)
    torch.testing.assert_close(future_kl_weights(lr, mask, adv, half_life=3.0, clip_high_only=False), want)
    # at the first update (logp = old logp) every weight is 1: FIPO's loss and gradient are PPO's
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    grads = []
    for fk in (None, {"half_life": 32.0}):
        lp = old.clone().requires_grad_(True)
        ppo_clip_loss(lp, old, torch.tensor([[1.0, -1.0, 0.5]]), torch.ones(1, 3, dtype=torch.bool), future_kl=fk).loss.backward()
        grads.append(lp.grad)
    torch.testing.assert_close(grads[0], grads[1])


# --- where an update puts the credit ----------------------------------------------------------------
def test_token_credit_by_hand():
    """Plain PPO, clip 0.2, advantages [1, 1, -1, 1] at ratios [1, 1.5, 0.5, 0.5]:
    token 0: ratio 1, unclipped -> credit A * ratio = 1;
    token 1: A > 0 and ratio 1.5 > 1.2: the clipped branch 1.2 wins -> no gradient, credit 0;
    token 2: A < 0 and ratio 0.5 < 0.8: -min(-0.5, -0.8) takes the clipped -0.8 -> credit 0;
    token 3: A > 0 and ratio 0.5: min(0.5, 0.8) = 0.5 unclipped -> credit 1 * 0.5 = 0.5;
    a padded position: 0. FIPO with half-life 1 token (gamma 0.5), clip-high only, on log-ratios
    0.1, -0.2, 0.3: f = [exp(0.1 + 0.5 * (-0.2 + 0.5 * 0.3)), 1, 1.2] = [exp(0.075), 1, 1.2];
    ratios exp(0.1), exp(-0.2), exp(0.3) = 1.35 > 1.2 with A = 1 clipped: credit [f0 * exp(0.1), exp(-0.2), 0]."""
    from train.loss import token_credit

    lp = torch.tensor([[0.0, math.log(1.5), math.log(0.5), math.log(0.5), 3.0]], dtype=torch.float64)
    old = torch.zeros_like(lp)
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, False]])
    torch.testing.assert_close(token_credit(lp, old, adv, mask), torch.tensor([[1.0, 0.0, 0.0, 0.5, 0.0]], dtype=torch.float64))

    lp = torch.tensor([[0.1, -0.2, 0.3]], dtype=torch.float64)
    got = token_credit(lp, torch.zeros_like(lp), torch.ones_like(lp), torch.ones(1, 3, dtype=torch.bool),
                       future_kl={"half_life": 1.0})
    torch.testing.assert_close(got, torch.tensor([[math.exp(0.075) * math.exp(0.1), math.exp(-0.2), 0.0]], dtype=torch.float64))
    # GRPO-λ at ratio 1 (kappa 0.5, recent) with A = 1: (1 + 0.5 + 0.25, 1 + 0.5, 1), trace_credit's values
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    got = token_credit(old, old, torch.ones_like(old), torch.ones(1, 3, dtype=torch.bool), ratio_trace=(0.5, "recent"))
    torch.testing.assert_close(got, torch.tensor([[1.75, 1.5, 1.0]], dtype=torch.float64))


@pytest.mark.parametrize("kw", [{}, {"ratio_trace": (0.9, "recent")}, {"ratio_trace": (0.7, "both")},
                                {"future_kl": {"half_life": 3.0, "clip_high_only": False}}])
def test_token_credit_is_minus_the_loss_gradient_times_the_token_count(kw):
    """Against autograd of the loss the trainer minimizes: under ``token-mean`` without a KL term,
    ``d(loss)/d(log pi_t) = -credit_t / n_tokens`` at ratios spread around the clip range."""
    from train.loss import token_credit

    g = torch.Generator().manual_seed(3)
    old = -torch.rand(3, 8, generator=g, dtype=torch.float64) * 3
    lp = (old + torch.randn(3, 8, generator=g, dtype=torch.float64) * 0.25).requires_grad_(True)
    adv = torch.randn(3, 8, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[1, 5:] = False
    mask[2, 1:] = False
    ppo_clip_loss(lp, old, adv, mask, loss_agg_mode="token-mean", **kw).loss.backward()
    credit = token_credit(lp, old, adv, mask, **kw)
    torch.testing.assert_close(credit, -lp.grad * mask.sum())
    assert lp.grad is not None and not credit.requires_grad
    with pytest.raises(ValueError, match="advantages has shape"):
        token_credit(lp, old, adv[:, :4], mask)


def test_credit_sums_average_each_token_over_the_passes():
    """Two responses of 3 and 1 tokens in one micro-batch (row 1 padded), passed twice (two PPO
    epochs): token means (1 + 3) / 2 = 2, (2 + 2) / 2 = 2, (0 + 6) / 2 = 3 and (5 + 7) / 2 = 6; the
    padded positions are never read. A third response never passed keeps 0 credit."""
    from train.trainer import CreditSums

    sums = CreditSums([3, 1, 2])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    sums.add(0, mask, torch.tensor([[1.0, 2.0, 0.0], [5.0, 99.0, 99.0]]))
    sums.add(0, mask, torch.tensor([[3.0, 2.0, 6.0], [7.0, 99.0, 99.0]]))
    assert sums.means() == [[2.0, 2.0, 3.0], [6.0], [0.0, 0.0]] and sums.passes.tolist() == [2, 2, 0]
    assert sums.sums.shape == (6,)  # one value per response token, no padding to the longest
    with pytest.raises(ValueError, match="example 2 has 2 response tokens; its micro-batch row masks 3"):
        sums.add(2, torch.ones(1, 3, dtype=torch.bool), torch.zeros(1, 3))


def test_loss_normalizer_by_hand_and_an_unknown_mode_named():
    from train.distributed import loss_normalizer

    mb = {"mask": torch.tensor([[1, 1, 0], [0, 0, 0]])}  # 2 response tokens, one response with a token
    assert loss_normalizer("token-mean", mb, 5) == 2.0
    assert loss_normalizer("seq-mean-token-mean", mb, 5) == 1.0
    assert loss_normalizer("seq-mean-token-sum-norm", mb, 5) == 2 * 5.0  # responses x the global length
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'sum'; valid: \\['token-mean'"):
        loss_normalizer("sum", mb, 5)


@pytest.mark.parametrize("mode, want", [
    ("token-mean", (1 - math.log(2)) / 3),  # one k3 of 1 - ln 2 over 3 tokens: 0.102284
    ("seq-mean-token-mean", ((1 - math.log(2)) / 1 + 0 / 2) / 2),  # mean of the rows' means: 0.153426
    ("seq-mean-token-sum-norm", (1 - math.log(2)) / (2 * 2)),  # over B x T = 2 x 2: 0.076713
])
def test_kl_to_the_reference_aggregates_over_uneven_rows_by_hand(mode, want):
    """Row 0 has one token whose reference log-prob is ln 2 above the policy's: k3 = e^(ln 2) - ln 2 - 1
    = 1 - ln 2 = 0.306853; row 1 has two tokens equal to the reference (k3 0) and no padding; row 0's
    padding holds a log-prob difference that must not count."""
    logp = torch.tensor([[-1.0, -5.0], [-0.5, -0.7]], dtype=torch.float64)
    ref = torch.tensor([[-1.0 + math.log(2), 3.0], [-0.5, -0.7]], dtype=torch.float64)
    mask = torch.tensor([[True, False], [True, True]])
    out = ppo_clip_loss(logp, logp.detach(), torch.zeros_like(logp), mask, loss_agg_mode=mode, ref_logprobs=ref,
                        kl_coef=0.1)
    assert round(1 - math.log(2), 6) == 0.306853
    assert float(out.kl_ref) == pytest.approx(want, abs=1e-12)
    assert float(out.loss) == pytest.approx(0.1 * want, abs=1e-12)  # zero advantages: the loss is the KL term
