"""Reading and writing recipes: the one parser every tool shares, the resolved recipe as YAML, and a tool's one-line
error boundary."""

from __future__ import annotations

import argparse
import copy
import functools
import os
import sys
from contextlib import contextmanager
from dataclasses import asdict, fields
from typing import NoReturn

from fsdp_trainer.config.recipe import SECTIONS, Recipe
from fsdp_trainer.errors import say
from fsdp_trainer.files import CONFIG_FILE, write_atomic


class RecipeError(ValueError):
    """A recipe that does not parse or validate; the message names the key (or file) and what is wrong."""


def recipe_parser(prog: str | None = None, description: str | None = None):
    """The one parser of recipes: `--recipe FILE` (repeatable, later files and flags override earlier ones) and a
    `--section.key value` flag for every key. Tools add their own arguments to it, so every tool reads a recipe the
    way the trainer does. Each call gets its own copy of one parser built per process (building it reads every
    section's source for its docstrings: 0.3 s of CPU, against 0.01 s for the copy)."""
    parser = copy.deepcopy(_sections_parser())
    parser.prog = prog or parser.prog
    parser.description = description or parser.description
    return parser


@functools.cache
def _sections_parser():
    from jsonargparse import ArgumentParser, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = ArgumentParser(
        prog="fsdp_trainer.train",  # the trainer's; a tool's copy names the tool (recipe_parser)
        description="Train a Llama/Qwen3-style model with FSDP. Launch with torchrun for several processes.",
        print_config="--print_config",
        exit_on_error=False,
    )
    parser.add_argument("--recipe", action="config", help="YAML recipe; flags after it override its keys.")
    for name, cls in SECTIONS.items():
        parser.add_class_arguments(cls, nested_key=name)
    parser.recipe_dests = {action.dest for action in parser._actions}  # a tool's own flags come after these
    _skip_subclass_defaults()
    return parser


def _skip_subclass_defaults() -> None:
    """jsonargparse fills in the defaults of values given as a subclass (a `class_path` and its `init_args`) by a pass
    that walks every key of the namespace, twice a parse (its own defaults, then the parsed ones): half the CPU of
    parsing a recipe (0.02 of 0.04 s, in every process that reads one). No key of a recipe takes a subclass (the
    sections' types are plain, their nested dataclasses closed), so for a recipe parser whose flags take none the
    pass is skipped; any other parser, and a recipe parser a tool gave such a flag, still runs it."""
    from jsonargparse._typehints import ActionTypeHint

    if hasattr(ActionTypeHint.add_sub_defaults, "original"):
        return

    def add_sub_defaults(parser, cfg) -> None:
        if not hasattr(parser, "recipe_dests") or _takes_a_subclass(parser):
            add_sub_defaults.original(parser, cfg)

    add_sub_defaults.original = ActionTypeHint.add_sub_defaults
    ActionTypeHint.add_sub_defaults = staticmethod(add_sub_defaults)


def _takes_a_subclass(parser) -> bool:
    """Whether a flag of `parser` takes a subclass (jsonargparse's own test), asked again when flags were added."""
    from jsonargparse._typehints import ActionTypeHint

    known = parser.__dict__.get("_takes_a_subclass")
    if known is None or known[0] != len(parser._actions):
        subclass = ActionTypeHint.is_subclass_typehint
        known = (len(parser._actions), any(subclass(a, all_subtypes=False, also_lists=True) for a in parser._actions))
        parser._takes_a_subclass = known
    return known[1]


def short_help(parser) -> str:
    """What `--help` prints: the command, its own flags (a tool's), and the recipe's sections with where their keys
    are told; `--help_all` prints every key."""
    # not the flags kept out of help (jsonargparse adds one of its own as a parser first parses)
    own = [a for a in parser._actions if a.dest not in parser.recipe_dests and a.help != argparse.SUPPRESS]
    lines = [f"usage: {parser.prog} --recipe FILE [--recipe FILE ...] [--section.key VALUE ...]"
             + (" [flags below]" if own else ""), "", parser.description or "", ""]  # fmt: skip
    if own:
        lines.append("flags:")
        for action in own:
            names = ", ".join(action.option_strings) or action.dest
            default = (
                "" if action.default in (None, False) or not action.option_strings else f" (default: {action.default})"
            )
            lines.append(f"  {names}: {' '.join((action.help or '').split())}{default}")
        lines.append("")
    lines.append("recipe sections, each key a flag --section.key VALUE that overrides the --recipe files:")
    for name, cls in SECTIONS.items():
        summary = " ".join((cls.__doc__ or "").split()).split(". ")[0].rstrip(".")
        lines.append(f"  {name:<11}{summary} ({len(fields(cls))} keys)")
    lines += ["", "--help_all lists every key with its default and meaning (docs/recipe_reference.md, as a table); "
              "--print_config prints the resolved recipe, checked as training checks it."]  # fmt: skip
    return "\n".join(lines)


def _parse_sections(parser, argv: list[str] | None):
    """(section dataclasses by name, the whole namespace); raises RecipeError."""
    from jsonargparse import ArgumentError

    try:
        namespace = parser.instantiate(parser.parse_args(argv))  # runs each section's __post_init__
    except (ArgumentError, ValueError, TypeError) as e:
        message = " ".join(str(e).split())
        raise RecipeError(message + unknown_key_hint(message, sys.argv[1:] if argv is None else argv)) from e
    return {name: namespace[name] for name in SECTIONS}, namespace


def unknown_key_hint(message: str, argv: list[str]) -> str:
    """For an unknown key: the closest known one, and the recipe file that has it (`; did you mean model.dim? (in
    my.yaml)`); "" for any other error."""
    import difflib
    import re

    import yaml

    keys = [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in fields(cls)]
    if found := re.search(r"Group '(\w+)' does not accept option '([\w.]+)'", message):
        key = f"{found[1]}.{found[2]}"
    elif found := re.search(r"Option '([\w.]+)' is not accepted", message):
        key = found[1]
    elif found := re.search(r"unrecognized arguments: --([\w.]+)", message):
        key = found[1]
    else:
        return ""
    section, _, name = key.partition(".")
    if section in SECTIONS:  # a key's typo: the closest key of its section
        close = [f"{section}.{n}" for n in difflib.get_close_matches(name, [f.name for f in fields(SECTIONS[section])])]
    else:  # a section's typo: the closest section, if it has the key
        close = [f"{s}.{name}" for s in difflib.get_close_matches(section, list(SECTIONS)) if f"{s}.{name}" in keys]
    hint = f"; did you mean {close[0]}?" if close else "; fsdp-train --help lists the sections and their keys"
    files = [argv[k + 1] for k, arg in enumerate(argv[:-1]) if arg == "--recipe"]
    for path in files:
        try:
            recipe = yaml.safe_load(open(path)) or {}
            if name.split(".")[0] in (recipe.get(section) or {}):
                return f"{hint} (in {path})"
        except (OSError, ValueError, AttributeError, yaml.YAMLError):
            continue
    return hint


def read_recipe(parser, argv: list[str] | None = None):
    """(Recipe, namespace with the tool's own arguments) from a command line; raises RecipeError."""
    sections, namespace = _parse_sections(parser, argv)
    try:
        return Recipe(**sections), namespace
    except ValueError as e:
        raise RecipeError(str(e)) from e


def parse_args(parser, argv: list[str] | None = None):
    """read_recipe for a command line: any error exits 1 with one `error: ...` line (see fail). `--help` prints
    short_help, `--help_all` every key, `--print_config` the recipe once it reads and validates; each exits 0."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if {"-h", "--help"} & set(argv):
        print(short_help(parser))
        sys.exit(0)
    if "--help_all" in argv:
        argv = ["--help"]
    printing = [arg for arg in argv if arg.startswith("--print_config")]
    try:
        recipe, namespace = read_recipe(parser, [arg for arg in argv if arg not in printing])
    except RecipeError as e:
        fail(e)
    if printing:
        print(recipe_to_yaml(recipe), end="")
        sys.exit(0)
    return recipe, namespace


def parse_recipe(argv: list[str] | None = None) -> Recipe:
    """Parse `--recipe FILE` and `--section.key value` flags into a validated Recipe.

    Any error (unknown key, wrong type, bad choice, impossible combination) exits with status 1 and exactly one
    `error: ...` line on stderr. `--help` and `--print_config` print and exit 0.
    """
    return parse_args(_sections_parser(), argv)[0]  # no copy: what a parse leaves in it changes no later one


def load_sections(path: str | os.PathLike) -> dict:
    """The sections of a recipe file ({name: dataclass}; a run's config.yaml, a checkpoint's recipe.yaml, an imported
    model.yaml), read as `--recipe path` is but without the checks that involve several sections, so a model section
    alone reads too; raises RecipeError. Parsed once a process for each version of the file (a resume asks its
    checkpoint's for the run's kind, then for its precision: 0.05-0.1 s of CPU a parse); each call gets its own copy."""
    try:
        stat = os.stat(path)
    except OSError:  # the parser's error names it
        return _parse_sections(_sections_parser(), ["--recipe", str(path)])[0]
    version = (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if version not in _LOADED:
        _LOADED[version] = _parse_sections(_sections_parser(), ["--recipe", str(path)])[0]
    return copy.deepcopy(_LOADED[version])


_LOADED: dict[tuple, dict] = {}


def sections_to_yaml(sections: dict) -> str:
    """Recipe sections ({name: dataclass}) as YAML that `--recipe` reads back."""
    import yaml

    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml's where PyYAML has it: the same text, 5x faster
    resolved = {name: plain(asdict(section)) for name, section in sections.items()}
    return yaml.dump(resolved, Dumper=dumper, sort_keys=False)


def recipe_to_yaml(recipe: Recipe) -> str:
    """The fully resolved recipe as YAML that `--recipe` reads back."""
    return sections_to_yaml({name: getattr(recipe, name) for name in SECTIONS})


def write_config(recipe: Recipe) -> None:
    """Write the resolved recipe to train.out_dir/config.yaml, which `--recipe` reads back to reproduce the run."""
    os.makedirs(recipe.train.out_dir, exist_ok=True)
    write_atomic(os.path.join(recipe.train.out_dir, CONFIG_FILE), recipe_to_yaml(recipe))


def fail(error: object) -> NoReturn:
    """Exit 1 with one `error: ...` line. Under torchrun every rank of a node fails the same way before any process
    group exists, so the line is said once per node (errors.say)."""
    say("error: " + " ".join(str(error).split()), everyone=True)
    sys.exit(1)


@contextmanager
def one_line_errors():
    """The error boundary of a command-line tool: whatever goes wrong ends it with one `error:` line and exit 1."""
    try:
        yield
    except Exception as e:
        fail(e)
