"""Render docs/config.md from the config models' field descriptions (pydantic ``Field``s).

    .venv/bin/python scripts/render_config_docs.py            # write docs/config.md
    .venv/bin/python scripts/render_config_docs.py --check    # exit 1 when docs/config.md is stale

The descriptions live once, on the fields in ``pipeline/config.py`` (attribute docstrings, read by
pydantic's ``use_attribute_docstrings``); ``tests/unit/test_config_docs.py`` fails when this file and
the models disagree.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "docs" / "config.md"


def _models(annotation) -> list[type[BaseModel]]:
    """Config models inside a field's annotation (a model, an optional one, a union of them)."""
    out, stack = [], [annotation]
    while stack:
        t = stack.pop(0)
        if isinstance(t, type) and issubclass(t, BaseModel):
            out.append(t)
        else:
            stack.extend(typing.get_args(t))
    return out


def _type(annotation) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or str(annotation).replace("typing.", "").replace("pipeline.config.", "")
    return text.replace("|", "\\|")


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.is_required():
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "see below"
    return "`" + json.dumps(value, default=str) + "`"


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def render() -> str:
    from pipeline.config import CAPOConfig

    lines = ["# Configuration reference", "",
             "Generated from `pipeline/config.py` by `scripts/render_config_docs.py`; do not edit by hand.",
             "Set a field in a YAML config (`configs/default.yaml`) or on the command line as a dotted",
             "override (`train.learning_rate=1e-5`). Stage keys: a stage re-runs when a field in its key",
             "changes (docs/design.md §2.1).", ""]
    seen: set[str] = set()
    queue: list[tuple[str, type[BaseModel]]] = [("", CAPOConfig)]
    while queue:
        prefix, model = queue.pop(0)
        title = prefix.rstrip(".") or "top level"
        heading = f"{title} ({model.__name__})" if prefix else f"{title} ({model.__name__})"
        if heading in seen:
            continue
        seen.add(heading)
        lines += [f"## {heading}", ""]
        if model.__doc__ and model.__doc__.strip() and not model.__doc__.startswith(BaseModel.__doc__ or "\0"):
            lines += [_one_line(model.__doc__), ""]
        lines += ["| field | type | default | description |", "| --- | --- | --- | --- |"]
        for name, field in model.model_fields.items():
            lines.append(f"| `{prefix}{name}` | {_type(field.annotation)} | {_default(field)} | "
                         f"{_one_line(field.description)} |")
            for sub in _models(field.annotation):
                queue.append((f"{prefix}{name}." if len(_models(field.annotation)) == 1
                              else f"{prefix}{name}.[type={sub.model_fields['type'].default}].", sub))
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/config.md is stale")
    a = ap.parse_args()
    text = render()
    if a.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run .venv/bin/python scripts/render_config_docs.py", file=sys.stderr)
            sys.exit(1)
        return
    OUT.write_text(text)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
