"""The stages of a CAPO round, each a function from files to files (docs/design.md §2).

    rollout -> verify -> segment -> critique -> vote -> reward -> train -> eval

:data:`REGISTRY` holds one :class:`Stage` record per stage: its input and output tables, whether
it is heavy (loads a model, so the flows run it in a child process), its key and the function
that computes it. Every stage computes a *key* (the config sections it depends on, the
fingerprints of its input tables, model ids, template version; the code version is recorded but
not keyed) and skips itself when its outputs are current under that key
(:func:`pipeline.storage.is_current`). The runner (:mod:`flows.runner`) reads the registry; the
stage functions do not care who calls them. Adding a stage: its function, its key function here
and one :class:`Stage` line in :data:`REGISTRY`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline import storage
from pipeline.config import CAPOConfig, section_hash

log = logging.getLogger("capo.stages")


RESULT_TAG = "CAPO_STAGE_RESULT "
"""A stage child prints its :class:`StageResult` as one JSON line after this tag (read by
:func:`flows.children.stream_child`)."""


@dataclass(frozen=True)
class StageResult:
    """What a stage did: ``skipped`` with the reason, or ran and wrote ``rows`` rows."""

    stage: str
    path: str
    skipped: bool
    reason: str
    rows: int | None = None
    seconds: float = 0.0
    critic_calls: int = 0  # critic requests this stage made (0 when critiques came from the cache)
    peak_rss_mb: float | None = None  # peak resident memory, MiB: the stage's child process (heavy stages) or
    # the orchestrator plus its children while the stage ran (light stages, sampled every 50 ms)

    def line(self) -> str:
        verb = "skipped" if self.skipped else f"wrote {self.rows} rows in {self.seconds:.1f}s"
        return f"[{self.stage}] {verb}: {self.reason}"


# ------------------------------------------------------------------------------------------- paths
def round_paths(cfg: CAPOConfig, round_idx: int) -> dict[str, Path]:
    """Every output path of round ``round_idx`` of ``cfg``'s run (and ``cfg.variant``)."""
    rd = cfg.round_dir(round_idx)
    vd = rd / "variants" / cfg.variant
    paths = {name: rd / f"{name}.parquet" for name in ("rollouts", "outcomes", "steps")}
    crit = "critiques" if cfg.critique.mode == "process" else "genorm_critiques"
    paths.update(critiques=rd / f"{crit}.parquet", step_verdicts=vd / "step_verdicts.parquet",
                 token_rewards=vd / "token_rewards.parquet", train_metrics=vd / "train_metrics.parquet",
                 checkpoint=vd / "checkpoint", train_state=vd / "train_state", round_dir=rd, variant_dir=vd,
                 run_summary=vd / "round_summary.json",
                 eval=(rd if round_idx == 0 else vd) / "eval.parquet")  # round 0: the starting policy, shared
    return paths


def input_fp(path: Path) -> str:
    """Fingerprint of a committed input table, from its manifest.

    Raises:
        FileNotFoundError: the input has not been committed (names the table).
    """
    man = storage.read_manifest(path)
    if man is None or not path.exists():
        raise FileNotFoundError(f"input {path} is missing or was never committed; run its stage first")
    return man["fingerprint"]


def run_table_stage(stage: str, out: Path, name: str, key: dict, compute, force: bool = False) -> StageResult:
    """The common body of a one-table stage: skip when ``out`` is current under ``key`` (unless
    ``force``), else call ``compute() -> (table, extra manifest fields)`` and write the table as
    schema ``name`` (:func:`pipeline.storage.write_table`) with its elapsed seconds."""
    cur = storage.is_current(out, key)
    if cur.current and not force:
        res = StageResult(stage, str(out), True, cur.reason)
        log.info(res.line())
        return res
    log.info("[%s] running: %s", stage, cur.reason)
    t0 = time.perf_counter()
    table, extra = compute()
    secs = time.perf_counter() - t0
    man = storage.write_table(table, out, name, stage=stage, key=key,
                              extra={"elapsed_s": round(secs, 3), **(extra or {})})
    res = StageResult(stage, str(out), False, cur.reason, man["rows"], secs)
    log.info(res.line())
    return res


# ---------------------------------------------------------------------------------- policy/prompts
def data_root(cfg: CAPOConfig) -> Path:
    return Path(cfg.data_dir).resolve()


def resolve_model(name_or_path: str, cfg: CAPOConfig, dtype: str = "bfloat16") -> str:
    """Embedded model name -> its converted checkpoint dir; anything else is returned unchanged."""
    from pipeline.assets.models import EMBEDDED_MODELS, ensure_model

    if name_or_path in EMBEDDED_MODELS:
        return str(ensure_model(name_or_path, root=data_root(cfg) / "models", dtype=dtype))
    return name_or_path


def model_fingerprint(model: str) -> str:
    p = Path(model)
    return storage.dir_fingerprint(p) if p.is_dir() else f"id:{model}"


def policy_for_round(cfg: CAPOConfig, round_idx: int) -> str:
    """Round 1 samples from ``rollout.policy``; round k > 1 from round k-1's checkpoint.

    Raises:
        FileNotFoundError: round k-1 has not written its checkpoint.
    """
    if round_idx < 1:
        raise ValueError(f"round {round_idx} has no rollouts: round 0 is the starting policy, only evaluated")
    if round_idx == 1:
        return resolve_model(cfg.rollout.policy, cfg)
    prev = round_paths(cfg, round_idx - 1)["checkpoint"]
    if storage.read_manifest(prev) is None:
        raise FileNotFoundError(
            f"round {round_idx} samples from round {round_idx - 1}'s checkpoint {prev}, which does not "
            f"exist yet: run round {round_idx - 1} first (capo round --round {round_idx - 1})")
    return str(prev)


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


def prompts_path(cfg: CAPOConfig) -> Path:
    """The prompt table of ``data.train_prompts`` (embedded GSM8K is ingested on first use)."""
    from pipeline.assets.prompts import ensure_embedded_prompts, ingest_prompts

    src, split = cfg.data.train_prompts, cfg.data.train_split
    root = data_root(cfg) / "prompts"
    if src == "gsm8k":
        return ensure_embedded_prompts(root)[f"gsm8k_{split}"]
    if Path(src).is_file():  # a local file: the table is named by its content, so an edit re-ingests
        out = root / f"{Path(src).stem}-{storage.file_sha256(Path(src))[:12]}_{split}.parquet"
    else:
        out = root / f"{src.replace('/', '_')}_{split}.parquet"
    if not out.exists():
        ingest_prompts(src, split, out)
    return out


def select_prompt_indices(n_prompts: int, per_round: int, round_idx: int, seed: int) -> np.ndarray:
    """Indices of the prompts of round ``round_idx`` (1-based).

    A seeded permutation per epoch; rounds take consecutive slices, so prompts do not repeat until
    the training set is used up, then a new epoch (a new permutation) starts.
    """
    if per_round > n_prompts:
        raise ValueError(f"data.prompts_per_round={per_round} exceeds the {n_prompts} prompts available")
    start, stop = (round_idx - 1) * per_round, round_idx * per_round
    out = []
    for pos in range(start, stop):
        epoch, off = divmod(pos, n_prompts)
        perm = np.random.default_rng([seed, epoch]).permutation(n_prompts)
        out.append(perm[off])
    return np.asarray(out, dtype=np.int64)


# -------------------------------------------------------------------------------------------- keys
# ------------------------------------------------------------------------------------ stage keys
# What each stage's output depends on (inputs must already be committed). ``auto`` dtypes enter as
# resolved (:func:`pipeline.precision.precision_record`): bf16 on one machine, fp32 on another.
def _rollout_key(cfg: CAPOConfig, round_idx: int) -> dict:
    from pipeline.precision import precision_record

    c = cfg.model_dump(mode="json")
    return {"round": round_idx, "seed": cfg.seed, "data": c["data"], "rollout": c["rollout"],
            "dtype": precision_record(cfg)["rollout_dtype"], "engine_logprobs": "processed",  # after temperature/top-p
            "policy": model_fingerprint(policy_for_round(cfg, round_idx)),
            "prompts": storage.file_sha256(prompts_path(cfg))}


def _verify_key(cfg: CAPOConfig, round_idx: int) -> dict:
    from importlib.metadata import version

    return {"rollouts": input_fp(round_paths(cfg, round_idx)["rollouts"]),
            "prompts": storage.file_sha256(prompts_path(cfg)), "verifier": f"math-verify=={version('math-verify')}"}


def _segment_key(cfg: CAPOConfig, round_idx: int) -> dict:
    return {"rollouts": input_fp(round_paths(cfg, round_idx)["rollouts"]), "steps": cfg.model_dump(mode="json")["steps"]}


def _critique_key(cfg: CAPOConfig, round_idx: int) -> dict:
    from pipeline.core.critique import PARSER_VERSION
    from pipeline.precision import precision_record

    p = round_paths(cfg, round_idx)
    crit = {k: v for k, v in cfg.model_dump(mode="json")["critique"].items() if k not in ("batch_rollouts", "template")}
    return {"steps": input_fp(p["steps"]), "rollouts": input_fp(p["rollouts"]), "critique": crit,
            "template_version": cfg.critique.template, "parser": PARSER_VERSION,
            "prompts": storage.file_sha256(prompts_path(cfg)), "dtype": precision_record(cfg)["critique_dtype"],
            "critic": model_fingerprint(resolve_model(cfg.critique.critic, cfg))}


def _vote_key(cfg: CAPOConfig, round_idx: int) -> dict:
    p = round_paths(cfg, round_idx)
    return {"steps": input_fp(p["steps"]), "critiques": input_fp(p["critiques"]),
            "majority_threshold": cfg.vote.majority_threshold, "partial_critiques": cfg.vote.partial_critiques,
            "variant": cfg.variant}


def _reward_key(cfg: CAPOConfig, round_idx: int) -> dict:
    p = round_paths(cfg, round_idx)
    c = cfg.model_dump(mode="json")
    ins = {"rollouts": input_fp(p["rollouts"]), "outcomes": input_fp(p["outcomes"])}
    if cfg.critique.enabled and cfg.critique.mode == "process":
        ins.update(steps=input_fp(p["steps"]), step_verdicts=input_fp(p["step_verdicts"]))
    if cfg.critique.enabled and cfg.critique.mode == "outcome":
        ins.update(critiques=input_fp(p["critiques"]))
    return {**ins, "critique_enabled": cfg.critique.enabled, "critique_mode": cfg.critique.mode,
            "vote": c["vote"], "reward": c["reward"], "variant": cfg.variant}


def _train_key(cfg: CAPOConfig, round_idx: int) -> dict:
    from pipeline.precision import precision_record

    p = round_paths(cfg, round_idx)
    prec = precision_record(cfg)
    return {"rollouts": input_fp(p["rollouts"]), "token_rewards": input_fp(p["token_rewards"]),
            "state": previous_state_fp(cfg, round_idx),
            "train": {k: v for k, v in cfg.model_dump(mode="json")["train"].items() if k not in ("launcher", "keep_states")},
            "mixed_precision": prec["train_mixed_precision"], "save_dtype": prec["train_save_dtype"],
            "policy": model_fingerprint(policy_for_round(cfg, round_idx)), "seed": cfg.seed}


def stage_key(stage: str, cfg: CAPOConfig, round_idx: int) -> dict:
    """The key of ``stage`` (what its output depends on): :attr:`Stage.key` of its registry entry.

    Raises:
        ValueError: unknown stage (lists the valid ones).
        FileNotFoundError: an input of the stage has not been committed.
    """
    return get_stage(stage).key(cfg, round_idx)


def eval_policy(cfg: CAPOConfig, round_idx: int) -> str:
    """The policy round ``round_idx`` evaluates: the starting one for 0, else round k's checkpoint.

    Raises:
        FileNotFoundError: round k has not committed its checkpoint yet.
    """
    if round_idx == 0:
        return resolve_model(cfg.rollout.policy, cfg)
    ckpt = round_paths(cfg, round_idx)["checkpoint"]
    if storage.read_manifest(ckpt) is None:
        raise FileNotFoundError(f"eval of round {round_idx} needs the checkpoint {ckpt}, which does not exist "
                                f"yet: run round {round_idx} first (capo round --round {round_idx})")
    return str(ckpt)


def eval_key(cfg: CAPOConfig, round_idx: int) -> dict:
    """What the eval table of a round depends on (policy, eval settings, engine, data, verifier)."""
    from importlib.metadata import version

    from pipeline.precision import precision_record

    ec = cfg.eval
    engine = ec.engine or cfg.rollout.engine
    from pipeline.assets.benchmarks import ensure_benchmark

    root = Path(cfg.data_dir).resolve() / "eval"
    return {"round": round_idx, "dtype": precision_record(cfg)["eval_dtype"], "variant": cfg.variant if round_idx else None,
            "policy": model_fingerprint(eval_policy(cfg, round_idx)),
            "eval": ec.model_dump(mode="json", exclude={"enabled", "engine"}), "engine": engine.model_dump(mode="json"),
            "instruction": cfg.instruction(),
            "benchmarks": {n: storage.file_sha256(ensure_benchmark(n, root)) for n in ec.benchmarks},
            "verifier": f"math-verify=={version('math-verify')}"}


# -------------------------------------------------------------------------------------- registry
def _no_critic(cfg: CAPOConfig) -> str | None:
    return "critique.enabled is false (GRPO rule baseline): no critic" if not cfg.critique.enabled else None


def _no_step_votes(cfg: CAPOConfig) -> str | None:
    if not cfg.critique.enabled:
        return _no_critic(cfg)
    return "critique.mode is outcome (GenORM baseline): no step votes" if cfg.critique.mode == "outcome" else None


def _no_eval(cfg: CAPOConfig) -> str | None:
    return "eval.enabled is false: no held-out evaluation" if not cfg.eval.enabled else None


@dataclass(frozen=True)
class Stage:
    """One stage of a round: everything the runner, the keys and the reports need to know of it.

    Attributes:
        name: the stage's name (``capo stage NAME``).
        inputs: :func:`round_paths` names of the tables it may read (committed by earlier stages;
            which ones depends on the config: reward reads ``critiques`` only for the GenORM
            baseline, eval of round 0 reads the starting policy, not a checkpoint).
        outputs: :func:`round_paths` names it commits; the stage is current when every one of them
            is current under its key.
        heavy: loads a model, so the flows run it in a child process (memory returned at its end).
        key: ``(cfg, round_idx) -> dict``, what its outputs depend on (:func:`stage_key`).
        function: ``"module:attribute"`` of ``(cfg, round_idx, force=False) -> StageResult``,
            imported only when the stage runs (models and engines load lazily). Named, not
            imported: ``pipeline`` never imports ``train`` (the train stage's function lives there).
        not_applicable: ``cfg -> reason or None``: the stage has nothing to do under ``cfg``.
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    heavy: bool
    key: Callable[[CAPOConfig, int], dict]
    function: str
    not_applicable: Callable[[CAPOConfig], str | None] = lambda cfg: None

    @property
    def output(self) -> str:
        """The main output (the one a stage result names)."""
        return self.outputs[0]

    def load(self) -> Callable[..., StageResult]:
        """Import and return :attr:`function`."""
        import importlib

        module, attr = self.function.split(":")
        return getattr(importlib.import_module(module), attr)


REGISTRY: dict[str, Stage] = {s.name: s for s in (
    Stage("rollout", (), ("rollouts",), True, _rollout_key, "pipeline.stage_generate:rollout_stage"),
    Stage("verify", ("rollouts",), ("outcomes",), False, _verify_key, "pipeline.stage_score:verify_stage"),
    Stage("segment", ("rollouts",), ("steps",), False, _segment_key, "pipeline.stage_score:segment_stage"),
    Stage("critique", ("rollouts", "steps"), ("critiques",), True, _critique_key,
          "pipeline.stage_generate:critique_stage", _no_critic),
    Stage("vote", ("steps", "critiques"), ("step_verdicts",), False, _vote_key, "pipeline.stage_score:vote_stage",
          _no_step_votes),
    Stage("reward", ("rollouts", "outcomes", "steps", "step_verdicts", "critiques"), ("token_rewards",), False,
          _reward_key, "pipeline.stage_score:reward_stage"),
    Stage("train", ("rollouts", "token_rewards"), ("checkpoint", "train_metrics"), True, _train_key,
          "train.trainer:train_stage"),
    Stage("eval", ("checkpoint",), ("eval",), True, lambda cfg, k: eval_key(cfg, k), "pipeline.evaluate:eval_stage",
          _no_eval),
)}
"""Every stage, in the order a round runs them (docs/architecture.md). ``eval`` runs after the
training stages for the round's policy (and with round 1 for round 0, the starting policy:
:func:`flows.runner.eval_rounds`)."""

STAGES = tuple(name for name in REGISTRY if name != "eval")
"""The stages of a training round, in order; ``eval`` follows them."""
HEAVY_STAGES = tuple(name for name, s in REGISTRY.items() if s.heavy)


def get_stage(name: str) -> Stage:
    """The registry entry of stage ``name``.

    Raises:
        ValueError: unknown stage (lists the valid ones).
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown stage {name!r}; valid: {list(REGISTRY)}") from None


def provenance(cfg: CAPOConfig, extra: dict | None = None) -> dict:
    """Manifest fields every stage records: the resolved config and its hash, the precision each
    ``auto`` setting resolved to on this machine and the device (:func:`pipeline.precision.precision_record`),
    plus ``extra``."""
    from pipeline.precision import precision_record

    return {"config_hash": section_hash(cfg), "resolved_config": cfg.model_dump(mode="json"),
            "precision": precision_record(cfg), **(extra or {})}
