"""``capo check RUN``: verify every table, critique shard, checkpoint and training state of a run.

Reads only (no lock needed). Each committed output is verified in full against its manifest
(:func:`pipeline.storage.verify_output`: a table's sha256 and row count; every byte of a folder
against the per-file sha256 recorded at write); outputs without a manifest, critique shards whose
part does not match its sidecar (:func:`pipeline.storage.part_intact`) and temporary leftovers of a
killed write are listed; and the stages of the config's variant are checked against the keys the
config gives today (:func:`pipeline.storage.is_current`), so a config or upstream change shows as
``stale``. Every finding names the command that recomputes it.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline import storage
from pipeline.config import CAPOConfig, list_presets
from pipeline.stages import STAGES, get_stage, stage_key
from pipeline.stages.base import round_paths

STATUSES = ("ok", "stale", "missing", "modified", "uncommitted", "torn", "leftover")
"""What :func:`check_run` finds: ``ok`` (intact and, for the config's variant, current); ``stale``
(intact, but the config or an input changed since: its stage would recompute it); ``missing`` (a
stage of a round that exists has not written it, or a manifest's output is gone); ``modified``
(bytes or rows differ from the manifest); ``uncommitted`` (an output without a manifest: a write
interrupted before its commit); ``torn`` (a critique shard whose part does not match its sidecar);
``leftover`` (a temporary file or folder of a killed write; harmless, the next write removes it)."""


@dataclass(frozen=True)
class Finding:
    """One output of a run and what :func:`check_run` found (``status`` one of :data:`STATUSES`)."""

    round: int
    variant: str | None
    output: str
    status: str
    detail: str
    fix: str


def _round_cmd(cfg: CAPOConfig, k: int, config: str, variant: str | None) -> str:
    """The command that recomputes round ``k``'s output of ``variant``: the checked config's own
    variant (or a shared table) as checked; another variant by its preset where one has its name,
    else by ``variant=`` (:func:`_with_args` adds the user's other arguments to both)."""
    head = f"capo round --round {max(k, 1)} --config {config}"
    tail = f"run_id={cfg.run_id} runs_dir={cfg.runs_dir}"
    if variant in (None, cfg.variant):
        return f"{head} {tail}"
    if variant in list_presets():
        return f"{head} --preset {variant} {tail}"
    return f"{head} variant={variant} {tail}"


def _with_args(findings: list[Finding], args: str, own_variant: str) -> list[Finding]:
    """The fix commands with the user's other arguments (overrides, preset) appended: all of them for
    the checked variant's outputs and the shared tables; for another variant's, all but the user's
    ``--preset`` and ``variant=`` (its own command names it), so the shared settings (data, rollout,
    seed, ...) that keep the round's shared tables current stay. Another variant without a preset of
    its name gets a note in its detail: its own settings are not known here."""
    presets = set(list_presets())
    words = shlex.split(args)
    shared, i = [], 0
    while i < len(words):  # drop --preset X / --preset=X and variant=...
        if words[i] == "--preset":
            i += 2
            continue
        if not words[i].startswith(("--preset=", "variant=")):
            shared.append(words[i])
        i += 1
    shared_args = " ".join(shlex.quote(w) for w in shared)
    out = []
    for f in findings:
        if not f.fix.startswith("capo "):
            out.append(f)
            continue
        own = f.variant in (None, own_variant)
        extra = args if own else shared_args
        detail = f.detail
        if not own and f.variant not in presets:
            detail += f" (variant {f.variant} is no preset: add the settings it was run with)"
        out.append(Finding(f.round, f.variant, f.output, f.status, detail, f"{f.fix} {extra}".rstrip()))
    return out


def check_run(cfg: CAPOConfig, config: str = "configs/default.yaml", args: str = "") -> list[Finding]:
    """Verify run ``cfg.run_id`` under ``cfg.runs_dir``; ``config`` and ``args`` (the other
    overrides the user gave, as shell words) are repeated in the fix commands.

    Returns:
        One :class:`Finding` per output, shard and leftover found, in round order.
    Raises:
        FileNotFoundError: the run folder does not exist (names the runs there).
    """
    run_dir = Path(cfg.run_dir())
    if not run_dir.is_dir():
        runs = sorted(p.name for p in Path(cfg.runs_dir).glob("*") if (p / "round_000").is_dir() or
                      (p / "round_001").is_dir()) if Path(cfg.runs_dir).is_dir() else []
        raise FileNotFoundError(f"no run {cfg.run_id!r} in {cfg.runs_dir}/; runs there: {runs or 'none'}")
    out: list[Finding] = []
    for rd in sorted(run_dir.glob("round_[0-9][0-9][0-9]")):
        k = int(rd.name.split("_")[1])
        seen: set[Path] = set()
        # 1. what this config's variant should have, against today's keys
        for name in (STAGES if k > 0 else ()) + ("eval",):
            stage = get_stage(name)
            if stage.not_applicable(cfg) or (name == "eval" and k > 0 and not (rd / "variants" / cfg.variant).is_dir()):
                continue
            paths = round_paths(cfg, k)
            for o in stage.outputs:
                path = paths[o]
                seen.add(path)
                variant = cfg.variant if path.is_relative_to(paths["variant_dir"]) else None
                out.append(_check_one(cfg, k, variant, name, path, config))
        # 2. every other committed output (other variants, outputs of stages no longer applicable)
        for mp in sorted(rd.rglob(f"*{storage.MANIFEST_SUFFIX}")):
            path = mp.with_name(mp.name[: -len(storage.MANIFEST_SUFFIX)])
            if path in seen or "superseded" in mp.parts or storage.manifest_path(path) != mp:
                continue
            seen.add(path)
            variant = mp.parent.name if mp.parent.parent.name == "variants" else None
            why = storage.verify_output(path)
            out.append(Finding(k, variant, _rel(path, run_dir), "ok" if why is None else _status(why), why or "intact",
                               "" if why is None else _round_cmd(cfg, k, config, variant)))
        # 3. outputs without a manifest, torn shards, leftovers of killed writes
        for p in sorted(rd.rglob("*")):
            if "superseded" in p.parts or p in seen:
                continue
            rel = _rel(p, run_dir)
            if p.name.startswith(".") and ".tmp" in p.name:
                out.append(Finding(k, None, rel, "leftover", "temporary file of an interrupted write",
                                   f"rm -r {shlex.quote(str(p))}  (or let the next write of that output remove it)"))
            elif p.parent.name.endswith(".parts") and p.suffix == ".parquet":
                side = p.with_suffix(".json")
                meta = storage.read_json_object(side)
                if meta is None:
                    out.append(Finding(k, None, rel, "uncommitted", "critique shard without its sidecar (killed before "
                                       "its commit); recomputed by the next run", _round_cmd(cfg, k, config, None)))
                elif not storage.part_intact(p, meta):
                    out.append(Finding(k, None, rel, "torn", "shard part does not match its sidecar (rows or sha256); "
                                       "recomputed by the next run", _round_cmd(cfg, k, config, None)))
            elif (p.suffix == ".parquet" or p.name in ("checkpoint", "train_state")) and \
                    not storage.manifest_path(p).exists() and not p.parent.name.endswith(".parts") and \
                    not any(q.name in ("checkpoint", "train_state") for q in p.parents):
                variant = p.parent.name if p.parent.parent.name == "variants" else None
                out.append(Finding(k, variant, rel, "uncommitted", "no manifest (its write was interrupted before "
                                   "the commit)", _round_cmd(cfg, k, config, variant)))
    return _with_args(out, args, cfg.variant)


def _rel(path: Path, run_dir: Path) -> str:
    return str(path.relative_to(run_dir))


def _status(why: str) -> str:
    if why.startswith("missing"):
        return "missing"
    if why.startswith("no manifest"):
        return "uncommitted"
    return "modified"


def _check_one(cfg: CAPOConfig, k: int, variant: str | None, stage: str, path: Path, config: str) -> Finding:
    run_dir = Path(cfg.run_dir())
    rel = _rel(path, run_dir)
    fix = _round_cmd(cfg, k, config, variant) if stage != "eval" or k > 0 else \
        f"capo stage eval --round 0 --config {config} run_id={cfg.run_id} runs_dir={cfg.runs_dir}"
    man = storage.read_manifest(path)
    if man is not None and man.get("pruned") and not path.exists():
        return Finding(k, variant, rel, "ok", "pruned on purpose (train.keep_states); its manifest is kept", "")
    if not path.exists() and man is None:
        return Finding(k, variant, rel, "missing", f"stage {stage} has not written it", fix)
    why = storage.verify_output(path)
    if why is not None:
        return Finding(k, variant, rel, _status(why), why, fix)
    try:
        cur = storage.is_current(path, stage_key(stage, cfg, k))
    except (FileNotFoundError, ValueError) as e:  # an input of the stage is gone
        return Finding(k, variant, rel, "stale", f"intact, but its key cannot be computed: {e}", fix)
    if not cur.current:
        return Finding(k, variant, rel, "stale", cur.reason, fix)
    return Finding(k, variant, rel, "ok", f"intact and current ({man.get('rows')} rows)" if man.get("rows") is not None
                   else "intact and current", "")


def format_findings(findings: list[Finding], all_rows: bool = False) -> str:
    """The findings as text: one line per finding that is not ``ok`` (every line with ``all_rows``),
    then a count per status."""
    lines = []
    for f in findings:
        if f.status == "ok" and not all_rows:
            continue
        where = f"round {f.round}" + (f" [{f.variant}]" if f.variant else "")
        lines.append(f"{f.status.upper():12s} {where:32s} {f.output}: {f.detail}")
        if f.fix:
            lines.append(f"{'':12s} fix: {f.fix}")
    counts = {s: sum(f.status == s for f in findings) for s in STATUSES}
    lines.append("checked %d outputs: %s" % (len(findings), ", ".join(f"{n} {s}" for s, n in counts.items() if n)))
    return "\n".join(lines)


def findings_json(findings: list[Finding]) -> str:
    """The findings as JSON lines."""
    return "\n".join(json.dumps(asdict(f)) for f in findings)
