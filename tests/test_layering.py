"""The import graph points one way (config <- model, data, ... <- parallel <- train <- tools), and model.py stays
free of torch.distributed."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_trainer"

# Which package modules each module may import.
ALLOWED = {
    "config": set(),
    "model": {"config"},
    "data": {"config"},
    "tokenizer": {"config"},
    "optim": {"config"},
    "metrics": {"config"},
    "checkpoint": {"config"},
    "hf": {"config"},
    "parallel": {"config", "model"},
    "train": {"config", "model", "data", "tokenizer", "optim", "metrics", "checkpoint", "parallel"},
    "plan": {"config", "model"},
    "__main__": {"train"},
    "__init__": set(),
}


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_package_imports_point_one_way():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert modules == set(ALLOWED), "a new module needs a line in ALLOWED"
    for name in modules:
        internal = {m.split(".")[1] for m in imports_of(PACKAGE / f"{name}.py") if m.startswith("fsdp_trainer.")}
        assert internal <= ALLOWED[name], f"{name} imports {internal - ALLOWED[name]}"
        assert not any(m.startswith("tools") for m in imports_of(PACKAGE / f"{name}.py"))


def test_model_has_no_distributed_code():
    assert not any("distributed" in m for m in imports_of(PACKAGE / "model.py"))
    assert "torch.distributed" not in (PACKAGE / "model.py").read_text()
