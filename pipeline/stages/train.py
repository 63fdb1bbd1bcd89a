"""Stage ``train``: one PPO-style update of the policy on the round's token rewards -> ``checkpoint``.

The stage's function is :func:`train.trainer.train_stage` (``pipeline`` never imports ``train``: it
is named in the record and imported only when the stage runs). This module holds what the runner and
the keys need: the key, which chains through the previous round's training state
(:func:`previous_state_fp`), and the record.
"""

from __future__ import annotations

from pipeline import storage
from pipeline.config import CAPOConfig
from pipeline.stages.base import (
    Stage,
    input_fp,
    model_fingerprint,
    policy_for_round,
    round_paths,
)


def previous_state_fp(cfg: CAPOConfig, round_idx: int) -> str | None:
    """Fingerprint of the training state round ``round_idx`` starts from: None for round 1 (the
    starting policy, a fresh optimizer), else round k-1's ``train_state`` of the same variant, read
    from its manifest (which outlives a state pruned by ``train.keep_states``).

    Raises:
        FileNotFoundError: round k-1 of this variant committed no training state.
    """
    if round_idx <= 1:
        return None
    prev = round_paths(cfg, round_idx - 1)["train_state"]
    man = storage.read_manifest(prev)
    if man is None:
        raise FileNotFoundError(
            f"round {round_idx} of variant {cfg.variant!r} continues from round {round_idx - 1}'s training state "
            f"{prev}, which was never committed: run round {round_idx - 1} first (capo round --round "
            f"{round_idx - 1}); a run trained by a version without carried training state must be re-trained "
            "from round 1 (or start a new run_id)")
    return f"{man['key_hash']}:{man['fingerprint']}"  # the key chains through every earlier round's state


def train_settings_key(cfg: CAPOConfig) -> dict:
    """The ``train`` settings that the checkpoint depends on: every field but ``launcher`` and
    ``keep_states`` (how and where it runs, how many states it keeps), and ``deterministic`` only
    when true (a setting added later must not make the runs trained before it stale)."""
    return {k: v for k, v in cfg.model_dump(mode="json")["train"].items()
            if k not in ("launcher", "keep_states") and not (k == "deterministic" and not v)}


def train_key(cfg: CAPOConfig, round_idx: int) -> dict:
    """What the checkpoint depends on: rollouts, token rewards, the training state it
    continues from, train settings (not the launcher or retention), resolved precision, policy, seed."""
    from pipeline.precision import precision_record

    p = round_paths(cfg, round_idx)
    prec = precision_record(cfg)
    return {"rollouts": input_fp(p["rollouts"]), "token_rewards": input_fp(p["token_rewards"]),
            "state": previous_state_fp(cfg, round_idx),
            "train": train_settings_key(cfg),
            "mixed_precision": prec["train_mixed_precision"], "save_dtype": prec["train_save_dtype"],
            "policy": model_fingerprint(policy_for_round(cfg, round_idx)), "seed": cfg.seed}


STAGE = Stage("train", ("rollouts", "token_rewards"), ("checkpoint", "train_metrics"), True, train_key,
              "train.trainer:train_stage", engine_env=True, launcher=lambda cfg: cfg.train.launcher,
              launch_module="train.trainer")
