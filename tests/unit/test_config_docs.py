"""Config documented once: every config field has its description on the field, and
docs/config.md is what ``scripts/render_config_docs.py`` renders from them."""

from __future__ import annotations

import importlib.util

from pydantic import BaseModel

from pipeline import config as C


def _renderer(repo):
    spec = importlib.util.spec_from_file_location("render_config_docs", repo / "scripts" / "render_config_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_config_field_has_a_description():
    missing = [f"{name}.{field}" for name, model in vars(C).items()
               if isinstance(model, type) and issubclass(model, BaseModel) and model.__module__ == C.__name__
               for field, info in model.model_fields.items() if not (info.description or "").strip()]
    assert missing == []


def test_docs_config_md_is_current(repo):
    mod = _renderer(repo)
    text = mod.render()
    assert mod.OUT.read_text() == text, "docs/config.md is stale: run .venv/bin/python scripts/render_config_docs.py"
    # spot checks that the rendering carries the fields and their descriptions
    assert "| `train.learning_rate` | float | `2e-06` |" in text
    assert "| `critique.engine.[type=openai].max_retries` |" in text
    assert "Rule whose step weights train the policy" in text
    # nested defaults are the config's, not the class's: critique.sampling is not SamplingConfig()
    assert "| `critique.sampling.temperature` | float | `0.7` |" in text
    assert "| `critique.engine.[type=vllm].max_model_len` | int | `4096` |" in text
    assert "| `rollout.sampling.max_tokens` | int | `320` |" in text
    assert "FieldInfo" not in text
