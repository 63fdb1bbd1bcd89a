"""The ``capo`` command line: setup, rounds, single stages, SQL over the catalog.

    capo setup                       convert embedded models, ingest GSM8K (idempotent)
    capo round --round 1             run one round here, without Prefect (same stages)
    capo run --rounds 3              run K on-policy rounds, without Prefect
    capo stage critique --round 1    one stage (what the flows start in child processes)
    capo stage eval --round 0        held-out eval of the starting policy (round k: round k's checkpoint)
    capo noise-floor --round 0       the eval's noise floor: same checkpoint again, one bf16 rounding away
    capo report                      plots and the paper-style table of a run (runs/<run>/report/)
    capo sql "SELECT ..."            query the DuckDB catalog read-only
    capo browse RUN --round 1        the critique browser of a round (HTML; --serve on 127.0.0.1)
    capo check RUN                   verify a run's tables, shards and checkpoints against their manifests
    capo signal RUN                  does the process signal tell wrong responses from right ones (AUROC)
    capo critic-eval run|bench|critique|export   measure a critic (ProcessBench F1 per voting rule and N)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="CAPO: LLM-as-GenPRM credit assignment for RL on math.")

DEFAULT_CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "default.yaml")
"""The repository's default config, wherever the command is started (a relative ``--config`` given
by the user is read from the current directory)."""


def _setup_logging() -> None:
    import os

    child = os.environ.get("CAPO_CHILD") == "1"  # a stage child: the parent adds time and stage
    fmt = "%(message)s" if child else "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, stream=sys.stderr)


def _cfg(config: Optional[str], overrides: Optional[list[str]], preset: Optional[str] = None):
    """:func:`pipeline.config.load_config`; a missing file, an unknown preset or key, a malformed
    override or a bad value is a usage error (exit status 2) with the loader's message, which names
    the bad value and the valid ones, instead of a traceback."""
    from pydantic import ValidationError

    from pipeline.config import load_config

    try:
        return load_config(config, overrides or [], preset)
    except (ValueError, FileNotFoundError, ValidationError) as e:
        raise typer.BadParameter(str(e)) from None


def _require_round_start(cfg, round_idx: int, param_hint: str) -> None:
    """Round k > 1 samples from round k-1's checkpoint: a round whose checkpoint is missing is a
    usage error before the run lock is taken (:func:`pipeline.stages.base.policy_for_round`), not
    after the lock in its first stage."""
    from pipeline.stages.base import policy_for_round

    if round_idx < 2:  # round 1 samples from rollout.policy (converted, if embedded, in its rollout stage)
        return
    try:
        policy_for_round(cfg, round_idx)
    except FileNotFoundError as e:
        raise typer.BadParameter(str(e), param_hint=param_hint) from None


@app.command()
def setup(
    config: str = typer.Option(DEFAULT_CONFIG, help="config whose models and prompts to prepare"),
    preset: Optional[str] = typer.Option(None),
    models: Optional[list[str]] = typer.Option(None, "--model", help="extra embedded model names to convert"),
    overrides: Optional[list[str]] = typer.Argument(None, help="section.key=value overrides"),
) -> None:
    """Convert the config's embedded models to HF checkpoints and ingest its prompt tables."""
    _setup_logging()
    from pipeline.assets.models import EMBEDDED_MODELS
    from pipeline.stages.base import prompts_path, resolve_model

    unknown = [m for m in models or [] if m not in EMBEDDED_MODELS and not Path(m).expanduser().is_dir()]
    if unknown:  # resolve_model would return such a name unchanged: nothing converted
        raise typer.BadParameter(f"{', '.join(map(repr, unknown))}: not an embedded model nor an existing checkpoint "
                                 f"folder; embedded: {', '.join(sorted(EMBEDDED_MODELS))}", param_hint="--model")
    cfg = _cfg(config, overrides, preset)
    try:  # first: a mistyped data.train_prompts is a usage error before minutes of model conversion
        prompts = str(prompts_path(cfg))
    except (FileNotFoundError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint="data.train_prompts") from None
    out = {"policy": resolve_model(cfg.rollout.policy, cfg)}
    if cfg.critique.enabled:
        out["critic"] = resolve_model(cfg.critique.critic, cfg)
    for m in models or []:
        out[m] = resolve_model(m, cfg)
    out["train_prompts"] = prompts
    typer.echo(json.dumps(out, indent=1))


@app.command("round")
def round_cmd(
    round: int = typer.Option(1, "--round", "-r", min=1, help="round number (1 samples from the starting policy)"),
    config: str = typer.Option(DEFAULT_CONFIG, help="YAML config"),
    preset: Optional[str] = typer.Option(None, help="a preset of configs/presets/, e.g. capo-majority, capo-intersection, capo-readout, grpo (an unknown name lists them all)"),
    force: Optional[list[str]] = typer.Option(None, help="stage(s) to recompute even when current"),
    overrides: Optional[list[str]] = typer.Argument(None, help="section.key=value overrides"),
) -> None:
    """Run one round (every stage, skipping finished ones) without Prefect."""
    _setup_logging()
    from pipeline.engines.host import policy_engine_session
    from pipeline.stages import REGISTRY

    unknown = [name for name in force or [] if name not in REGISTRY]
    if unknown:
        raise typer.BadParameter(f"--force {', '.join(unknown)}: not a stage; valid: {', '.join(REGISTRY)}",
                                 param_hint="--force")

    cfg = _cfg(config, overrides, preset)
    _require_round_start(cfg, round, "--round")
    with _writing(cfg), policy_engine_session(cfg):
        _run_round(cfg, round, force or [])


@app.command("run")
def run_cmd(
    rounds: int = typer.Option(2, "--rounds", "-k", min=1, help="number of on-policy rounds"),
    start_round: int = typer.Option(1, min=1, help="first round (earlier rounds must be finished)"),
    config: str = typer.Option(DEFAULT_CONFIG, help="YAML config"),
    preset: Optional[str] = typer.Option(None, help="a name from configs/presets/"),
    overrides: Optional[list[str]] = typer.Argument(None, help="section.key=value overrides"),
) -> None:
    """Run K on-policy rounds without Prefect (round k+1 samples from round k's checkpoint); a
    killed run started again continues from the first unfinished stage of the first unfinished round."""
    _setup_logging()
    from pipeline.engines.host import policy_engine_session

    cfg = _cfg(config, overrides, preset)
    _require_round_start(cfg, start_round, "--start-round")
    with _writing(cfg), policy_engine_session(cfg):  # scale.policy_engine=persistent: one engine for all rounds
        for k in range(start_round, start_round + rounds):
            _run_round(cfg, k, [])


def _writing(cfg) -> contextlib.ExitStack:
    """The run's write lock (:func:`pipeline.runlock.run_lock`) as a context to hold while writing;
    a second writer exits at once with status 3 and a message naming the holder."""
    from pipeline.runlock import RunLockedError, run_lock

    stack = contextlib.ExitStack()
    try:
        stack.enter_context(run_lock(cfg.run_dir()))
    except RunLockedError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(3) from None
    return stack


def _run_round(cfg, round_idx: int, force: list[str]) -> None:
    import time

    from flows.runner import finish_round, run_stage
    from pipeline.stages import round_plan
    from pipeline.precision import describe, precision_record

    typer.echo(describe(precision_record(cfg)))
    t0 = time.perf_counter()
    results = [dataclasses.asdict(run_stage(name, cfg, k, force=name in force)) for name, k in round_plan(round_idx)]
    done = finish_round(cfg, round_idx, results, time.perf_counter() - t0)
    typer.echo(f"round {round_idx} summary: {done['summary']}")
    typer.echo(f"catalog: {done['catalog']}")
    typer.echo(f"report: {done.get('report_html', '')}")


@app.command()
def stage(
    name: str = typer.Argument(..., help="rollout | verify | segment | mc | densr | critique | vote | reward | train | eval"),
    round: int = typer.Option(1, "--round", "-r", min=0, help="round number (0, the starting policy: eval only)"),
    config: str = typer.Option(DEFAULT_CONFIG),
    preset: Optional[str] = typer.Option(None),
    force: bool = typer.Option(False, help="recompute even when current"),
    shards: Optional[str] = typer.Option(
        None, help="critique only: compute and commit just these shards of the round's plan (comma-separated "
                   "ids, e.g. 0,3,5), not the table: what a fan-out worker runs (flows/fanout.py); it takes "
                   "no run lock (the chunks of one fan-out run at once), so run it by hand only on a run "
                   "nothing else writes"),
    allow_stale_inputs: bool = typer.Option(
        False, help="run even when an input is not current (made from an earlier version of its own inputs, "
                    "or under other settings): the check before the run is skipped"),
    overrides: Optional[list[str]] = typer.Argument(None),
) -> None:
    """Run a single stage in this process (the critique stage with scale.critique.runner=dask|ray
    fans its shards out to the cluster and finalizes here; the train stage with train.launcher set
    runs under that launcher, as in a round).

    Before the run lock, every input table the stage reads must be current, as a round would find
    it (:func:`flows.runner.require_current_inputs`): a stale one is a usage error naming it and the
    stages to run first. A stage child of the runner skips the check (the round ran the stages
    before it), and so does ``--allow-stale-inputs``."""
    _setup_logging()
    import os
    import resource

    from flows.runner import run_stage, stage_function
    from pipeline.stages.base import RESULT_TAG

    from pipeline.stages import get_stage

    cfg = _cfg(config, overrides, preset)
    try:
        st = get_stage(name)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="NAME") from None
    if round == 0 and 0 not in st.rounds(1):  # before the lock: round 0 is the starting policy, evaluated only
        raise typer.BadParameter(f"--round 0 is the starting policy, which only the eval stage takes; {name} "
                                 "needs a round >= 1", param_hint="--round")
    if 0 not in st.rounds(1):  # a training stage of round k follows round k-1's checkpoint (the eval, which
        _require_round_start(cfg, round, "--round")  # also takes round 0, reads round k's own)
    if shards is not None:
        # no run lock here: a fan-out's chunks run at once as workers of one stage, each committing only its
        # own shards' part files, on cluster workers that need not inherit the holder's lock (docs/resume.md)
        if st.shard_function is None:
            raise typer.BadParameter(f"--shards applies to a stage with shards (the critique stage), not {name!r}")
        try:
            ids = [int(x) for x in shards.split(",") if x.strip()]
        except ValueError:
            raise typer.BadParameter(f"--shards takes comma-separated shard ids (e.g. 0,3,5), got {shards!r}")
        from pipeline.stages.base import ShardIdError

        try:
            out = st.load_shards()(cfg, round, ids)
        except ShardIdError as e:  # raised before any engine is loaded
            raise typer.BadParameter(str(e), param_hint="--shards") from None
        out["peak_rss_mb"] = float(f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f}")
        print(RESULT_TAG + json.dumps(out), flush=True)
        return
    if not allow_stale_inputs and os.environ.get("CAPO_CHILD") != "1" and not st.not_applicable(cfg):
        from flows.runner import StaleInputsError, require_current_inputs

        try:  # before the lock and any model: a stage on stale inputs writes wrong tables as current
            require_current_inputs(name, cfg, round)
        except StaleInputsError as e:
            raise typer.BadParameter(str(e), param_hint="NAME") from None
    with _writing(cfg):  # a no-op in a stage child of the runner (it inherits its parent's lock)
        if st.fans_out(cfg) or st.launcher(cfg):
            # skips when current, else fans out (flows/fanout.py) or starts the trainer under train.launcher
            res = run_stage(name, cfg, round, force=force)
        else:
            res = stage_function(name)(cfg, round, force=force)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
            res = dataclasses.replace(res, peak_rss_mb=float(f"{peak:.1f}"))  # (`round` is the CLI option here)
    print(RESULT_TAG + json.dumps(dataclasses.asdict(res)), flush=True)


@app.command("noise-floor")
def noise_floor_cmd(
    round: int = typer.Option(0, "--round", "-r", min=0, help="the round whose eval policy is measured (0 = the start)"),
    config: str = typer.Option(DEFAULT_CONFIG),
    preset: Optional[str] = typer.Option(None),
    force: bool = typer.Option(False, help="re-evaluate even when the arms' tables are current"),
    overrides: Optional[list[str]] = typer.Argument(None),
) -> None:
    """Measure the held-out eval's noise floor of a round: its eval policy evaluated again, and a copy
    one bf16 rounding away, each paired with the round's eval table (pipeline/noise_floor.py); the
    report prints it. Run after the round's eval stage: a round whose eval table is not written or
    not current is a usage error, before the run lock."""
    import os

    _setup_logging()
    from pipeline.engines.base import batch_invariant_env

    os.environ.update(batch_invariant_env())  # before vLLM is imported, as the runner gives the eval stage
    from pipeline.noise_floor import measure_noise_floor, require_eval_table

    cfg = _cfg(config, overrides, preset)
    try:  # before the lock and any model: the round's eval table must be written and current
        require_eval_table(cfg, round)
    except FileNotFoundError as e:
        raise typer.BadParameter(str(e), param_hint="--round") from None
    with _writing(cfg):
        summary = measure_noise_floor(cfg, round, force=force)
        typer.echo(json.dumps(summary, indent=1))
        from pipeline.report import write_report

        typer.echo(f"report: {write_report(Path(cfg.runs_dir), cfg.run_id).get('report_html', '')}")


@app.command()
def report(
    config: str = typer.Option(DEFAULT_CONFIG, help="config naming the run (run_id, runs_dir)"),
    preset: Optional[str] = typer.Option(None),
    out_dir: Optional[str] = typer.Option(None, help="default: <runs_dir>/<run_id>/report"),
    overrides: Optional[list[str]] = typer.Argument(None),
) -> None:
    """Write a run's report: PNG plots over rounds, report.md and report.html (paper-style table)."""
    _setup_logging()
    from pipeline.report import report_run_dir, write_report

    cfg = _cfg(config, overrides, preset)
    try:
        report_run_dir(Path(cfg.runs_dir), cfg.run_id)
    except FileNotFoundError as e:
        raise typer.BadParameter(str(e)) from None
    try:
        out = write_report(Path(cfg.runs_dir), cfg.run_id, Path(out_dir) if out_dir else None)
    except FileExistsError as e:
        raise typer.BadParameter(str(e), param_hint="--out-dir") from None
    typer.echo(json.dumps({k: str(v) for k, v in out.items()}, indent=1))


@app.command()
def sql(
    query: str = typer.Argument(..., help="SQL over the catalog views (rollouts, critiques, ...)"),
    runs_dir: str = typer.Option("runs", help="directory holding catalog.duckdb"),
    max_rows: int = typer.Option(50, help="rows to print"),
) -> None:
    """Run SQL on the DuckDB catalog, opened read-only (safe while a round is running): only statements
    that read (SELECT, and DESCRIBE, SHOW, SUMMARIZE, WITH, FROM, VALUES, which parse as one; EXPLAIN
    [ANALYZE] of one) are run, and files outside the runs and prompt folders can be neither read nor
    written. A syntax error or an unknown view exits with status 2 and DuckDB's message."""
    import duckdb

    path = Path(runs_dir) / "catalog.duckdb"
    if not path.exists():
        raise typer.BadParameter(f"no catalog at {path}; run a round first (or `capo catalog`)")
    # read-only, and no file access beyond the catalog's own tables: COPY ... TO, read_csv('/etc/...')
    # and the like are refused (the views' Parquet paths are allowed)
    con = duckdb.connect(str(path), read_only=True)
    try:
        _lock_down(con, path)
        try:
            _refuse_writes(con, query)
            con.sql(query).show(max_rows=max_rows, max_width=200)
        except duckdb.Error as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
    finally:
        con.close()


def _explained_statement(query: str) -> str | None:
    """The text of the statement an ``EXPLAIN [ANALYZE]`` statement explains, found with DuckDB's own
    tokenizer (so comments, nested ones included, are skipped as the parser skips them); None for
    an option list (``EXPLAIN (FORMAT ...)``) or anything else this does not read."""
    import duckdb

    starts = [pos for pos, kind in duckdb.tokenize(query) if kind != duckdb.token_type.comment]
    words = [query[a:b].strip().upper() for a, b in zip(starts, [*starts[1:], len(query)])]
    if len(words) < 2 or words[0] != "EXPLAIN" or words[1].startswith("("):
        return None
    at = 2 if words[1] in ("ANALYZE", "ANALYSE") else 1
    return query[starts[at]:] if at < len(starts) else None


def _refuse_writes(con, query: str) -> None:
    """Refuse ``query`` unless each of its statements only reads: DuckDB parses it
    (``extract_statements``) and every statement must be a SELECT (DESCRIBE, SHOW, SUMMARIZE, WITH,
    FROM and VALUES parse as one) or an EXPLAIN of a SELECT (EXPLAIN ANALYZE runs its statement, so
    ``EXPLAIN ANALYZE COPY ...`` is refused too). PRAGMA is refused (some write or change settings).

    Raises:
        typer.BadParameter: no statement, or a statement of another type (named).
        duckdb.Error: the query does not parse.
    """
    import duckdb

    statements = con.extract_statements(query)
    if not statements:
        raise typer.BadParameter("no SQL statement given", param_hint="QUERY")
    for st in statements:
        kind = st.type.name
        if kind == "EXPLAIN":
            text = _explained_statement(st.query)
            try:
                inner = con.extract_statements(text) if text is not None else []
            except duckdb.Error:
                inner = []
            if len(inner) == 1 and inner[0].type == duckdb.StatementType.SELECT:
                continue
            kind = f"EXPLAIN {' '.join(i.type.name for i in inner) or '(whose statement could not be read)'}"
        elif kind == "SELECT":
            continue
        raise typer.BadParameter(
            f"capo sql is read-only: {kind} statements are refused. Allowed: SELECT (also WITH, FROM, VALUES, "
            "DESCRIBE, SHOW, SUMMARIZE) and EXPLAIN [ANALYZE] SELECT; for PRAGMA table_info('v') use "
            "SELECT * FROM pragma_table_info('v')", param_hint="QUERY")


def _run_folder(run: str, runs_dir: str | Path) -> Path:
    """The run folder ``capo check``, ``browse`` and ``signal`` read: ``<runs_dir>/<run>`` when that
    folder exists, else ``run`` itself when it is the path of a folder (``runs/x``, ``./x``, an
    absolute path, or a folder in the working directory).

    Raises:
        typer.BadParameter: neither is a folder; the message lists the runs in ``runs_dir``.
    """
    under, path = Path(runs_dir) / run, Path(run)
    if len(path.parts) == 1 and run not in (".", "..") and under.is_dir():  # a run id: one name
        return under
    if path.is_dir():
        return path
    root = Path(runs_dir)
    runs = sorted(p.name for p in root.glob("*") if (p / "round_000").is_dir() or (p / "round_001").is_dir()) \
        if root.is_dir() else []
    raise typer.BadParameter(f"no run {run!r} in {runs_dir}/ and no such folder; runs there: {runs or 'none'}",
                             param_hint="RUN")


@app.command()
def check(
    run: str = typer.Argument(..., help="run id (a folder of runs_dir) or the path of a run folder"),
    config: str = typer.Option(DEFAULT_CONFIG, help="the run's config (its variant's keys are checked)"),
    preset: Optional[str] = typer.Option(None),
    all_rows: bool = typer.Option(False, "--all", help="list the intact outputs too"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per output"),
    overrides: Optional[list[str]] = typer.Argument(None, help="section.key=value overrides (e.g. runs_dir=...)"),
) -> None:
    """Verify every table, critique shard, checkpoint and training state of a run against its
    manifests (every byte), and the config's variant against today's keys; print what is stale,
    missing, modified, uncommitted or torn with the command that recomputes it. Exit status 1 when
    anything is not intact and current. Reads only: safe while a round runs."""
    _setup_logging()
    from pipeline.check import check_run, findings_json, format_findings

    import shlex

    runs_dir = _cfg(config, overrides, preset).runs_dir
    folder = _run_folder(run, runs_dir)
    if folder.resolve() == (Path(runs_dir) / folder.name).resolve():  # a run of runs_dir, by name or path
        where = [f"run_id={folder.name}"]
    else:  # a run folder's path: its parent holds the runs
        where = [f"runs_dir={folder.resolve().parent}", f"run_id={folder.resolve().name}"]
    cfg = _cfg(config, [*(overrides or []), *where], preset)
    args = " ".join(shlex.quote(o) for o in overrides or [] if not o.startswith(("run_id=", "runs_dir=")))
    try:
        findings = check_run(cfg, config, (f"--preset {preset} " if preset else "") + args)
    except FileNotFoundError as e:
        raise typer.BadParameter(str(e)) from None
    typer.echo(findings_json(findings) if as_json else format_findings(findings, all_rows))
    if any(f.status not in ("ok", "leftover") for f in findings):
        raise typer.Exit(1)


@app.command()
def browse(
    run: str = typer.Argument(..., help="run id (a folder of --runs-dir) or the path of a run folder"),
    round_idx: int = typer.Option(1, "--round", "-r", help="round to show (>= 1)"),
    variant: Optional[str] = typer.Option(None, help="variant to show (default: the round's first)"),
    runs_dir: str = typer.Option("runs", help="directory holding the runs"),
    out: Optional[str] = typer.Option(None, help="folder to write index.html to (default: <run>/browse/round_<k>-<variant>/)"),
    serve: bool = typer.Option(False, "--serve", help="serve the page on 127.0.0.1 (only) until Ctrl-C"),
    port: int = typer.Option(8765, help="port for --serve"),
) -> None:
    """Write the critique browser of a round: each response's steps as the critic saw them, the
    votes, the raw critiques and the token rewards and advantages, with filters. Opens from disk."""
    _setup_logging()
    from pipeline.browse import build_browser
    from pipeline.browse import serve as serve_folder

    run_dir = _run_folder(run, runs_dir)
    if round_idx < 1:
        raise typer.BadParameter(f"--round {round_idx}: round 0 is the starting policy (no rollouts); give a round >= 1")
    try:
        page = build_browser(run_dir, round_idx, variant, Path(out) if out else None)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        raise typer.BadParameter(str(e)) from None
    typer.echo(str(page))
    if serve:
        server = serve_folder(page.parent, port)
        typer.echo(f"serving on http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C stops)")
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()


@app.command("signal")
def signal_cmd(
    run: str = typer.Argument(..., help="run id (a folder of --runs-dir) or the path of a run folder"),
    runs_dir: str = typer.Option("runs", help="directory holding the runs"),
    rounds: Optional[list[int]] = typer.Option(None, "--round", "-r", help="rounds to measure (default: every one)"),
    n_boot: int = typer.Option(2000, min=1, help="bootstrap resamples for the AUROC's 95 % interval"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per row"),
) -> None:
    """Measure a finished run's process signal where it is used: per round, variant, signal source
    (the variant's vote of the critiques, an exact check of the steps' written arithmetic, both; with
    the log-prob readout also the readout and the readout with the check) and scope (all
    steps; the steps before the one stating the final answer), the share of right and of wrong
    responses with a penalized step and the AUROC of the penalized-token share against a wrong
    outcome with its bootstrap interval, and the groups that train on the outcome or on the process
    signal alone. Reads the tables only."""
    from pipeline.process_signal import format_rows, measure_run

    run_dir = _run_folder(run, runs_dir)
    try:
        rows = measure_run(run_dir, rounds or None, n_boot=n_boot)
    except (FileNotFoundError, ValueError) as e:  # no such round; tables that do not fit together
        raise typer.BadParameter(str(e)) from None
    typer.echo("\n".join(json.dumps(r) for r in rows) if as_json else format_rows(rows))


@app.command("mc-labels")
def mc_labels_cmd(
    out: str = typer.Option(..., "--out", help="the ProcessBench-format JSONL file to write (must not exist)"),
    round: int = typer.Option(1, "--round", "-r"),
    config: str = typer.Option(DEFAULT_CONFIG),
    preset: Optional[str] = typer.Option("vineppo", help="the preset the round ran with"),
    drop: float = typer.Option(0.5, help="the smallest fall of Monte Carlo value that marks a step wrong"),
    overrides: Optional[list[str]] = typer.Argument(None),
) -> None:
    """Write a VinePPO round's responses as a critic-eval benchmark: each fully valued response's first
    step whose Monte Carlo value falls by at least --drop is its label (-1: none). Score a critic on
    them with ``capo critic-eval run --benchmark FILE``. Reads the tables only."""
    from collections import Counter

    from pipeline.mc_labels import mc_label_records

    path = Path(out)
    if path.exists():
        raise typer.BadParameter(f"{path} exists; give a new file (nothing is overwritten)", param_hint="--out")
    cfg = _cfg(config, overrides, preset)
    try:
        records = mc_label_records(cfg, round, drop)
    except (FileNotFoundError, ValueError) as e:
        raise typer.BadParameter(str(e)) from None
    with open(path, "x", encoding="utf-8") as f:  # "x": a file made meanwhile is not overwritten either
        f.write("".join(json.dumps(r) + "\n" for r in records))
    labels = Counter("right" if r["label"] < 0 else f"step {r['label']}" for r in records)
    typer.echo(json.dumps({"out": str(path), "items": len(records), "labels": dict(sorted(labels.items()))}))


def _lock_down(con, catalog_path: Path) -> None:
    """Let ``con`` touch files only in the folders the catalog's views read (the runs folder, the
    prompt tables' folder): DuckDB ``allowed_directories`` with ``enable_external_access`` off and
    the configuration locked. Reading any other file, ``COPY ... TO`` outside those folders,
    extensions and settings are refused."""
    from pipeline.storage import sql_literal

    dirs = {str(catalog_path.resolve().parent)}
    for (sql,) in con.execute("SELECT sql FROM duckdb_views() WHERE NOT internal").fetchall():
        for part in (sql or "").split("'"):
            if part.startswith("/") and ("/round_" in part or part.endswith((".parquet", ".json"))):
                dirs.add(part.split("*")[0] if "*" in part else str(Path(part).parent))  # a glob's fixed folder
    allowed = ", ".join(sql_literal(d.rstrip("/") + "/") for d in sorted(dirs))
    con.execute(f"SET allowed_directories = [{allowed}]")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


@app.command()
def catalog(runs_dir: str = "runs", data_dir: str = "data") -> None:
    """Rebuild the DuckDB catalog views over every run's tables (``runs_dir`` must exist)."""
    from pipeline.storage import refresh_catalog

    if not Path(runs_dir).is_dir():
        raise typer.BadParameter(f"no folder {runs_dir}; give the folder that holds the runs (their config's "
                                 "runs_dir)", param_hint="--runs-dir")

    typer.echo(str(refresh_catalog(Path(runs_dir), Path(data_dir))))


@app.command("critic-eval", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def critic_eval_cmd(ctx: typer.Context) -> None:
    """Measure a critic: ProcessBench F1 per voting rule and N (`capo critic-eval --help`)."""
    from flows.critic_eval import app as sub  # imported lazily: it imports Prefect

    sub(args=ctx.args, prog_name="capo critic-eval")


if __name__ == "__main__":
    app()
