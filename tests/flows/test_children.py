"""flows/children.py ``stream_child`` with real child processes: a failure names the stage, the
exit code or signal, the memory and the last lines; a silent child is stopped with its descendants."""

from __future__ import annotations

import logging
import sys
import time

import psutil
import pytest

from flows.children import StageChildFailed, stream_child

LOG = logging.getLogger("test.children")


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_non_zero_exit_names_the_stage_the_code_and_the_last_lines():
    code = "import sys\nfor i in range(30): print('line', i)\nsys.exit(3)"
    with pytest.raises(StageChildFailed) as e:
        stream_child(_py(code), "verify", LOG, "stage 'verify' of round 1")
    err = e.value
    assert err.returncode == 3 and err.signal_name is None and err.silent_s is None
    assert str(err).startswith("stage 'verify' of round 1 failed (exit code 3)")
    assert err.tail == [f"line {i}" for i in range(10, 30)] and "line 29" in str(err)


def test_a_sigkill_names_the_signal_the_memory_and_the_oom_killer():
    code = ("import os, time\nblob = bytearray(300 * 2**20)\nfor i in range(0, len(blob), 4096): blob[i] = 1\n"
            "print('allocated', flush=True)\ntime.sleep(2)\nos.kill(os.getpid(), 9)")
    with pytest.raises(StageChildFailed) as e:
        stream_child(_py(code), "critique", LOG, "stage 'critique' of round 2")
    err = e.value
    assert err.returncode == -9 and err.signal_name == "SIGKILL"
    assert err.peak_rss_mb is not None and err.peak_rss_mb >= 250, err.peak_rss_mb
    msg = str(err)
    assert msg.startswith("stage 'critique' of round 2 was killed by SIGKILL; peak memory ")
    assert "out-of-memory killer" in msg and "MiB on this machine" in msg and msg.endswith("allocated")


def test_a_silent_child_and_its_grandchild_are_stopped():
    code = ("import subprocess, sys, time\n"
            "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print('grandchild', g.pid, flush=True)\ntime.sleep(120)")
    t0 = time.monotonic()
    with pytest.raises(StageChildFailed) as e:
        stream_child(_py(code), "train", LOG, "stage 'train' of round 1", silence_s=2)
    took = time.monotonic() - t0
    err = e.value
    assert 2 <= err.silent_s < 4 and took < 15
    assert "was stopped: no output for" in str(err) and "(scale.child_silence_s)" in str(err)
    grandchild = int(err.tail[0].split()[1])
    deadline = time.monotonic() + 10
    while psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the grandchild outlived the stop"
        time.sleep(0.1)


def test_a_child_that_keeps_talking_is_not_stopped():
    code = "import time\nfor i in range(8):\n    print('tick', i, flush=True)\n    time.sleep(0.5)\nprint('@@R{\"ok\": 1}')"
    assert stream_child(_py(code), "eval", LOG, "stage 'eval' of round 1", result_tag="@@R", silence_s=2) == {"ok": 1}
