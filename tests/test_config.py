"""Recipe parsing: overrides, validation messages, --help, and the recipe reference staying complete."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fsdp_trainer.config import SECTIONS, parse_recipe, recipe_to_yaml
from fsdp_trainer.reference import recipe_reference

README = Path(__file__).resolve().parents[1] / "README.md"
CONFIG = Path(__file__).resolve().parents[1] / "fsdp_trainer" / "config"
REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "recipe_reference.md"


def test_overrides_and_types():
    recipe = parse_recipe(
        ["--model.dim", "128", "--optim.betas", "[0.8, 0.99]", "--parallel.compile", "true", "--data.val_path", "null"]
    )
    assert recipe.model.dim == 128 and recipe.optim.betas == (0.8, 0.99) and recipe.parallel.compile is True
    assert recipe.data.val_path is None


def test_resolved_yaml_round_trips(tmp_path):
    recipe = parse_recipe(["--model.family", "qwen3", "--model.head_dim", "64", "--train.steps", "7"])
    scaled = parse_recipe(
        ["--model.rope_scaling.factor", "32", "--model.rope_scaling.original_max_position_embeddings", "8192"]
    )
    assert scaled.model.rope_scaling.factor == 32.0 and scaled.model.rope_scaling.high_freq_factor == 4.0
    (tmp_path / "s.yaml").write_text(recipe_to_yaml(scaled))
    assert parse_recipe(["--recipe", str(tmp_path / "s.yaml")]) == scaled
    (tmp_path / "c.yaml").write_text(recipe_to_yaml(recipe))
    assert parse_recipe(["--recipe", str(tmp_path / "c.yaml")]) == recipe
    assert parse_recipe(["--recipe", str(tmp_path / "c.yaml")]) == recipe


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model.dim", "abc"], "Parser key \"model.dim\": Expected a <class 'int'>. Got value: abc"),
        (["--model.dim", "100", "--model.n_heads", "8"], "model.n_heads=8 must divide model.dim=100"),
        (["--model.head_dim", "7"], "model.head_dim=7 must be even for RoPE"),
        (["--optim.min_lr", "1.0"], "optim.min_lr=1.0 must lie in [0, optim.lr=0.0003]"),
        (["--parallel.ac_every", "2"], "parallel.ac_every=2 needs parallel.activation_checkpointing full or selective"),
        (["--parallel.activation_checkpointing", "some"], 'Parser key "parallel.activation_checkpointing"'),
        (["--data.micro_batch_size", "0"], "data.micro_batch_size=0 must be positive"),
        (["--model.rope_scaling.factor", "0.5"], "model.rope_scaling.factor=0.5 must be >= 1"),
        (["--recipe", "/no/such.yaml"], 'Parser key "recipe": File does not exist'),
        (["--lora.rank", "0"], "lora.rank=0 must be >= 1, or null"),
        (["--lora.targets", "[q_proj, norm]"], "lora.targets has ['norm']; choose among q_proj"),
        (
            ["--lora.rank", "8", "--lora.targets", "[embed_tokens, lm_head]", "--model.tie_embeddings", "true"],
            "lora.targets has embed_tokens, lm_head, but model.tie_embeddings ties the output layer to the embedding",
        ),
        (["--lora.rank", "8", "--checkpoint.export_hf", "true"], "checkpoint.export_hf writes the model without"),
        (
            ["--lora.rank", "8", "--lora.quantize_base", "nf4", "--parallel.cpu_offload", "true"],
            "lora.quantize_base nf4 does not run with parallel.cpu_offload yet; set one of them off",
        ),
        (["--lora.adapter", "adapter_out"], "lora.adapter=adapter_out needs lora.rank (the adapter's r)"),
    ],
)
def test_errors_are_one_line_naming_the_key(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        parse_recipe(argv)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_yaml_typo_names_the_key(tmp_path, capsys):
    (tmp_path / "r.yaml").write_text("model:\n  dimm: 3\n")
    with pytest.raises(SystemExit):
        parse_recipe(["--recipe", str(tmp_path / "r.yaml")])
    assert "dimm" in capsys.readouterr().err


def test_help_is_short_and_help_all_documents_every_key(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_recipe(["--help"])
    assert exit_info.value.code == 0
    short = capsys.readouterr().out
    assert len(short.splitlines()) < 30 and "--help_all lists every key" in short
    assert all(f"  {section} " in short for section in SECTIONS)
    with pytest.raises(SystemExit) as exit_info:
        parse_recipe(["--help_all"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for section, cls in SECTIONS.items():
        for field in dataclasses.fields(cls):
            assert f"--{section}.{field.name}" in out
    assert "Width of the residual stream" in out  # attribute docstrings are the help text


def _attribute_docstrings() -> dict[str, dict[str, str]]:
    """{section: {key: its attribute docstring, whitespace folded}}: the text `--help` shows."""
    import ast

    nodes = [node for path in CONFIG.glob("*.py") for node in ast.parse(path.read_text()).body]
    classes = {node.name: node for node in nodes if isinstance(node, ast.ClassDef)}
    out = {}
    for section, cls in SECTIONS.items():
        body, docs = classes[cls.__name__].body, {}
        for field_node, doc in zip(body, body[1:], strict=False):
            if isinstance(field_node, ast.AnnAssign) and isinstance(doc, ast.Expr):
                docs[field_node.target.id] = " ".join(doc.value.value.split())
        out[section] = docs
    return out


def test_the_recipe_reference_is_the_help_text_of_every_key():
    """docs/recipe_reference.md is what tools/recipe_reference.py makes from config/'s sections, a row per key whose
    meaning is the key's --help text, and README points to it: checked here, so they cannot drift."""
    text = REFERENCE.read_text()
    assert text == recipe_reference(), "docs/recipe_reference.md is stale: run python tools/recipe_reference.py"
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `") and line.count(" | ") >= 2:
            key, _, meaning = line.strip("| ").split(" | ", 2)
            rows.setdefault(key.strip("`"), []).append(" ".join(meaning.strip(" |").replace("\\|", "|").split()))
    for section, docs in _attribute_docstrings().items():
        assert f"## `{section}`" in text
        for field in dataclasses.fields(SECTIONS[section]):
            assert field.name in rows, f"the reference lacks {section}.{field.name}"
            assert docs[field.name] in rows[field.name], f"the reference's {section}.{field.name} differs from --help"
    assert "(docs/recipe_reference.md)" in README.read_text()


def test_print_config_prints_the_resolved_recipe_that_reproduces_it(tmp_path, capsys):
    recipe_path = Path(__file__).resolve().parents[1] / "recipes" / "debug.yaml"
    with pytest.raises(SystemExit) as exit_info:
        parse_recipe(["--recipe", str(recipe_path), "--train.steps", "7", "--print_config"])
    assert exit_info.value.code == 0
    (tmp_path / "printed.yaml").write_text(capsys.readouterr().out)
    printed = parse_recipe(["--recipe", str(tmp_path / "printed.yaml")])
    assert printed == parse_recipe(["--recipe", str(recipe_path), "--train.steps", "7"])
    assert printed.train.steps == 7
    # A recipe training would refuse is refused here too, not printed.
    with pytest.raises(SystemExit) as exit_info:
        parse_recipe(["--recipe", str(recipe_path), "--data.seq_len", "4096", "--print_config"])
    assert exit_info.value.code == 1 and capsys.readouterr().out == ""


def test_a_tools_help_shows_its_own_flags_first(capsys):
    from fsdp_trainer.config.parse import parse_args, recipe_parser

    parser = recipe_parser("tools/x.py", "A tool.")
    parser.add_argument("--format", default="text", help="what the inputs are")
    with pytest.raises(SystemExit):
        parse_args(parser, ["--help"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:6] == ["A tool.", "", "flags:", "  --format: what the inputs are (default: text)"]


def test_an_unknown_key_names_the_closest_known_one_and_the_recipe_file_it_is_in(tmp_path):
    from fsdp_trainer.config.parse import RecipeError, read_recipe, recipe_parser

    (tmp_path / "key.yaml").write_text("model:\n  dimm: 64\n")
    (tmp_path / "section.yaml").write_text("lora:\n  rank: 4\nmodle:\n  dim: 64\n")
    cases = {
        ("--recipe", str(tmp_path / "key.yaml")): f"'dimm'; did you mean model.dim? (in {tmp_path / 'key.yaml'})",
        ("--recipe", str(tmp_path / "section.yaml")): f"did you mean model.dim? (in {tmp_path / 'section.yaml'})",
        ("--trian.steps", "4"): "unrecognized arguments: --trian.steps 4; did you mean train.steps?",
        ("--lora.rnak", "4"): "did you mean lora.rank?",
        ("--train.zzz", "4"): "--train.zzz 4; fsdp-train --help lists the sections and their keys",
    }
    for argv, message in cases.items():
        with pytest.raises(RecipeError) as refused:
            read_recipe(recipe_parser(), ["--recipe", str(Path(__file__).parents[1] / "recipes" / "debug.yaml"), *argv])
        assert str(refused.value).endswith(message), str(refused.value)


def test_a_recipe_file_is_parsed_once_a_version_and_each_reader_gets_its_own_copy(tmp_path, monkeypatch):
    """load_sections (a checkpoint's recipe, which a resume reads for its kind and then its precision) parses a file
    once a process until it changes, and gives each caller a copy to change."""
    from fsdp_trainer.config import parse

    path, recipe = tmp_path / "recipe.yaml", parse_recipe(["--model.dim", "128"])
    path.write_text(recipe_to_yaml(recipe))
    parses, parse_sections = [], parse._parse_sections
    monkeypatch.setattr(parse, "_parse_sections", lambda *args: parses.append(args) or parse_sections(*args))
    first = parse.load_sections(path)
    first["model"].dim = 1
    assert parse.load_sections(path)["model"].dim == 128 and len(parses) == 1  # its own copy, of one parse
    recipe.model.dim = 256
    (tmp_path / "new.yaml").write_text(recipe_to_yaml(recipe))
    (tmp_path / "new.yaml").replace(path)  # written anew, as write_atomic writes
    assert parse.load_sections(path)["model"].dim == 256 and len(parses) == 2


NESTED = [
    ["--model.family", "qwen3_moe", "--model.head_dim", "32", "--model.moe", '{"experts": 8, "top_k": 2}'],
    ["--model.family", "qwen3_moe", "--model.head_dim", "32", "--model.moe.experts", "8", "--model.moe.top_k", "2"],
    ["--model.family", "qwen3_moe", "--model.moe", '{"experts": "x", "top_k": 2}'],
    ["--model.rope_scaling", '{"factor": 8.0}'],
    ["--model.rope_scaling", '{"factor": "a"}'],
    ["--grpo.rewards", '[{function: "fsdp_trainer.rewards:exact_answer", weight: 2}]'],
    ["--grpo.rewards", "[{weight: 2}]"],
    ["--data.mixture", "[{path: /data/a.bin}]"],
    ["--model.dimm", "3"],
]
"""Sections nested in a recipe, given whole or in part, and keys that do not parse."""


def test_recipes_parse_as_they_do_with_jsonargparses_pass_for_subclass_defaults(monkeypatch):
    """parse.py skips the pass for a recipe parser (no key of a recipe takes a subclass): every shipped recipe, and
    each nested section given whole or in part, reads as the same Recipe, or fails with the same message, as with
    it; the tools' parsers with their own flags too. parse_recipe reads every command line of a process with one
    parser, not a copy each (a third of a parse's CPU): read in turn, they read as with a copy each; a copy made
    after it parsed still lists a tool's own flags alone in its help."""
    from jsonargparse._typehints import ActionTypeHint

    from fsdp_trainer.config.parse import RecipeError, _sections_parser, read_recipe, recipe_parser, short_help

    recipes = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))
    cases = [["--recipe", str(path)] for path in recipes] + [["--recipe", str(recipes[0]), *flags] for flags in NESTED]

    def read(argv: list[str], parser=None) -> str:
        try:
            return repr(read_recipe(parser or recipe_parser(), argv)[0])
        except RecipeError as e:
            return str(e)

    skipped = [read(argv) for argv in cases]
    assert [read(argv, _sections_parser()) for argv in cases] == skipped
    tool = recipe_parser("tools/x.py", "A tool.")
    tool.add_argument("--format", default="text", help="what the inputs are")
    assert short_help(tool).split("flags:\n")[1].split("\n\n")[0] == "  --format: what the inputs are (default: text)"
    passes = []
    original = ActionTypeHint.add_sub_defaults.original
    monkeypatch.setattr(
        ActionTypeHint.add_sub_defaults, "original", lambda *args: passes.append(args) or original(*args)
    )
    assert [read(argv) for argv in cases] == skipped
    assert passes and not any(hasattr(parser, "recipe_dests") for parser, _ in passes)  # a nested section's alone
    monkeypatch.setattr(ActionTypeHint, "add_sub_defaults", staticmethod(original))
    assert [read(argv) for argv in cases] == skipped
    assert sum("Recipe(" in result for result in skipped) == len(recipes) + 5  # four of NESTED do not parse
