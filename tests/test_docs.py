"""The commands of README and the guides in docs/ stay in step with the code: every `make` target exists, every tool
and recipe named exists, every flag a tool is given is one of its own or a recipe key, and every training command's
recipe and flags parse as the trainer parses them (the walk-throughs themselves were run by hand; their recipes are
checked by tests/test_recipes.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from fsdp_trainer.config import SECTIONS
from fsdp_trainer.config.parse import _parse_sections, recipe_parser
from fsdp_trainer.launch import split_argv
from tests.helpers import REPO, tool

GUIDES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "benchmarks.md")]
PRINTING = ("--help", "--help_all", "--print_config")
KEYS = {f"--{section}.{field}" for section, cls in SECTIONS.items() for field in cls.__dataclass_fields__}


def commands(path: Path) -> list[list[str]]:
    """The shell commands of a file's ```bash blocks, each split into words: continuation lines joined, comments,
    `&&` chains and leading environment assignments split off."""
    found, variables = [], {}
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            for part in filter(None, (p.strip() for p in line.split("&&"))):
                words = shlex.split(part, comments=True)
                while words and re.match(r"^[A-Z_]+=", words[0]):  # CHAT="--data.train_path ...": used as $CHAT
                    name, value = words.pop(0).split("=", 1)
                    variables[name] = shlex.split(value)
                words = [w for word in words for w in (variables.get(word[1:], [word]) if word[:1] == "$" else [word])]
                if words:
                    found.append(words)
    return found


def _every(kind):
    return [(path.name, words) for path in GUIDES for words in commands(path) if kind(words)]


def _trainer(words: list[str]) -> list[str] | None:
    """The trainer's arguments of a training command (fsdp-train, python -m fsdp_trainer.train, torchrun -m ...)."""
    if words[0] == "fsdp-train":
        return split_argv(words[1:])[1]
    if "-m" in words and words[words.index("-m") + 1] == "fsdp_trainer.train":
        return split_argv(words[words.index("-m") + 2 :])[1]
    return None


def test_the_guides_have_commands():
    assert {path.name for path in GUIDES} >= {"README.md", "pretraining.md", "preference.md", "chat_finetuning.md"}
    for path in GUIDES[1:]:
        if path.name != "recipe_reference.md":
            assert commands(path), f"{path.name} opens with no walk-through"


@pytest.mark.parametrize("name, words", _every(lambda w: w[0] == "make"))
def test_every_make_target_exists(name, words):
    targets = re.findall(r"^([a-z-]+):", (REPO / "Makefile").read_text(), flags=re.M)
    assert all(word in targets or "=" in word for word in words[1:]), f"{name}: {' '.join(words)}"


@pytest.fixture(scope="module")
def parser():
    return recipe_parser()


@pytest.mark.parametrize("name, words", _every(lambda w: _trainer(w) is not None))
def test_every_training_command_parses(name, words, parser):
    args = _trainer(words)
    for k, word in enumerate(args[:-1]):  # the recipes a walk-through makes on the way (an import's) are not here
        if word == "--recipe" and args[k + 1].startswith("recipes/"):
            assert (REPO / args[k + 1]).is_file(), f"{name}: {args[k + 1]} does not exist"
    shipped = []
    for k, word in enumerate(args):
        if word == "--recipe" and not args[k + 1].startswith("recipes/"):
            continue
        if k and args[k - 1] == "--recipe" and not word.startswith("recipes/"):
            continue
        shipped.append(word)
    flags = [word for word in shipped if word.startswith("--") and word not in ("--recipe", *PRINTING)]
    unknown = [flag.split("=")[0] for flag in flags if flag.split("=")[0] not in KEYS]
    assert not unknown, f"{name}: {' '.join(words)}: {unknown} are no recipe keys"
    _parse_sections(parser, [word for word in shipped if word not in PRINTING])


TOOLS = sorted({w[1] for _, w in _every(lambda w: w[0] == "python" and len(w) > 1 and w[1].startswith("tools/"))})


@pytest.mark.parametrize("script", TOOLS)
def test_every_tool_flag_is_the_tools_or_a_recipe_key(script):
    assert (REPO / script).is_file(), f"{script} does not exist"
    text = tool(Path(script).name, "--help").stdout
    own = set(re.findall(r"(--[a-z_]+)", text))
    for name, words in _every(lambda w: w[0] == "python" and len(w) > 1 and w[1] == script):
        for flag in (word.split("=")[0] for word in words[2:] if word.startswith("--")):
            assert flag in own or flag in KEYS, f"{name}: {' '.join(words)}: {script} takes no {flag}"
        for k, word in enumerate(words[:-1]):
            if word == "--recipe" and words[k + 1].startswith("recipes/"):
                assert (REPO / words[k + 1]).is_file(), f"{name}: {words[k + 1]} does not exist"
