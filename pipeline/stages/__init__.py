"""The stages of a CAPO round, one module each, and the registry that lists them (docs/design.md §2).

    rollout -> verify -> segment -> mc -> densr -> critique -> vote -> reward -> train -> eval

(``mc``, the Monte Carlo step values, runs only for ``reward.estimator: vineppo``; ``densr``, the
hidden-state divergences, only for ``reward.estimator: densr``.)

Each stage module declares one :class:`~pipeline.stages.base.Stage` record (``STAGE``): its input and
output tables, whether it is heavy (loads a model, so the flows run it in a child process), its key
and the function that computes it. Every stage computes a *key* (the config sections it depends on,
the fingerprints of its input tables, model ids, template version; the code version is recorded but
not keyed) and skips itself when its outputs are current under that key
(:func:`pipeline.storage.is_current`). The runner (:mod:`flows.runner`) reads :data:`REGISTRY`; the
stage functions do not care who calls them. Adding a stage: one module with its function, key and
``STAGE``, and its name in the tuple below.
"""

from __future__ import annotations

from pipeline.stages import (
    critique,
    densr,
    eval,
    mc,
    reward,
    rollout,
    segment,
    train,
    verify,
    vote,
)
from pipeline.stages.base import Stage

REGISTRY: dict[str, Stage] = {m.STAGE.name: m.STAGE for m in (
    rollout, verify, segment, mc, densr, critique, vote, reward, train, eval)}
"""Every stage, in the order a round runs them (docs/architecture.md). ``eval`` runs after the
training stages for the round's policy (and with round 1 for round 0, the starting policy:
:func:`pipeline.stages.eval.eval_rounds`; :func:`round_plan`)."""

STAGES = tuple(name for name in REGISTRY if name != "eval")
"""The stages of a training round, in order; ``eval`` follows them."""
HEAVY_STAGES = tuple(name for name, s in REGISTRY.items() if s.heavy)


def round_plan(round_idx: int) -> list[tuple[str, int]]:
    """``(stage, round)`` in the order a round runs them: every stage of :data:`REGISTRY` for each
    round of its :attr:`Stage.rounds` (the training stages for ``round_idx``, then the evals of
    round ``round_idx`` and, with round 1, of round 0). The one sequence the flow, the CLI and
    bench_round use."""
    return [(name, k) for name, s in REGISTRY.items() for k in s.rounds(round_idx)]


def get_stage(name: str) -> Stage:
    """The registry entry of stage ``name``.

    Raises:
        ValueError: unknown stage (lists the valid ones).
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown stage {name!r}; valid: {list(REGISTRY)}") from None


def stage_key(stage: str, cfg, round_idx: int) -> dict:
    """The key of ``stage`` (what its output depends on): :attr:`Stage.key` of its registry entry.

    Raises:
        ValueError: unknown stage (lists the valid ones).
        FileNotFoundError: an input of the stage has not been committed.
    """
    return get_stage(stage).key(cfg, round_idx)
