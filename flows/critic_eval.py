"""``critic-eval``: how well does a critic find the first wrong step? (Prefect flow and CLI).

    python -m flows.critic_eval run                       # configs/critic_eval.yaml, without Prefect
    python -m flows.critic_eval run --benchmark pb.jsonl n_values=[1,4] name=pb
    python -m flows.critic_eval bench --out bench.jsonl   # write the built-in benchmark as JSONL
    python -m flows.critic_eval critique --setup embedded-1.5b+gold   # one setup, in this process
    python -m flows.critic_eval export > scores.jsonl     # a finished evaluation as JSON lines
    prefect deployment run 'critic-eval/default' --watch

The flow only sequences: it runs the records of :data:`critic_eval.stages.STAGES` with the round's
runner (:func:`flows.runner.run_record`), each for its units. The benchmark, score and report
stages are light and run in the task's process; each critic setup's critique runs in a child
process (``python -m flows.critic_eval critique``), so a model's memory is returned before the
next loads. A finished stage is skipped (its tables and
manifests say so), so running again resumes. Outputs: ``runs/critic_eval/<name>/``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from critic_eval import stages as ces
from flows.runner import run_record
from pipeline.stages.base import RESULT_TAG

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = str(REPO / "configs" / "critic_eval.yaml")


def _overrides(benchmark: Optional[str], name: Optional[str], overrides: Optional[list[str]]) -> list[str]:
    out = list(overrides or [])
    if benchmark:
        out.append(f"benchmark.source={json.dumps(benchmark)}")
    if name:
        out.append(f"name={name}")
    return out


def run_all(cfg: ces.CriticEvalConfig, logger: logging.Logger, force: bool = False) -> dict:
    """Every stage for each of its units, in order (what the flow does, without Prefect), through the
    round's runner (:func:`flows.runner.run_record`); returns the output paths."""
    results = [run_record(st, cfg, unit, logger, force) for st in ces.STAGES for unit in st.units(cfg)]
    p = ces.paths(cfg)
    return {"report": str(p["report"]), "plot": str(p["plot"]), "scores": str(p["scores"]),
            "stages": [dataclasses.asdict(r) for r in results]}


# ------------------------------------------------------------------------------------------ Prefect
@task(cache_policy=NO_CACHE)
def stage_task(config: str, overrides: list[str], name: str, unit: Optional[str] = None) -> dict:
    """One critic-eval stage for one unit (a critic setup, or None), through the round's runner: light
    stages in the task's process, a setup's critique in a child process."""
    res = run_record(ces.get_stage(name), ces.load_eval_config(config, overrides), unit, get_run_logger())
    return dataclasses.asdict(res)


@flow(name="critic-eval", log_prints=True)
def critic_eval(config: str = DEFAULT_CONFIG, benchmark: Optional[str] = None, name: Optional[str] = None,
                overrides: Optional[list[str]] = None) -> dict:
    """Score critics (GenPRMs) on a step-error benchmark per voting rule and N; write a report.

    Args:
        config: YAML config (``configs/critic_eval.yaml``: the embedded 1.5B critic and the policy
            critiquing itself, gold answer on and off, N = 1, 2, 4, 8, built-in GSM8K benchmark).
        benchmark: ``gsm8k-corrupt`` or a ProcessBench-format .jsonl/.parquet file (overrides
            ``benchmark.source``).
        name: run name, the directory ``runs/critic_eval/<name>/`` (overrides ``name``).
        overrides: ``key=value`` strings, e.g. ``["n_values=[1,2,4]", "include_gold_answer=[true]"]``.

    Returns:
        Paths of the report, plot and scores table, and what each stage did.
    """
    ov = _overrides(benchmark, name, overrides)
    cfg = ces.load_eval_config(config, ov)  # fail before any work on a bad config
    logger = get_run_logger()
    stages = [stage_task.with_options(task_run_name=st.name if unit is None else f"{st.name}-{unit}")(config, ov, st.name, unit)
              for st in ces.STAGES for unit in st.units(cfg)]
    for s in stages:
        logger.info("%s: %s", s["stage"], "skipped" if s["skipped"] else f"ran in {s['seconds']:.1f}s")
    p = ces.paths(cfg)
    logger.info("report: %s", p["report"])
    return {"report": str(p["report"]), "plot": str(p["plot"]), "scores": str(p["scores"]), "stages": stages}


# ---------------------------------------------------------------------------------------------- CLI
app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Measure a critic (GenPRM): ProcessBench F1 per voting rule and N.")


def _setup_logging() -> None:
    fmt = "%(message)s" if os.environ.get("CAPO_CHILD") == "1" else "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, stream=sys.stderr, force=True)  # prefect's import set WARNING


def _config(config: str, overrides: list[str]) -> ces.CriticEvalConfig:
    """:func:`critic_eval.stages.load_eval_config`; a missing file, an unknown key or a bad value is
    a usage error (exit status 2) with the loader's message (it names them), not a traceback."""
    from pydantic import ValidationError

    try:
        return ces.load_eval_config(config, overrides)
    except (ValueError, FileNotFoundError, ValidationError) as e:
        raise typer.BadParameter(str(e)) from None


@app.command()
def run(
    config: str = typer.Option(DEFAULT_CONFIG, help="critic-eval YAML config"),
    benchmark: Optional[str] = typer.Option(None, help="gsm8k-corrupt or a ProcessBench .jsonl/.parquet"),
    name: Optional[str] = typer.Option(None, help="run name (runs/critic_eval/<name>/)"),
    force: bool = typer.Option(False, help="recompute every stage even when current"),
    overrides: Optional[list[str]] = typer.Argument(None, help="key=value overrides"),
) -> None:
    """Run the whole evaluation here, without Prefect (critics still in child processes)."""
    _setup_logging()
    cfg = _config(config, _overrides(benchmark, name, overrides))
    out = run_all(cfg, logging.getLogger("capo.critic_eval"), force=force)
    typer.echo(json.dumps({k: v for k, v in out.items() if k != "stages"}, indent=1))


@app.command()
def critique(
    setup: str = typer.Option(..., help="<critic name>+gold, <critic name>+nogold, or the name alone for an arithmetic check"),
    config: str = typer.Option(DEFAULT_CONFIG),
    force: bool = typer.Option(False),
    overrides: Optional[list[str]] = typer.Argument(None),
) -> None:
    """Sample one setup's critiques in this process (what the flow runs as a child); an unknown
    setup is a usage error naming the valid ones."""
    _setup_logging()
    cfg = _config(config, overrides)
    try:
        ces.check_setup(cfg, setup)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--setup") from None
    res = ces.critique_stage(cfg, setup, force=force)
    print(RESULT_TAG + json.dumps(dataclasses.asdict(res)), flush=True)  # what flows.runner reads


@app.command()
def bench(
    config: str = typer.Option(DEFAULT_CONFIG),
    out: Optional[str] = typer.Option(None, help="also write the items here as ProcessBench JSONL (must not exist)"),
    overrides: Optional[list[str]] = typer.Argument(None),
) -> None:
    """Build (or load) the benchmark table; optionally export it as JSONL (to a new file)."""
    _setup_logging()
    if out and Path(out).exists():
        raise typer.BadParameter(f"{out} exists; give a new file (nothing is overwritten)", param_hint="--out")
    cfg = _config(config, overrides)
    res = ces.benchmark_stage(cfg)
    if out:
        with open(out, "x") as f:  # "x": a file made while the benchmark was built is not overwritten
            for row in ces.read_benchmark(cfg):
                f.write(json.dumps(row) + "\n")
    typer.echo(res.line())


@app.command()
def export(
    config: str = typer.Option(DEFAULT_CONFIG),
    overrides: Optional[list[str]] = typer.Argument(None),
) -> None:
    """Print a finished evaluation as JSON lines (its benchmark, each setup's critic and answers,
    every score row): the evidence a figure quoted from it links to."""
    cfg = _config(config, overrides)
    try:
        lines = ces.evidence_lines(cfg)
    except FileNotFoundError as e:
        raise typer.BadParameter(str(e), param_hint="--config") from None
    for line in lines:
        typer.echo(json.dumps(line, allow_nan=False))


if __name__ == "__main__":
    app()
