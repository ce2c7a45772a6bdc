"""Knowledge distillation: the divergence against TRL's GKD definition (its generalized_jsd_loss), chunked as the
whole; a run distilling a teacher of another size from its checkpoint, 2 ranks equal to 1 process, exact on resume,
its teacher recorded and a changed one refused; a teacher that cannot teach this model refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fsdp_trainer.loss import IGNORE, DistillationLoss
from tests.helpers import read_metrics, rewind, run_args, train_cli

trl = pytest.importorskip("trl")


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_loss_is_trls_generalized_jsd_and_chunks_change_nothing(beta, temperature):
    """A student (dim 16) and a teacher (dim 24) output layer over a vocabulary of 50: the divergence is TRL's
    generalized_jsd_loss (summed over the targets, `batchmean` x their count), the cross-entropy F.cross_entropy's,
    and 3 chunks give the loss and gradients of 1."""
    from trl.experimental.gkd import GKDTrainer

    generator = torch.Generator().manual_seed(0)
    student_head, teacher_head = nn.Linear(16, 50, bias=False), nn.Linear(24, 50, bias=False)
    hidden = torch.randn(2, 9, 16, generator=generator)
    teacher_hidden = torch.randn(2, 9, 24, generator=generator)
    targets = torch.randint(0, 50, (2, 9), generator=generator)
    targets[0, :4] = IGNORE  # a prompt
    n = (targets != IGNORE).sum()
    theirs = (
        GKDTrainer.generalized_jsd_loss(
            student_head(hidden), teacher_head(teacher_hidden), targets, beta=beta, temperature=temperature
        )
        * n
    )
    ce = nn.functional.cross_entropy(student_head(hidden).flatten(0, 1), targets.flatten(), reduction="sum")
    grads = []
    for chunks in (1, 3):
        student_head.zero_grad()
        h = hidden.clone().requires_grad_()
        sums = DistillationLoss(targets, teacher_hidden, teacher_head, beta, temperature, alpha=0.75, chunks=chunks)(
            h, student_head
        )
        torch.testing.assert_close(sums[1], theirs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sums[2], ce, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sums[0], 0.75 * theirs + 0.25 * ce, rtol=1e-5, atol=1e-6)
        teacher_ce = nn.functional.cross_entropy(teacher_head(teacher_hidden).flatten(0, 1), targets.flatten(),
                                                 reduction="sum")  # fmt: skip
        torch.testing.assert_close(sums[3], teacher_ce, rtol=1e-5, atol=1e-6)
        sums[0].backward()
        grads.append((h.grad, student_head.weight.grad.clone()))
        assert teacher_head.weight.grad is None  # the teacher learns nothing
    for ours, whole in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(ours, whole, rtol=1e-5, atol=1e-7)


BIGGER = {"dim": 96, "n_layers": 3, "ffn_dim": 192, "max_seq_len": 128}  # the teacher: another size of the tiny model


@pytest.fixture(scope="module")
def teacher(tiny_data, tmp_path_factory):
    """A run of a bigger model on the tiny data, 2 ranks: its directory (`latest` names its step 6)."""
    out = tmp_path_factory.mktemp("teacher") / "run"
    train_cli(run_args(tiny_data, out, 6, model=BIGGER, checkpoint={"every": 6}), nproc=2)
    return out


@pytest.mark.slow
def test_distillation_two_ranks_equal_one_process_resume_bitwise_and_its_teacher_is_recorded(
    tiny_data, teacher, tmp_path
):
    """The student (the tiny model) learns from the bigger teacher's checkpoint, reverse KL at temperature 2 with a
    quarter of cross-entropy: 2 ranks FULL_SHARD equal 1 process x accumulation 2 over 10 steps (loss, kd_loss,
    ce_loss, validation); the divergence falls; every checkpoint records the teacher; a resume from step 5 is bitwise,
    and onto 1 process equal to float order; a teacher changed since, or another one named, is refused in one line."""
    distill = {"teacher": str(teacher), "loss": "reverse_kl", "temperature": 2.0, "alpha": 0.75}
    every = {"every": 5, "keep_last": 0}
    train = {"eval_every": 5}
    two, one = tmp_path / "two", tmp_path / "one"
    train_cli(run_args(tiny_data, two, 10, distill=distill, checkpoint=every, train=train), nproc=2)
    accumulated = {"data": {"grad_accum_steps": 2}, "train": {**train, "eval_steps": 4}}
    one_args = run_args(tiny_data, one, 10, distill=distill, **accumulated)
    train_cli(one_args)
    records_two, records_one = read_metrics(two), read_metrics(one)
    for a, b in zip(records_two, records_one, strict=True):
        for key in {"loss", "kd_loss", "ce_loss", "val_loss", "val_kd_loss"} & set(a):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["step"], key)
    steps = {r["step"]: r for r in records_two if "kd_loss" in r}
    assert steps[10]["kd_loss"] < steps[1]["kd_loss"]
    assert steps[1]["loss"] == pytest.approx(0.75 * steps[1]["kd_loss"] + 0.25 * steps[1]["ce_loss"], rel=1e-6)
    record = json.loads((two / "checkpoints" / "step_00000005" / "teacher.json").read_text())
    assert record["path"] == str((teacher / "checkpoints" / "step_00000006").resolve())

    moved = tmp_path / "moved"
    shutil.copytree(two, moved)
    shutil.rmtree(moved / "checkpoints" / "step_00000010")
    (moved / "checkpoints" / "latest").write_text("step_00000005\n")
    resume = run_args(tiny_data, moved, 10, distill=distill, checkpoint=every, train=train)
    train_cli(resume, nproc=2)
    resumed = {r["step"]: r for r in read_metrics(moved) if "kd_loss" in r}
    for step in (6, 8, 10):
        assert (resumed[step]["loss"], resumed[step]["kd_loss"]) == (steps[step]["loss"], steps[step]["kd_loss"])
    onto_one = tmp_path / "onto_one"  # the 2-rank checkpoint of step 5 resumed by 1 process, accumulating 2
    shutil.copytree(moved, onto_one)
    shutil.rmtree(onto_one / "checkpoints" / "step_00000010")
    (onto_one / "checkpoints" / "latest").write_text("step_00000005\n")
    train_cli(run_args(tiny_data, onto_one, 10, distill=distill, checkpoint=every, **accumulated))
    resumed = {r["step"]: r for r in read_metrics(onto_one) if "kd_loss" in r}
    for step in (6, 8, 10):
        assert resumed[step]["kd_loss"] == pytest.approx(steps[step]["kd_loss"], rel=1e-5), step

    (moved / "checkpoints" / "latest").write_text("step_00000005\n")
    other = run_args(tiny_data, moved, 10, distill={**distill, "teacher": str(two)}, checkpoint=every)
    proc = train_cli(other, check=False)
    assert proc.returncode == 1
    assert f"this run's teacher is {record['path']}, not " in proc.stderr.strip().splitlines()[-1]

    manifest = Path(record["path"]) / "checksums.json"
    original = manifest.read_bytes()
    try:
        manifest.write_bytes(original + b" ")  # a teacher rewritten since
        proc = train_cli(resume, check=False)
    finally:
        manifest.write_bytes(original)
    assert proc.returncode == 1
    assert "its weights have changed since" in proc.stderr.strip().splitlines()[-1]


def test_a_teacher_that_cannot_teach_the_model_is_one_line(tiny_data, teacher, tmp_path):
    """Another vocabulary, no such checkpoint, or another tokenizer of the same size: one line before training (from
    fsdp-train, before any worker starts), naming the teacher."""
    proc = train_cli(run_args(tiny_data, tmp_path / "a", 2, distill={"teacher": str(teacher)},
                              model={"vocab_size": 640}), check=False)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: distill.teacher {teacher / 'checkpoints' / 'step_00000006'} has a vocabulary of 512 and this model "
        "640: a teacher must predict the same tokens"
    ]
    proc = train_cli(run_args(tiny_data, tmp_path / "b", 2, distill={"teacher": str(tmp_path / "none")}), check=False)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("error: distill.teacher: checkpoint ")

    import gzip

    from fsdp_trainer.data.prepare import BUNDLED_CORPUS
    from fsdp_trainer.tokenizer import train_tokenizer
    from tests.helpers import forked

    other = tmp_path / "other_tokenizer"  # the same vocabulary size, learnt from other text
    shutil.copytree(teacher, other)
    step = other / "checkpoints" / "step_00000006"
    with gzip.open(BUNDLED_CORPUS, "rt") as f:
        (tmp_path / "text.txt").write_text(f.read(1_000_000)[600_000:].upper())
    train_tokenizer([str(tmp_path / "text.txt")], str(step / "tokenizer.model"), 512)
    args = run_args(tiny_data, tmp_path / "c", 2, distill={"teacher": str(other)})
    proc = forked.run("fsdp_trainer.launch", ["--nproc_per_node", "2", *args])  # fsdp-train's module, forked
    assert proc.returncode == 1 and proc.stdout == ""  # before any worker started
    assert proc.stderr.strip().splitlines() == [
        f"error: distill.teacher {step} was trained with the tokenizer {step}, not this run's "
        f"{json.loads(Path(tiny_data).read_text())['data']['tokenizer_path']} (their files differ): a teacher must use "
        "the model's tokenizer"
    ]


@pytest.mark.slow
def test_imported_models_distil_with_the_divergence_of_transformers_logits(tmp_path):
    """A teacher wider and deeper than the student, both transformers Llamas built from configs, saved sharded with
    one tokenizer and imported: the run's held-out kd_loss (JSD at beta 0.5, temperature 2) and teacher_ce_loss equal
    TRL's divergence and the cross-entropy of transformers' own logits of both on the same windows (fp32, 1e-5)."""
    import transformers
    from trl.experimental.gkd import GKDTrainer

    from fsdp_trainer.data.format import TokenFile
    from tests.helpers import tool
    from tests.test_real_models import corpus, recipe_for, save_hf_tokenizer

    models = {}
    for name, width, layers in (("teacher", 64, 3), ("student", 32, 2)):
        tokenizer = save_hf_tokenizer(tmp_path / f"{name}_hf", "llama")
        config = transformers.LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(len(name))
        models[name] = transformers.LlamaForCausalLM(config).eval()
        models[name].save_pretrained(tmp_path / f"{name}_hf", max_shard_size="100KB")
        tool("import_hf.py", tmp_path / f"{name}_hf", tmp_path / name)
    (tmp_path / "plays.txt").write_text(corpus(60_000))
    recipe = recipe_for(tmp_path)
    student = ["--recipe", recipe, "--recipe", str(tmp_path / "student" / "model.yaml")]
    tool("prepare_data.py", *student, "--data.tokenizer_path", tmp_path / "student", "--input", tmp_path / "plays.txt",
         "--val_fraction", "0.1")  # fmt: skip
    distill = ["--distill.teacher", str(tmp_path / "teacher"), "--distill.loss", "jsd", "--distill.temperature", "2"]
    train_cli([*student, "--data.tokenizer_path", str(tmp_path / "student"), "--checkpoint.resume",
               str(tmp_path / "student"), "--train.out_dir", str(tmp_path / "run"), *distill])  # fmt: skip
    held_out = next(r for r in read_metrics(tmp_path / "run") if "val_kd_loss" in r)

    tokens = torch.from_numpy(TokenFile(tmp_path / "data" / "val.bin").tokens[: 4 * 32 + 1].astype("int64"))
    windows = torch.stack([tokens[k * 32 : k * 32 + 33] for k in range(4)])  # eval_steps 2 x micro-batches of 2
    inputs, targets = windows[:, :-1], windows[:, 1:]
    with torch.no_grad():
        student_logits, teacher_logits = (models[name](inputs).logits for name in ("student", "teacher"))
    kd = GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, targets, beta=0.5, temperature=2.0)
    teacher_ce = nn.functional.cross_entropy(teacher_logits.flatten(0, 1), targets.flatten())
    assert held_out["val_kd_loss"] == pytest.approx(kd.item(), rel=1e-5)
    assert held_out["val_teacher_ce_loss"] == pytest.approx(teacher_ce.item(), rel=1e-5)


def test_a_lora_student_saves_its_adapters_and_exports_merged(tiny_data, teacher, tmp_path):
    """LoRA on the student: its checkpoints hold the adapters alone beside the teacher's record; the export merges."""
    out = tmp_path / "run"
    train_cli(run_args(tiny_data, out, 2, distill={"teacher": str(teacher)}, lora={"rank": 4},
                       checkpoint={"every": 2}))  # fmt: skip
    step = out / "checkpoints" / "step_00000002"
    assert (step / "lora_base.json").is_file() and (step / "teacher.json").is_file()
    assert all(r["kd_loss"] > 0 for r in read_metrics(out) if "kd_loss" in r)
    from tests.helpers import tool

    tool("consolidate.py", out, tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()


# --- on-policy distillation (GKD's lmbda) ---------------------------------------------------------------------------


def _window(examples: list[tuple[list[int], list[bool]]], length: int) -> tuple[list[int], list[int]]:
    """A packed window as prepare_data writes it: tokens and flags (TARGET where the next token is trained on, START
    where an example or the padding begins)."""
    from fsdp_trainer.data.format import START, TARGET

    tokens, flags = [], []
    for ids, trained in examples:
        for i, token in enumerate(ids):
            tokens.append(token)
            flags.append((START if i == 0 else 0) | (TARGET if i + 1 < len(ids) and trained[i + 1] else 0))
    flags += [START] + [0] * (length - len(tokens) - 1)
    return tokens + [0] * (length - len(tokens)), flags


def test_an_on_policy_batch_keeps_each_prompt_and_trains_on_the_sampled_answer_alone():
    """prompts_of finds each example's prompt: its tokens through the one before its last answer (a two-turn
    example's first answer is part of it); packed lays out (prompt, answer) as TRL's GKD labels them: the prompt
    untrained, every answer token a target (its end-of-turn included), block-causal, in order, a new window when the
    next example does not fit; and the prompts come back out of it."""
    import numpy as np

    from fsdp_trainer.data.loader import micro_batch
    from fsdp_trainer.steps.examples import examples_of, packed

    def prompts_of(batch):
        return [prompt for prompt, _ in examples_of(batch)]

    f, t = False, True
    row0 = _window([([1, 2, 3, 4, 5], [f, f, f, t, t]), ([6, 7, 8, 9, 10, 11, 12], [f, f, t, f, f, t, t])], 16)
    row1 = _window([([13, 14, 15], [f, f, t])], 16)
    batch = micro_batch(np.array([row0, row1]), packed=True, records=None, device=torch.device("cpu"))
    prompts = prompts_of(batch)
    assert [p.tolist() for p in prompts] == [[1, 2, 3], [6, 7, 8, 9, 10], [13, 14]]
    assert [a.tolist() for _, a in examples_of(batch)] == [[4, 5], [11, 12], [15]]
    whole = [(p.tolist(), a.tolist()) for p, a in examples_of(batch, last_answer=False)]  # from the first target on
    assert whole == [([1, 2, 3], [4, 5]), ([6, 7], [8, 9, 10, 11, 12]), ([13, 14], [15])]

    answers = [[20, 21], [22], [23, 24, 25]]
    out = packed(list(zip(prompts, answers, strict=True)), 8, torch.device("cpu"))
    windows = [[1, 2, 3, 20, 21, 0, 0, 0], [6, 7, 8, 9, 10, 22, 0, 0], [13, 14, 23, 24, 25, 0, 0, 0]]
    assert out.inputs.tolist() == windows
    trained = [[(i, target) for i, target in enumerate(row) if target != IGNORE] for row in out.targets.tolist()]
    assert trained == [[(2, 20), (3, 21)], [(4, 22)], [(1, 23), (2, 24), (3, 25)]]
    assert out.documents.tolist()[0] == [1, 1, 1, 1, 1, 2, 2, 2]
    assert [p.tolist() for p in prompts_of(out)] == [p.tolist() for p in prompts]
    assert packed([], 8, torch.device("cpu")).targets.eq(IGNORE).all()  # no example: a window trained on nothing

    everything = _window([([1, 2, 3], [t, t, t])], 16)  # train_on=all: no prompt to answer
    with pytest.raises(ValueError, match="trained from its first token"):
        prompts_of(micro_batch(np.array([everything]), packed=True, records=None, device=torch.device("cpu")))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_answers_sampled_in_one_batch_are_those_sampled_one_prompt_at_a_time(temperature):
    """model.sample_batch (left-padded prompts, one KV cache) gives each row the tokens model.generate gives its prompt
    alone with the same generator, ending after the stop token or at the row's own limit."""
    from fsdp_trainer.config import ModelConfig
    from fsdp_trainer.generation import generate, sample_batch
    from fsdp_trainer.model import Transformer

    model = Transformer(ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97))
    model.init_weights(seed=1)
    prompts = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 9, 5, 1)]
    limits = [10, 4, 12, 30]

    def batch(stop: int) -> list[list[int]]:
        generators = [torch.Generator().manual_seed(i) for i in range(4)]
        return sample_batch(model, prompts, limits, temperature, torch.tensor([stop]), generators)

    stop = batch(-1)[3][4]  # a token the last row draws: it stops there
    rows = batch(stop)
    assert rows[3][-1] == stop and len(rows[3]) <= 5
    for i, prompt in enumerate(prompts):
        generator = torch.Generator().manual_seed(i)
        alone = generate(model, prompt, limits[i], temperature, generator=generator, stop_id=stop)
        assert rows[i] == alone[len(prompt) :].tolist()


def test_the_steps_that_sample_are_drawn_from_the_seed_and_step():
    from fsdp_trainer.config import DistillConfig
    from fsdp_trainer.steps.on_policy import OnPolicy

    def due(lmbda, seed=0):
        return [OnPolicy(DistillConfig(teacher="t", lmbda=lmbda), seed, "unread").due(step) for step in range(1, 2001)]

    assert not any(due(0.0)) and all(due(1.0))
    assert sum(due(0.3)) / 2000 == pytest.approx(0.3, abs=0.03)
    assert due(0.3) == due(0.3) and due(0.3) != due(0.3, seed=1)


@pytest.mark.slow
def test_on_policy_distillation_two_ranks_equal_one_process_and_resume_bitwise(chat_data, teacher, tmp_path):
    """GKD on chat data (lmbda 0.5: the steps (seed, step) draws train on the student's own sampled answers, scored
    by the teacher; JSD): 2 ranks FULL_SHARD equal 1 process x accumulation 2 over 10 steps, the same steps sampled
    and the same answers (their token counts) whatever rank sampled them; a resume from step 5 is bitwise."""
    distill = {"teacher": str(teacher), "loss": "jsd", "lmbda": 0.5, "max_new_tokens": 12}
    every = {"every": 5, "keep_last": 0}
    two, one = tmp_path / "two", tmp_path / "one"
    train_cli(run_args(chat_data, two, 10, distill=distill, checkpoint=every), nproc=2)
    train_cli(run_args(chat_data, one, 10, distill=distill, data={"grad_accum_steps": 2}))
    steps = {r["step"]: r for r in read_metrics(two) if "kd_loss" in r}
    for r in (r for r in read_metrics(one) if "kd_loss" in r):
        a = steps[r["step"]]
        assert (r["on_policy"], r["supervised_tokens"]) == (a["on_policy"], a["supervised_tokens"]), r["step"]
        for key in ("loss", "kd_loss", "ce_loss", "grad_norm"):
            assert r[key] == pytest.approx(a[key], rel=1e-5), (r["step"], key)
    assert {r["on_policy"] for r in steps.values()} == {0.0, 1.0}

    rewind(two, 5)
    train_cli(run_args(chat_data, two, 10, distill=distill, checkpoint=every), nproc=2)
    resumed = {r["step"]: r for r in read_metrics(two) if "kd_loss" in r}
    for step in (6, 8, 10):
        assert (resumed[step]["loss"], resumed[step]["supervised_tokens"]) == (
            steps[step]["loss"], steps[step]["supervised_tokens"]), step  # fmt: skip


def test_sampled_answers_are_trained_on_the_tokens_trls_gkd_labels():
    """The targets of an on-policy batch are the tokens TRL's GKDTrainer.generate_on_policy_outputs leaves in its
    labels for the same prompts and generations: each answer through its first stop token, the prompt and what follows
    the stop masked."""
    from types import SimpleNamespace

    from trl.experimental.gkd import GKDTrainer

    from fsdp_trainer.steps.examples import packed

    eos, pad = 2, 0
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    generated = [[11, 12, eos, 13], [14, 15, 16, 17]]  # the first stops at EOS (a batch generates on after it)
    left = torch.tensor([[5, 6, 7], [pad, 8, 9]])
    sequences = torch.cat([left, torch.tensor(generated)], dim=1)
    model = SimpleNamespace(generate=lambda **kwargs: SimpleNamespace(sequences=sequences))
    inputs = {"prompts": left, "prompt_attention_mask": (left != pad).long()}
    _, _, labels = GKDTrainer.generate_on_policy_outputs(model, inputs, SimpleNamespace(eos_token_id=eos))
    trls = [row[row != -100].tolist() for row in labels]

    ours = [answer[: answer.index(eos) + 1] if eos in answer else answer for answer in generated]  # sample_batch's
    batch = packed([(p.numpy(), a) for p, a in zip(prompts, ours, strict=True)], 16, torch.device("cpu"))
    targets = batch.targets[0]
    by_example = [targets[(batch.documents[0] == k) & (targets != IGNORE)].tolist() for k in (1, 2)]
    assert by_example == trls == [[11, 12, eos], [14, 15, 16, 17]]
