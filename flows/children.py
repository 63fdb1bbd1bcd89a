"""Child processes of the flows: the resolved config they read and the streamer that runs them.

Every model-loading stage runs as ``python -m flows.cli stage ...`` (or ``flows.critic_eval``, or
an ``accelerate launch`` of ``train.trainer``): a child gets the resolved config as a YAML file,
logs its lines through :func:`stream_child`, and reports its :class:`pipeline.stages.StageResult`
as one JSON line after a result tag (:data:`pipeline.stages.base.RESULT_TAG`).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path

from pipeline.config import CAPOConfig
from pipeline.config import write_resolved_config as write_config
from pipeline.stages.base import RESULT_TAG, round_paths

REPO = Path(__file__).resolve().parent.parent


def write_resolved_config(cfg: CAPOConfig, round_idx: int) -> Path:
    """The resolved config as YAML in the round dir, named by its hash (what child processes read)."""
    return write_config(cfg, round_paths(cfg, round_idx)["round_dir"])


def output_lines(fd: int):
    """Yield (text, is_progress_redraw) for each \\n- or \\r-terminated piece of a child's output."""
    buf = b""
    while chunk := os.read(fd, 65536):
        buf += chunk
        while True:
            cut = min((i for i in (buf.find(b"\n"), buf.find(b"\r")) if i >= 0), default=-1)
            if cut < 0:
                break
            piece, sep, buf = buf[:cut], buf[cut:cut + 1], buf[cut + 1:]
            text = piece.decode("utf-8", errors="replace").strip()
            if text:
                yield text, sep == b"\r"
    if buf.strip():
        yield buf.decode("utf-8", errors="replace").strip(), False


class StageChildFailed(RuntimeError):
    """A child process of a flow ended badly: a non-zero exit, a signal (the OS's OOM killer sends
    SIGKILL), or silence past the configured time (then it was stopped).

    Attributes:
        what: what the child was doing (``stage 'critique' of round 1``).
        returncode: its exit status (negative: killed by that signal).
        signal_name: ``SIGKILL`` etc. when killed by a signal, else None.
        tail: its last output lines (up to 20).
        peak_rss_mb: the peak resident memory of the child and its own children (MiB), sampled
            every 0.5 s (None when it could not be sampled).
        silent_s: seconds without output before it was stopped (None when it was not).
    """

    def __init__(self, what: str, returncode: int, tail: list[str], peak_rss_mb: float | None,
                 silent_s: float | None = None) -> None:
        import signal as _signal

        self.what, self.returncode, self.tail = what, returncode, list(tail)
        self.peak_rss_mb, self.silent_s = peak_rss_mb, silent_s
        self.signal_name = None
        if returncode < 0:
            try:
                self.signal_name = _signal.Signals(-returncode).name
            except ValueError:
                self.signal_name = f"signal {-returncode}"
        mem = f"; peak memory {peak_rss_mb:.0f} MiB" if peak_rss_mb is not None else ""
        if silent_s is not None:
            head = f"{what} was stopped: no output for {silent_s:.0f} s (scale.child_silence_s){mem}"
        elif self.signal_name:
            head = f"{what} was killed by {self.signal_name}{mem}"
            if self.signal_name == "SIGKILL":
                head += (f" of {_total_mib():.0f} MiB on this machine; a SIGKILL nobody sent is usually the "
                         "kernel's out-of-memory killer (see `dmesg` / `journalctl -k`): lower the batch sizes, "
                         "kv_cache_gib or max_model_len")
        else:
            head = f"{what} failed (exit code {returncode}){mem}"
        super().__init__(head + "; last output:\n" + "\n".join(self.tail))


def _total_mib() -> float:
    import psutil

    return psutil.virtual_memory().total / 2**20


def _tree_rss_mib(pid: int) -> float | None:
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def _stop_tree(pid: int, grace_s: float = 5.0) -> None:
    """SIGTERM the process ``pid`` and its descendants, SIGKILL what is left after ``grace_s``."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for q in procs:
        try:
            q.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for q in alive:
        try:
            q.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def stream_child(cmd: list[str], tag: str, logger: logging.Logger, what: str,
                 env_extra: dict[str, str] | None = None, result_tag: str = RESULT_TAG,
                 silence_s: float | None = None) -> dict | None:
    """Run ``cmd`` (a child of a flow) from the repo root, log its output lines as ``[tag] ...``
    (progress redraws at most every 10 s, and the final one) and return the JSON payload of its
    line starting with ``result_tag``, or None when it printed none. ``env_extra`` is added to its
    environment. The child's memory (with its own children) is sampled every 0.5 s; a child that
    prints nothing (progress redraws count) for ``silence_s`` seconds is stopped with its
    descendants (SIGTERM, then SIGKILL after 5 s); None or 0: never.

    Raises:
        StageChildFailed: the child exited non-zero, was killed by a signal, or was stopped for
            silence (the message names ``what``, the exit code or signal, the peak memory, for a
            SIGKILL the machine's memory and the OOM killer, and the last 20 output lines).
    """
    import threading

    logger.info("[%s] starting child process: %s", tag, " ".join(cmd))
    env = {**os.environ, **(env_extra or {}), "PYTHONUNBUFFERED": "1", "CAPO_CHILD": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    tail: list[str] = []
    result = None
    last_progress = 0.0
    state = {"last_output": time.monotonic(), "peak": None, "silent": None}
    done = threading.Event()

    def watch() -> None:  # memory samples and the silence limit
        while not done.wait(0.5):
            rss = _tree_rss_mib(proc.pid)
            if rss is not None:
                state["peak"] = max(state["peak"] or 0.0, rss)
            quiet = time.monotonic() - state["last_output"]
            if silence_s and quiet > silence_s and state["silent"] is None:
                state["silent"] = quiet
                logger.error("[%s] no output for %.0f s (scale.child_silence_s=%s): stopping the child", tag, quiet, silence_s)
                _stop_tree(proc.pid)
                return

    watcher = threading.Thread(target=watch, name=f"capo-watch-{tag}", daemon=True)
    watcher.start()
    assert proc.stdout is not None
    try:
        for line, is_progress in output_lines(proc.stdout.fileno()):
            state["last_output"] = time.monotonic()
            if line.startswith(result_tag):
                result = json.loads(line[len(result_tag):])
                continue
            now = time.monotonic()
            if is_progress and now - last_progress < 10 and "100%" not in line:
                continue
            last_progress = now if is_progress else last_progress
            logger.info("[%s] %s", tag, line)
            tail = (tail + [line])[-20:]
        code = proc.wait()
    finally:
        done.set()
        watcher.join()
    if code != 0 or state["silent"] is not None:
        peak = None if state["peak"] is None else round(state["peak"], 1)
        raise StageChildFailed(what, code, tail, peak, state["silent"])
    return result
