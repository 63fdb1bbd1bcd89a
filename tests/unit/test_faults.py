"""Kill points (pipeline/faults.py): the spec's grammar, and a matching point SIGKILLs the whole
process group at the n-th hit (real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from pipeline.faults import kill_point, parse_spec


def test_spec_grammar():
    assert parse_spec("table.renamed:round_001/rollouts.parquet") == ("table.renamed", "round_001/rollouts.parquet", 1)
    assert parse_spec("catalog.written:catalog.duckdb@2") == ("catalog.written", "catalog.duckdb", 2)
    assert parse_spec("report.written:*@1") == ("report.written", "*", 1)
    for bad, why in (("nocolon", "expected '<event>:<path suffix>"), (":x", "expected"),
                     ("a:b@0", "positive integer, got '0'"), ("a:b@x", "positive integer, got 'x'")):
        with pytest.raises(ValueError, match=why):
            parse_spec(bad)


def test_without_the_variable_a_point_returns():
    """In a child of its own process group (a point that fired would kill pytest's group otherwise):
    without the variable, at another path and at another event, each point returns."""
    code = ("import os\n"
            "from pipeline.faults import kill_point\n"
            "os.environ.pop('CAPO_KILL_AT', None)\n"
            "kill_point('table.renamed', '/x/round_001/rollouts.parquet')\n"
            "os.environ['CAPO_KILL_AT'] = 'table.renamed:round_002/rollouts.parquet'\n"
            "kill_point('table.renamed', '/x/round_001/rollouts.parquet')\n"
            "kill_point('table.written', '/x/round_002/rollouts.parquet')\n"
            "print('returned', flush=True)\n")
    env = {k: v for k, v in os.environ.items() if k != "CAPO_KILL_AT"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          start_new_session=True, env=env)
    assert (proc.returncode, proc.stdout.split()) == (0, ["returned"]), proc.stderr


def test_the_nth_hit_kills_the_whole_process_group():
    code = ("import subprocess, sys, time\n"
            "from pipeline.faults import kill_point\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(child.pid, flush=True)\n"
            "kill_point('table.renamed', '/r/round_001/steps.parquet')\n"
            "print('after hit 1', flush=True)\n"
            "kill_point('table.renamed', '/r/round_001/steps.parquet')\n"
            "print('after hit 2', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          start_new_session=True, env={**os.environ, "CAPO_KILL_AT": "table.renamed:steps.parquet@2"})
    assert proc.returncode == -signal.SIGKILL
    lines = proc.stdout.split()
    assert lines[1:] == ["after", "hit", "1"]
    child = int(lines[0])
    try:
        assert psutil.Process(child).wait(timeout=10) == -signal.SIGKILL or not psutil.pid_exists(child)
    except psutil.NoSuchProcess:
        pass  # already reaped: it died with the group


def test_the_suite_kill_subset_covers_every_group_over_commits():
    """tests/slow/test_multi_round.py kills a default run at a seeded subset of its kill groups: two
    distinct groups in run order per seed, every group within a few dozen seeds (commits), the
    whole matrix on request, and a group's point independent of which other groups were drawn."""
    from tests.slow.test_multi_round import DEFAULT_KILL_GROUPS, KILL_GROUPS, kill_groups, kill_points

    assert DEFAULT_KILL_GROUPS == 2
    covered = set()
    for seed in range(40):
        g = kill_groups(seed, DEFAULT_KILL_GROUPS)
        assert len(g) == 2 == len(set(g)) and g == sorted(g)
        covered |= set(g)
        full = kill_points(seed)
        assert kill_points(seed, g) == [full[i] for i in g]
        assert all(p in KILL_GROUPS[i][1] for i, p in zip(g, kill_points(seed, g)))
    assert covered == set(range(len(KILL_GROUPS)))
    assert kill_groups(7, "all") == kill_groups(7, "99") == list(range(len(KILL_GROUPS)))
    assert kill_groups(1, 4) != kill_groups(2, 4) or kill_groups(1, 4) != kill_groups(3, 4)
    for bad in ("0", "-1", "some"):
        with pytest.raises(ValueError, match=f"CAPO_KILL_GROUPS='{bad}'"):
            kill_groups(0, bad)
