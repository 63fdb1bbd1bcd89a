"""A policy engine that outlives stages: one vLLM process reused across rounds (``scale.policy_engine``).

With ``scale.policy_engine: persistent`` the orchestrator (``capo run`` / ``capo round`` and the
``capo-run`` / ``capo-round`` flows) starts one host process for the whole invocation, and the
rollout and eval stages, which still run in their own child processes, talk to it through a
:class:`RemoteEngine` instead of starting vLLM themselves::

    round k:  rollout (policy k-1) ... train -> eval k (reload ckpt k) ; round k+1: rollout (reused)

When a stage asks for another checkpoint of the same architecture and the same engine settings,
the host loads the new weights in place (vLLM ``collective_rpc("reload_weights")``, then drops the
prefix cache, whose KV entries belong to the old weights) instead of paying vLLM's start-up again.
Any other change of engine settings rebuilds the engine. The host loads nothing until the first
request, so a fully cached round never starts a model.

Protocol: :mod:`multiprocessing.connection` over a Unix socket with a random auth key, passed to
the stage processes in :data:`ADDRESS_ENV` / :data:`AUTHKEY_ENV`. Requests are served one at a time
(stages of a round run one after another). The session stops the host with SIGTERM to its process
group when the block ends, however it ends.

Reproducibility: the host reseeds the sampler on every ``load`` request with the stage's seed, but
a reused engine has a history (prefix cache, warm-up) that a fresh one does not, so sampled rollouts
are not bit-identical to those of ``per-stage`` engines; greedy decoding (the eval) is.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Iterator

from pipeline import engines
from pipeline.config import CAPOConfig, SamplingConfig, VLLMEngineConfig
from pipeline.engines.base import Engine, Generation, engine_process_env, load_tokenizer

log = logging.getLogger("capo.engine_host")

ADDRESS_ENV = "CAPO_POLICY_ENGINE_ADDRESS"
AUTHKEY_ENV = "CAPO_POLICY_ENGINE_AUTHKEY"


# ------------------------------------------------------------------------------------------ client
class RemoteEngine(Engine):
    """An :class:`~pipeline.engines.Engine` whose model lives in the policy engine host.

    Raises:
        RuntimeError: the host is gone, or it failed to load or to generate (its error is quoted).
    """

    name = "vllm-persistent"

    def __init__(self, model: str, cfg: VLLMEngineConfig, seed: int = 0, address: str | None = None,
                 authkey: bytes | None = None) -> None:
        super().__init__()
        address = address or os.environ[ADDRESS_ENV]
        authkey = authkey or bytes.fromhex(os.environ[AUTHKEY_ENV])
        try:
            self.conn = Client(address, family="AF_UNIX", authkey=authkey)
        except (OSError, EOFError) as e:
            raise RuntimeError(f"policy engine host at {address!r} is not reachable ({e}); it is started by "
                               "`capo run` / `capo round` / the flows when scale.policy_engine=persistent") from e
        self.model = model
        reply = self._call({"op": "load", "model": model, "cfg": cfg.model_dump(mode="json"), "seed": seed})
        self.stats.extra.update(host_action=reply["action"], load_seconds=reply["seconds"],
                                host_pid=reply["pid"], host_engine_starts=reply["engine_starts"],
                                host_reloads=reply["reloads"])
        log.info("policy engine host (pid %d): %s %s in %.2fs", reply["pid"], reply["action"], model, reply["seconds"])
        self.tokenizer = load_tokenizer(model)

    def _call(self, msg: dict) -> dict:
        try:
            self.conn.send(msg)
            reply = self.conn.recv()
        except (OSError, EOFError) as e:
            raise RuntimeError(f"policy engine host died during {msg['op']!r} ({e}); see its log "
                               "(policy_engine.log in the run directory)") from e
        if reply.get("error"):
            raise RuntimeError(f"policy engine host failed on {msg['op']!r}: {reply['error']}")
        return reply

    supports_constraints = True

    def generate(self, conversations, n: int, sampling: SamplingConfig, constraints=None) -> list[Generation]:
        """See :meth:`pipeline.engines.base.Engine.generate` (served by the host's vLLM engine)."""
        reply = self._call({"op": "generate", "conversations": [list(c) for c in conversations], "n": n,
                            "sampling": sampling.model_dump(mode="json"),
                            "constraints": None if constraints is None else list(constraints)})
        gens = reply["generations"]
        self._account(gens, reply["seconds"], scheduled=reply.get("scheduled"), cached=reply.get("cached"))
        return gens

    def close(self) -> None:
        """Disconnect; the model stays loaded in the host for the next stage."""
        with contextlib.suppress(OSError):
            self.conn.close()


def policy_engine(model: str, cfg, seed: int = 0) -> Engine:
    """The engine a policy-sampling stage (rollout, eval) should use for ``model``.

    The persistent host's :class:`RemoteEngine` when one is running (:data:`ADDRESS_ENV` set) and
    ``cfg`` is a vLLM engine; otherwise a fresh engine from :func:`~pipeline.engines.make_engine`.
    """
    if os.environ.get(ADDRESS_ENV) and getattr(cfg, "type", None) == "vllm":
        return RemoteEngine(model, cfg, seed)
    return engines.make_engine(model, cfg, seed=seed)


# ------------------------------------------------------------------------------------------ server
def _seed_worker(worker, seed: int) -> None:
    """Reseed a vLLM worker's samplers (run on each worker through ``collective_rpc``)."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class _Host:
    def __init__(self) -> None:
        self.engine = None
        self.cfg: dict | None = None
        self.engine_starts = 0
        self.reloads = 0

    def load(self, model: str, cfg: dict, seed: int) -> dict:
        from pipeline.engines.vllm_engine import VLLMEngine

        t0 = time.perf_counter()
        if self.engine is not None and cfg != self.cfg:
            log.info("engine settings changed: rebuilding the engine")
            self.engine.close()
            self.engine = None
        if self.engine is None:
            self.engine = VLLMEngine(model, VLLMEngineConfig.model_validate(cfg), seed=seed)
            self.cfg, action = cfg, "started"
            self.engine_starts += 1
        elif os.path.realpath(model) != os.path.realpath(self.engine.model):
            if not (Path(model) / "config.json").is_file():
                raise FileNotFoundError(f"checkpoint {model!r} has no config.json; the engine keeps {self.engine.model!r}")
            try:
                self.engine.reload(model)
            except BaseException:
                # a half-loaded model must never serve: drop it, the next load starts afresh
                self.engine.close()
                self.engine = None
                raise
            action = "reloaded"
            self.reloads += 1
        else:
            action = "reused"
        self.engine.llm.collective_rpc(_seed_worker, args=(seed,))
        secs = time.perf_counter() - t0
        log.info("%s %s in %.2fs (engine starts %d, reloads %d)", action, model, secs, self.engine_starts, self.reloads)
        return {"action": action, "seconds": secs, "pid": os.getpid(), "engine_starts": self.engine_starts,
                "reloads": self.reloads}

    def generate(self, conversations: list, n: int, sampling: dict, constraints: list | None = None) -> dict:
        if self.engine is None:
            raise RuntimeError("generate before load")
        before = self.engine.stats.scheduled_prompt_tokens, self.engine.stats.cached_prompt_tokens
        t0 = time.perf_counter()
        gens = self.engine.generate(conversations, n, SamplingConfig.model_validate(sampling), constraints)
        secs = time.perf_counter() - t0
        return {"generations": gens, "seconds": secs,
                "scheduled": self.engine.stats.scheduled_prompt_tokens - before[0],
                "cached": self.engine.stats.cached_prompt_tokens - before[1]}


def serve(address: str, authkey: bytes) -> None:
    """Serve load/generate/shutdown requests on ``address`` until a ``shutdown`` request."""
    host = _Host()
    with Listener(address, family="AF_UNIX", authkey=authkey) as listener:
        log.info("policy engine host pid %d listening on %s", os.getpid(), address)
        while True:
            try:
                conn = listener.accept()
            except (OSError, EOFError) as e:  # a client that failed the handshake
                log.warning("rejected a connection: %s", e)
                continue
            with conn:
                while True:
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        break  # the stage finished and disconnected
                    op = msg.get("op")
                    if op == "shutdown":
                        conn.send({"ok": True})
                        if host.engine is not None:
                            host.engine.close()
                        return
                    try:
                        if op == "load":
                            reply = host.load(msg["model"], msg["cfg"], msg["seed"])
                        elif op == "generate":
                            reply = host.generate(msg["conversations"], msg["n"], msg["sampling"], msg.get("constraints"))
                        else:
                            reply = {"error": f"unknown op {op!r}; valid: load, generate, shutdown"}
                    except Exception as e:  # report to the stage, keep serving
                        log.exception("%s failed", op)
                        reply = {"error": f"{type(e).__name__}: {e}"}
                    conn.send(reply)


# -------------------------------------------------------------------------------------- lifecycle
@contextlib.contextmanager
def policy_engine_session(cfg: CAPOConfig, logger: logging.Logger | None = None) -> Iterator[str | None]:
    """Run a policy engine host for the duration of the block when ``scale.policy_engine`` is
    ``persistent`` and the rollout engine is vLLM; yields its address (None when not started).

    Re-entrant: inside an outer session (``capo-run`` around ``capo-round``) it reuses the outer
    host. The host's log goes to ``<run_dir>/policy_engine.log``.

    Raises:
        RuntimeError: the host process exited before it started listening.
    """
    logger = logger or log
    if cfg.scale.policy_engine != "persistent" or os.environ.get(ADDRESS_ENV):
        yield os.environ.get(ADDRESS_ENV)
        return
    if cfg.rollout.engine.type != "vllm":
        logger.info("scale.policy_engine=persistent applies to vLLM engines only (rollout.engine.type=%s): "
                    "each stage starts its own engine", cfg.rollout.engine.type)
        yield None
        return
    sock_dir = tempfile.mkdtemp(prefix="capo-engine-")
    address = os.path.join(sock_dir, "policy.sock")
    authkey = secrets.token_bytes(16)
    log_path = cfg.run_dir() / "policy_engine.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **engine_process_env(), AUTHKEY_ENV: authkey.hex(), "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.engines.host", "--address", address],
                                stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                cwd=Path(__file__).resolve().parent.parent, start_new_session=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(address):
        if proc.poll() is not None:
            raise RuntimeError(f"policy engine host exited with code {proc.returncode} before listening; "
                               f"see {log_path}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"policy engine host did not start listening within 120 s; see {log_path}")
        time.sleep(0.1)
    logger.info("policy engine host pid %d on %s (log: %s)", proc.pid, address, log_path)
    os.environ[ADDRESS_ENV], os.environ[AUTHKEY_ENV] = address, authkey.hex()
    try:
        yield address
    finally:
        os.environ.pop(ADDRESS_ENV, None)
        os.environ.pop(AUTHKEY_ENV, None)
        _stop(proc)
        with contextlib.suppress(OSError):
            os.unlink(address)
            os.rmdir(sock_dir)
        logger.info("policy engine host stopped (exit code %s)", proc.returncode)


def _stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Stop the host and whatever it started (its own process group): SIGTERM, then SIGKILL.

    No shutdown request over the socket: a stage that died mid-request can leave the host serving
    a connection that never ends, and a handshake with it would block forever.
    """
    import signal

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="CAPO policy engine host (started by the orchestrator)")
    ap.add_argument("--address", required=True, help="Unix socket path to listen on")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # run finalizers (vLLM shutdown) on stop
    serve(args.address, bytes.fromhex(os.environ[AUTHKEY_ENV]))


if __name__ == "__main__":
    main()
