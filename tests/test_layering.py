"""The package is built in floors, and an import points down: a room (a top-level file, or a folder and its files)
imports only rooms on floors below its own, and a folder's files import each other without a cycle. model.py stays
free of torch.distributed, tools/ and benchmarks/ are never imported by the package, and data preparation never
imports torch. And the rooms stay a size a reader takes in: no package file over 600 lines, no class or function over
80."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_trainer"

FLOORS = [
    {"__init__", "errors", "files", "loss", "rewards", "muon", "lean_autograd"},
    {"config", "tokenizer"},
    {"moe"},  # the mixture of experts model.py puts in a block
    {"hf_experts"},  # an MoE's experts between the Hub's layout and ours, for hf.py and convert.py
    {"model", "optim", "hf", "data", "reference"},
    {"distributed", "generation"},  # runtime, parallelize; sampling from a model
    {"adapters"},  # applied to the model between construction and parallelize
    {"checkpoint", "sinks"},
    {"metrics", "convert"},
    {"steps", "evaluation"},  # one room per training kind; benchmark tasks through lm-eval
    {"build"},  # the pieces of a run, from its recipe
    {"train"},
    {"launch", "__main__", "planner"},  # the planner reads the trainer; nothing reads it
]
"""Rooms, bottom floor first."""

LONGEST_FILE, LONGEST_DEFINITION = 600, 80
"""The house's sizes, in lines: a package file, and a class or function (docstrings and comments counted)."""


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


def _floor(room: str) -> int:
    return next(i for i, rooms in enumerate(FLOORS) if room in rooms)


def package_graph() -> dict[str, set[str]]:
    """Each package module (`folder.file`) and the package modules it imports."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py") if "assets" not in p.parts}
    return {
        name: {m.removeprefix("fsdp_trainer.") for m in imports_of(path) if m.startswith("fsdp_trainer.")}
        for name, path in modules.items()
    }


def test_every_import_points_down_a_floor():
    graph = package_graph()
    rooms = {name.split(".")[0] for name in graph}
    assert rooms <= set().union(*FLOORS), f"{sorted(rooms - set().union(*FLOORS))}: give the new room a floor"
    upward = []
    for name, imported in graph.items():
        room = name.split(".")[0]
        for target in imported:
            other = target.split(".")[0]
            if other != room and _floor(other) >= _floor(room):
                upward.append(f"{name} -> {target} (floor {_floor(room)} -> {_floor(other)})")
    assert not upward, "imports that do not point down: " + "; ".join(sorted(upward))


def test_a_folders_files_import_each_other_without_a_cycle():
    graph = package_graph()
    inside = {name: {t for t in imported if t.split(".")[0] == name.split(".")[0]} for name, imported in graph.items()}
    done, stack = set(), []

    def visit(name: str) -> None:
        assert name not in stack, "import cycle: " + " -> ".join([*stack[stack.index(name) :], name])
        if name in done:
            return
        stack.append(name)
        for target in inside.get(name, ()):
            visit(target)
        stack.pop()
        done.add(name)

    for name in inside:
        visit(name)


def test_the_layering_test_fails_on_an_upward_import(monkeypatch):
    graph = package_graph()
    monkeypatch.setattr(sys.modules[__name__], "package_graph", lambda: {**graph, "model": {"config", "train"}})
    try:
        test_every_import_points_down_a_floor()
    except AssertionError as e:
        assert "model -> train (floor 4 -> 11)" in str(e)
    else:
        raise AssertionError("an upward import passed")


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


def test_no_package_file_class_or_function_outgrows_the_house():
    too_long = []
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        if source.count("\n") > LONGEST_FILE:
            too_long.append(f"{_module(path)}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_DEFINITION:
                    too_long.append(f"{_module(path)}.{node.name}: {lines} lines")
    assert not too_long, f"over {LONGEST_FILE} lines a file or {LONGEST_DEFINITION} a definition: {too_long}"
