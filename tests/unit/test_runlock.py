"""One writer per run: the OS lock on a run directory, its message, its release
when the holder is killed, re-entrance and inheritance by the holder's children, and the CLI
refusing a second writer before it writes anything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.runlock import ENV, LOCK_NAME, RunLockedError, run_lock

HOLD = """
import sys, time
from pipeline.runlock import run_lock
with run_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(run_dir: Path, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_fails_at_once_naming_the_holder_and_a_killed_holder_frees_the_run(tmp_path, monkeypatch):
    import filelock

    timeouts = []

    class Spy(filelock.FileLock):  # records the wait each acquire was allowed
        def acquire(self, timeout=None, *args, **kwargs):
            timeouts.append(self.timeout if timeout is None else timeout)
            return super().acquire(timeout, *args, **kwargs)

    monkeypatch.setattr(filelock, "FileLock", Spy)
    run = tmp_path / "runs" / "r1"
    holder = _holder(run)
    try:
        with pytest.raises(RunLockedError, match=rf"being written by pid {holder.pid} on .*started .*Z?.*kill <pid>"):
            with run_lock(run):
                pass
        assert timeouts == [0]  # one try, no wait: fails at once
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with run_lock(run) as rd:  # the OS released the lock with the killed process: nothing to clear
        assert rd == run.resolve() and (run / LOCK_NAME).exists()
        assert os.environ[ENV].split(os.pathsep)[-1] == str(run.resolve())
    assert ENV not in os.environ and not (run / f"{LOCK_NAME}.json").exists()


def test_re_entrant_in_one_process_and_inherited_by_the_holders_children(tmp_path):
    run = tmp_path / "r2"
    with run_lock(run):
        with run_lock(run):  # capo-run calls capo-round
            pass
        # a stage child inherits CAPO_RUN_LOCK and does not lock again
        child = subprocess.run([sys.executable, "-c", "import sys; from pipeline.runlock import run_lock\n"
                                "with run_lock(sys.argv[1]): print('child ran')", str(run)],
                               capture_output=True, text=True, timeout=60)
        assert child.returncode == 0 and "child ran" in child.stdout
        # a process that did not inherit it is refused
        stranger = subprocess.run([sys.executable, "-c", "import sys; from pipeline.runlock import run_lock\n"
                                   "with run_lock(sys.argv[1]): pass", str(run)],
                                  capture_output=True, text=True, timeout=60, env={k: v for k, v in os.environ.items() if k != ENV})
        assert stranger.returncode != 0 and "RunLockedError" in stranger.stderr
    with run_lock(run):  # released after the outer block
        pass


def test_capo_round_refuses_a_locked_run_before_writing_anything(tmp_path, repo):
    runs = tmp_path / "runs"
    run = runs / "locked"
    holder = _holder(run)
    try:
        before = sorted(p.name for p in run.iterdir())
        out = subprocess.run([sys.executable, "-m", "flows.cli", "round", "--config", "configs/tiny.yaml",
                              f"runs_dir={runs}", "run_id=locked", f"data_dir={tmp_path / 'data'}"],
                             cwd=repo, capture_output=True, text=True, timeout=300,
                             env={k: v for k, v in os.environ.items() if k != ENV})
        assert out.returncode == 3, out.stderr[-2000:]
        assert f"being written by pid {holder.pid}" in out.stderr
        assert sorted(p.name for p in run.iterdir()) == before  # no round directory, no table
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_a_writer_refused_before_the_holder_wrote_its_record_still_names_it(tmp_path):
    """The race CI hit: the second writer is refused between the holder's lock and its record."""
    import json
    import socket
    import threading

    from filelock import FileLock

    run = tmp_path / "r4"
    run.mkdir()
    lock = FileLock(str(run / LOCK_NAME), timeout=0)
    lock.acquire()  # a holder that has not written its record yet
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": "now", "command": "capo round (late)"}
    late = threading.Timer(0.5, lambda: (run / f"{LOCK_NAME}.json").write_text(json.dumps(info)))
    late.start()
    try:
        with pytest.raises(RunLockedError, match=rf"pid {os.getpid()} on .*capo round \(late\)"):
            with run_lock(run):
                pass
    finally:
        late.join()
        lock.release()
