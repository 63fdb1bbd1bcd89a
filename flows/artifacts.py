"""The run's report as Prefect artifacts (the report itself: :mod:`pipeline.report`, which knows
nothing of Prefect)."""

from __future__ import annotations

import base64
import json
import logging
import re
from pathlib import Path

log = logging.getLogger("capo.report")


def publish_artifacts(report: dict[str, Path], key_prefix: str) -> list:
    """Publish a :func:`pipeline.report.write_report` result to the Prefect UI (inside a flow or task run).

    One markdown artifact (the tables, then every plot embedded as a base64 PNG data URL, which the
    UI's markdown renderer shows) and one table artifact (accuracy rows). Keys are ``key_prefix``
    lowercased with other characters than ``a-z0-9-`` turned into ``-``. Outside a run it logs and
    does nothing. Returns the artifact ids.
    """
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        log.info("publish_artifacts: no Prefect flow run context, nothing published (report in %s)",
                 Path(report["report_md"]).parent)
        return []
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    key = re.sub(r"[^a-z0-9-]+", "-", key_prefix.lower()).strip("-") or "capo"
    md = [Path(report["table_md"]).read_text(), "\n## Plots\n"]
    for name, path in report.items():
        if Path(path).suffix == ".png":
            b64 = base64.b64encode(Path(path).read_bytes()).decode()
            md.append(f"**{name}**\n\n![{name}](data:image/png;base64,{b64})\n")
    ids = [create_markdown_artifact("\n".join(md), key=f"{key}-report",
                                    description=f"CAPO report ({report['report_md']})")]
    rows = json.loads(Path(report["accuracy_json"]).read_text())
    if rows:
        ids.append(create_table_artifact(rows, key=f"{key}-accuracy",
                                         description="greedy accuracy (%) per variant and round"))
    return ids
