"""How much of the fp32 update the exported checkpoint carries (the bf16 dead zone).

The trainer keeps fp32 master weights in the training state and exports the checkpoint that vLLM
and the eval load as their ``train.save_dtype`` cast (:func:`train.state.export_checkpoint`). A
bf16-valued start sits exactly on the bf16 grid, so a weight's cast moves only once its
accumulated update passes half a bf16 step (2^-9 to 2^-8 of its magnitude); AdamW at a small learning
rate moves a weight about ``lr`` per step, so over a short run most of the update never reaches the
engines (docs/benchmarks.md, "the bf16 dead zone"). The train stage records, per round, how much of
it did (:func:`checkpoint_drift`); ``benchmarks/bench_export_drift.py`` prints the same figures
per kind of tensor for any saved state.

The figures, over the weights matched by name (``d`` the fp32 update ``w - ref``, ``dc`` the
engine's update ``cast(w) - ref_engine``, sums over all elements):

- ``share_moved_fp32`` / ``share_moved_cast``: fraction of elements with ``d != 0`` / ``dc != 0``;
- ``l2_update_fp32`` / ``l2_update_cast``: ``|d|`` and ``|dc|``;
- ``cosine``: ``<d, dc> / (|d| |dc|)``;
- ``slope_cast_on_fp32``: ``<d, dc> / <d, d>``, the regression slope of the engine's update on the
  fp32 one: 1 when the cast carries the update at full size on average, 0 when none of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_SUMS = ("n", "moved", "moved_cast", "dd", "cc", "dc")


def canonical_name(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (DDP ``module.``, ``torch.compile``'s
    ``_orig_mod.``, PEFT's ``base_model.model.``), as the checkpoints on disk name it."""
    prefixes = ("module.", "_orig_mod.", "base_model.model.")
    while name.startswith(prefixes):  # in any order and nesting (compile outside DDP, ...)
        name = next(name.removeprefix(p) for p in prefixes if name.startswith(p))
    return name


def update_sums(acc: dict[str, float], ref: torch.Tensor, w: torch.Tensor, cast: torch.dtype,
                ref_engine: torch.Tensor | None = None, chunk: int = 1 << 22) -> None:
    """Add one tensor's fp32 update and its cast's update to the running sums ``acc``.

    Args:
        acc: running sums ``n, moved, moved_cast, dd, cc, dc`` (created as zeros when missing).
        ref: the master weights before the update, any shape (float).
        w: the master weights after it, the same shape as ``ref``.
        cast: the export dtype (``train.save_dtype``).
        ref_engine: the engine's weights before the update (the previous checkpoint), the same
            shape; ``None`` means ``ref`` cast to ``cast`` (what an engine loading ``ref`` in the
            export dtype has: for a bf16-valued start and a bf16 export, ``ref`` itself).
        chunk: elements per slice (bounds the temporaries: about 80 MB for 4 Mi elements; the
            whole ``ref`` tensors are read first).

    Raises:
        ValueError: when the shapes differ (naming them).
    """
    sums_against(w, [(acc, ref, ref_engine)], cast, chunk)


def sums_against(w: torch.Tensor, refs: list[tuple[dict, torch.Tensor, torch.Tensor | None]], cast: torch.dtype,
                 chunk: int = 1 << 22) -> None:
    """:func:`update_sums` of one ``w`` against several ``(acc, ref, ref_engine)`` at once: one cast
    of ``w`` per slice, computed on ``w``'s device (the references are moved there slice by slice).

    Raises:
        ValueError: when a reference's shape differs from ``w``'s (naming which), before any sum changes.
    """
    for j, (_, ref, ref_engine) in enumerate(refs):
        for what, t in (("master", ref), ("engine", ref_engine)):
            if t is not None and t.shape != w.shape:
                raise ValueError(f"reference {j}: {what} shape {tuple(t.shape)} != trained shape {tuple(w.shape)}")
    flat = []
    for acc, ref, ref_engine in refs:
        for k in _SUMS:
            acc.setdefault(k, 0.0)
        acc["n"] += w.numel()
        flat.append((acc, ref.detach().reshape(-1), None if ref_engine is None else ref_engine.detach().reshape(-1)))
    dev = w.device
    w = w.detach().reshape(-1)
    for i in range(0, w.numel(), chunk):
        wi = w[i:i + chunk].float()
        wc = wi.to(cast).float()
        for acc, ref, ref_engine in flat:
            # float32 differences of nearby floats are exact (Sterbenz) and zero only for equal weights
            r = ref[i:i + chunk].to(dev, torch.float32)
            d = wi - r
            e = r.to(cast).float() if ref_engine is None else ref_engine[i:i + chunk].to(dev, torch.float32)
            dc = wc - e
            acc["moved"] += int(torch.count_nonzero(d))
            acc["moved_cast"] += int(torch.count_nonzero(dc))
            acc["dd"] += float(torch.dot(d, d))
            acc["cc"] += float(torch.dot(dc, dc))
            acc["dc"] += float(torch.dot(d, dc))


def summarize(acc: dict[str, float]) -> dict[str, float]:
    """The figures of the module docstring from :func:`update_sums`' sums (NaN ratios for no update).

    Raises:
        ValueError: when the sums cover no element.
    """
    if not acc.get("n"):
        raise ValueError("no weights were compared: the sums are empty")
    nan = float("nan")
    return {
        "elements": int(acc["n"]),
        "share_moved_fp32": acc["moved"] / acc["n"],
        "share_moved_cast": acc["moved_cast"] / acc["n"],
        "l2_update_fp32": acc["dd"] ** 0.5,
        "l2_update_cast": acc["cc"] ** 0.5,
        "cosine": acc["dc"] / (acc["dd"] * acc["cc"]) ** 0.5 if acc["dd"] > 0 and acc["cc"] > 0 else nan,
        "slope_cast_on_fp32": acc["dc"] / acc["dd"] if acc["dd"] > 0 else nan,
    }


class WeightFiles:
    """The tensors of a checkpoint directory's ``*.safetensors`` files (one file or shards; an
    Accelerate state's ``model.safetensors``), read one tensor at a time, by canonical name.

    Raises:
        FileNotFoundError: when ``path`` holds no ``.safetensors`` file (naming it).
    """

    def __init__(self, path: Path | str):
        from safetensors import safe_open

        path = Path(path)
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors")) if path.is_dir() else []
        if not files:
            raise FileNotFoundError(f"no .safetensors file under {path}: pass a model directory, a train_state "
                                    "directory or the file")
        self.path = path
        self._handles = [safe_open(str(f), "pt") for f in files]
        self._where = {canonical_name(k): (h, k) for h in self._handles for k in h.keys()}

    def __contains__(self, name: str) -> bool:
        return canonical_name(name) in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        h, k = self._where[canonical_name(name)]
        return h.get_tensor(k)


def checkpoint_drift(named: Iterable[tuple[str, torch.Tensor]], save_dtype: str, start: Path | str,
                     prev_master: Path | str | None = None, prev_engine: Path | str | None = None) -> dict[str, float]:
    """The round's and the run's share of the fp32 update that the exported checkpoint carries.

    Args:
        named: the master weights after the round's update, ``(name, tensor)`` (a model's
            ``state_dict().items()`` or Accelerate's gathered state dict), any dtype.
        save_dtype: ``train.save_dtype``, one of ``bfloat16``, ``float16``, ``float32``.
        start: the starting policy's checkpoint directory (its weights are the run's reference for
            both the master and the engine).
        prev_master / prev_engine: round k-1's training state and checkpoint directories; both
            ``None`` for round 1, whose reference is ``start``.

    Returns:
        ``master_moved_frac`` / ``export_moved_frac`` (this round: fraction of elements whose
        master weight / exported weight changed, 0 when none did), ``export_update_share`` (this
        round: :func:`summarize`'s slope of the checkpoint's change on the master's change) and
        ``export_update_share_from_start`` (the same slope for everything since the start); the
        two shares are NaN when the master did not move. The run's engine reference is the
        start's cast to ``save_dtype``.

    Raises:
        ValueError: an unknown ``save_dtype``; ``prev_master`` without ``prev_engine`` or the
            reverse; no weight of ``named`` found by name in all of the references (naming which
            lack it); a reference whose shape differs from the weight's.
        FileNotFoundError: a directory without ``.safetensors`` files.
    """
    if save_dtype not in DTYPES:
        raise ValueError(f"save_dtype {save_dtype!r} is not one of {sorted(DTYPES)}")
    if (prev_master is None) != (prev_engine is None):
        raise ValueError(f"prev_master and prev_engine go together: both for round k > 1, neither for round 1; got "
                         f"prev_master={prev_master!r}, prev_engine={prev_engine!r}")
    cast = DTYPES[save_dtype]
    s = WeightFiles(start)
    m = WeightFiles(prev_master) if prev_master is not None else None
    e = WeightFiles(prev_engine) if prev_engine is not None else None
    rnd: dict[str, float] = {}
    run: dict[str, float] = {}
    for name, w in named:
        if name not in s or (m is not None and (name not in m or name not in e)):
            continue  # buffers, tied copies, LoRA adapters: not an exported weight of the start
        refs = [(run, s.get(name), None)] + ([] if m is None else [(rnd, m.get(name), e.get(name))])
        sums_against(w, refs, cast)
    if not run:
        refs = [s] + ([m, e] if m is not None else [])
        raise ValueError(f"no weight matched by name in all of {[str(x.path) for x in refs]} (first names: "
                         + "; ".join(f"{x.path.name}: {x.names()[:3]}" for x in refs) + ")")
    total = summarize(run)
    r = total if m is None else summarize(rnd)  # round 1: the round is the run
    return {"master_moved_frac": r["share_moved_fp32"], "export_moved_frac": r["share_moved_cast"],
            "export_update_share": r["slope_cast_on_fp32"],
            "export_update_share_from_start": total["slope_cast_on_fp32"]}
