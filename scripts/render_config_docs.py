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
import types
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
    """A readable type: Annotated metadata dropped, unions and Literals spelled out."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _default(value) -> str:
    if isinstance(value, BaseModel):
        return "see below"
    return "`" + json.dumps(value, default=str) + "`"


def _value(model: type[BaseModel], name: str, instance: BaseModel | None):
    """The field's default as the config has it: read from the parent's default instance when
    there is one (``critique.sampling`` is not ``SamplingConfig()``), else the class default."""
    if instance is not None:
        return getattr(instance, name)
    field = model.model_fields[name]
    return field.default_factory() if field.default_factory is not None else field.default


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def render() -> str:
    from pipeline.config import CAPOConfig

    lines = ["# Configuration reference", "",
             "Generated from `pipeline/config.py` by `scripts/render_config_docs.py`; do not edit by hand.",
             "Set a field in a YAML config (`configs/default.yaml`) or on the command line as a dotted",
             "override (`train.learning_rate=1e-5`). Defaults are those of an empty config, the paper's",
             "method (variant `capo-majority`); the embedded `configs/default.yaml` is that config under the",
             "`capo-readout` preset (the critic's log-prob readout and the arithmetic check vote, no sampled",
             "critiques; `configs/presets/capo-readout.yaml`). A stage re-runs when a field in its key changes",
             "(docs/design.md §2.1).", ""]
    queue: list[tuple[str, type[BaseModel], BaseModel | None]] = [("", CAPOConfig, CAPOConfig())]
    while queue:
        prefix, model, instance = queue.pop(0)
        title = prefix.rstrip(".") or "top level"
        lines += [f"## {title} ({model.__name__})", ""]
        if model.__doc__ and model.__doc__.strip() and not model.__doc__.startswith(BaseModel.__doc__ or "\0"):
            lines += [_cell(model.__doc__), ""]
        lines += ["| field | type | default | description |", "| --- | --- | --- | --- |"]
        for name, field in model.model_fields.items():
            value = _value(model, name, instance)
            lines.append(f"| `{prefix}{name}` | {_cell(_type(field.annotation))} | {_default(value)} | "
                         f"{_cell(field.description)} |")
            subs = _models(field.annotation)
            for sub in subs:
                inst = value if isinstance(value, sub) else None
                tag = f"{name}." if len(subs) == 1 else f"{name}.[type={sub.model_fields['type'].default}]."
                queue.append((prefix + tag, sub, inst))
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
