"""Stage outputs on disk: commit/currency, superseding, shards and the DuckDB catalog (pipeline/storage.py)."""

import json
import os
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import storage
from pipeline.schemas import SCHEMAS


def _outcomes(n: int = 3, answer: str = "5", run_id: str = "r1") -> pa.Table:
    rows = [{"run_id": run_id, "round": 1, "rollout_id": f"ro-{i}", "prompt_id": "p-0", "gold_answer": "5",
             "extracted_answer": answer, "outcome_correct": answer == "5", "verify_status": "ok"} for i in range(n)]
    return pa.Table.from_pylist(rows, schema=SCHEMAS["outcomes"])


def _rollouts(n: int, run_id: str = "r1", round_idx: int = 1) -> pa.Table:
    rows = [{"run_id": run_id, "round": round_idx, "rollout_id": f"ro-{i}", "prompt_id": "p-0", "sample_idx": i,
             "policy": "m", "prompt_token_ids": [1, 2], "response_text": "x", "response_token_ids": [3, 4, 5],
             "rollout_logprobs": [-0.1, -0.2, -0.3], "finish_reason": "stop", "num_tokens": 3} for i in range(n)]
    return pa.Table.from_pylist(rows, schema=SCHEMAS["rollouts"])


KEY = {"rollouts": "abc", "vote": {"rule": "intersection"}, "n": 4}


# ------------------------------------------------------------------------------------ currency
def test_written_table_is_current_under_same_key(tmp_path):
    out = tmp_path / "round_001" / "outcomes.parquet"
    man = storage.write_table(_outcomes(), out, "outcomes", stage="verify", key=KEY)
    assert man["rows"] == 3 and man["key"] == KEY and man["stage"] == "verify"
    assert json.loads(storage.manifest_path(out).read_text())["key_hash"] == storage.key_hash(KEY)
    cur = storage.is_current(out, dict(KEY))
    assert cur.current, cur.reason
    assert storage.read_table(out, "outcomes").equals(_outcomes())


def test_changed_key_is_not_current_and_reason_names_the_key(tmp_path):
    out = tmp_path / "outcomes.parquet"
    storage.write_table(_outcomes(), out, "outcomes", stage="verify", key=KEY)
    cur = storage.is_current(out, {**KEY, "vote": {"rule": "union"}})
    assert not cur.current
    assert "'vote'" in cur.reason
    assert "'rollouts'" not in cur.reason and "'n'" not in cur.reason
    added = storage.is_current(out, {**KEY, "extra": 1})  # a new key entry counts as a change too
    assert not added.current and "'extra'" in added.reason


def test_missing_manifest_means_interrupted_stage(tmp_path):
    out = tmp_path / "outcomes.parquet"
    storage.write_table(_outcomes(), out, "outcomes", stage="verify", key=KEY)
    storage.manifest_path(out).unlink()  # killed between the table rename and the manifest commit
    cur = storage.is_current(out, KEY)
    assert not cur.current and "manifest" in cur.reason
    missing = storage.is_current(tmp_path / "nothing.parquet", KEY)
    assert not missing.current and "does not exist" in missing.reason


def test_file_modified_after_commit_with_same_size_is_not_current(tmp_path):
    out = tmp_path / "outcomes.parquet"
    storage.write_table(_outcomes(answer="5"), out, "outcomes", stage="verify", key=KEY)
    size, mtime_ns = out.stat().st_size, out.stat().st_mtime_ns
    # Same schema and row count, other values: a parquet of exactly the same size, other bytes.
    other = tmp_path / "other.parquet"
    pq.write_table(_outcomes(answer="7"), other, compression="zstd")
    assert other.stat().st_size == size, "test needs a same-size rewrite"
    new_bytes = other.read_bytes()
    assert new_bytes != out.read_bytes()
    out.write_bytes(new_bytes)
    os.utime(out, ns=(mtime_ns + 2_000_000_000, mtime_ns + 2_000_000_000))
    cur = storage.is_current(out, KEY)
    assert not cur.current and "modified" in cur.reason


def test_table_corrupted_with_its_size_and_mtime_kept_is_not_current(tmp_path):
    """Content decides: a size + mtime shortcut would take this table as current."""
    out = tmp_path / "outcomes.parquet"
    storage.write_table(_outcomes(answer="5"), out, "outcomes", stage="verify", key=KEY)
    st = out.stat()
    other = tmp_path / "other.parquet"
    pq.write_table(_outcomes(answer="7"), other, compression="zstd")
    assert other.stat().st_size == st.st_size, "test needs a same-size rewrite"
    out.write_bytes(other.read_bytes())
    os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as committed
    assert (out.stat().st_size, out.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    cur = storage.is_current(out, KEY)
    assert not cur.current and "content hash differs" in cur.reason
    assert storage.verify_output(out) == "modified: content hash differs"


def test_touched_but_unchanged_file_stays_current(tmp_path):
    out = tmp_path / "outcomes.parquet"
    storage.write_table(_outcomes(), out, "outcomes", stage="verify", key=KEY)
    st = out.stat()
    os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    assert storage.is_current(out, KEY).current  # falls back to the fingerprint, which matches


def test_rewrite_moves_old_output_to_superseded(tmp_path):
    out = tmp_path / "round_001" / "outcomes.parquet"
    storage.write_table(_outcomes(answer="5"), out, "outcomes", stage="verify", key={"v": 1})
    storage.write_table(_outcomes(answer="7"), out, "outcomes", stage="verify", key={"v": 2})
    sup = out.parent / "superseded"
    olds = sorted(sup.glob("outcomes-*.parquet"))
    assert len(olds) == 1
    assert pq.read_table(olds[0]).column("extracted_answer").to_pylist() == ["5"] * 3  # nothing lost
    old_man = json.loads(storage.manifest_path(olds[0]).read_text())
    assert old_man["key"] == {"v": 1}
    assert storage.is_current(out, {"v": 2}).current
    assert pq.read_table(out).column("extracted_answer").to_pylist() == ["7"] * 3
    # an uncommitted leftover (table without manifest) is also kept, not overwritten
    storage.manifest_path(out).unlink()
    storage.write_table(_outcomes(answer="9"), out, "outcomes", stage="verify", key={"v": 3})
    assert len(list(sup.glob("outcomes-*.parquet"))) == 2
    assert len(list(sup.glob(f"*{storage.MANIFEST_SUFFIX}"))) == 1


def test_a_kill_inside_supersede_never_leaves_a_manifest_without_its_output(tmp_path, monkeypatch):
    """supersede moves the manifest before the output: a kill between the two moves leaves the
    output in place uncommitted (recomputed) and nothing naming an output that has gone."""
    out = tmp_path / "round_001" / "outcomes.parquet"
    storage.write_table(_outcomes(answer="5"), out, "outcomes", stage="verify", key={"v": 1})
    real_move, calls = storage.shutil.move, []

    def move_then_die(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the two moves")
        return real_move(src, dst)

    monkeypatch.setattr(storage.shutil, "move", move_then_die)
    with pytest.raises(KeyboardInterrupt):
        storage.supersede(out)
    monkeypatch.undo()
    assert out.exists() and not storage.manifest_path(out).exists()  # uncommitted, not a dangling manifest
    assert not storage.is_current(out, {"v": 1}).current
    storage.write_table(_outcomes(answer="7"), out, "outcomes", stage="verify", key={"v": 1})
    assert pq.read_table(out).column("extracted_answer").to_pylist() == ["7"] * 3
    assert len(list((out.parent / "superseded").glob("outcomes-*.parquet"))) == 1  # the old table kept


def test_schema_mismatch_names_the_column(tmp_path):
    t = _outcomes()
    bad_type = t.set_column(t.schema.get_field_index("round"), "round", pa.array([1, 1, 1], pa.int64()))
    # writers cast safely (int64 -> int32 when the values fit) and refuse a lossy cast
    too_big = t.set_column(t.schema.get_field_index("round"), "round", pa.array([1, 2**40, 1], pa.int64()))
    with pytest.raises(ValueError, match="does not fit its schema"):
        storage.write_table(too_big, tmp_path / "o.parquet", "outcomes", stage="verify", key=KEY)
    storage.write_table(bad_type, tmp_path / "c.parquet", "outcomes", stage="verify", key=KEY)
    assert pq.read_table(tmp_path / "c.parquet").schema.field("round").type == pa.int32()
    missing = t.drop_columns(["verify_status"])
    with pytest.raises(ValueError, match="verify_status"):
        storage.write_table(missing, tmp_path / "o.parquet", "outcomes", stage="verify", key=KEY)
    assert not (tmp_path / "o.parquet").exists()
    pq.write_table(bad_type, tmp_path / "b.parquet")
    with pytest.raises(ValueError, match="'round'"):
        storage.read_table(tmp_path / "b.parquet", "outcomes")
    with pytest.raises(FileNotFoundError, match="outcomes"):
        storage.read_table(tmp_path / "absent.parquet", "outcomes")


# -------------------------------------------------------------------------------------- shards
def test_write_part_commits_with_a_sidecar_that_part_intact_checks(tmp_path):
    parts = tmp_path / "critiques.parts"
    storage.write_part(_outcomes(2, run_id="a"), parts, 0, "outcomes", {"key": "K"})
    storage.write_part(_outcomes(3, run_id="c"), parts, 2, "outcomes", {"key": "K"})
    side = json.loads((parts / "part-00000.json").read_text())
    assert side == {"key": "K", "rows": 2, "sha256": storage.file_sha256(parts / "part-00000.parquet")}
    assert storage.part_intact(parts / "part-00000.parquet", side)
    assert not storage.part_intact(parts / "part-00002.parquet", side)  # 3 rows, another hash
    assert not storage.part_intact(parts / "part-00002.parquet", {**side, "rows": 3})  # same rows, another hash
    assert sorted(p.name for p in parts.iterdir()) == ["part-00000.json", "part-00000.parquet",
                                                       "part-00002.json", "part-00002.parquet"]


# ------------------------------------------------------------------------------------- catalog
def _populate_runs(runs, data):
    storage.write_table(_rollouts(3), runs / "r1" / "round_001" / "rollouts.parquet", "rollouts", stage="rollout", key={})
    storage.write_table(_rollouts(2, round_idx=2), runs / "r1" / "round_002" / "rollouts.parquet", "rollouts",
                        stage="rollout", key={})
    storage.write_table(_rollouts(4, "r2"), runs / "r2" / "round_001" / "rollouts.parquet", "rollouts",
                        stage="rollout", key={}, extra={"elapsed_s": 1.5})
    storage.write_table(_outcomes(3), runs / "r1" / "round_001" / "outcomes.parquet", "outcomes", stage="verify", key={"v": 1})
    storage.write_table(_outcomes(3), runs / "r1" / "round_001" / "outcomes.parquet", "outcomes", stage="verify", key={"v": 2})
    (data / "prompts").mkdir(parents=True)
    prompts = pa.Table.from_pylist([{"prompt_id": f"p-{i}", "source": "s", "split": "train", "question": "q",
                                     "gold_answer": "1", "gold_solution": None} for i in range(5)], schema=SCHEMAS["prompts"])
    pq.write_table(prompts, data / "prompts" / "s_train.parquet")


def test_catalog_views_are_absolute_and_read_only_queryable(tmp_path, monkeypatch):
    runs, data = tmp_path / "runs", tmp_path / "data"
    _populate_runs(runs, data)
    monkeypatch.chdir(tmp_path)
    cat = storage.refresh_catalog(runs.relative_to(tmp_path), data.relative_to(tmp_path))
    assert cat == runs.resolve() / storage.CATALOG_NAME
    assert [p.name for p in runs.iterdir() if p.name.startswith(".")] == []  # no temp file left
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # views must not depend on the reader's directory
    con = duckdb.connect(str(cat), read_only=True)
    try:
        q = lambda sql: con.execute(sql).fetchall()  # noqa: E731
        assert q("SELECT count(*) FROM rollouts") == [(3 + 2 + 4,)]
        assert q("SELECT run_id, round, count(*) FROM rollouts GROUP BY ALL ORDER BY ALL") == [
            ("r1", 1, 3), ("r1", 2, 2), ("r2", 1, 4)]
        assert q("SELECT count(*) FROM outcomes") == [(3,)]  # the superseded copy is not in the view
        assert q("SELECT count(*) FROM prompts") == [(5,)]
        assert q("SELECT sum(len(response_token_ids)) FROM rollouts") == [(27,)]
        views = {r[0] for r in q("SELECT view_name FROM duckdb_views() WHERE NOT internal")}
        assert {"rollouts", "outcomes", "prompts", "manifests"} <= views and "critiques" not in views
        # one manifest per committed output; superseded ones left out; missing elapsed_s is NULL
        mans = q("SELECT \"table\", rows, elapsed_s FROM manifests ORDER BY path")
        assert sorted(mans, key=str) == sorted([("outcomes", 3, None), ("rollouts", 3, None), ("rollouts", 2, None),
                                                ("rollouts", 4, 1.5)], key=str)
        # the key a stage computed, queryable (the committed outcomes are the second write's, v 2)
        assert q("SELECT key->>'$.v' FROM manifests WHERE \"table\" = 'outcomes'") == [("2",)]
        with pytest.raises(duckdb.Error):
            con.execute("CREATE TABLE t AS SELECT 1")
    finally:
        con.close()


def test_catalog_refresh_while_a_reader_holds_it_open(tmp_path):
    runs = tmp_path / "runs"
    storage.write_table(_rollouts(3), runs / "r1" / "round_001" / "rollouts.parquet", "rollouts", stage="rollout", key={})
    cat = storage.refresh_catalog(runs)
    reader = duckdb.connect(str(cat), read_only=True)
    try:
        assert reader.execute("SELECT count(*) FROM rollouts").fetchall() == [(3,)]
        storage.write_table(_rollouts(2), runs / "r1" / "round_002" / "rollouts.parquet", "rollouts", stage="rollout", key={})
        storage.refresh_catalog(runs)  # must not be blocked by the open reader
        with duckdb.connect(str(cat), read_only=True) as fresh:
            assert fresh.execute("SELECT count(*) FROM rollouts").fetchall() == [(5,)]
    finally:
        reader.close()


def test_empty_runs_dir_gives_an_empty_catalog(tmp_path):
    cat = storage.refresh_catalog(tmp_path / "runs")
    with duckdb.connect(str(cat), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM duckdb_views() WHERE NOT internal").fetchall() == [(0,)]


def _critiques(run_id: str, sources: list[str], drop: tuple[str, ...] = ()) -> pa.Table:
    rows = [{f.name: None for f in SCHEMAS["critiques"]} | {
        "run_id": run_id, "round": 1, "rollout_id": f"{run_id}-{i}", "critique_idx": 0, "source": s,
        "parse_status": "ok", "step_scores": [0.25, 0.75] if s == "logprob" else None} for i, s in enumerate(sources)]
    table = pa.Table.from_pylist(rows, schema=SCHEMAS["critiques"])
    return table.drop_columns(list(drop))


def test_catalog_reads_columns_added_since_a_table_was_written(tmp_path):
    """A critiques file from before `source`, `step_scores`, `mode` and `steps_wrong_lines` existed reads
    as source 'llm', mode 'process' and nulls in the SQL view and the run report, as read_table reads
    it; with no new file at all, the columns still exist."""
    runs = tmp_path / "runs"
    old = runs / "old" / "round_001" / "critiques.parquet"
    old.parent.mkdir(parents=True)
    pq.write_table(_critiques("old", ["llm", "llm"], drop=("source", "step_scores", "mode", "steps_wrong_lines")), old)
    with duckdb.connect(str(storage.refresh_catalog(runs)), read_only=True) as con:
        assert con.execute("SELECT rollout_id, source, step_scores FROM critiques ORDER BY ALL").fetchall() == [
            ("old-0", "llm", None), ("old-1", "llm", None)]
        types = dict(con.execute("SELECT column_name, data_type FROM information_schema.columns "
                                 "WHERE table_name = 'critiques'").fetchall())
        assert types["source"] == "VARCHAR" and types["step_scores"] == "FLOAT[]"
    new = runs / "new" / "round_001" / "critiques.parquet"
    new.parent.mkdir(parents=True)
    pq.write_table(_critiques("new", ["arithmetic", "logprob"]), new)
    with duckdb.connect(str(runs / storage.CATALOG_NAME), read_only=True) as con:  # not refreshed: the glob finds it
        assert con.execute("SELECT rollout_id, source FROM critiques ORDER BY ALL").fetchall() == [
            ("new-0", "arithmetic"), ("new-1", "logprob"), ("old-0", "llm"), ("old-1", "llm")]
    with duckdb.connect(str(storage.refresh_catalog(runs)), read_only=True) as con:
        assert con.execute("SELECT rollout_id, source, step_scores FROM critiques ORDER BY ALL").fetchall() == [
            ("new-0", "arithmetic", None), ("new-1", "logprob", [0.25, 0.75]), ("old-0", "llm", None), ("old-1", "llm", None)]
        assert con.execute("SELECT count(*) FROM critiques WHERE source = 'llm' AND parse_status = 'ok'").fetchall() == [(2,)]
    from pipeline.browse import _register_views

    with duckdb.connect() as con:  # the browser's views over one run answer the same
        _register_views(con, runs / "old", None)
        assert con.execute("SELECT rollout_id, step_scores FROM critiques WHERE source = 'llm' ORDER BY 1").fetchall() == [
            ("old-0", None), ("old-1", None)]
    for path in (old, new):  # the view answers as the reader the stages use
        t = storage.read_table(path, "critiques")
        assert t.column("source").to_pylist() == (["llm", "llm"] if path == old else ["arithmetic", "logprob"])
    assert storage.read_table(old, "critiques").column("mode").to_pylist() == ["process", "process"]
    from pipeline.report import collect

    data, notes = collect(runs / "old")  # the run report reads the old table through the same views
    assert not notes and [(r["mode"], r["critiques"]) for r in data["parse"]] == [("process", 2)]
    assert [r["steps_wrong_lines"] for r in data["critique_rows"]] == [None, None]


# -------------------------------------------------------------------------------- fingerprints
def test_dir_fingerprint_sees_small_file_changes(tmp_path):
    ck = tmp_path / "checkpoint"
    (ck / "sub").mkdir(parents=True)
    (ck / "config.json").write_text('{"a": 1}')
    (ck / "sub" / "tok.json").write_text("abc")
    fp0 = storage.dir_fingerprint(ck)
    assert storage.dir_fingerprint(ck) == fp0 == storage.fingerprint(ck)
    (ck / "config.json").write_text('{"a": 2}')  # same size, other bytes
    fp1 = storage.dir_fingerprint(ck)
    assert fp1 != fp0
    (ck / "sub" / "tok.json").rename(ck / "sub" / "tok2.json")
    fp2 = storage.dir_fingerprint(ck)
    assert fp2 not in (fp0, fp1)
    (ck / "new.bin").write_bytes(b"")
    assert storage.dir_fingerprint(ck) != fp2


def test_dir_fingerprint_sees_retrained_weights_of_the_same_size(tmp_path):
    """A re-trained checkpoint has weight files of the same size: the sampled blocks of large
    files must tell it apart (with (path, size) alone, eval and the next round's rollouts were
    taken as current against the old weights); a copy elsewhere fingerprints the same."""
    import shutil

    import numpy as np

    ck = tmp_path / "checkpoint"
    ck.mkdir()
    w = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)  # 4 MiB of weights
    (ck / "model.safetensors").write_bytes(w.tobytes())
    fp0 = storage.dir_fingerprint(ck)
    (ck / "model.safetensors").write_bytes((w + 1e-6 * np.sign(w)).astype(np.float32).tobytes())  # a small update
    fp1 = storage.dir_fingerprint(ck)
    assert fp1 != fp0
    shutil.copytree(ck, tmp_path / "copy")
    assert storage.dir_fingerprint(tmp_path / "copy") == fp1
    b = bytearray((ck / "model.safetensors").read_bytes())
    b[-1] ^= 1  # the last byte lies in the last sampled block
    (ck / "model.safetensors").write_bytes(bytes(b))
    assert storage.dir_fingerprint(ck) != fp1


def test_directory_output_commit_and_currency(tmp_path):
    ck = tmp_path / "variants" / "v" / "checkpoint"
    ck.mkdir(parents=True)
    (ck / "config.json").write_text("{}")
    man = storage.commit_manifest(ck, stage="train", key=KEY, rows=None)
    assert storage.manifest_path(ck) == ck.parent / "checkpoint.manifest.json"
    assert man["size"] is None and man["table"] == "checkpoint"
    assert storage.is_current(ck, KEY).current
    (ck / "config.json").write_text("{ }")
    assert not storage.is_current(ck, KEY).current


@pytest.mark.parametrize("content", [b"[]", b"null", b'"text"', b"\xff\xfe not utf-8", b'{"key_hash": 5}', b"{"])
def test_a_manifest_that_is_not_a_manifest_reads_as_stale(tmp_path, content):
    out = tmp_path / "outcomes.parquet"
    storage.write_table(_outcomes(), out, "outcomes", stage="verify", key={"k": 1})
    storage.manifest_path(out).write_bytes(content)
    assert storage.read_manifest(out) is None
    cur = storage.is_current(out, {"k": 1})
    assert not cur.current and "no manifest" in cur.reason


def test_one_corrupt_table_is_left_out_of_the_catalog_and_named(tmp_path):
    runs, data = tmp_path / "runs", tmp_path / "data"
    _populate_runs(runs, data)
    bad = runs / "r3" / "round_001" / "rollouts.parquet"
    bad.parent.mkdir(parents=True)
    good = (runs / "r2" / "round_001" / "rollouts.parquet").read_bytes()
    bad.write_bytes(good[: len(good) // 2])  # torn: the footer is gone
    weird = tmp_path / "it's runs"  # a quote in the path must not break the SQL
    (runs).rename(weird)
    cat = storage.refresh_catalog(weird, data)
    con = duckdb.connect(str(cat), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM rollouts").fetchall() == [(3 + 2 + 4,)]  # the other runs still answer
        skipped = con.execute("SELECT view_name, path, reason FROM skipped_tables").fetchall()
        assert [(v, p) for v, p, _ in skipped] == [("rollouts", str(weird.resolve() / "r3" / "round_001" / "rollouts.parquet"))]
        assert skipped[0][2]  # the reason pyarrow gave
    finally:
        con.close()


def test_one_bad_manifest_is_left_out_of_the_manifests_view_and_named(tmp_path):
    """A torn or hand-edited manifest does not break ``SELECT * FROM manifests``: the good ones are
    listed, each bad one is named with its reason in ``skipped_tables``."""
    runs, data = tmp_path / "runs", tmp_path / "data"
    _populate_runs(runs, data)
    torn = storage.manifest_path(runs / "r1" / "round_002" / "rollouts.parquet")
    torn.write_bytes(torn.read_bytes()[:40])
    edited = storage.manifest_path(runs / "r2" / "round_001" / "rollouts.parquet")
    edited.write_text(edited.read_text().replace('"rows": 4', '"rows": "many"'))
    late = storage.manifest_path(runs / "r1" / "round_001" / "outcomes.parquet")
    late.write_text(json.dumps({**json.loads(late.read_text()), "created_at": "yesterday"}))
    listed = runs / "r3" / "round_001" / "steps.parquet.manifest.json"
    listed.parent.mkdir(parents=True)
    listed.write_text("[1, 2]")
    with duckdb.connect(str(storage.refresh_catalog(runs, data)), read_only=True) as con:
        assert con.execute('SELECT "table", rows FROM manifests').fetchall() == [("rollouts", 3)]
        skipped = {Path(p).relative_to(runs.resolve()).as_posix(): (v, why)
                   for v, p, why in con.execute("SELECT view_name, path, reason FROM skipped_tables").fetchall()}
    assert {p: v for p, (v, _) in skipped.items()} == {
        "r1/round_002/rollouts.parquet.manifest.json": "manifests", "r2/round_001/rollouts.parquet.manifest.json": "manifests",
        "r1/round_001/outcomes.parquet.manifest.json": "manifests", "r3/round_001/steps.parquet.manifest.json": "manifests"}
    assert skipped["r1/round_002/rollouts.parquet.manifest.json"][1].startswith("JSONDecodeError")
    assert skipped["r2/round_001/rollouts.parquet.manifest.json"][1] == 'rows is "many", not a BIGINT'
    assert skipped["r1/round_001/outcomes.parquet.manifest.json"][1] == 'created_at is "yesterday", not a TIMESTAMPTZ'
    assert skipped["r3/round_001/steps.parquet.manifest.json"][1] == "not a JSON object but a JSON list"


def test_capo_sql_reads_the_catalog_and_nothing_else(tmp_path, repo):
    """`capo sql` is read-only and cannot write or read files outside the runs."""
    import subprocess
    import sys

    runs, data = tmp_path / "runs", tmp_path / "data"
    _populate_runs(runs, data)
    storage.refresh_catalog(runs, data)
    secret = tmp_path / "secret.csv"
    secret.write_text("a\n1\n")

    def sql(q):
        return subprocess.run([sys.executable, "-m", "flows.cli", "sql", q, "--runs-dir", str(runs)], cwd=repo,
                              capture_output=True, text=True, timeout=120)

    ok = sql("SELECT count(*) AS n FROM rollouts")
    assert ok.returncode == 0 and "9" in ok.stdout
    assert sql("SELECT count(*) FROM prompts").returncode == 0
    for q in (f"COPY (SELECT 1) TO '{tmp_path / 'out.csv'}'", f"SELECT * FROM read_csv('{secret}')",
              "SELECT * FROM read_csv('/etc/passwd')", "INSTALL httpfs",
              "SET enable_external_access = true", "CREATE TABLE t AS SELECT 1"):
        bad = sql(q)
        assert bad.returncode != 0 and ("Permission" in bad.stderr or "locked" in bad.stderr
                                        or "read-only" in bad.stderr), (q, bad.stderr[-500:])
    assert not (tmp_path / "out.csv").exists()


def test_folder_manifest_lists_every_file_and_full_check_reads_every_byte(tmp_path):
    """A folder output's manifest records each file's size and sha256 at write; the cheap check
    sees an added, removed or resized file and sampled bytes; verify_output (capo check) sees a
    byte flipped between the sampled blocks too."""
    import hashlib

    ck = tmp_path / "checkpoint"
    ck.mkdir()
    blob = bytes(range(256)) * (3 * 2**20 // 256)  # 3 MiB: sampled in 16 blocks of 64 KiB
    (ck / "model.safetensors").write_bytes(blob)
    (ck / "config.json").write_text("{}")
    man = storage.commit_manifest(ck, stage="train", key=KEY, rows=None)
    assert man["files"] == {"config.json": {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()},
                            "model.safetensors": {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}}
    assert storage.is_current(ck, KEY).current and storage.verify_output(ck) is None
    # one byte between two sampled blocks (block k starts at (size - 64 KiB) * k / 15)
    b = bytearray(blob)
    b[(len(blob) - 2**16) // 15 + 2**16 + 100] ^= 0xFF
    (ck / "model.safetensors").write_bytes(bytes(b))
    assert storage.is_current(ck, KEY).current  # the cheap check reads ~1 MiB per file
    assert storage.verify_output(ck) == "modified: model.safetensors: content hash differs"
    (ck / "model.safetensors").write_bytes(blob)
    (ck / "extra.bin").write_bytes(b"x")
    cur = storage.is_current(ck, KEY)
    assert not cur.current and "files added ['extra.bin']" in cur.reason
    (ck / "extra.bin").unlink()
    (ck / "config.json").unlink()
    assert "missing ['config.json']" in storage.is_current(ck, KEY).reason
