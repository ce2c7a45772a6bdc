"""Any checkpoint of this trainer starts any kind of run. A checkpoint of the run's own kind is resumed whole (its
step, optimizer and data position); one of another kind (full or LoRA; next-token or DPO) gives its weights only, a
LoRA checkpoint's adapters merged into its base, and the run starts at step 0 with its own optimizer and data. Every
pair of the kinds that exist today, in one process that calls main() for each run (lr 1e-30 in the runs that start,
so what they save is, in fp32, what they started from)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import PAIRS_SEQ_LEN
from tests.helpers import made_once, run_args, script, tool, train_cli

KINDS = {
    "full": {},
    "lora": {"lora": {"rank": 4, "alpha": 8}},
    "dpo": {"preference": {"loss": "sigmoid"}},
    "lora_dpo": {"preference": {"loss": "sigmoid"}, "lora": {"rank": 4, "alpha": 8}},
}

SCRIPT = r"""
import json, logging, sys
from pathlib import Path
import torch
from fsdp_trainer.checkpoint.weights import read_saved_model, weight_stream
from fsdp_trainer.train import main

runs = json.loads(sys.argv[1])
lines = []
handler = logging.Handler()
handler.emit = lambda record: lines.append(record.getMessage())
logging.getLogger("fsdp_trainer").addHandler(handler)

def weights(out):
    step = sorted((Path(out) / "checkpoints").glob("step_*"))[-1]
    return dict(weight_stream(read_saved_model(step))[1])

results = {}
for name, args, source in runs:
    lines.clear()
    try:
        main(args)
    except SystemExit as e:  # a refusal: one error line on stderr
        results[name] = {"exit": e.code}
        continue
    result = {"log": list(lines)}
    if source is not None:
        theirs, ours = weights(source), weights(args[args.index("--train.out_dir") + 1])
        assert theirs.keys() == ours.keys(), (name, sorted(theirs.keys() ^ ours.keys()))
        result["max_diff"] = max((theirs[k].float() - ours[k].float()).abs().max().item() for k in theirs)
    results[name] = result
print("RESULTS " + json.dumps(results))
"""


def _kind_args(kind: str, tiny_data, pairs, out, steps: int, **sections) -> list[str]:
    overrides = {section: dict(values) for section, values in KINDS[kind].items()}
    if "preference" in overrides:  # trains on the prepared pairs
        overrides["model"] = {"max_seq_len": PAIRS_SEQ_LEN}
        overrides["data"] = {"train_path": pairs / "train.bin", "val_path": pairs / "val.bin",
                             "seq_len": PAIRS_SEQ_LEN, "micro_batch_size": 2}  # fmt: skip
    for section, values in sections.items():
        overrides[section] = {**overrides.get(section, {}), **values}
    return run_args(tiny_data, out, steps, **overrides)


@pytest.fixture(scope="module")
def starts(tiny_data, pairs, tmp_path_factory):
    """Two trained steps of each kind, then a run of each kind from each of their checkpoints (once for the suite's
    workers): the root of their directories, each run's results and the runs' stderr."""
    root = made_once(tmp_path_factory, "starts", lambda root: _start_runs(tiny_data, pairs, root))
    return root, json.loads((root / "results.json").read_text()), (root / "stderr.txt").read_text()


def _start_runs(tiny_data: Path, pairs: Path, root: Path) -> None:
    runs = []
    for kind in KINDS:  # lr high enough that the adapters move off their init (B = 0)
        args = _kind_args(kind, tiny_data, pairs, root / kind, 2, checkpoint={"every": 2}, optim={"lr": 3e-2})
        runs.append((kind, args, None))
    for source in KINDS:
        for kind in KINDS:
            out = root / f"{source}_to_{kind}"
            resume = {"every": 1, "resume": root / source}
            steps = 3 if source == kind else 1  # step 3 after the source's 2; a start saves its first step
            args = _kind_args(
                kind, tiny_data, pairs, out, steps, checkpoint=resume, optim={"lr": 1e-30, "min_lr": 1e-30}
            )
            runs.append((f"{source}->{kind}", args, None if source == kind else str(root / source)))
    # Full training from another full run's checkpoint, on other data: the next stage, from its weights
    other = {"train_path": json.loads(tiny_data.read_text())["data"]["val_path"]}
    frozen = {"lr": 1e-30, "min_lr": 1e-30}
    resume = {"every": 1, "resume": root / "full"}
    args = _kind_args(
        "full", tiny_data, pairs, root / "full_other_data", 1, data=other, optim=frozen, checkpoint=resume
    )
    runs.append(("full->full_other_data", args, str(root / "full")))
    # A LoRA run's directory holds LoRA checkpoints: a full run there under resume auto is refused
    runs.append(("full_in_lora_dir", _kind_args("full", tiny_data, pairs, root / "lora", 4), None))
    runs = [(name, [str(a) for a in args], source) for name, args, source in runs]
    (root / "runs.py").write_text(SCRIPT)
    proc = script(root / "runs.py", json.dumps(runs))  # forked: torch and the package imported already
    (root / "results.json").write_text(proc.stdout.split("RESULTS ", 1)[1])
    (root / "stderr.txt").write_text(proc.stderr)


@pytest.mark.parametrize("source", list(KINDS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_run_resumes_its_own_kind_and_starts_from_the_weights_of_any_other(starts, source, kind):
    root, results, _ = starts
    result = results[f"{source}->{kind}"]
    log = "\n".join(result["log"])
    with open(root / f"{source}_to_{kind}" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    first = next(r for r in records if "loss" in r)
    if source == kind:  # the whole state: step 2 of the source goes on to 3
        assert f"resumed from {root / source}" in log and first["step"] == 3, log
        return
    assert f"loaded weights from {root / source}" in log and "only its weights carry over" in log, log
    assert "resumed from" not in log and first["step"] == 1
    # What the run saved (lr 1e-30: what it started from) computes as the source does: its weights, or for a LoRA
    # checkpoint its base with its adapters merged, bit for bit.
    assert result["max_diff"] == 0.0
    if "lora" in source:
        assert "its adapters merged into its base" in log
    if "dpo" in kind:  # the reference is the policy it starts as: every reward 0, the loss ln 2
        assert first["loss"] == pytest.approx(math.log(2), abs=1e-6) and first["rewards/margins"] == 0


def test_another_runs_checkpoint_of_the_kind_on_other_data_starts_a_new_stage_from_its_weights(starts):
    """Full SFT from a full pretraining run's checkpoint (the same kind, next-token, on other data) starts from its
    weights at step 0, instead of resuming it whole and refusing its data position."""
    root, results, _ = starts
    result = results["full->full_other_data"]
    log = "\n".join(result["log"])
    assert f"loaded weights from {root / 'full'}" in log and "resumed from" not in log, log
    with open(root / "full_other_data" / "metrics.jsonl") as f:
        assert next(json.loads(line) for line in f if '"loss"' in line)["step"] == 1
    assert result["max_diff"] == 0.0


def test_a_lora_source_moved_its_adapters(starts):
    """The LoRA sources trained their adapters away from zero, so the merge above is not a no-op."""
    root, _, _ = starts
    from fsdp_trainer.checkpoint.storage import read_metadata
    from fsdp_trainer.checkpoint.weights import load_model_weights

    for source in ("lora", "lora_dpo"):
        step = sorted((root / source / "checkpoints").glob("step_*"))[-1]
        saved = read_metadata(step).state_dict_metadata
        shapes = {key.removeprefix("model."): tuple(meta.size) for key, meta in saved.items()
                  if key.startswith("model.") and "lora_B" in key}  # fmt: skip
        values = load_model_weights(step, shapes)
        assert max(v.abs().max().item() for v in values.values()) > 0, source


def test_a_run_directory_of_another_kind_is_refused_under_resume_auto(starts):
    root, results, stderr = starts
    assert results["full_in_lora_dir"] == {"exit": 1}
    message = f"{root / 'lora' / 'checkpoints'} holds the checkpoints of a run of another kind than this recipe trains"
    assert message in stderr, stderr[-3000:]


def test_a_start_with_weights_of_its_own_takes_them_and_records_them(tmp_path):
    """A kind's frozen model whose weights come from elsewhere than the run's start (a distillation teacher) takes
    them in a fresh run too, and every checkpoint records where they came from, fingerprinted."""
    import torch

    from fsdp_trainer.checkpoint.restore import Restorer
    from fsdp_trainer.checkpoint.starts import Start, recorded_start
    from fsdp_trainer.checkpoint.weights import save_model_weights
    from fsdp_trainer.config import ModelConfig
    from fsdp_trainer.model import Transformer
    from tests.helpers import TINY_MODEL

    teacher_weights = Transformer(ModelConfig(**TINY_MODEL))
    teacher_weights.init_weights(seed=7)
    source = save_model_weights(dict(teacher_weights.state_dict()), tmp_path / "teacher")
    teacher = Transformer(ModelConfig(**TINY_MODEL))
    teacher.init_weights(seed=0)
    attachments: dict[str, bytes] = {}
    start = Start("teacher.json", teacher, "teacher is", source=source)
    restorer = Restorer(
        tmp_path / "run" / "checkpoints", {}, [start], attachments, lambda path: False, None, True, "fp32"
    )
    assert restorer.load("none") is None
    for name, value in teacher_weights.state_dict().items():
        assert torch.equal(teacher.state_dict()[name], value), name
    (tmp_path / "step").mkdir()
    (tmp_path / "step" / "teacher.json").write_bytes(attachments["teacher.json"])
    assert recorded_start(tmp_path / "step", "teacher.json", start.what) == source.resolve()


def test_a_checkpoint_trained_with_another_tokenizer_is_refused_before_any_worker(tiny_data, tmp_path):
    """A run that starts from a checkpoint whose tokenizer (the copy it carries) is not data.tokenizer_path would read
    its token ids as other text: one line, before the model is built, naming the fix."""
    train_cli(run_args(tiny_data, tmp_path / "small", 1, checkpoint={"every": 1}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "corpus.txt").write_text((tiny_data.parent / "corpus.txt").read_text()[:150_000])
    data = {"train_path": other / "train.bin", "val_path": other / "val.bin", "tokenizer_path": other / "tok.model"}
    overrides = [arg for key, value in data.items() for arg in (f"--data.{key}", value)]
    tool("prepare_data.py", "--recipe", tiny_data, *overrides, "--input", other / "corpus.txt", "--val_fraction", "0.1")
    proc = train_cli(run_args(tiny_data, tmp_path / "run", 2, data=data, checkpoint={"resume": tmp_path / "small"}),
                     check=False)  # fmt: skip
    step = tmp_path / "small" / "checkpoints" / "step_00000001"
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"error: checkpoint.resume: {step} was trained with the tokenizer it carries, and data.tokenizer_path="
        f"{other / 'tok.model'} is another (their files differ), so its token ids would mean other text: set "
        "data.tokenizer_path to null (the checkpoint's own) and prepare the data with that tokenizer"
    ], proc.stderr
    assert "starting" not in proc.stdout and not (tmp_path / "run").exists()
