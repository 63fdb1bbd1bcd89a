"""Tables documented once: docs/tables.md is what ``scripts/render_table_docs.py`` renders from the
schema registry (``pipeline/schemas.py``), every table of the registry has its entry there, and the
example queries name only views the catalog has."""

from __future__ import annotations

import importlib.util
import re

from pipeline import storage
from pipeline.schemas import SCHEMAS


def _renderer(repo):
    spec = importlib.util.spec_from_file_location("render_table_docs", repo / "scripts" / "render_table_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_registry_table_has_an_entry(repo):
    mod = _renderer(repo)
    assert set(mod.TABLES) == set(SCHEMAS), "add or remove the table's entry in TABLES of scripts/render_table_docs.py"
    assert set(mod.DERIVED_VIEWS) == {"variant_summary", "eval_summary", "manifests"}


def test_docs_tables_md_is_current(repo):
    mod = _renderer(repo)
    text = mod.render()
    assert mod.OUT.read_text() == text, "docs/tables.md is stale: run .venv/bin/python scripts/render_table_docs.py"
    # every table and every column with its Arrow type is there
    for name, schema in SCHEMAS.items():
        assert f"### {name}\n" in text
        for f in schema:
            assert f"| `{f.name}` | `{mod._type(f.type)}` |" in text, (name, f.name)
    # descriptions come from the schema module's comments, and comments containing markup are escaped
    assert "| `outcome_correct` | `bool` | no | r_v |" in text
    assert "| `rewards` | `list<float>` | yes | R[t] = C\\*r_v - P\\*w[step(t)] |" in text
    assert "steps with &lt;&lt;expr=result&gt;&gt;; audit only" in text
    assert "| `auroc` | `double` | yes | of the item's mean step weight" in text  # from critic_eval.scores.Score
    # the derived views' columns come from their SQL
    assert "| `share_tokens_penalized` | `DOUBLE` |" in text
    assert "| `pass_at_k` | `DOUBLE` |" in text


def test_example_queries_use_catalog_views(repo):
    mod = _renderer(repo)
    views = set(storage.CATALOG_GLOBS) | {"prompts", "variant_summary", "eval_summary", "manifests", "skipped_tables"}
    sql = "\n".join(re.findall(r"```sql\n(.*?)```", mod.INTRO, flags=re.S))
    ctes = set(re.findall(r"\b([a-z_]+)\s+AS\s*\(", sql))  # WITH per_response AS (...)
    named = set(re.findall(r"\b(?:FROM|JOIN)\s+([a-z_]+)", sql)) - ctes
    assert named and named <= views, named - views
