"""Benchmark evaluation through lm-evaluation-harness: our model behind its LM interface scores what lm-eval's own
Hugging Face model (HFLM) scores on the same published-layout checkpoint (transformers, built from a config, saved
sharded), for every request type; tools/evaluate.py reads our checkpoints (LoRA merged), splits the requests over
processes with the results of one, and names an unknown task in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fsdp_trainer.convert import load_model
from tests.helpers import REPO, run_args, torchrun_command, train_cli
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
    ours, theirs = (
        evaluate(lm, tasks, num_fewshot=1, limit=12, include_path=include)["results"]
        for lm in (ModelLM(model, tokenizer, batch_size=5), hf)
    )
    assert ours == theirs and set(ours) == set(tasks)
    assert ours["arc_easy_local"]["sample_len"] == 3 and 0 <= ours["shakespeare_next_line"]["acc,none"] <= 1


@pytest.mark.slow
def test_the_tool_reads_a_lora_checkpoint_and_two_processes_score_as_one(tiny_data, tmp_path):
    """tools/evaluate.py on a LoRA run's checkpoint (adapters merged on the fly): the same scores from one process
    and from two that split the requests; an unknown task is one line naming it."""
    train_cli(run_args(tiny_data, tmp_path / "run", 2, lora={"rank": 4}, checkpoint={"every": 2}))
    tool = str(REPO / "tools" / "evaluate.py")
    flags = [str(tmp_path / "run"), "--tasks", "shakespeare_next_line", "--limit", "30", "--batch_size", "4"]
    results = []
    for nproc in (1, 2):
        path = tmp_path / f"scores_{nproc}.json"
        command = torchrun_command([tool, *flags, "--output_path", str(path)], nproc=nproc)
        proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.startswith("shakespeare_next_line: acc "), proc.stdout
        results.append(json.loads(path.read_text())["results"])
    one, two = (r["shakespeare_next_line"] for r in results)
    assert {k: v for k, v in one.items() if "stderr" not in k} == {k: v for k, v in two.items() if "stderr" not in k}
    assert two["acc_norm_stderr,none"] == pytest.approx(one["acc_norm_stderr,none"], rel=1e-12)  # a sum's order
    proc = subprocess.run([sys.executable, tool, str(tmp_path / "run"), "--tasks", "shakespeare_nxt_line"],
                          capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --tasks: no task named shakespeare_nxt_line in")
