"""Run one stage of a round: in this process (light stages) or in a child process (heavy ones).

Heavy stages (rollout, critique, train) load models; running each in its own process returns its
memory when it ends and keeps vLLM's engine out of the orchestrator. Whether a stage is current is
checked here first, in-process, so resuming a finished round never starts a child process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

from flows.children import stream_child, write_resolved_config
from pipeline import storage
from pipeline.config import CAPOConfig, section_hash
from pipeline.stages import get_stage, stage_key
from pipeline.stages.base import Stage, StageResult, round_paths


def stage_function(name: str):
    """The function that computes stage ``name`` (:meth:`pipeline.stages.base.Stage.load`: imported
    lazily, so models load only when needed).

    Raises:
        ValueError: unknown stage (lists the valid ones).
    """
    return get_stage(name).load()


def check_current(name: str, cfg: CAPOConfig, round_idx: int) -> storage.Currency:
    """Is stage ``name`` of the round current, every output of it under its key? (cheap: manifests
    and file stats only). Returns the first output's currency that is not current, else the main one's."""
    paths = round_paths(cfg, round_idx)
    return storage.outputs_current([paths[out] for out in get_stage(name).outputs], stage_key(name, cfg, round_idx))


@dataclasses.dataclass(frozen=True)
class StaleInput:
    """An output upstream of a stage that is not current: ``stage`` writes it at ``path``, and
    ``reason`` says why it is not current (:class:`pipeline.storage.Currency`)."""

    stage: str
    path: Path
    reason: str


class StaleInputsError(ValueError):
    """A stage run on its own (``capo stage NAME``) would read inputs that are not current
    (:func:`require_current_inputs`); ``stale`` lists them, ``run_first`` the stages to run
    before it, in round order."""

    def __init__(self, message: str, stale: list[StaleInput], run_first: list[str]) -> None:
        super().__init__(message)
        self.stale = stale
        self.run_first = run_first


def _writer(table: str) -> Stage | None:
    """The round stage whose outputs include ``table`` (None: no stage of the round writes it)."""
    from pipeline.stages import REGISTRY

    return next((s for s in REGISTRY.values() if table in s.outputs), None)


def _visit_upstream(stage: Stage, cfg: CAPOConfig, round_idx: int, seen: dict[str, storage.Currency | None]) -> None:
    """Record in ``seen`` the currency (:func:`check_current`, the runner's test) of every stage
    that writes a committed input of ``stage``, and of theirs, up the round."""
    paths = round_paths(cfg, round_idx)
    for table in stage.inputs:
        writer = _writer(table)
        if writer is None or writer.name in seen or writer.not_applicable(cfg):
            continue
        if storage.read_manifest(paths[table]) is None:
            continue  # never committed: not read (round 0's checkpoint); a missing input the stage reads fails in it
        try:
            seen[writer.name] = check_current(writer.name, cfg, round_idx)
        except (FileNotFoundError, ValueError) as e:  # an input of the writer is gone
            seen[writer.name] = storage.Currency(False, f"its key cannot be computed: {e}")
        _visit_upstream(writer, cfg, round_idx, seen)


def stale_inputs(name: str, cfg: CAPOConfig, round_idx: int) -> tuple[list[StaleInput], list[str]]:
    """The inputs of stage ``name`` of round ``round_idx`` (and their inputs, up the round) that
    are not current, and the stages to run before it.

    Each committed table the stage may read (:attr:`Stage.inputs`) is checked as the runner checks
    a stage before it runs it (:func:`check_current`): its stage's key, which holds the
    fingerprints of the tables it was made from, against its manifest; so is every input of that
    stage, up to the rollouts. A table made from an earlier version of its own inputs (steps
    segmented again after the critiques were sampled) or under other settings than ``cfg``'s is not
    current. Reads manifests and hashes tables only (no model, no lock). Tables that were never
    committed are left out (the stage's own key names a missing one it reads).

    Returns:
        ``(stale, run_first)``: the outputs that are not current, in round order; the stages to run
        first, in round order: every stage upstream of ``name`` from the first stale one on (a
        current one is skipped when run). Both empty when every input is current.
    Raises:
        ValueError: unknown stage (lists the valid ones).
    """
    from pipeline.stages import REGISTRY

    seen: dict[str, storage.Currency | None] = {}
    _visit_upstream(get_stage(name), cfg, round_idx, seen)
    order = [s for s in REGISTRY if s in seen and s != name]
    paths = round_paths(cfg, round_idx)
    stale = [StaleInput(s, paths[get_stage(s).output], seen[s].reason) for s in order if not seen[s].current]
    first = order.index(stale[0].stage) if stale else len(order)
    return stale, order[first:]


def require_current_inputs(name: str, cfg: CAPOConfig, round_idx: int) -> None:
    """Refuse to run stage ``name`` of round ``round_idx`` on its own when an input it reads is not
    current (:func:`stale_inputs`): a stage's key holds its input tables' fingerprints but not
    whether those tables were made from the current version of their own inputs, so, e.g., votes
    of old critiques onto steps segmented again would be written as current. A round
    (``capo round``) recomputes the stale tables in order; run it, or the listed stages first.

    Raises:
        StaleInputsError: an input is not current (a ValueError; the message names each stale
            table, why, and the stages to run first).
        ValueError: unknown stage (lists the valid ones).
    """
    stale, run_first = stale_inputs(name, cfg, round_idx)
    if not stale:
        return
    what = "; ".join(f"{s.path.name} (stage {s.stage}): {s.reason}" for s in stale)
    steps = ", then ".join(f"capo stage {s} --round {round_idx}" for s in run_first)
    raise StaleInputsError(
        f"stage {name} of round {round_idx} would read inputs that are not current under this config: {what}. "
        f"Run first, with the same config and overrides: {steps}; or the whole round: capo round --round {round_idx}",
        stale, run_first)


def not_applicable(name: str, cfg: CAPOConfig) -> str | None:
    """Why stage ``name`` has nothing to do under ``cfg`` (None: it applies)."""
    return get_stage(name).not_applicable(cfg)


def run_stage(name: str, cfg: CAPOConfig, round_idx: int, logger: logging.Logger | None = None,
              force: bool = False) -> StageResult:
    """Run stage ``name`` of round ``round_idx`` unless it is current; return what happened
    (:func:`run_record` of its registry entry).

    The critique stage with ``scale.critique.runner`` dask or ray is fanned out over that cluster
    (:func:`flows.fanout.run_critique_fanout`); every other heavy stage runs in a child process.

    Raises:
        ValueError: unknown stage (lists the valid ones).
        flows.children.StageChildFailed: a child process failed, was killed by a signal or was
            stopped for silence (a RuntimeError; the message names the signal, memory and last lines).
        flows.fanout.MissingExtraError: the fan-out runner's package is not installed.
    """
    return run_record(get_stage(name), cfg, round_idx, logger, force)


def run_record(stage: Stage, cfg, unit, logger: logging.Logger | None = None, force: bool = False) -> StageResult:
    """Run ``stage`` for ``unit`` (a round index, a critic-eval setup, None) unless it is current.

    In order: not applicable under ``cfg`` (skipped, with the reason); current, every output under
    its key (skipped; checked here, so resuming never starts a child process; a stage without a key
    decides in its function); fanned out to a cluster (:attr:`Stage.fans_out`); light, run in this
    process (its peak memory measured); heavy, run in a child process whose log is streamed.

    Raises:
        flows.children.StageChildFailed: a child process failed, was killed by a signal or was
            stopped for silence (a RuntimeError; the message names the signal, memory and last lines).
        flows.fanout.MissingExtraError: the fan-out runner's package is not installed.
    """
    logger = logger or logging.getLogger("capo.flows")
    why_not = stage.not_applicable(cfg)
    if why_not:
        res = StageResult(stage.name, "", True, why_not)
        _log_result(logger, res, unit)
        return res
    if not force and stage.key is not None:
        paths = stage.paths(cfg, unit)
        cur = storage.outputs_current([paths[out] for out in stage.outputs], stage.key(cfg, unit))
        if cur.current:
            res = StageResult(stage.name, str(paths[stage.output]), True, cur.reason)
            _log_result(logger, res, unit)
            return res
    if stage.fans_out(cfg):  # the critique shards on a Dask / Ray cluster
        from flows.fanout import run_critique_fanout

        return run_critique_fanout(cfg, unit, logger, force)
    if not stage.heavy:
        with PeakRSS() as mem:
            res = stage.load()(cfg, unit, force=force)
        return dataclasses.replace(res, peak_rss_mb=mem.peak_mb)
    return _run_child(stage, cfg, unit, logger, force)


def _log_result(logger: logging.Logger, res: StageResult, unit) -> None:
    """Log a stage's result line, led by its unit when that is a name (a critic-eval setup)."""
    logger.info("[%s] %s", unit, res.line()) if isinstance(unit, str) else logger.info(res.line())


class PeakRSS:
    """Peak resident memory (MiB) of this process plus its children while the block runs.

    A light stage runs inside the orchestrator, whose lifetime ``ru_maxrss`` says nothing about
    one stage; a daemon thread samples ``psutil`` every ``interval_s`` seconds instead (the verify
    stage's math-verify worker processes included). Peaks shorter than the interval can be missed.
    """

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.peak_mb: float | None = None

    def _sample(self) -> float:
        import psutil

        me = psutil.Process()
        rss = me.memory_info().rss
        for child in me.children(recursive=True):
            try:
                rss += child.memory_info().rss
            except psutil.Error:  # a worker that just exited
                pass
        return rss / 2**20

    def __enter__(self) -> "PeakRSS":
        import threading

        self._stop = threading.Event()
        self._peak = self._sample()

        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                self._peak = max(self._peak, self._sample())

        self._thread = threading.Thread(target=loop, name="capo-peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mb = round(max(self._peak, self._sample()), 1)


def _child_command(stage: Stage, cfg, unit) -> tuple[list[str], str]:
    """The argv of ``stage``'s child process for ``unit`` and how messages name it."""
    if stage.child_argv is not None:
        return [sys.executable, *stage.child_argv(cfg, unit)], f"stage {stage.name!r} of {unit!r}"
    conf = write_resolved_config(cfg, unit)
    launcher = stage.launcher(cfg)
    if launcher:
        exe, *rest = launcher
        local = Path(sys.executable).parent / exe  # e.g. .venv/bin/accelerate when .venv/bin is not on PATH
        cmd = [str(local) if os.sep not in exe and local.is_file() else exe, *rest,
               "-m", stage.launch_module, "--config", str(conf), "--round", str(unit)]
    else:
        cmd = [sys.executable, "-m", "flows.cli", "stage", stage.name, "--config", str(conf), "--round", str(unit)]
    return cmd, f"stage {stage.name!r} of round {unit}"


def _run_child(stage: Stage, cfg, unit, logger: logging.Logger, force: bool) -> StageResult:
    from pipeline.config import ScaleConfig
    from pipeline.engines.base import engine_process_env

    cmd, what = _child_command(stage, cfg, unit)
    if force:
        cmd.append("--force")
    extra = engine_process_env() if stage.engine_env else {}
    if stage.batch_invariant:
        from pipeline.engines.base import batch_invariant_env

        extra.update(batch_invariant_env())
    scale = getattr(cfg, "scale", None)  # critic-eval's config has no scale section: the default
    silence = scale.child_silence_s if scale is not None else ScaleConfig.model_fields["child_silence_s"].default
    tag = stage.name if unit is None or isinstance(unit, int) else f"{stage.name} {unit}"
    payload = stream_child(cmd, tag, logger, what, extra, silence_s=silence)
    result = StageResult(**payload) if payload is not None else \
        StageResult(stage.name, "", False, "child process finished (no result line)")
    _log_result(logger, result, unit)
    return result


def critic_signal(cfg: CAPOConfig, round_idx: int) -> dict | None:
    """:func:`pipeline.core.critique.signal_health` of the round's process critiques under the variant's
    rule and partial-critique policy (None without process critiques or without sampled ones); logs its
    warning."""
    p = round_paths(cfg, round_idx)
    from pipeline.core.critique import critique_mode, signal_health

    if critique_mode(cfg.critique).type != "process" or storage.read_manifest(p["critiques"]) is None:
        return None

    crit = [r for r in storage.read_table(p["critiques"], "critiques").select(
        ["rollout_id", "source", "parse_status", "wrong_steps", "steps_wrong_lines"]).to_pylist() if r["source"] == "llm"]
    if not crit:  # critique.num_critiques=0: the checkers alone, no sampled critique to be healthy or not
        return None
    rate = None
    if storage.read_manifest(p["step_verdicts"]) is not None:
        sv = storage.read_table(p["step_verdicts"], "step_verdicts").select(["rule", "llm_weight"]).to_pylist()
        w = [r["llm_weight"] for r in sv if r["rule"] == cfg.vote.rule]
        rate = sum(x > 0 for x in w) / len(w) if w else None
    health = signal_health(crit, rate, cfg.vote.partial_critiques)
    if health["warning"]:
        logging.getLogger("capo.flows").warning("[critic] round %d: %s", round_idx, health["warning"])
    return health


def process_signal(cfg: CAPOConfig, round_idx: int) -> list[dict] | None:
    """:func:`pipeline.process_signal.measure_round` of this round and variant (each signal source and scope:
    right / wrong responses penalized, AUROC against a wrong outcome with a 1000-resample interval,
    groups that train on the outcome or on the process signal alone); None before the round has
    committed outcomes, steps and token rewards, or when the measurement fails (logged: it never
    fails the round)."""
    from pipeline.process_signal import measure_round

    p = round_paths(cfg, round_idx)
    if any(storage.read_manifest(p[n]) is None for n in ("outcomes", "steps", "token_rewards")):
        return None
    try:
        return measure_round(p["round_dir"], n_boot=1000, seed=cfg.seed, variant=cfg.variant)
    except Exception as e:  # noqa: BLE001 - a measurement must not fail a round that has trained
        logging.getLogger("capo.flows").warning("[signal] round %d: not measured (%s: %s)", round_idx,
                                                type(e).__name__, e)
        return None


def finish_round(cfg: CAPOConfig, round_idx: int, results: list[dict], wall_s: float | None = None) -> dict[str, Path]:
    """The tail of every round, whoever ran it (the ``capo-round`` flow, ``capo round``, ``capo run``):
    the round summary (:func:`write_round_summary`), the DuckDB catalog refreshed over the runs
    dir (:func:`pipeline.storage.refresh_catalog`) and the run's report
    (:func:`pipeline.report.write_report`).

    Returns:
        ``{"summary": path, "catalog": path, **report}`` (the report's paths: ``report_html`` ...).
    """
    from pipeline.faults import kill_point
    from pipeline.report import write_report
    from pipeline.storage import refresh_catalog

    summary = write_round_summary(cfg, round_idx, results, wall_s)
    catalog = refresh_catalog(Path(cfg.runs_dir), Path(cfg.data_dir))
    report = write_report(Path(cfg.runs_dir), cfg.run_id)
    kill_point("report.written", report.get("report_html", ""))
    kill_point("round.finished", f"round_{round_idx:03d}")
    return {"summary": summary, "catalog": catalog, **report}


def write_round_summary(cfg: CAPOConfig, round_idx: int, results: list[dict], wall_s: float | None = None) -> Path:
    """``variants/<variant>/round_summary.json``: what each stage of this invocation did.

    Records per stage skipped/ran, seconds and critic calls, so "re-training a cached round made
    zero critic calls" is a fact in a file (and in the catalog's ``manifests`` neighbours). An
    invocation that skipped every stage writes ``round_summary.resume.json`` instead, keeping the
    real run's times and memory; one that ran some stages moves an earlier summary to
    ``superseded/`` (:func:`pipeline.storage.supersede`) before writing its own.
    """
    from pipeline.precision import precision_record
    from pipeline.storage import supersede

    path = round_paths(cfg, round_idx)["run_summary"]
    if path.exists():
        if all(r.get("skipped") for r in results):
            path = path.with_name("round_summary.resume.json")  # keep the real run's times and memory
        else:
            supersede(path)  # e.g. a --force eval: the whole round's figures stay readable
    path.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "run_id": cfg.run_id, "round": round_idx, "variant": cfg.variant, "config_hash": section_hash(cfg),
        "critic_calls": int(sum(r.get("critic_calls", 0) for r in results)),
        "stages": results, "stage_seconds": round(sum(r.get("seconds", 0.0) for r in results), 3),
        "wall_seconds": None if wall_s is None else round(wall_s, 3),
        "precision": precision_record(cfg),  # what each auto setting resolved to here, and the device
        "critic_signal": critic_signal(cfg, round_idx),
        "process_signal": process_signal(cfg, round_idx),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, path)
    return path
