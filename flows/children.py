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


def stream_child(cmd: list[str], tag: str, logger: logging.Logger, what: str,
                 env_extra: dict[str, str] | None = None, result_tag: str = RESULT_TAG) -> dict | None:
    """Run ``cmd`` (a child of a flow) from the repo root, log its output lines as ``[tag] ...``
    (progress redraws at most every 10 s, and the final one) and return the JSON payload of its
    line starting with ``result_tag``, or None when it printed none. ``env_extra`` is added to its
    environment.

    Raises:
        RuntimeError: the child exited non-zero (``what`` failed, with its last 20 output lines).
    """
    logger.info("[%s] starting child process: %s", tag, " ".join(cmd))
    env = {**os.environ, **(env_extra or {}), "PYTHONUNBUFFERED": "1", "CAPO_CHILD": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    tail: list[str] = []
    result = None
    last_progress = 0.0
    assert proc.stdout is not None
    for line, is_progress in output_lines(proc.stdout.fileno()):
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
    if code != 0:
        raise RuntimeError(f"{what} failed (exit code {code}); last output:\n" + "\n".join(tail))
    return result
