"""The import graph points one way (files, config <- model, loss, data/ ... <- distributed/ <- checkpoint, metrics <-
train <- launch <- tools), and model.py stays free of torch.distributed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_trainer"

# Which package modules each module may import (folders as `folder.module`).
ALLOWED = {
    "files": set(),
    "config": {"files"},
    "model": {"config"},
    "loss": set(),
    "tokenizer": {"files"},
    "data.format": {"files"},
    "data.loader": {"config", "loss", "tokenizer", "data.format"},
    "data.chat": {"tokenizer", "data.format"},
    "data.sources": set(),
    "data.encode": {"data.chat", "data.format", "data.sources", "tokenizer"},
    "data.writers": {"data.chat", "data.encode", "data.format", "files"},
    "data.prepare": {
        "config", "data.chat", "data.encode", "data.format", "data.sources", "data.writers", "files", "tokenizer"
    },
    "muon": set(),
    "optim": {"config", "muon"},
    "hf": {"config", "tokenizer"},
    "distributed.parallelize": {"config", "model"},
    "distributed.runtime": {"config", "distributed.parallelize"},
    "distributed.fake": {
        "adapters.lora", "config", "data.loader", "distributed.parallelize", "loss", "model", "optim", "preference",
        "train",
    },
    "distributed.speed": {"config", "distributed.runtime", "metrics"},
    "distributed.plan": {
        "adapters.lora", "adapters.nf4", "config", "distributed.speed", "metrics", "model", "optim", "distributed.fake",
        "distributed.parallelize", "distributed.runtime",
    },
    "adapters.lora": {"config", "model"},
    "adapters.nf4": {"adapters.lora", "config", "distributed.parallelize", "model"},
    "checkpoint": {
        "adapters.lora", "adapters.nf4", "config", "files", "model", "optim", "distributed.runtime", "tokenizer"
    },
    "sinks": {"config", "files"},
    "metrics": {"config", "data.loader", "files", "model", "distributed.runtime", "sinks"},
    "preference": {
        "adapters.lora", "config", "data.loader", "distributed.parallelize", "distributed.runtime", "loss", "model"
    },
    "convert": {"adapters.lora", "checkpoint", "config", "files", "hf", "model", "tokenizer"},
    "train": {
        "adapters.lora", "adapters.nf4", "checkpoint", "config", "convert", "data.loader", "data.format", "files", "hf",
        "loss", "metrics", "model", "optim", "preference", "sinks", "distributed.parallelize", "distributed.runtime",
        "tokenizer",
    },
    "launch": {"config", "train"},
    "__main__": {"train"},
    "__init__": set(),
    "data.__init__": set(),
    "distributed.__init__": set(),
    "adapters.__init__": set(),
}  # fmt: skip


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _module(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def test_package_imports_point_one_way():
    modules = {_module(p): p for p in PACKAGE.rglob("*.py") if "assets" not in p.parts}
    assert set(modules) == set(ALLOWED), "a new module needs a line in ALLOWED"
    for name, path in modules.items():
        internal = {m.removeprefix("fsdp_trainer.") for m in imports_of(path) if m.startswith("fsdp_trainer.")}
        internal -= {"data", "distributed", "adapters"}  # `from fsdp_trainer.data import x`
        assert internal <= ALLOWED[name], f"{name} imports {internal - ALLOWED[name]}"
        assert not any(m.startswith(("tools", "benchmarks")) for m in imports_of(path))


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
        "import fsdp_trainer.data.prepare\n"
        "parse_args(recipe_parser('prepare', ''), ['--recipe', 'recipes/debug.yaml', '--data.seq_len', '64'])\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:500]
