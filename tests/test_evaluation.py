"""Benchmark evaluation through lm-evaluation-harness: our model behind its LM interface scores what lm-eval's own
Hugging Face model (HFLM) scores on the same published-layout checkpoint (transformers, built from a config, saved
sharded), for every request type; tools/evaluate.py reads our checkpoints (LoRA merged), splits the requests over
processes with the results of one, and names an unknown task in one line."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch

from fsdp_trainer.convert import load_model
from tests.helpers import read_metrics, run_args, run_distributed, tool, train_cli
from tests.test_real_models import corpus, save_hf_checkpoint, save_hf_tokenizer

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from fsdp_trainer.evaluation.lm import ModelLM  # noqa: E402
from fsdp_trainer.evaluation.tasks import evaluate  # noqa: E402


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A Llama 3.2-layout HF directory (BOS on every text, 64 positions) and lm-eval's HFLM on it."""
    out = tmp_path_factory.mktemp("hf")
    tokenizer = save_hf_tokenizer(out, "llama")
    model = save_hf_checkpoint(out, "llama3.2", len(tokenizer))
    return out, HFLM(pretrained=model, tokenizer=tokenizer, batch_size=3, device="cpu")


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_every_request_type_scores_as_lm_evals_hf_model(published):
    """Continuations (an empty context among them), whole texts longer than the model's 64 positions (several
    rolling windows), and greedy generation to a stop sequence: our numbers are HFLM's."""
    out, hf = published
    model, tokenizer = load_model(out)
    ours = ModelLM(model, tokenizer, batch_size=2)
    text = corpus(3_000)
    pairs = [(text[i : i + 150], text[i + 150 : i + 150 + n]) for i, n in ((0, 12), (400, 40), (900, 5), (1500, 90))]
    pairs.append(("", "ROMEO. What say you?"))
    ours_ll, hf_ll = (
        ours.loglikelihood(requests("loglikelihood", pairs)),
        hf.loglikelihood(requests("loglikelihood", pairs)),
    )
    torch.testing.assert_close([s for s, _ in ours_ll], [s for s, _ in hf_ll], rtol=1e-5, atol=1e-4)
    assert [g for _, g in ours_ll] == [g for _, g in hf_ll]

    texts = [(text[:1_200],), (text[1_200:1_260],)]
    assert len(tokenizer.encode(texts[0][0])) > 3 * 64  # four windows at least
    rolling = requests("loglikelihood_rolling", texts)
    torch.testing.assert_close(
        ours.loglikelihood_rolling(rolling), hf.loglikelihood_rolling(rolling), rtol=1e-5, atol=1e-3
    )

    prompts = [
        (text[i : i + 80], {"until": ["\n\n", "ROMEO"], "max_gen_toks": 20, "do_sample": False}) for i in (0, 700)
    ]
    prompts.append((text[2000:2100], {"until": ["is"], "max_gen_toks": 10}))  # stops at once
    generated = ours.generate_until(requests("generate_until", prompts))
    assert generated == hf.generate_until(requests("generate_until", prompts))
    assert all(generated) and len(generated[2]) < 10


def _sharded_equals_whole(rank, world_size, hf_dir):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_trainer.config import ParallelConfig
    from fsdp_trainer.distributed.parallelize import parallelize
    from fsdp_trainer.model import Transformer

    whole, tokenizer = load_model(hf_dir)
    with torch.device("meta"):
        sharded = Transformer(whole.cfg)
    parallelize(sharded, ParallelConfig(mixed_precision="fp32"), init_device_mesh("cpu", (world_size,)))
    sharded.to_empty(device="cpu")
    set_model_state_dict(sharded, whole.state_dict(), options=StateDictOptions(full_state_dict=True))
    sharded.rope_cos.copy_(whole.rope_cos), sharded.rope_sin.copy_(whole.rope_sin)
    text = corpus(6_000)
    # Each rank its own work, unequal in every way: requests, batches, windows, tokens generated.
    n_pairs, n_texts = (5, 1) if rank == 0 else (2, 2)
    pairs = [(text[900 * i + rank : 900 * i + 120], text[900 * i + 120 : 900 * i + 160]) for i in range(n_pairs)]
    texts = [(text[3000 + i * 500 : 3000 + i * 500 + (1_000 if rank == 0 else 200)],) for i in range(n_texts)]
    prompts = [(text[i * 300 : i * 300 + 60], {"until": ["\n\n"], "max_gen_toks": 12}) for i in range(3)]
    if rank == 1:
        prompts = [(text[4000:4060], {"until": ["is"], "max_gen_toks": 4})]
    answers = []
    for model in (ModelLM(sharded, tokenizer, batch_size=2, lockstep=True), ModelLM(whole, tokenizer, batch_size=2)):
        answers.append(
            (
                model.loglikelihood(requests("loglikelihood", pairs)),
                model.loglikelihood_rolling(requests("loglikelihood_rolling", texts)),
                model.generate_until(requests("generate_until", prompts)),
            )
        )
    (ll, rolling, generated), (ll_whole, rolling_whole, generated_whole) = answers
    torch.testing.assert_close([s for s, _ in ll], [s for s, _ in ll_whole], rtol=1e-5, atol=1e-4)
    assert [g for _, g in ll] == [g for _, g in ll_whole]
    torch.testing.assert_close(rolling, rolling_whole, rtol=1e-5, atol=1e-3)
    assert generated == generated_whole and len(generated) == (3 if rank == 0 else 1)


def test_a_sharded_model_scores_as_the_whole_one_however_unequal_the_ranks_work(published):
    """In training the model is sharded, so every rank's forward passes are collective: with a different number of
    requests, batches, rolling windows and generated tokens on each of 2 ranks, every score equals the whole model's."""
    run_distributed(_sharded_equals_whole, str(published[0]))


ARC_RECORDS = [
    {"question": "Which is a play?", "choices": {"text": ["Hamlet", "a river", "salt"], "label": ["A", "B", "C"]},
     "answerKey": "A"},
    {"question": "Who loves Romeo?", "choices": {"text": ["Juliet", "Lear"], "label": ["1", "2"]}, "answerKey": "1"},
    {"question": "What is Yorick?", "choices": {"text": ["a jester", "a king", "a ghost", "a horse"],
     "label": ["A", "B", "C", "D"]}, "answerKey": "A"},
]  # fmt: skip
ARC_LOCAL = """task: arc_easy_local
dataset_path: json
dataset_kwargs: {data_files: {train: %(data)s, test: %(data)s}}
training_split: train
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: "{{choices.label.index(answerKey)}}"
doc_to_choice: "{{choices.text}}"
metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]
"""


def test_tasks_score_as_through_lm_evals_hf_model(published, tmp_path):
    """The shipped next-line task (3-shot) and a user's task on local files, README's YAML (`--include_path`),
    through lm-eval's evaluator: the same scores as HFLM's."""
    out, hf = published
    model, tokenizer = load_model(out)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "arc.jsonl").write_text("".join(json.dumps(record) + "\n" for record in ARC_RECORDS))
    (tmp_path / "tasks" / "arc_easy_local.yaml").write_text(ARC_LOCAL % {"data": tmp_path / "arc.jsonl"})
    tasks, include = ["shakespeare_next_line", "arc_easy_local"], str(tmp_path / "tasks")
    scored = [
        evaluate(lm, tasks, num_fewshot=1, limit=12, include_path=include, describe_machine=False)
        for lm in (ModelLM(model, tokenizer, batch_size=5), hf)
    ]
    ours, theirs = (results["results"] for results in scored)
    assert ours == theirs and set(ours) == set(tasks)
    assert "pretty_env_info" not in scored[0]  # as scores taken while training: no description of the machine
    from fsdp_trainer.evaluation.tasks import task_manager

    assert task_manager(tasks, include).all_tasks == ["arc_easy_local"]  # lm-eval's registry of thousands not indexed
    assert ours["arc_easy_local"]["sample_len"] == 3 and 0 <= ours["shakespeare_next_line"]["acc,none"] <= 1
    # --apply_chat_template: the few-shot examples as turns of a conversation, rendered by the tokenizer's template
    chats = [ModelLM(model, tokenizer), hf]
    history = [{"role": "user", "content": "Who's there?"}, {"role": "assistant", "content": "Nay, answer me."}]
    for prompt in (True, False):
        assert chats[0].apply_chat_template(history, prompt) == chats[1].apply_chat_template(history, prompt)
    ours, theirs = (
        evaluate(lm, ["arc_easy_local"], num_fewshot=1, include_path=include, apply_chat_template=True,
                 describe_machine=False)["results"]
        for lm in chats
    )  # fmt: skip
    assert ours == theirs


@pytest.mark.slow
def test_the_tool_reads_a_lora_checkpoint_and_two_processes_score_as_one(tiny_data, tmp_path):
    """tools/evaluate.py on a LoRA run's checkpoint (adapters merged on the fly): the same scores from one process,
    from two that split the requests, and from two that also shard the model (--shard); an unknown task is one line
    naming it."""
    train_cli(run_args(tiny_data, tmp_path / "run", 2, lora={"rank": 4}, checkpoint={"every": 2}))
    flags = [str(tmp_path / "run"), "--tasks", "shakespeare_next_line", "--limit", "30", "--batch_size", "4"]
    results = []
    for nproc, shard in ((1, ["--log_samples"]), (2, []), (2, ["--shard"])):
        path = tmp_path / f"scores_{nproc}{''.join(shard)}.json"
        proc = tool("evaluate.py", *flags, *shard, "--output_path", path, nproc=nproc, check=False)  # torchrun's ranks
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.startswith("shakespeare_next_line: acc "), proc.stdout
        written = json.loads(path.read_text())
        results.append(written["results"])
        config = written["config"]  # lm-eval's own default seeds, as `lm_eval` draws examples
        assert [config[f"{k}_seed"] for k in ("random", "numpy", "torch", "fewshot")] == [0, 1234, 1234, 1234]
        assert "PyTorch version: " in written["pretty_env_info"]  # the machine, described as `lm_eval` describes it
    # --log_samples: each document's result beside the JSON, as lm_eval writes them
    samples = [json.loads(line) for line in (tmp_path / "scores_1--log_samples_samples_shakespeare_next_line.jsonl")
               .read_text().splitlines()]  # fmt: skip
    assert len(samples) == 30 and {s["doc_id"] for s in samples} == set(range(30))
    assert sum(s["acc"] for s in samples) / 30 == pytest.approx(results[0]["shakespeare_next_line"]["acc,none"])
    one, *two = (r["shakespeare_next_line"] for r in results)
    for split in two:  # whole on each process, or sharded over them
        assert {k: v for k, v in one.items() if "stderr" not in k} == {
            k: v for k, v in split.items() if "stderr" not in k
        }
        assert split["acc_norm_stderr,none"] == pytest.approx(one["acc_norm_stderr,none"], rel=1e-12)  # a sum's order
    proc = tool("evaluate.py", tmp_path / "run", "--tasks", "shakespeare_nxt_line", check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --tasks: no task named shakespeare_nxt_line in")


@pytest.mark.slow
def test_scores_during_training_are_the_tools_on_each_checkpoint_and_a_resume_scores_no_step_twice(tiny_data, tmp_path):
    """eval.tasks on 2 ranks (FSDP): a record of eval/TASK/METRIC numbers every eval.every steps and after the last,
    equal to tools/evaluate.py on that step's checkpoint; resumed to a later last step, each step is scored once."""
    out = tmp_path / "run"
    scored = {"tasks": '["shakespeare_next_line"]', "limit": 16, "every": 2, "batch_size": 4}
    args = run_args(tiny_data, out, 4, eval=scored, checkpoint={"every": 2, "keep_last": 0})
    first = train_cli(args, nproc=2)
    assert "| shakespeare_next_line acc " in first.stdout + first.stderr
    train_cli([*args, "--train.steps", "6"], nproc=2)
    records = [r for r in read_metrics(out) if "eval/shakespeare_next_line/acc" in r]
    assert [r["step"] for r in records] == [2, 4, 6]
    assert all(0 <= r["eval/shakespeare_next_line/acc"] <= 1 and "eval/shakespeare_next_line/acc_stderr" in r
               for r in records)  # fmt: skip
    step_2 = [out / "checkpoints" / "step_00000002", "--output_path", tmp_path / "s.json"]
    proc = tool("evaluate.py", *step_2, "--tasks", "shakespeare_next_line", "--limit", 16, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads((tmp_path / "s.json").read_text())["results"]["shakespeare_next_line"]
    assert records[0]["eval/shakespeare_next_line/acc"] == theirs["acc,none"]
    assert records[0]["eval/shakespeare_next_line/acc_norm"] == theirs["acc_norm,none"]
    assert records[0]["eval/shakespeare_next_line/acc_stderr"] == theirs["acc_stderr,none"]  # kept at full precision


def test_an_unknown_eval_task_is_one_line_before_training(tiny_data, tmp_path):
    proc = train_cli(run_args(tiny_data, tmp_path / "run", 2, eval={"tasks": '["shakespeare_nxt_line"]'}), check=False)
    assert proc.returncode == 1 and not (tmp_path / "run" / "metrics.jsonl").exists()
    assert proc.stderr.strip().splitlines() == [
        "error: eval.tasks: no task named shakespeare_nxt_line in lm-eval's registry, in the include path or among "
        "ours (shakespeare_next_line); `lm-eval ls tasks` lists lm-eval's"
    ]


def test_a_name_no_task_file_mentions_is_unknown_without_indexing_lm_evals_registry():
    """Every name lm-eval indexes in a directory is in the text of one of its files (okapi's group `arc_multilingual`
    only in `_arc_yaml`, which its tasks include), so check_tasks names a misspelt task without indexing the
    registry's thousands of files, and indexes it for a name some file mentions."""
    from lm_eval.tasks import TaskManager

    from fsdp_trainer.evaluation import tasks

    okapi = tasks.lm_eval_tasks_dir() / "okapi" / "arc_multilingual"
    indexed = TaskManager(include_path=str(okapi), include_defaults=False).all_tasks
    assert {"arc_multilingual", "arc_de"} <= set(indexed)
    assert all(tasks.mentioned(name, okapi) for name in indexed)
    assert not tasks.mentioned("arc_dee", okapi)
    with mock.patch.object(tasks, "registry", wraps=tasks.registry) as built:
        with pytest.raises(ValueError, match="^no task named arc_eazy in lm-eval's registry"):
            tasks.check_tasks(["shakespeare_next_line", "arc_eazy"])
    assert [call.kwargs for call in built.call_args_list] == [{"defaults": False}]
    asked = []  # the registry as okapi's directory alone, where check_tasks would index lm-eval's

    def registry(include_path=None, defaults=True):
        asked.append(defaults)
        return TaskManager(include_path=str(okapi), include_defaults=False)

    with mock.patch.object(tasks, "registry", registry):
        tasks.check_tasks(["arc_de"])
        with pytest.raises(ValueError, match=r"^no task named arc_zz\* in"):
            tasks.check_tasks(["arc_zz*"])  # a pattern: lm-eval's registry has what it matches
        assert asked == [False, False, True]
        with mock.patch.object(tasks, "mentioned", return_value=True):  # as for arc_easy: the registry decides
            with pytest.raises(ValueError, match="^no task named arc_eazy in"):
                tasks.check_tasks(["arc_eazy"])
        assert asked == [False, False, True, False, True]
