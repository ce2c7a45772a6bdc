"""The recipe reference (docs/recipe_reference.md): every key of every section, its default and its meaning, which
is the key's attribute docstring in config/ (sections.py, tuning.py), the text `--help` shows. Written by
tools/recipe_reference.py; tests/test_config.py checks the file is what this makes, so the two cannot drift."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import sys

from fsdp_trainer.config import SECTIONS

HEADER = """# Recipe reference

Every key of a recipe, with its default (recipes override them) and what it means: the text `--help` prints
(`python -m fsdp_trainer.train --help`). Override any key as `--section.key value`. This file is generated from
fsdp_trainer/config/ by `python tools/recipe_reference.py`; do not edit it by hand.
"""


def attribute_docstrings() -> dict[str, dict[str, str]]:
    """{class name: {key: its attribute docstring, whitespace folded}} of the classes in the sections' modules."""
    out = {}
    modules = {sys.modules[section.__module__] for section in SECTIONS.values()}
    nodes = [
        node
        for module in sorted(modules, key=lambda m: m.__name__)
        for node in ast.parse(inspect.getsource(module)).body
    ]
    for node in nodes:
        if isinstance(node, ast.ClassDef):
            docs = out.setdefault(node.name, {})
            for field, doc in zip(node.body, node.body[1:], strict=False):
                if (
                    isinstance(field, ast.AnnAssign)
                    and isinstance(doc, ast.Expr)
                    and isinstance(doc.value, ast.Constant)
                ):
                    docs[field.target.id] = " ".join(doc.value.value.split())
    return out


def _default(field: dataclasses.Field) -> str:
    """A key's default as a recipe spells it (YAML: null, true, lists in brackets)."""
    if field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        value = field.default
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)


def recipe_reference() -> str:
    """The text of docs/recipe_reference.md."""
    docs = attribute_docstrings()
    parts = [HEADER]
    for section, cls in SECTIONS.items():
        summary = " ".join((cls.__doc__ or "").split())
        rows = [f"| `{f.name}` | `{_default(f)}` | {docs[cls.__name__][f.name]} |" for f in dataclasses.fields(cls)]
        parts.append(
            f"## `{section}`\n\n{summary}\n\n| key | default | meaning |\n|---|---|---|\n" + "\n".join(rows) + "\n"
        )
    return "\n".join(parts)
