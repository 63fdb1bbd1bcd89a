"""Per-token log-probs of the sampled responses under the policy, at the sampling temperature
(docs/design.md §1.9), without materializing the (B, T, V) logits: the output head is applied
``LOGPROB_CHUNK`` positions at a time with a hand-written backward (:class:`HeadLogProbs`)."""

from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger("capo.train")


LOGPROB_CHUNK = 128
"""Response positions per chunk of the vocabulary log-softmax in :func:`token_logprobs`."""


def _tempered_logprobs(logits: torch.Tensor, target: torch.Tensor, inv_temp: float, entropy: bool = False):
    """(B, C, V) logits, (B, C) targets -> (B, C) fp32 log-softmax of ``logits * inv_temp`` at the
    targets (and, with ``entropy``, the (B, C) entropy in nats of that distribution:
    ``logsumexp(z) - sum(softmax(z) * z)``)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) * inv_temp  # fp32 (fp64 stays fp64)
    lse = torch.logsumexp(z, dim=-1)
    lp = z.gather(-1, target.unsqueeze(-1)).squeeze(-1) - lse
    if not entropy:
        return lp
    return lp, lse - (torch.softmax(z, dim=-1) * z).sum(-1)


def _chunk_logprobs(logits: torch.Tensor, idx: torch.Tensor, target: torch.Tensor, inv_temp: float,
                    entropy: bool = False):
    """(B, L', V) logits, (B, C) positions into them, (B, C) targets -> :func:`_tempered_logprobs`
    of those positions."""
    sel = torch.gather(logits, 1, idx.unsqueeze(-1).expand(-1, -1, logits.size(-1)))  # (B, C, V)
    return _tempered_logprobs(sel, target, inv_temp, entropy)


def _chunk_head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, idx: torch.Tensor,
                         target: torch.Tensor, inv_temp: float, autocast: tuple | None, entropy: bool = False):
    """(B, L', H) final hidden states, the output head's (V, H) weight and (V,) bias, (B, C)
    positions, (B, C) targets -> :func:`_tempered_logprobs` of ``hidden @ weight.T + bias`` at those
    positions: the logits of C positions only, under the autocast the model's forward ran in
    (``autocast``: (device type, dtype), or None)."""
    h = torch.gather(hidden, 1, idx.unsqueeze(-1).expand(-1, -1, hidden.size(-1)))  # (B, C, H)
    ctx = torch.autocast(autocast[0], dtype=autocast[1]) if autocast else contextlib.nullcontext()
    with ctx:
        logits = torch.nn.functional.linear(h, weight, bias)  # (B, C, V)
    return _tempered_logprobs(logits, target, inv_temp, entropy)


class HeadLogProbs(torch.autograd.Function):
    """Tempered log-probs of the targets under the output head, chunk by chunk, with a hand-written
    backward that never holds more than one (B, chunk, V) block and accumulates the head's weight
    gradient in place in one (V, H) buffer (autograd would allocate a (V, H) gradient per chunk
    and sum them: +0.55 GB per chunk in flight for Qwen2.5-0.5B's 151,936 x 896 head).

    Forward: (B, L', H) ``hidden``, (V, H) ``weight``, (V,) ``bias`` or None, (B, T) ``idx`` into
    L', (B, T) ``target`` -> (B, T) log-probs (:func:`_chunk_head_logprobs` per chunk, under the
    forward's ``autocast``). Backward, with z = (hidden @ weight.T + bias) * inv_temp and
    lp = z[target] - logsumexp(z): d lp / d logits = inv_temp * (onehot(target) - softmax(z)),
    so per chunk G = grad_lp * that (B, C, V); d hidden = G @ weight, d weight += G^T @ h,
    d bias += sum G (the gradients in fp32, or the weight's dtype when wider).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, idx, target, inv_temp, chunk, autocast):
        out = [_chunk_head_logprobs(hidden, weight, bias, idx[:, c0:c0 + chunk], target[:, c0:c0 + chunk],
                                    inv_temp, autocast) for c0 in range(0, idx.size(1), chunk)]
        ctx.save_for_backward(hidden, weight, bias, idx, target)
        ctx.inv_temp, ctx.chunk, ctx.autocast = inv_temp, chunk, autocast
        return torch.cat(out, dim=1) if out else hidden.new_zeros(idx.shape, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad_lp):
        hidden, weight, bias, idx, target = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = torch.promote_types(weight.dtype, torch.float32)
        gh = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        gb = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b and bias is not None else None
        B, H, V = hidden.size(0), hidden.size(-1), weight.size(0)
        w = weight.to(acc)
        for c0 in range(0, idx.size(1), ctx.chunk):
            ix, tg = idx[:, c0:c0 + ctx.chunk], target[:, c0:c0 + ctx.chunk]
            g = grad_lp[:, c0:c0 + ctx.chunk].to(acc)  # (B, C)
            h = torch.gather(hidden, 1, ix.unsqueeze(-1).expand(-1, -1, H))  # (B, C, H)
            ac = torch.autocast(ctx.autocast[0], dtype=ctx.autocast[1]) if ctx.autocast else contextlib.nullcontext()
            # an ambient autocast (``loss.backward()`` called inside ``with autocast``) must not recast
            # the fp32 accumulation below: only the recomputed logits take the forward's autocast
            with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
                with ac:
                    logits = torch.nn.functional.linear(h, weight, bias)  # (B, C, V), as in forward
                G = torch.softmax(logits.to(acc) * ctx.inv_temp, dim=-1)
                del logits
                G.mul_(-g.unsqueeze(-1)).scatter_add_(-1, tg.unsqueeze(-1), g.unsqueeze(-1)).mul_(ctx.inv_temp)
                G2 = G.view(-1, V)
                if gw is not None:
                    gw.addmm_(G2.t(), h.reshape(-1, H).to(acc))
                if gb is not None:
                    gb.add_(G2.sum(0))
                if gh is not None:
                    gh.scatter_add_(1, ix.unsqueeze(-1).expand(-1, -1, H), (G2 @ w).view(B, -1, H))
                del G, G2
        return (gh.to(hidden.dtype) if gh is not None else None, gw.to(weight.dtype) if gw is not None else None,
                gb.to(bias.dtype) if gb is not None else None, None, None, None, None, None)


def output_head(model) -> torch.nn.Linear | None:
    """The model's output head (a plain ``nn.Linear``, possibly tied to the input embedding) through
    DDP/DeepSpeed (``.module``) and peft wrappers, or None when it has another form."""
    m = model
    while isinstance(getattr(m, "module", None), torch.nn.Module):
        m = m.module
    if getattr(getattr(m, "config", None), "final_logit_softcapping", None):
        return None  # Gemma 2 squashes the logits after the head (tanh): the head is not the last step
    get = getattr(m, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if type(head) is torch.nn.Linear else None

@contextlib.contextmanager
def head_bypassed(head: torch.nn.Linear, seen: dict):
    """Make ``head`` return its input (the final hidden states) for the duration, recording in
    ``seen["autocast"]`` the autocast (device type, dtype) active inside the model's forward (None
    when off), so the caller applies the head itself, chunk by chunk, in the same precision."""
    def passthrough(x):
        dt = x.device.type
        seen["autocast"] = (dt, torch.get_autocast_dtype(dt)) if torch.is_autocast_enabled(dt) else None
        return x

    before = head.__dict__.get("forward")  # e.g. an Accelerate hook (device_map / offload) to restore
    head.forward = passthrough  # an instance attribute shadows nn.Linear.forward
    try:
        yield
    finally:
        if before is None:
            del head.forward
        else:
            head.forward = before


def _forward_from_first_response(model, mb: dict[str, torch.Tensor], dev: torch.device, fuse_head: bool
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Linear | None, dict]:
    """(B, keep, H or V) output from the first response position, (B, T) indices into it, the head, the autocast."""
    pos = mb["pos"].to(dev)
    L = mb["input_ids"].size(1)
    first = int(pos[mb["mask"].to(dev)].min()) if bool(mb["mask"].any()) else L - 1
    keep = L - first  # logits for positions first .. L-1
    head = output_head(model) if fuse_head else None
    seen: dict = {}
    with head_bypassed(head, seen) if head is not None else contextlib.nullcontext():
        out_t = model(input_ids=mb["input_ids"].to(dev), attention_mask=mb["attention_mask"].to(dev),
                      logits_to_keep=keep).logits  # (B, keep, H) hidden states with the head bypassed, else (B, keep, V)
    if out_t.size(1) != keep:  # a model that ignores logits_to_keep returns every position
        out_t = out_t[:, -keep:]
    rel = (pos - first).clamp(min=0)  # (B, T) index into the kept positions
    return out_t, rel, head, seen


def _chunk_loop(fn, args: tuple, extra: tuple, rel: torch.Tensor, target: torch.Tensor, inv_temp: float, chunk: int,
                grad: bool, with_entropy: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The (B, C) log-prob blocks of ``fn``, ``chunk`` positions at a time, and the entropy blocks (nats) if asked."""
    out, ent = [], []
    for c0 in range(0, rel.size(1), chunk):
        idx, tgt = rel[:, c0:c0 + chunk], target[:, c0:c0 + chunk]
        if grad:  # the model's own logits: recompute each block's log-softmax in backward
            from torch.utils.checkpoint import checkpoint

            out.append(checkpoint(fn, *args, idx, tgt, inv_temp, *extra, use_reentrant=False))
        elif with_entropy:
            lp_c, ent_c = fn(*args, idx, tgt, inv_temp, *extra, entropy=True)
            out.append(lp_c)
            ent.append(ent_c)
        else:
            out.append(fn(*args, idx, tgt, inv_temp, *extra))
    return out, ent


def token_logprobs(model, mb: dict[str, torch.Tensor], temperature: float = 1.0,
                   chunk: int = LOGPROB_CHUNK, with_entropy: bool = False, fuse_head: bool = True):
    """(B, T) log-prob (nats) of each response token under ``model`` at sampling ``temperature``
    (0 at padding).

    The log-probs are those of the distribution the rollout engine sampled from:
    ``log_softmax(logits / temperature)`` (temperature 0, greedy, counts as 1). Top-p/top-k
    truncation is not applied, as in verl and TRL: the truncated distribution is undefined outside
    the nucleus and the PPO ratio uses the untruncated one.

    Memory: the model runs only from the first response position on (``logits_to_keep``) and,
    with ``fuse_head`` (the default, where the output head is a plain ``nn.Linear`` with whole
    weights), returns its final hidden states instead of logits: the output head and the fp32
    log-softmax are applied ``chunk`` positions at a time, so the (B, T', V) logits never exist
    (V = 151,936 for Qwen2.5: 0.39 GB of fp32 logits and as much again for their gradient in a
    micro-batch of 2 x 320 tokens); at most one (B, chunk, V) block is alive, in the backward too
    (:class:`HeadLogProbs` recomputes each block and accumulates the head's weight gradient in
    place). The chunked scheme of Liger-Kernel's and Apple's cut-cross-entropy fused linear losses,
    in plain PyTorch (it runs on any device). Without ``fuse_head`` (FSDP / ZeRO-3, whose head
    weight is a shard outside the forward) the model's own (B, T', V) logits are chunked instead,
    each block's log-softmax recomputed in backward (activation checkpointing).

    Args:
        model: a causal LM (plain, prepared by Accelerate, or peft-wrapped) taking ``logits_to_keep``.
        mb: a :func:`collate` micro-batch (``input_ids``/``attention_mask`` (B, L), ``pos``/``target``/
            ``mask`` (B, T)).
        temperature: the rollout's sampling temperature (``rollout.sampling.temperature``).
        chunk: response positions per log-softmax block.
        with_entropy: also return the (B, T) entropy (nats) of each position's tempered
            distribution (no-grad passes only).
        fuse_head: apply the output head chunk by chunk (ignored when the model has no plain
            ``nn.Linear`` head); pass False when parameters are sharded (FSDP, ZeRO-3).

    Returns:
        (B, T) log-probs, or ``(log-probs, entropies)`` with ``with_entropy``.

    Raises:
        ValueError: ``with_entropy`` on a pass that records gradients.
    """
    dev = next(model.parameters()).device
    out_t, rel, head, seen = _forward_from_first_response(model, mb, dev, fuse_head)
    target = mb["target"].to(dev)
    inv_temp = 1.0 / temperature if temperature > 0 else 1.0
    grad = torch.is_grad_enabled() and out_t.requires_grad
    if with_entropy and grad:
        raise ValueError("token_logprobs(with_entropy=True) is for no-grad passes")
    mask = mb["mask"].to(dev)
    if grad and head is not None:  # one Function over all chunks, with a hand-written chunked backward
        return HeadLogProbs.apply(out_t, head.weight, head.bias, rel, target, inv_temp, chunk,
                                   seen.get("autocast")) * mask
    if head is not None:
        fn, args = _chunk_head_logprobs, (out_t, head.weight, head.bias)
        extra: tuple = (seen.get("autocast"),)
    else:
        fn, args, extra = _chunk_logprobs, (out_t,), ()
    out, ent = _chunk_loop(fn, args, extra, rel, target, inv_temp, chunk, grad, with_entropy)
    lp = torch.cat(out, dim=1) if out else torch.zeros(rel.shape, device=dev)
    if with_entropy:
        return lp * mask, (torch.cat(ent, dim=1) if ent else torch.zeros(rel.shape, device=dev)) * mask
    return lp * mask
