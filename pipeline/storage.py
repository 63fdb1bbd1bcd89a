"""Parquet tables, manifests and the DuckDB catalog: all I/O of stage outputs lives here.

A stage output ``X.parquet`` is committed in two atomic steps: the table is written to a
temporary file and renamed into place, then ``X.manifest.json`` (what produced it) is written the
same way. The manifest is the commit marker: a table without a manifest, or whose manifest
records another key or another file fingerprint, is not current and its stage runs again.
Whatever a re-run replaces is moved to ``superseded/`` beside it, never silently overwritten.

Correctness of resume therefore comes from the files, not from an orchestrator's cache.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.faults import kill_point
from pipeline.schemas import ADDED_COLUMNS, SCHEMAS, check_schema, fill_added_columns

log = logging.getLogger("capo.storage")

MANIFEST_SUFFIX = ".manifest.json"


# ------------------------------------------------------------------------------------ fingerprints
def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 hex digest of a file's bytes (streams 4 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


_SAMPLE_BLOCKS = 16
_SAMPLE_BYTES = 1 << 16


def dir_fingerprint(path: Path) -> str:
    """Cheap fingerprint of a directory (checkpoint): sha256 over (relative path, size) of every
    file, the bytes of every file under 1 MiB (configs, tokenizer, index) and, of every larger file
    (weights), 16 blocks of 64 KiB spread evenly from its first to its last byte.

    The sampled blocks make a re-trained checkpoint of the same shape fingerprint differently (a
    PPO update moves nearly every weight, so every block changes; with (path, size) alone, eval and
    the next round's rollouts were taken as current against the old weights), while a fingerprint
    stays ~1 MiB of reading per file. A change confined to bytes between the blocks is not seen.
    """
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        size = p.stat().st_size
        h.update(f"{p.relative_to(path)}:{size}\n".encode())
        if size < (1 << 20):
            h.update(p.read_bytes())
            continue
        with open(p, "rb") as f:
            last = size - _SAMPLE_BYTES
            for k in range(_SAMPLE_BLOCKS):
                f.seek(last * k // (_SAMPLE_BLOCKS - 1))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def fingerprint(path: Path) -> str:
    """Fingerprint of a stage output: file sha256 or :func:`dir_fingerprint`."""
    return dir_fingerprint(path) if path.is_dir() else file_sha256(path)


def key_hash(key: dict) -> str:
    """sha256 (16 hex chars) of a stage key, JSON with sorted keys."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


_CODE_VERSION: str | None = None


def code_version() -> str:
    """``capo <version>+g<commit>[-dirty]`` of the running code (git when available)."""
    global _CODE_VERSION
    if _CODE_VERSION is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            ver = version("capo")
        except PackageNotFoundError:
            ver = "0+unknown"
        repo = Path(__file__).resolve().parent.parent
        try:
            sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"],
                                 capture_output=True, text=True, timeout=5).stdout.strip()
            dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            ver += f"+g{sha}" + ("-dirty" if dirty else "") if sha else ""
        except (OSError, subprocess.SubprocessError):
            pass
        _CODE_VERSION = ver
    return _CODE_VERSION


# --------------------------------------------------------------------------------------- manifests
def manifest_path(path: Path) -> Path:
    return path.with_name(path.name + MANIFEST_SUFFIX) if path.suffix else path.parent / (path.name + MANIFEST_SUFFIX)


def read_json_object(path: Path) -> dict | None:
    """The JSON object in ``path``; None when it is missing, unreadable, not UTF-8, not JSON or not
    an object (a shard's sidecar: callers treat it as not written)."""
    try:
        meta = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


def read_manifest(path: Path) -> dict | None:
    """The manifest of stage output ``path``, or None when there is none, or it is unreadable (not
    UTF-8, not JSON, not a JSON object): the output then reads as not current and is recomputed."""
    mp = manifest_path(path)
    if not mp.is_file():
        return None
    try:
        man = json.loads(mp.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        log.warning("manifest %s is unreadable (%s); treating %s as not current", mp, type(e).__name__, path.name)
        return None
    if not isinstance(man, dict) or not isinstance(man.get("key_hash", ""), str):
        log.warning("manifest %s does not hold a manifest; treating %s as not current", mp, path.name)
        return None
    return man


def fsync_file(path: Path | str) -> None:
    """Flush ``path``'s data to disk (a commit point must survive a power loss, not only a kill)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path | str) -> None:
    """Flush a directory's entries (a rename into it) to disk; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: Path | str) -> None:
    """fsync every file and folder under folder ``path`` (deepest first) and ``path`` itself: a
    checkpoint or training state saved into a temporary folder is on disk before it is renamed."""
    path = Path(path)
    for p in sorted(path.rglob("*"), key=lambda q: len(q.parts), reverse=True):
        if p.is_file():
            fsync_file(p)
        elif p.is_dir():
            fsync_dir(p)
    fsync_dir(path)


def remove_temporaries(path: Path) -> list[Path]:
    """Delete the temporary files an interrupted write of ``path`` left beside it
    (``.<name>.<random>.tmp``); returns them. Safe because one process writes a run at a time
    (:mod:`pipeline.runlock`), and a fan-out worker writes only its own shards' parts."""
    gone = [t for t in path.parent.glob(f".{path.name}.*.tmp") if t.is_file()]
    for t in gone:
        t.unlink(missing_ok=True)
        log.info("removed %s, left by an interrupted write", t.name)
    return gone


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_temporaries(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


@dataclass(frozen=True)
class Currency:
    """Whether a stage output can be reused, and why (logged by the flows)."""

    current: bool
    reason: str


def is_current(path: Path, key: dict) -> Currency:
    """Is stage output ``path`` present, committed, unmodified, and produced under ``key``?

    Content decides, not size and mtime: a table's sha256 is compared with the one its manifest
    recorded at write (tables are small: a default round's are < 1 MB, hashed at ~0.5 GB/s); a
    folder (checkpoint, training state) must hold exactly the files, of the sizes, its manifest
    lists, and its sampled :func:`dir_fingerprint` (about 1 MiB read per file) must match.
    :func:`verify_output` (``capo check``) reads every byte of a folder against the per-file sha256
    recorded at write.
    """
    if not path.exists():
        return Currency(False, f"{path.name} does not exist")
    man = read_manifest(path)
    if man is None:
        return Currency(False, f"{path.name} has no manifest (stage was interrupted before commit)")
    if man.get("key_hash") != key_hash(key):
        changed = sorted(k for k in set(key) | set(man.get("key", {}))
                         if json.dumps(key.get(k), sort_keys=True, default=str)
                         != json.dumps(man.get("key", {}).get(k), sort_keys=True, default=str))
        return Currency(False, f"{path.name} was produced under another key (changed: {changed})")
    why = _modified(path, man, full=False)
    if why:
        return Currency(False, f"{path.name} was modified after its manifest was written ({why})")
    return Currency(True, f"{path.name} is current (key {man['key_hash']}, {man.get('rows')} rows)")


def outputs_current(paths: list[Path], key: dict) -> Currency:
    """Are all of a stage's outputs current under ``key``? The first that is not, else the first
    one's currency (cheap: manifests and file stats)."""
    first = None
    for path in paths:
        cur = is_current(path, key)
        if not cur.current:
            return cur
        first = first or cur
    return first


def dir_files(path: Path, hashes: bool = True) -> dict[str, dict]:
    """``{relative path: {"size": bytes, "sha256": hex}}`` of every file under folder ``path``
    (without ``sha256`` when ``hashes`` is False)."""
    out = {}
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        out[str(p.relative_to(path))] = {"size": p.stat().st_size, **({"sha256": file_sha256(p)} if hashes else {})}
    return out


def _modified(path: Path, man: dict, full: bool) -> str | None:
    """How output ``path`` differs from what manifest ``man`` committed (None: it does not).
    ``full``: a folder's every byte is hashed against the per-file sha256 recorded at write."""
    if not path.is_dir():
        if man.get("size") is not None and path.stat().st_size != man["size"]:
            return f"size {path.stat().st_size} bytes, committed {man['size']}"
        return None if file_sha256(path) == man.get("fingerprint") else "content hash differs"
    files = man.get("files")
    if isinstance(files, dict):
        now = dir_files(path, hashes=full)
        if set(now) != set(files):
            extra, gone = sorted(set(now) - set(files)), sorted(set(files) - set(now))
            return f"files added {extra[:3]}, missing {gone[:3]}"
        for rel, meta in files.items():
            if not isinstance(meta, dict) or now[rel]["size"] != meta.get("size"):
                return f"{rel}: size {now[rel]['size']} bytes, committed {meta.get('size') if isinstance(meta, dict) else '?'}"
            if full and now[rel]["sha256"] != meta.get("sha256"):
                return f"{rel}: content hash differs"
        if full:
            return None
    return None if dir_fingerprint(path) == man.get("fingerprint") else "sampled content fingerprint differs"


def verify_output(path: Path) -> str | None:
    """Full verification of a committed output against its manifest (every byte, :func:`capo check`):
    None when it is intact, else what is wrong (no manifest, missing, modified, unreadable rows)."""
    man = read_manifest(path)
    if man is None:
        return "no manifest (not committed)"
    if man.get("pruned"):
        return None if not path.exists() else "marked pruned but present"
    if not path.exists():
        return "missing (its manifest is there)"
    why = _modified(path, man, full=True)
    if why:
        return f"modified: {why}"
    if path.suffix == ".parquet" and man.get("rows") is not None:
        try:
            rows = pq.read_metadata(path).num_rows
        except Exception as e:
            return f"unreadable: {type(e).__name__}: {str(e)[:120]}"
        if rows != man["rows"]:
            return f"{rows} rows, committed {man['rows']}"
    return None


def uncommit(path: Path) -> None:
    """Delete ``path``'s manifest (the output stays but is no longer current): the first step of
    replacing an output in several moves, so a crash in between leaves it visibly uncommitted."""
    mp = manifest_path(path)
    if mp.exists():
        mp.unlink()


def mark_pruned(path: Path) -> None:
    """Record in ``path``'s manifest that the output was deliberately deleted (kept: its fingerprint,
    which later stages' keys hold). :func:`is_current` reports a pruned output as missing."""
    man = read_manifest(path)
    if man is not None:
        _atomic_write_text(manifest_path(path), json.dumps({**man, "pruned": True}, indent=1, default=str))


def supersede(path: Path) -> Path | None:
    """Move an existing output (and its manifest) to ``superseded/`` beside it; return where.

    The manifest moves first: a kill between the two moves leaves the output in place without a
    manifest (uncommitted: recomputed, the leftover itself kept in ``superseded/``), never a
    manifest in place naming an output that has gone."""
    mp = manifest_path(path)
    if not path.exists():
        if mp.exists():
            mp.unlink()
        return None
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    dest_dir = path.parent / "superseded"
    dest_dir.mkdir(exist_ok=True)
    dest = dest_dir / f"{path.stem}-{stamp}{path.suffix}"
    if mp.exists():
        shutil.move(str(mp), manifest_path(dest))
    shutil.move(str(path), dest)
    log.warning("moved the earlier %s to %s (it was produced under another key)", path.name, dest)
    return dest


def place_dir(tmp: Path, dest: Path, event: str) -> None:
    """Move a folder output written in full to ``tmp`` into place at ``dest``: fsync it, then
    rename it over ``dest`` (an earlier folder there is superseded, never overwritten) and fsync
    the parent. Its manifest is the caller's last step (:func:`commit_manifest`), so a crash
    anywhere leaves ``dest`` visibly uncommitted. Kill points (:mod:`pipeline.faults`):
    ``<event>.saved`` before the rename, ``<event>.renamed`` after it (``event``: ``checkpoint``,
    ``state``).

    Raises:
        FileNotFoundError: ``tmp`` is not a folder.
    """
    if not tmp.is_dir():
        raise FileNotFoundError(f"{tmp} is not a folder: nothing to place at {dest}")
    fsync_tree(tmp)
    kill_point(f"{event}.saved", dest)
    if dest.exists():
        supersede(dest)
    os.replace(tmp, dest)
    fsync_dir(dest.parent)
    kill_point(f"{event}.renamed", dest)


def commit_manifest(path: Path, *, stage: str, key: dict, rows: int | None, extra: dict | None = None) -> dict:
    """Write the manifest of an output that is already in place at ``path``; return it."""
    st = path.stat()
    man = {
        "table": path.stem if not path.is_dir() else path.name,
        "stage": stage,
        "path": str(path),
        "rows": rows,
        "key": key,
        "key_hash": key_hash(key),
        "fingerprint": fingerprint(path),
        "size": None if path.is_dir() else st.st_size,
        "mtime_ns": None if path.is_dir() else st.st_mtime_ns,
        **({"files": dir_files(path)} if path.is_dir() else {}),  # every file's sha256, once, at write
        "code_version": code_version(),
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        **(extra or {}),
    }
    _atomic_write_text(manifest_path(path), json.dumps(man, indent=1, sort_keys=False, default=str))
    return man


# ------------------------------------------------------------------------------------------ tables
def write_table(table: pa.Table, path: Path, name: str, *, stage: str, key: dict, extra: dict | None = None) -> dict:
    """Check ``table`` against schema ``name``, write it atomically to ``path``, commit its manifest
    (:func:`write_parquet`).

    Returns:
        The manifest written.
    Raises:
        ValueError: the table does not match the schema (see :func:`pipeline.schemas.check_schema`).
    """
    return write_parquet(check_schema(table, name, cast=True), path, stage=stage, key=key, extra=extra)


def write_parquet(table: pa.Table, path: Path, *, stage: str, key: dict, extra: dict | None = None) -> dict:
    """Write ``table`` (already in its final schema) atomically to ``path`` (a temporary file in the
    same folder, then a rename) and commit its manifest. An existing output at ``path`` is moved to
    ``superseded/`` first (never overwritten).

    Returns:
        The manifest written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or manifest_path(path).exists():
        supersede(path)
    remove_temporaries(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp, compression="zstd")
        fsync_file(tmp)
        kill_point("table.written", path)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    kill_point("table.renamed", path)
    return commit_manifest(path, stage=stage, key=key, rows=table.num_rows, extra=extra)


def read_table(path: Path, name: str) -> pa.Table:
    """Read table ``name`` from ``path`` and check its schema.

    Raises:
        FileNotFoundError: no such file (names the stage that writes it).
        ValueError: schema mismatch.
    """
    if not path.is_file():
        raise FileNotFoundError(f"table {name!r} not found at {path}; run the stage that writes it first")
    return check_schema(fill_added_columns(pq.read_table(path), name), name, str(path))


def write_part(table: pa.Table, parts_dir: Path, part_idx: int, name: str, meta: dict) -> Path:
    """Write one resumable shard of a long stage: ``part-XXXXX.parquet`` plus a JSON sidecar.

    The sidecar (written after the shard, both fsynced with their directory) is the shard's commit
    marker; it records the part's row count and sha256, which :func:`part_intact` checks, so a torn
    or altered part is recomputed instead of trusted.
    """
    parts_dir.mkdir(parents=True, exist_ok=True)
    path = parts_dir / f"part-{part_idx:05d}.parquet"
    table = check_schema(table, name, cast=True)
    remove_temporaries(path)
    fd, tmp = tempfile.mkstemp(dir=parts_dir, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    pq.write_table(table, tmp, compression="zstd")
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(parts_dir)
    kill_point("part.written", path)
    _atomic_write_text(path.with_suffix(".json"),
                       json.dumps({**meta, "rows": table.num_rows, "sha256": file_sha256(path)}))
    return path


def part_intact(path: Path, meta: dict) -> bool:
    """Whether shard ``path`` is the part its sidecar ``meta`` committed: its footer reads, its row
    count matches and (sidecars from this version on) its sha256 matches."""
    try:
        rows = pq.read_metadata(path).num_rows
    except Exception:  # truncated or not Parquet
        return False
    if "rows" in meta and rows != meta["rows"]:
        return False
    return "sha256" not in meta or file_sha256(path) == meta["sha256"]


# ----------------------------------------------------------------------------------------- catalog
CATALOG_NAME = "catalog.duckdb"
CATALOG_STORAGE_VERSION = "v1.2.0"
"""Storage version of the catalog file, so the PyPI ``duckdb-cli`` (1.5.x) can open it too."""

CATALOG_GLOBS = {
    "rollouts": "*/round_*/rollouts.parquet",
    "outcomes": "*/round_*/outcomes.parquet",
    "steps": "*/round_*/steps.parquet",
    "mc_values": "*/round_*/mc_values.parquet",
    "token_divergence": "*/round_*/token_divergence.parquet",
    "critiques": "*/round_*/*critiques.parquet",
    "step_verdicts": "*/round_*/variants/*/step_verdicts.parquet",
    "token_rewards": "*/round_*/variants/*/token_rewards.parquet",
    "train_metrics": "*/round_*/variants/*/train_metrics.parquet",
    "token_credit": "*/round_*/variants/*/token_credit.parquet",
    "eval": "*/round_*/**/eval.parquet",  # round_000/eval.parquet and round_k/variants/*/eval.parquet
}

_MANIFEST_COLUMNS = {"table": "VARCHAR", "stage": "VARCHAR", "path": "VARCHAR", "rows": "BIGINT",
                     "key_hash": "VARCHAR", "key": "JSON", "code_version": "VARCHAR", "created_at": "TIMESTAMPTZ",
                     "elapsed_s": "DOUBLE", "fingerprint": "VARCHAR"}


VARIANT_SUMMARY_SQL = """
CREATE OR REPLACE VIEW cat.variant_summary AS
WITH tok AS (
    SELECT run_id, round, variant, outcome_correct, unnest(rewards) AS r, unnest(advantages) AS a
    FROM cat.token_rewards
), per AS (
    SELECT run_id, round, variant, count(*) AS tokens,
           avg(r) FILTER (WHERE outcome_correct) AS mean_token_reward_correct,
           avg(r) FILTER (WHERE NOT outcome_correct) AS mean_token_reward_wrong,
           avg(a) AS adv_mean, stddev_samp(a) AS adv_std, min(a) AS adv_min, max(a) AS adv_max
    FROM tok GROUP BY ALL
), pen AS (
    SELECT run_id, round, variant, any_value(rule) AS rule,
           sum(n_penalized_tokens) / sum(len(rewards)) AS share_tokens_penalized,
           avg(outcome_correct::INT) AS accuracy, avg(outcome_reward) AS mean_outcome_reward
    FROM cat.token_rewards GROUP BY ALL
), m AS (
    SELECT run_id, round, variant,
           avg(value) FILTER (WHERE name = 'loss') AS loss,
           avg(value) FILTER (WHERE name = 'clip_frac') AS clip_frac,
           avg(value) FILTER (WHERE name = 'approx_kl') AS approx_kl,
           avg(value) FILTER (WHERE name = 'kl_ref') AS kl_ref,
           count(DISTINCT step) AS optimizer_steps
    FROM {metrics} GROUP BY ALL
)
SELECT per.run_id, per.round, per.variant, pen.rule, per.tokens, pen.accuracy, pen.mean_outcome_reward,
       pen.share_tokens_penalized, per.mean_token_reward_correct, per.mean_token_reward_wrong,
       per.adv_mean, per.adv_std, per.adv_min, per.adv_max,
       m.loss, m.clip_frac, m.approx_kl, m.kl_ref, m.optimizer_steps
FROM per JOIN pen USING (run_id, round, variant) LEFT JOIN m USING (run_id, round, variant)
ORDER BY per.run_id, per.round, per.variant
"""
"""Per run, round and variant: what the variant did to the tokens and to the update."""


EVAL_SUMMARY_SQL = """
CREATE OR REPLACE VIEW cat.eval_summary AS
WITH g AS (
    SELECT run_id, round, variant, benchmark, count(*) AS n_problems, avg(correct::INT) AS accuracy,
           avg(num_tokens) AS mean_response_tokens, avg((finish_reason = 'length')::INT) AS share_truncated
    FROM cat.eval WHERE decoding = 'greedy' GROUP BY ALL
), per_problem AS (
    SELECT run_id, round, variant, benchmark, prompt_id, count(*) AS n, sum(correct::INT) AS c
    FROM cat.eval WHERE decoding = 'sample' GROUP BY ALL
), pk AS (
    SELECT run_id, round, variant, benchmark, max(n) AS pass_k, avg((c > 0)::INT) AS pass_at_k,
           avg(c / n) AS sampled_accuracy
    FROM per_problem GROUP BY ALL
)
SELECT g.*, pk.pass_k, pk.pass_at_k, pk.sampled_accuracy
FROM g LEFT JOIN pk ON g.run_id = pk.run_id AND g.round = pk.round AND g.benchmark = pk.benchmark
                       AND g.variant IS NOT DISTINCT FROM pk.variant
ORDER BY run_id, round, variant NULLS FIRST, benchmark
"""
"""Per run, round, variant and benchmark: :func:`pipeline.stages.eval.summarize_eval` in SQL (pass@k as
any-correct: every sampled problem has n = k samples)."""


def _present(con) -> set[str]:
    return {r[0] for r in con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_catalog = 'cat'").fetchall()}


def sql_literal(value: str) -> str:
    """``value`` as a SQL string literal (single quotes doubled): paths with a ``'`` stay paths."""
    return "'" + str(value).replace("'", "''") + "'"


def _unreadable_parquet(path: Path) -> str | None:
    """Why ``path`` cannot be read as Parquet (its footer does not parse), or None."""
    try:
        pq.read_metadata(path)
    except Exception as e:  # truncated, overwritten, not Parquet at all
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # Python reads NaN/Infinity, DuckDB's JSON reader does not


_MANIFEST_TYPES = {"VARCHAR": (str,), "BIGINT": (int,), "DOUBLE": (int, float), "JSON": (object,),
                   "TIMESTAMPTZ": (str,)}


def _manifest_problem(path: Path) -> tuple[dict | None, str | None]:
    """The manifest ``path`` and None, or None and why it cannot be a row of the catalog's
    ``manifests`` view (not UTF-8, not JSON, not an object, a column of the wrong type)."""
    try:
        man = json.loads(Path(path).read_text(encoding="utf-8"), parse_constant=_reject_constant)
    except (OSError, UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        return None, f"{type(e).__name__}: {str(e)[:200]}"
    if not isinstance(man, dict):
        return None, f"not a JSON object but a JSON {type(man).__name__}"
    for col, typ in _MANIFEST_COLUMNS.items():
        v = man.get(col)
        if v is not None and ((isinstance(v, bool) and typ != "JSON") or not isinstance(v, _MANIFEST_TYPES[typ])):
            return None, f"{col} is {json.dumps(v)[:80]}, not a {typ}"
        if typ == "BIGINT" and v is not None and not -(2 ** 63) <= v < 2 ** 63:
            return None, f"{col} is {v}, out of a BIGINT's range"
    return man, None


def _manifest_problems(paths: list[Path], con) -> dict[Path, str]:
    """``{path: why}`` for each manifest the ``manifests`` view could not read (see
    :func:`_manifest_problem`; ``created_at`` must also cast to DuckDB's TIMESTAMPTZ)."""
    bad, stamps = {}, []
    for p in paths:
        man, why = _manifest_problem(p)
        if why is not None:
            bad[p] = why
        elif isinstance(man.get("created_at"), str):
            stamps.append((p, man["created_at"]))
    if stamps:
        nulls = [r[1] for r in con.execute(
            "SELECT i, TRY_CAST(($l::VARCHAR[])[i] AS TIMESTAMPTZ) IS NULL FROM range(1, len($l::VARCHAR[]) + 1) t(i) "
            "ORDER BY i", {"l": [v for _, v in stamps]}).fetchall()]
        bad.update({p: f"created_at is {json.dumps(v)[:80]}, not a TIMESTAMPTZ" for (p, v), n in zip(stamps, nulls) if n})
    return bad


def split_unreadable(files) -> tuple[list[Path], dict[Path, str]]:
    """``files`` split into those whose Parquet footer reads and ``{path: why}`` for the others
    (truncated, overwritten, not Parquet at all), so that one bad file does not fail a query over
    all of them. Order is kept; never raises for a bad file."""
    good, bad = [], {}
    for f in files:
        why = _unreadable_parquet(f)
        if why is None:
            good.append(f)
        else:
            bad[f] = why
    return good, bad


def _remove_dead_temporaries(runs_dir: Path) -> None:
    """Delete catalog temporaries (``.catalog.duckdb.<pid>.tmp[.wal]``) whose process is gone (killed
    mid-refresh); a live process's (another run refreshing now) is left alone."""
    import psutil

    for f in runs_dir.glob(f".{CATALOG_NAME}.*.tmp*"):
        pid = f.name[len(CATALOG_NAME) + 2:].split(".")[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            f.unlink(missing_ok=True)


def view_select(con, name: str, source: str) -> str:
    """The SELECT of view ``name`` over the Parquet files ``source`` (a SQL literal or list of them).

    Columns of :data:`pipeline.schemas.ADDED_COLUMNS` read at their value in files written before the
    column existed, as :func:`read_table` reads them, even when no file of the view has the column yet
    (an empty relation with every added column is unioned by name, so a later file that has the
    column does not clash with the view).
    """
    select = f"SELECT * FROM read_parquet({source}, union_by_name = true)"
    added = ADDED_COLUMNS.get(name)
    if not added:
        return select
    empty = pa.schema([SCHEMAS[name].field(c) for c in added]).empty_table()
    types = con.from_arrow(empty).dtypes
    typed = ", ".join(f'NULL::{t} AS "{c}"' for c, t in zip(added, types))
    literal = lambda v: sql_literal(v) if isinstance(v, str) else repr(v)  # noqa: E731
    fills = ", ".join(f'coalesce("{c}", {literal(v)}) AS "{c}"' for c, v in added.items() if v is not None)
    union = f"{select} UNION ALL BY NAME SELECT {typed} WHERE false"
    return f"SELECT * REPLACE ({fills}) FROM ({union})" if fills else f"SELECT * FROM ({union})"


def refresh_catalog(runs_dir: Path, data_dir: Path | None = None) -> Path:
    """(Re)build ``<runs_dir>/catalog.duckdb``: one view per table over every run and round.

    Views use absolute paths (DuckDB resolves relative ones against the reader's directory). The
    file is built under a temporary name and renamed into place, so a user holding the old catalog
    open read-only is never blocked and never sees a half-built one. A table whose Parquet footer
    does not read (truncated, overwritten) is left out of its view and named, with the reason, in
    the view ``skipped_tables`` and the log, so one bad file does not break every run's catalog.
    A manifest that is not a JSON object with columns of the ``manifests`` view's types (torn,
    hand-edited) is left out of that view and named in ``skipped_tables`` the same way.
    """
    import duckdb

    runs_dir = Path(runs_dir).resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    dest = runs_dir / CATALOG_NAME
    tmp = runs_dir / f".{CATALOG_NAME}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    _remove_dead_temporaries(runs_dir)
    con = duckdb.connect()
    try:
        con.execute(f"ATTACH {sql_literal(str(tmp))} AS cat (STORAGE_VERSION '{CATALOG_STORAGE_VERSION}')")
        views = dict(CATALOG_GLOBS)
        sources = {name: str(runs_dir / pattern) for name, pattern in views.items()}
        if data_dir is not None:
            sources["prompts"] = str(Path(data_dir).resolve() / "prompts" / "*.parquet")
        skipped: list[tuple[str, str, str]] = []  # (view, file, why)
        for name, glob in sources.items():
            files = sorted(Path("/").glob(glob.lstrip("/")))
            if not files:
                continue
            _, bad = split_unreadable(files)
            skipped += [(name, str(f), why) for f, why in bad.items()]
            if not bad:  # a glob: tables written after this refresh show up too
                source = sql_literal(glob)
            elif len(bad) == len(files):
                continue
            else:  # the readable files only; the others are named in skipped_tables
                source = "[" + ", ".join(sql_literal(str(f)) for f in files if f not in bad) + "]"
            con.execute(f"CREATE OR REPLACE VIEW cat.{name} AS {view_select(con, name, source)}")
        man_glob = str(runs_dir / "*" / "round_*" / "**" / f"*{MANIFEST_SUFFIX}")
        mans = sorted(p for p in runs_dir.glob(f"*/round_*/**/*{MANIFEST_SUFFIX}") if "superseded" not in p.parts)
        # one torn or hand-edited manifest would fail read_json over all of them: check each first
        bad_mans = _manifest_problems(mans, con)
        skipped += [("manifests", str(p), why) for p, why in bad_mans.items()]
        if len(bad_mans) < len(mans):
            # Explicit columns: a manifest lacking one (e.g. no elapsed_s) reads as NULL instead of
            # failing the bind; superseded outputs' manifests are left out like their tables.
            types = ", ".join(f"'{c}': '{t}'" for c, t in _MANIFEST_COLUMNS.items())
            names = ", ".join(f'"{c}"' for c in _MANIFEST_COLUMNS)
            source = (sql_literal(man_glob) if not bad_mans  # a glob: manifests written later show up too
                      else "[" + ", ".join(sql_literal(str(p)) for p in mans if p not in bad_mans) + "]")
            con.execute(
                f"CREATE OR REPLACE VIEW cat.manifests AS SELECT {names} "
                f"FROM read_json({source}, columns = {{{types}}}, format = 'auto', filename = true) "
                "WHERE filename NOT LIKE '%/superseded/%'"
            )
        if skipped:
            for view, f, why in skipped:
                log.warning("catalog: view %s leaves out %s (%s); recompute its stage (--force) or delete it", view, f, why)
            rows = ", ".join(f"({sql_literal(v)}, {sql_literal(f)}, {sql_literal(w)})" for v, f, w in skipped)
            con.execute(f"CREATE OR REPLACE VIEW cat.skipped_tables AS SELECT * FROM (VALUES {rows}) "
                        "AS t(view_name, path, reason)")
        if "token_rewards" in _present(con):
            con.execute(VARIANT_SUMMARY_SQL.format(metrics="cat.train_metrics" if "train_metrics" in _present(con)
                                                   else "(SELECT NULL::VARCHAR run_id, NULL::INT round, NULL::VARCHAR variant, "
                                                        "NULL::VARCHAR name, NULL::DOUBLE value, NULL::INT step)"))
        if "eval" in _present(con):
            con.execute(EVAL_SUMMARY_SQL)
        con.execute("DETACH cat")
    finally:
        con.close()
    kill_point("catalog.written", dest)
    os.replace(tmp, dest)
    wal = runs_dir / f".{CATALOG_NAME}.{os.getpid()}.tmp.wal"
    wal.unlink(missing_ok=True)
    return dest
