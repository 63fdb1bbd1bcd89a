"""One writer per run: an OS file lock on the run directory.

Every command and flow that writes into ``runs/<run_id>/`` (``capo round``, ``capo run``,
``capo stage``, ``capo noise-floor`` and the Prefect flows ``capo-round`` / ``capo-run``) holds
:func:`run_lock` while it works; a second writer fails at once with :class:`RunLockedError`,
naming the holder. Readers (``capo sql``, ``capo browse``, the report of another run) never take
it.

The lock is ``fcntl``/``msvcrt`` locking through the `filelock` library on ``<run>/.capo.lock``:
the operating system releases it when the holding process exits, however it exits (a SIGKILL
included), so a stale lock cannot outlive its holder; ``.capo.lock.json`` beside it records who
holds it (pid, host, start time, command) for the error message. Stage child processes and
fan-out workers started by the holder inherit ``CAPO_RUN_LOCK`` and do not lock again; inside one
process the lock is re-entrant (``capo-run`` calls ``capo-round``). ``capo stage critique --shards``
(a fan-out chunk) takes no lock at all: the chunks run at once, on workers of a cluster at an
address that do not inherit ``CAPO_RUN_LOCK``, and each commits only its own shards.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Iterator

LOCK_NAME = ".capo.lock"
ENV = "CAPO_RUN_LOCK"
"""Run directories whose lock an ancestor process holds (``os.pathsep``-separated)."""

_held: dict[str, list] = {}  # resolved run dir -> [FileLock, depth] held by this process


class RunLockedError(RuntimeError):
    """Another process is writing this run."""


def _holder(info_path: Path, wait_s: float = 3.0) -> str:
    """Who holds the lock, from its record. The holder writes the record just after it takes the
    lock, so a writer refused in between waits up to ``wait_s`` for it (and for a record of a live
    process on this host: one left by a killed holder is replaced by the next)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = json.loads(info_path.read_text())
            alive = info["host"] != socket.gethostname() or _alive(int(info["pid"]))
            if alive or time.monotonic() > deadline:
                return f"pid {info['pid']} on {info['host']}, started {info['started']}: {info['command']}"
        except (OSError, ValueError, KeyError, TypeError):
            if time.monotonic() > deadline:
                return "a process that left no holder record"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _inherited(run_dir: str) -> bool:
    return run_dir in os.environ.get(ENV, "").split(os.pathsep)


@contextlib.contextmanager
def run_lock(run_dir: Path | str) -> Iterator[Path]:
    """Hold the write lock of ``run_dir`` (created if missing) for the ``with`` block.

    Raises:
        RunLockedError: another process holds it; the message names the holder (pid, host, start
            time, command) and what to do.
    """
    from filelock import FileLock, Timeout

    rd = Path(run_dir).resolve()
    key = str(rd)
    if _inherited(key):  # a stage child or worker of the holder
        yield rd
        return
    if key in _held:  # re-entrant within this process
        _held[key][1] += 1
        try:
            yield rd
        finally:
            _held[key][1] -= 1
        return
    rd.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(rd / LOCK_NAME), timeout=0)
    info_path = rd / f"{LOCK_NAME}.json"
    try:
        lock.acquire()
    except Timeout:
        raise RunLockedError(
            f"run {rd} is being written by {_holder(info_path)}. One writer per run: wait for it to finish, "
            f"stop it (kill <pid>), or use another run_id. The lock is an OS lock on {rd / LOCK_NAME}: it "
            "is released the moment its holder exits, even when killed, so there is nothing stale to clear "
            "by hand.") from None
    _held[key] = [lock, 1]
    old_env = os.environ.get(ENV)
    os.environ[ENV] = os.pathsep.join(filter(None, [old_env, key]))
    try:
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                "command": " ".join(sys.argv)[:500]}
        tmp = info_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(info_path)
        yield rd
    finally:
        if old_env is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old_env
        del _held[key]
        with contextlib.suppress(OSError):
            info_path.unlink()
        lock.release()
