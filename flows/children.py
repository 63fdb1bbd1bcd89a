"""Child processes of the flows: the resolved config they read and the streamer that runs them.

Every model-loading stage runs as ``python -m flows.cli stage ...`` (or ``flows.critic_eval``, or
an ``accelerate launch`` of ``pipeline.stages.train``): a child gets the resolved config as a YAML file,
logs its lines through :func:`stream_child`, and reports its :class:`pipeline.stages.StageResult`
as one JSON line after a result tag (:data:`pipeline.stages.base.RESULT_TAG`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
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


def output_lines(fd: int, on_read=None):
    """Yield (text, is_progress_redraw) for each \\n- or \\r-terminated piece of a child's output;
    ``on_read()``, when given, is called at every chunk read (output without a line end counts)."""
    buf = b""
    while chunk := os.read(fd, 65536):
        if on_read is not None:
            on_read()
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
    SIGKILL), or silence past the configured time (then it was stopped with its descendants).

    A :class:`RuntimeError`, so callers that catch those still do; it pickles with its attributes
    (a Dask or Ray worker sends it back to the flow).

    Attributes:
        what: what the child was doing (``stage 'critique' of round 1``).
        returncode: its exit status (negative: killed by that signal).
        signal_name: ``SIGKILL`` etc. when killed by a signal, else None.
        tail: its last output lines (up to 20).
        peak_rss_mb: the peak resident memory of the child and its descendants (MiB), sampled
            every 0.5 s (None when no sample was taken).
        last_rss_mb: the last such sample (MiB), the memory it had shortly before it ended.
        silent_s: seconds without output before it was stopped (None when it was not).
        total_mb: the machine's memory (MiB), given for a SIGKILL.
        kernel_log: the kernel's "Killed process <pid>" line of the child or a descendant when
            ``dmesg`` could be read and has one, else None.
    """

    def __init__(self, what: str, returncode: int, tail: list[str], peak_rss_mb: float | None,
                 silent_s: float | None = None, last_rss_mb: float | None = None,
                 total_mb: float | None = None, kernel_log: str | None = None) -> None:
        self.what, self.returncode, self.tail = what, returncode, list(tail)
        self.peak_rss_mb, self.last_rss_mb, self.silent_s = peak_rss_mb, last_rss_mb, silent_s
        self.total_mb, self.kernel_log = total_mb, kernel_log
        self.signal_name = None
        if returncode < 0:
            try:
                self.signal_name = signal.Signals(-returncode).name
            except ValueError:
                self.signal_name = f"signal {-returncode}"
        mem = ""
        if peak_rss_mb is not None:
            mem = f"; peak memory {peak_rss_mb:.0f} MiB, last sampled {last_rss_mb or 0:.0f} MiB"
            if total_mb is not None:
                mem += f", of {total_mb:.0f} MiB on this machine"
        if silent_s is not None:
            head = f"{what} was stopped: no output for {silent_s:.0f} s (scale.child_silence_s){mem}"
        elif self.signal_name:
            head = f"{what} was killed by {self.signal_name}{mem}"
            if self.signal_name == "SIGKILL":
                head += ("; a SIGKILL nobody sent is usually the kernel's out-of-memory killer (see `dmesg` / "
                         "`journalctl -k`): lower the batch sizes, kv_cache_gib or max_model_len")
        else:
            head = f"{what} failed (exit code {returncode}){mem}"
        if kernel_log:
            head += f"; the kernel log says: {kernel_log}"
        super().__init__(head + "; last output:\n" + "\n".join(self.tail))

    def __reduce__(self):
        return (type(self), (self.what, self.returncode, self.tail, self.peak_rss_mb, self.silent_s,
                             self.last_rss_mb, self.total_mb, self.kernel_log))


STOP_GRACE_S = 5.0
"""Seconds between the SIGTERM and the SIGKILL of a child stopped for silence."""
SAMPLE_S = 0.5
"""Seconds between two memory samples (and silence checks) of a running child."""
PAUSE_S = 10.0
"""Seconds. A gap longer than this between two of the watcher's checks (``SAMPLE_S`` apart), during
which the child's processes used no CPU time either, means the round was stopped (``kill -STOP``
of its process group, Ctrl-Z) and continued: the child's silence then counts from the resumption.
A gap right after another long one is not credited (a machine starved for minutes is not a
pause), nor one during which the child ran; a pause shorter than this still counts as silence."""


def _total_mib() -> float:
    import psutil

    return psutil.virtual_memory().total / 2**20


class _Tree:
    """A child process and every descendant seen so far (kept after the child exits, so that an
    orphaned grandchild still holding the output pipe can be stopped too)."""

    def __init__(self, pid: int, popen: subprocess.Popen | None = None) -> None:
        import psutil

        self.pid, self.popen = pid, popen
        self.seen: dict[int, psutil.Process] = {}
        try:
            self.seen[pid] = psutil.Process(pid)
        except psutil.Error:
            pass

    def current(self) -> list:
        """The child and its descendants now (recorded in :attr:`seen`)."""
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            procs = []
        for q in procs:
            self.seen.setdefault(q.pid, q)
        return procs

    def rss_mib(self) -> float | None:
        """Resident memory of the child and its descendants (MiB); None when the child is gone or a
        zombie (it has ended)."""
        import psutil

        procs = self.current()
        if not procs:
            return None
        total, read = 0, False
        for q in procs:
            try:
                if q.status() == psutil.STATUS_ZOMBIE:
                    continue
                total += q.memory_info().rss
                read = True
            except psutil.Error:
                pass
        return total / 2**20 if read else None

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system, seconds) the child and its live descendants have used; None
        when none can be read."""
        import psutil

        total, read = 0.0, False
        for q in self.current():
            try:
                t = q.cpu_times()
                total += t.user + t.system
                read = True
            except psutil.Error:
                pass
        return total if read else None

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the child and every descendant still running (the ones seen earlier included),
        SIGKILL those left after ``grace_s`` seconds."""
        import psutil

        self.current()
        procs = [q for q in self.seen.values() if q.is_running()]  # is_running: not a reused pid
        for q in procs:
            try:
                q.terminate()
            except psutil.Error:
                pass
        # The direct child is waited for through its Popen: psutil would reap it, and the Popen
        # would then read exit code 0 instead of the signal that ended it.
        own = [q for q in procs if self.popen is not None and q.pid == self.pid]
        others = [q for q in procs if q not in own]
        deadline = time.monotonic() + grace_s
        _, alive = psutil.wait_procs(others, timeout=grace_s)
        if own:
            try:
                self.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                alive.append(own[0])
        for q in alive:
            try:
                q.kill()
            except psutil.Error:
                pass
        if own and own[0] in alive:
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        psutil.wait_procs([q for q in alive if q not in own], timeout=grace_s)


def _kernel_kill_line(procs: dict) -> str | None:
    """The kernel log's last "Killed process <pid>" (the OOM killer's) line for one of ``procs``
    (pid -> psutil.Process), written after the first of them started (an older line is another
    process that had the pid); None when there is none or ``dmesg`` cannot be read (it often may
    not: never an error)."""
    import re

    import psutil

    try:
        out = subprocess.run(["dmesg"], check=False, capture_output=True, text=True, errors="replace",
                             timeout=3).stdout
        since = min(q.create_time() for q in procs.values()) - psutil.boot_time() - 2.0
    except (OSError, subprocess.SubprocessError, psutil.Error, ValueError):
        return None  # not installed, not permitted, too slow, no process seen: the message goes without it
    found = None
    for line in out.splitlines():
        m = re.search(r"Kill(?:ed)? process (\d+)", line)
        if not m or int(m.group(1)) not in procs:
            continue
        at = re.match(r"\s*\[\s*(\d+(?:\.\d+)?)\]", line)  # seconds since boot
        if at is None or float(at.group(1)) >= since:
            found = line.strip()
    return found


def _watch_child(tree: _Tree, state: dict, done, silence_s: float | None, logger: logging.Logger, tag: str) -> None:
    """Sample the child tree's memory (MiB) into ``state``; stop the tree after ``silence_s`` s of silence
    (a stop and continue of the round, :data:`PAUSE_S`, restarts the count)."""
    checked = resumed = time.monotonic()
    cpu, long_gap = tree.cpu_seconds(), False
    while True:
        rss = tree.rss_mib()
        if rss is not None:
            state["peak"], state["last"] = max(state["peak"] or 0.0, rss), rss
        now, cpu_now = time.monotonic(), tree.cpu_seconds()
        gap = now - checked
        if gap > PAUSE_S:
            ran = cpu is not None and cpu_now is not None and cpu_now - cpu > 1.0
            if not long_gap and not ran:
                logger.info("[%s] the round did not run for %.0f s (stopped and continued); the child's silence "
                            "counts from now", tag, gap)
                resumed = now
            else:
                logger.warning("[%s] the watcher was not scheduled for %.0f s (the child %s); its silence still "
                               "counts", tag, gap, "ran meanwhile" if ran else "was starved too")
        checked, cpu, long_gap = now, cpu_now, gap > PAUSE_S
        quiet = now - max(state["last_output"], resumed)
        if silence_s and quiet > silence_s:
            state["silent"] = quiet
            logger.error("[%s] no output for %.0f s (scale.child_silence_s=%s): stopping the child and its "
                         "descendants", tag, quiet, silence_s)
            tree.stop()
            return
        if done.wait(SAMPLE_S):
            return


def _log_output(fd: int, heard, result_tag: str, logger: logging.Logger, tag: str) -> tuple[dict | None, list[str]]:
    """Log the child's output lines read from ``fd``; return its result payload (or None) and its last 20 lines."""
    tail: list[str] = []
    result = None
    last_progress = 0.0
    for line, is_progress in output_lines(fd, heard):
        if line.startswith(result_tag):
            result = json.loads(line[len(result_tag):])
            continue
        now = time.monotonic()
        if is_progress and now - last_progress < 10 and "100%" not in line:
            continue
        last_progress = now if is_progress else last_progress
        logger.info("[%s] %s", tag, line)
        tail = (tail + [line])[-20:]
    return result, tail


def _child_failure(what: str, code: int, tail: list[str], state: dict, tree: _Tree) -> StageChildFailed:
    """The :class:`StageChildFailed` of a child that exited with ``code`` (memory in MiB from ``state``)."""
    peak = None if state["peak"] is None else round(state["peak"], 1)
    last = None if state["last"] is None else round(state["last"], 1)
    killed = code == -signal.SIGKILL and state["silent"] is None
    kernel = None if state["silent"] is not None else _kernel_kill_line(tree.seen)
    return StageChildFailed(what, code, tail, peak, state["silent"], last,
                            round(_total_mib()) if killed else None, kernel)


def stream_child(cmd: list[str], tag: str, logger: logging.Logger, what: str,
                 env_extra: dict[str, str] | None = None, result_tag: str = RESULT_TAG,
                 silence_s: float | None = None) -> dict | None:
    """Run ``cmd`` (a child of a flow) from the repo root, log its output lines as ``[tag] ...``
    (progress redraws at most every 10 s, and the final one) and return the JSON payload of its
    line starting with ``result_tag``, or None when it printed none. ``env_extra`` is added to its
    environment.

    The memory of the child and its descendants is sampled every 0.5 s. When the child prints
    nothing (progress redraws count) for ``silence_s`` seconds, it and every descendant seen (an
    orphan holding its output included) get SIGTERM, then SIGKILL after 5 s; ``silence_s`` None or
    0: never. A stop of the round's process group longer than :data:`PAUSE_S` (Ctrl-Z, ``kill
    -STOP``) followed by a continue restarts the count. If reading its output fails (or is
    interrupted), the child is stopped the same way.

    Raises:
        StageChildFailed: the child exited non-zero, was killed by a signal, or was stopped for
            silence. The message names ``what``, the exit code or the signal's name, the peak and
            last sampled memory (MiB), for a SIGKILL the machine's memory and the OOM killer, the
            kernel's kill line when ``dmesg`` shows one, and the last 20 output lines.
        json.JSONDecodeError: the result line is not JSON (the child is stopped).
    """
    import threading

    logger.info("[%s] starting child process: %s", tag, " ".join(cmd))
    env = {**os.environ, **(env_extra or {}), "PYTHONUNBUFFERED": "1", "CAPO_CHILD": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    tree = _Tree(proc.pid, proc)
    state: dict = {"last_output": time.monotonic(), "peak": None, "last": None, "silent": None}
    done = threading.Event()

    def heard() -> None:  # any bytes read: the child is not silent
        state["last_output"] = time.monotonic()

    watcher = threading.Thread(target=_watch_child, args=(tree, state, done, silence_s, logger, tag),
                               name=f"capo-watch-{tag}", daemon=True)
    watcher.start()
    assert proc.stdout is not None
    ok = False
    try:
        result, tail = _log_output(proc.stdout.fileno(), heard, result_tag, logger, tag)
        code = proc.wait()
        ok = True
    finally:
        done.set()
        watcher.join()
        if not ok:  # reading failed or was interrupted: leave nothing running
            tree.stop()
            proc.wait()
        proc.stdout.close()
    if code != 0 or state["silent"] is not None:
        raise _child_failure(what, code, tail, state, tree)
    return result
