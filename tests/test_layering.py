"""The import graph points one way (files, config <- model, data, ... <- parallel <- checkpoint, metrics <- train
<- tools), and model.py stays free of torch.distributed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_trainer"

# Which package modules each module may import.
ALLOWED = {
    "files": set(),
    "config": {"files"},
    "model": {"config"},
    "tokenizer": {"files"},
    "tokens": {"files"},
    "data": {"config", "model", "tokenizer", "tokens"},
    "muon": set(),
    "optim": {"config", "muon"},
    "hf": {"config", "tokenizer"},
    "parallel": {"config", "model"},
    "checkpoint": {"config", "files", "optim", "parallel", "tokenizer"},
    "metrics": {"config", "data", "files", "model", "parallel"},
    "plan": {"config", "model", "optim", "parallel"},
    "chat": {"tokenizer", "tokens"},
    "prepare": {"chat", "config", "files", "tokenizer", "tokens"},
    "convert": {"checkpoint", "config", "hf", "model", "tokenizer"},
    "train": {"checkpoint", "config", "data", "files", "metrics", "model", "optim", "parallel", "tokenizer", "tokens"},
    "launch": {"config", "train"},
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
        assert not any(m.startswith(("tools", "benchmarks")) for m in imports_of(PACKAGE / f"{name}.py"))


def test_model_has_no_distributed_code():
    assert not any("distributed" in m for m in imports_of(PACKAGE / "model.py"))
    assert "torch.distributed" not in (PACKAGE / "model.py").read_text()


def test_tools_and_benchmarks_import_the_installed_package():
    """No sys.path edits: both quick-start commands install the package."""
    repo = PACKAGE.parent
    for script in [*repo.glob("tools/*.py"), *repo.glob("benchmarks/*.py")]:
        assert "sys.path" not in script.read_text(), script


def test_preparing_data_never_imports_torch():
    """Reading a recipe and preparing data stay numpy-only: importing torch costs a second of every prepare_data.py
    run (a tenth of a 100 MB corpus's preparation) and of each worker started with spawn."""
    code = (
        "import sys\n"
        "from fsdp_trainer.config import parse_args, recipe_parser\n"
        "import fsdp_trainer.prepare\n"
        "parse_args(recipe_parser('prepare', ''), ['--recipe', 'recipes/debug.yaml', '--data.seq_len', '64'])\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:500]
