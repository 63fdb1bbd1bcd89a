"""Named kill points: where the suite SIGKILLs a run on purpose (fault injection, off by default).

Every commit point of a round calls :func:`kill_point` with an event and the path it commits:
a table written but not yet renamed into place, renamed but its manifest not yet written, a
critique shard's part written without its sidecar, a checkpoint or training state saved but not
renamed, the catalog and report rebuilt, a round finished. With ``CAPO_KILL_AT`` unset (always,
outside the tests) the call is a dictionary lookup and returns.

``CAPO_KILL_AT=<event>:<path suffix>[@<n>]`` makes the process that reaches the matching point
SIGKILL its whole process group (the ``capo`` command and every engine child, as the OS would
on an out-of-memory kill or a preempted node): the n-th time (default the first) this process
reaches an ``<event>`` point whose path ends with ``<path suffix>`` (``*``: any path). The
environment is inherited by the stage children, so a point inside a child kills the parent too.
``tests/slow/test_multi_round.py`` kills a two-round run at a seeded choice of these points, one
after the other, and checks that the resumed run equals an uninterrupted one.

Events (``pipeline/storage.py``, ``flows/runner.py``):

=====================  ==========================================================================
``table.written``      a table's temporary file is written and fsynced, not yet renamed into place
``table.renamed``      the table is in place, its manifest not yet written
``part.written``       a critique shard's part is in place, its sidecar not yet written
``state.saved``        the training state is saved to its temporary folder, not yet renamed
``checkpoint.saved``   the exported checkpoint is in its temporary folder, not yet renamed
``checkpoint.renamed`` the checkpoint is in place, its manifest not yet written
``state.renamed``      the training state is in place, its manifest not yet written
``catalog.written``    the DuckDB catalog is rebuilt in a temporary file, not yet renamed
``report.written``     the report's plots and tables are written (path: the report folder)
``round.finished``     a round's stages, summary, catalog and report are done (path: ``round_<k>``)
=====================  ==========================================================================
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

ENV = "CAPO_KILL_AT"
_hits: Counter = Counter()


def parse_spec(spec: str) -> tuple[str, str, int]:
    """``"<event>:<path suffix>[@<n>]"`` -> (event, suffix, n).

    Raises:
        ValueError: no ``:``, or an ``@n`` that is not a positive integer.
    """
    event, sep, rest = spec.partition(":")
    if not sep or not event:
        raise ValueError(f"{ENV}={spec!r}: expected '<event>:<path suffix>[@<n>]', e.g. 'table.renamed:round_001/rollouts.parquet'")
    suffix, _, nth = rest.rpartition("@") if "@" in rest else (rest, "", "1")
    if not nth.isdigit() or int(nth) < 1:
        raise ValueError(f"{ENV}={spec!r}: the count after '@' must be a positive integer, got {nth!r}")
    return event, suffix, int(nth)


def kill_point(event: str, path: Path | str = "") -> None:
    """SIGKILL this process group here if ``CAPO_KILL_AT`` names this point (see the module doc);
    otherwise return at once."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    want, suffix, nth = parse_spec(spec)
    where = str(path)
    if event != want or not (suffix == "*" or where.endswith(suffix)):
        return
    _hits[(event, suffix)] += 1
    if _hits[(event, suffix)] == nth:
        os.killpg(os.getpgrp(), signal.SIGKILL)
