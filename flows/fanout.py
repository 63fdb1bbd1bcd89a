"""Critique fan-out: the critique shards of a round computed on a Dask or Ray cluster through Prefect.

With ``scale.critique.runner`` = ``dask`` or ``ray``, :func:`flows.runner.run_stage` (behind the
same is-it-current check as every stage, so a finished critique stage never starts a cluster)
hands the stage to :func:`run_critique_fanout`. That runs the Prefect flow ``critique-fanout`` on a
``DaskTaskRunner`` / ``RayTaskRunner`` (optional extra ``fanout``: ``pip install -e '.[fanout]'``):

1. in this process: plan the round's shards (:func:`pipeline.stages.critique.critique_shard_plan`:
   the rollouts in table order, ``critique.batch_rollouts`` per shard), keep those already
   committed under the stage key, and split the others into ``scale.critique.workers`` contiguous
   chunks (:func:`split_chunks`);
2. on the cluster: one Prefect task per chunk (``critique_chunk``), which starts
   ``capo stage critique --shards i,j,...`` as a child process and streams its log lines. The
   critic never loads inside a Dask or Ray worker: Dask's worker processes are daemonic and vLLM
   starts processes of its own, and a child hands the engine's memory back when it ends. Each
   child loads one critic engine and commits its shards as ``critiques.parts/part-<i>.parquet``,
   exactly the parts the local runner would write, so a fan-out can resume a local run and the
   other way round;
3. in this process again: concatenate the parts into ``critiques.parquet`` with the same stage key
   as the local runner (the runner is not part of the key), add the arithmetic check's rows and,
   with ``critique.logprob_readout``, run the readout here (it loads the critic in this process:
   known limitation, not yet sharded), and remove the parts.

Workers need the same code and environment (``sys.executable`` of the worker starts the child)
and must see ``runs_dir`` and ``data_dir`` at the same paths: one machine, or a shared filesystem.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import socket
import sys
from contextlib import contextmanager
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import wait

from pipeline.config import CAPOConfig, CritiqueFanoutConfig, load_config
from pipeline.stages.base import StageResult

INSTALL_HINT = "pip install -e '.[fanout]'"
"""How to install the optional packages the dask and ray runners need."""

_RUNNERS = {"dask": ("prefect_dask", "DaskTaskRunner", "prefect-dask"),
            "ray": ("prefect_ray", "RayTaskRunner", "prefect-ray")}

LOCAL_RAY_OBJECT_STORE_BYTES = 256 * 1024**2
"""Object store of a local Ray instance: the chunk tasks only pass small dicts around."""

log = logging.getLogger("capo.fanout")


class MissingExtraError(ImportError):
    """A fan-out runner was configured but its optional package is not installed."""


def task_runner_class(runner: str):
    """``DaskTaskRunner`` or ``RayTaskRunner``, imported on first use.

    Raises:
        MissingExtraError: ``prefect-dask`` / ``prefect-ray`` is not installed (the message names
            the extra to install).
        ValueError: ``runner`` is not ``dask`` or ``ray``.
    """
    if runner not in _RUNNERS:
        raise ValueError(f"scale.critique.runner={runner!r} has no task runner; valid: {sorted(_RUNNERS)}")
    module, cls, package = _RUNNERS[runner]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise MissingExtraError(
            f"scale.critique.runner={runner} needs the package {package}, which is not installed ({e}). "
            f"Install the optional extra 'fanout': {INSTALL_HINT} (or run with scale.critique.runner=local)"
        ) from e


def make_task_runner(fan: CritiqueFanoutConfig):
    """The Prefect task runner for ``scale.critique``.

    dask: ``address`` None starts a ``LocalCluster`` of ``workers`` worker processes, one thread
    each (stopped when the flow ends); an address (``tcp://host:8786``) connects to that scheduler.
    ray: ``address`` None starts a local Ray instance with ``workers`` CPUs and no dashboard
    (stopped when the flow ends); an address (``ray://host:10001``, ``auto``) connects to it.

    Raises:
        MissingExtraError: the runner's package is not installed.
        ValueError: ``fan.runner`` is ``local`` (nothing to fan out).
    """
    cls = task_runner_class(fan.runner)
    if fan.runner == "dask":
        if fan.address:
            return cls(address=fan.address)
        return cls(cluster_kwargs={"n_workers": fan.workers, "threads_per_worker": 1, "processes": True,
                                   "dashboard_address": "127.0.0.1:0", "silence_logs": logging.WARNING})  # dashboard: loopback only
    if fan.address == "auto":  # an existing cluster found by Ray (RAY_ADDRESS, `ray start`): fail if none
        return cls(init_kwargs={"address": "auto"})
    if fan.address:
        return cls(address=fan.address)
    return cls(init_kwargs={"address": "local", "num_cpus": fan.workers, "include_dashboard": False,
                            "object_store_memory": LOCAL_RAY_OBJECT_STORE_BYTES})


def split_chunks(shard_ids: list[int], workers: int) -> list[list[int]]:
    """Split shard ids into at most ``workers`` contiguous chunks whose sizes differ by at most one
    (the first chunks take the extra shards); no chunk is empty.

    Contiguous chunks keep each critic engine's shards together in plan order, e.g. shards
    ``[0, 1, 2, 3]`` on 2 workers -> ``[[0, 1], [2, 3]]``; ``[0, 1, 2]`` on 2 -> ``[[0, 1], [2]]``.

    Raises:
        ValueError: ``workers`` < 1.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    ids = list(shard_ids)
    k = min(workers, len(ids))
    if k == 0:
        return []
    size, extra = divmod(len(ids), k)
    out, start = [], 0
    for i in range(k):
        end = start + size + (1 if i < extra else 0)
        out.append(ids[start:end])
        start = end
    return out


@task(cache_policy=NO_CACHE, task_run_name="critique-round-{round_idx}-chunk-{chunk_idx}")
def critique_chunk(config_path: str, round_idx: int, chunk_idx: int, shard_ids: list[int], runner: str,
                   silence_s: float | None = None) -> dict:
    """Compute and commit critique shards ``shard_ids`` in a child process (``capo stage critique
    --shards``) started from the Dask / Ray worker this task runs on; its log lines are streamed
    to the task's log. Returns the child's :func:`pipeline.stages.critique.critique_shards` result
    plus where it ran (``worker_pid``, ``worker_host``: the Dask / Ray worker that started it).

    The child is stopped when it prints nothing for ``silence_s`` seconds (``scale.child_silence_s``;
    None: never).

    Raises:
        flows.children.StageChildFailed: the child failed, was killed or was stopped for silence
            (a RuntimeError; exit code or signal, memory and last output lines in the message).
        RuntimeError: the child printed no result line.
    """
    from flows.children import stream_child
    from pipeline.engines.base import engine_process_env
    from pipeline.stages.critique import STAGE

    cmd = [sys.executable, "-m", "flows.cli", "stage", STAGE.name, "--config", config_path,
           "--round", str(round_idx), "--shards", ",".join(str(s) for s in shard_ids)]
    out = stream_child(cmd, f"critique chunk {chunk_idx}", get_run_logger(),
                       f"critique chunk {chunk_idx} (shards {shard_ids}) of round {round_idx}",
                       engine_process_env(), silence_s=silence_s)
    if out is None:
        raise RuntimeError(f"critique chunk {chunk_idx} of round {round_idx}: the child printed no result line")
    return {"runner": runner, "chunk": chunk_idx, **out, "worker_pid": os.getpid(), "worker_host": socket.gethostname()}


def _remote_options(cfg: CAPOConfig, runner: str):
    """Ray only: ask for one GPU per chunk when the cluster has GPUs and the critic runs locally
    (Ray hides the GPUs from tasks that do not ask for one)."""
    from contextlib import nullcontext

    if runner != "ray" or cfg.critique.engine.type == "openai":
        return nullcontext()
    import ray
    from prefect_ray.context import remote_options

    return remote_options(num_gpus=1) if ray.cluster_resources().get("GPU", 0) >= 1 else nullcontext()


@flow(name="critique-fanout", log_prints=True)
def critique_fanout(config_path: str, round_idx: int, force: bool = False) -> dict:
    """The critique stage of one round with its shards fanned out over this flow's task runner.

    Args:
        config_path: the resolved config YAML (:func:`flows.children.write_resolved_config`); the
            chunk processes read it too.
        round_idx: the round.
        force: recompute the table even when it is current (committed shards are still reused).

    Returns:
        The stage's :class:`~pipeline.stages.StageResult` as a dict.
    Raises:
        RuntimeError: a chunk failed (the shards other chunks committed are kept: a re-run
            computes only what is missing).
    """
    from pipeline.stages.critique import critique_stage

    cfg = load_config(config_path)
    fan = cfg.scale.critique
    logger = get_run_logger()

    def run_shards(todo: list[int]) -> list[dict]:
        chunks = split_chunks(todo, fan.workers)
        logger.info("[critique] fanning out %d shards in %d chunks on %s%s: %s", len(todo), len(chunks), fan.runner,
                    f" ({fan.address})" if fan.address else " (local cluster)", chunks)
        with _remote_options(cfg, fan.runner):
            futures = [critique_chunk.submit(config_path, round_idx, i, c, fan.runner,
                                              cfg.scale.child_silence_s) for i, c in enumerate(chunks)]
        wait(futures)
        results, errors = [], []
        for i, f in enumerate(futures):
            try:
                results.append(f.result())
            except Exception as e:  # noqa: BLE001 - collect every chunk's failure before raising
                errors.append(f"chunk {i} (shards {chunks[i]}): {e}")
        if errors:
            raise RuntimeError(f"{len(errors)} of {len(chunks)} critique chunks of round {round_idx} failed; the "
                               "committed shards are kept, run the stage again to finish:\n" + "\n".join(errors))
        for r in results:
            logger.info("[critique] chunk %d: %d shards computed in %.1fs by pid %s on %s (worker pid %s), %d critic calls",
                        r["chunk"], len(r["computed"]), r["seconds"], r["pid"], r["host"], r["worker_pid"], r["critic_calls"])
        return results

    return dataclasses.asdict(critique_stage(cfg, round_idx, force=force, run_shards=run_shards))


EPHEMERAL_STARTUP_TIMEOUT_S = 180
"""Seconds the fan-out waits for the ephemeral Prefect server it starts, unless the user set
Prefect's own ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``. Prefect's default (20 s) was
missed on a 2-core CPU busy with the rest of a round (the server imports Prefect's whole API and
migrates its SQLite database before it answers)."""

EPHEMERAL_STARTUP_ATTEMPTS = 2
"""How many times the fan-out starts the ephemeral server before it gives up."""


class PrefectServerStartError(RuntimeError):
    """The ephemeral Prefect API server the fan-out needs did not answer in time."""


def ephemeral_startup_timeout() -> tuple[int, str]:
    """The start-up timeout for the fan-out's ephemeral Prefect server, in seconds, and where it
    came from: Prefect's setting ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` when the user
    set it (environment or profile), otherwise :data:`EPHEMERAL_STARTUP_TIMEOUT_S`."""
    from prefect.settings import get_current_settings

    eph = get_current_settings().server.ephemeral
    if "startup_timeout_seconds" in eph.model_fields_set:
        return int(eph.startup_timeout_seconds), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
    return EPHEMERAL_STARTUP_TIMEOUT_S, "the fan-out's default (flows.fanout.EPHEMERAL_STARTUP_TIMEOUT_S)"


def start_ephemeral_server(attempts: int = EPHEMERAL_STARTUP_ATTEMPTS):
    """Start this process's ephemeral Prefect API server (Prefect's ``SubprocessASGIServer``, the one
    Prefect itself would start) with the timeout of :func:`ephemeral_startup_timeout`, trying up to
    ``attempts`` times; a server that missed its timeout is stopped before the next try.

    Returns:
        The running server (``.api_url`` is its API).
    Raises:
        PrefectServerStartError: no try answered in time; the message names the timeout, where it
            came from, the setting that raises it, and ``PREFECT_API_URL`` for a server of one's own.
    """
    from prefect.server.api.server import SubprocessASGIServer

    timeout, source = ephemeral_startup_timeout()
    errors = []
    for attempt in range(1, attempts + 1):
        server = SubprocessASGIServer()  # one per process: the one Prefect itself would use
        try:
            server.start(timeout=timeout)
            return server
        except Exception as e:  # noqa: BLE001 - Prefect raises RuntimeError on a timeout, httpx errors on a bad answer
            errors.append(f"try {attempt}: {type(e).__name__}: {str(e)[:300]}")
            server.stop()  # Prefect leaves the late process running; the next try starts afresh
            log.warning("[critique] the ephemeral Prefect server did not answer within %d s (try %d of %d)",
                        timeout, attempt, attempts)
    raise PrefectServerStartError(
        f"the ephemeral Prefect API server the critique fan-out needs did not answer within {timeout} s "
        f"({source}) in {attempts} tries. On a busy machine raise the timeout, e.g. "
        f"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS={max(4 * timeout, 600)}, or start a server once "
        "(`prefect server start`) and point the run at it with PREFECT_API_URL=http://127.0.0.1:4200/api. "
        + "; ".join(errors))


@contextmanager
def _prefect_api():
    """Make the Dask / Ray workers report to the Prefect API this process uses.

    A server the user runs (``PREFECT_API_URL``) is used as it is. With none, Prefect runs an
    ephemeral server per process; start this process's (:func:`start_ephemeral_server`: a timeout
    that fits a busy 2-core CPU, a second try) and pass its URL on in the settings the task runner
    ships to the workers, so that each worker does not start a server of its own.

    Raises:
        PrefectServerStartError: the ephemeral server did not start.
    """
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_ALLOW_EPHEMERAL_MODE,
        temporary_settings,
    )

    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
        yield
        return
    server = start_ephemeral_server()
    with temporary_settings({PREFECT_API_URL: server.api_url}):
        yield


@contextmanager
def environment_kept():
    """Leave ``os.environ`` as the block found it.

    Dask's nanny writes its workers' settings into the environment of the process that starts a
    ``LocalCluster`` (``distributed.nanny.pre-spawn-environ``: ``OMP_NUM_THREADS=1``,
    ``MKL_NUM_THREADS=1``, ``OPENBLAS_NUM_THREADS=1``, ``MALLOC_TRIM_THRESHOLD_``) and leaves them
    there; Ray's ``init`` adds its own (``RAY_*``, ``PYTHONBREAKPOINT``). Every later stage child
    of the orchestrator inherits that environment: after a fan-out the train and eval stages ran
    torch on one thread of a 2-core machine, about twice as slow. Variables the block added are
    removed, changed ones set back, removed ones restored.
    """
    before = dict(os.environ)
    try:
        yield
    finally:
        for k in [k for k in os.environ if k not in before]:
            del os.environ[k]
        for k, v in before.items():
            if os.environ.get(k) != v:
                os.environ[k] = v


def run_critique_fanout(cfg: CAPOConfig, round_idx: int, logger: logging.Logger | None = None,
                        force: bool = False) -> StageResult:
    """Run the critique stage of ``round_idx`` as the ``critique-fanout`` flow on the task runner
    ``cfg.scale.critique`` names (see the module docstring). Called by :func:`flows.runner.run_stage`
    after its is-it-current check.

    Raises:
        MissingExtraError: ``prefect-dask`` / ``prefect-ray`` is not installed.
        ValueError: ``scale.critique.runner`` is ``local``.
        PrefectServerStartError: no ``PREFECT_API_URL`` is set and the ephemeral Prefect server
            did not start (a RuntimeError naming the setting to raise).
        RuntimeError: a chunk failed, or a shard was still missing afterwards.
    """
    from flows.children import write_resolved_config

    logger = logger or logging.getLogger("capo.flows")
    fan = cfg.scale.critique
    runner = make_task_runner(fan)  # fails here, before any work, when the extra is missing
    for name in ("httpx", "distributed"):  # the Prefect client's requests, the local Dask scheduler's chatter
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)
    conf = write_resolved_config(cfg, round_idx)
    logger.info("[critique] running on %s with %d workers%s (scale.critique)", fan.runner, fan.workers,
                f" at {fan.address}" if fan.address else ", local cluster")
    with environment_kept(), _prefect_api():  # the cluster's thread settings stay out of later stages
        out: dict[str, Any] = critique_fanout.with_options(task_runner=runner)(str(conf), round_idx, force)
    res = StageResult(**out)
    logger.info(res.line())
    return res
