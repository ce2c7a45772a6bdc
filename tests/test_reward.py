"""Reward models against TRL's RewardTrainer: the same pairs prepared by prepare_data.py and collated by TRL give the
same conversations, the same reward for each (the score head at its last token), and the same loss and metrics; a run
on the bundled pairs: 2 ranks equal 1 process x accumulation 2 over 10 steps, resume is bitwise, and held-out
accuracy rises above chance; the export loads in transformers' AutoModelForSequenceClassification and scores as
ours, and a LoRA run's adapter (with its head, PEFT's modules_to_save) loads in peft and scores as ours."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, replace

import pytest
import torch

from fsdp_trainer.model import Transformer
from fsdp_trainer.steps.reward import RewardStep, rewards
from tests.helpers import read_metrics, rewind, run_args, train_cli
from tests.test_dpo import LLAMA3_TEMPLATE, PAIRS, prepared_batch, trl_first_batch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

PAD = "<|pad|>"
"""A padding token of its own: transformers reads a reward at the last token that is not padding, and with EOS for
padding a conversation ending in EOS would be read one token early."""


def reward_model(tokenizer, family: str):
    """A transformers reward model (a sequence classifier of one label) for `tokenizer`, from a config."""
    classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification),
               "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForSequenceClassification)}  # fmt: skip
    config_class, model_class = classes[family]
    config = config_class(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=False, num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    config.architectures = [model_class.__name__]  # as save_pretrained writes it
    torch.manual_seed(0)
    model = model_class(config)
    torch.nn.init.normal_(model.score.weight, std=0.5)  # rewards far enough apart that accuracy is not all ties
    return model


def ours(hf_model, cfg) -> Transformer:
    model = Transformer(cfg)
    missing, unexpected = model.load_state_dict(hf_model.state_dict(), strict=False)
    assert not unexpected and all(name.startswith("rope_") for name in missing)
    return model


@pytest.mark.parametrize("template", ["llama3", "chatml"])
def test_prepared_pairs_give_trls_conversations_rewards_loss_and_metrics(tmp_path, one_rank, template):
    """Conversational pairs through prepare_data.py --format preference and our loader, against TRL's RewardTrainer
    on the same records: the same token ids per conversation (ChatML's newline after <|im_end|> included: the reward
    is read after it, as transformers reads it), the same reward of each, and the same loss, accuracy, margin and mean
    reward, plain, and with centring and TRL's margin column (prepared into the file's margins)."""
    from fsdp_trainer.hf import model_config_from_hf
    from tests.test_chat import CHATML
    from tests.test_real_models import save_hf_tokenizer

    chat_template, family = {"llama3": (LLAMA3_TEMPLATE, "llama"), "chatml": (CHATML, "qwen3")}[template]
    tokenizer = save_hf_tokenizer(tmp_path / "tokenizer", family, chat_template)
    tokenizer.add_special_tokens({"pad_token": PAD})
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    plain = [
        {k: [{"role": "user" if k == "prompt" else "assistant", "content": pair[k]}] for k in pair} for pair in PAIRS
    ]
    plain[0]["prompt"].insert(0, {"role": "system", "content": "Answer in verse."})
    hf = reward_model(tokenizer, family)
    cfg = replace(model_config_from_hf(hf.config.to_dict(), "test"), max_seq_len=512)
    assert cfg.num_labels == 1
    with_margins = [{**record, "margin": margin} for record, margin in zip(plain, (0.5, 0.0, 2), strict=True)]

    for center, records in ((None, plain), (0.01, with_margins)):
        prepared = tmp_path / ("margins" if center else "plain")
        prepared.mkdir()
        shutil.copytree(tmp_path / "tokenizer", prepared / "tokenizer")
        batch = prepared_batch(prepared, asdict(cfg), records, "preference", 512)
        assert (batch.margins is None) == (center is None)
        args = trl.RewardConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=len(PAIRS),
                                center_rewards_coefficient=center, report_to=[], use_cpu=True, bf16=False,
                                disable_tqdm=True)  # fmt: skip
        trainer = trl.RewardTrainer(model=hf, args=args, processing_class=tokenizer,
                                    train_dataset=datasets.Dataset.from_list(records))  # fmt: skip
        trl_batch, trl_loss, trl_metrics = trl_first_batch(trainer)

        # The same conversations, token for token: chosen ones first in TRL's batch, then the rejected.
        rows = zip(trl_batch["input_ids"], trl_batch["attention_mask"], strict=True)
        conversations = [ids[mask.bool()].tolist() for ids, mask in rows]
        theirs = list(zip(conversations[: len(PAIRS)], conversations[len(PAIRS) :], strict=True))
        mine = []
        for k in range(batch.pairs):
            pair = []
            for sequence in (2 * k, 2 * k + 1):
                row = int((batch.sequences == sequence).any(dim=1).nonzero()[0])
                document = batch.documents[row][batch.sequences[row] == sequence][0]
                pair.append(batch.inputs[row][batch.documents[row] == document].tolist())
            mine.append(tuple(pair))
        assert sorted(mine) == sorted(theirs)

        model = ours(hf, cfg)
        with torch.no_grad():
            chosen, rejected = rewards(model, batch)
            trl_rewards = hf(**{k: trl_batch[k] for k in ("input_ids", "attention_mask")}).logits[:, 0]
        by_conversation = dict(zip(map(tuple, conversations), trl_rewards.tolist(), strict=True))
        for pair, c, r in zip(mine, chosen.tolist(), rejected.tolist(), strict=True):
            assert (c, r) == pytest.approx((by_conversation[tuple(pair[0])], by_conversation[tuple(pair[1])]), rel=1e-5)
        if batch.margins is not None:  # each pair's margin read back beside its conversations
            ours_margins = zip(mine, batch.margins.tolist(), strict=True)
            assert sorted(ours_margins) == sorted(zip(theirs, trl_batch["margin"].tolist(), strict=True))

        numbers = RewardStep(center or 0.0).evaluate(model, [batch])
        names = ("accuracy", "margin", "mean_reward")
        print({"loss": (numbers["loss"].item(), trl_loss), **{n: (numbers[n].item(), trl_metrics[n]) for n in names}})
        assert numbers["loss"].item() == pytest.approx(trl_loss, rel=1e-5)
        for name in ("accuracy", "margin", "mean_reward"):
            assert numbers[name].item() == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-6), name
        all_rewards = torch.cat([chosen, rejected])  # std: from the mean and mean square (fp32), 1e-4 of itself
        assert numbers["std_reward"].item() == pytest.approx(all_rewards.std(unbiased=False).item(), rel=1e-4)


REWARD_SEQ = 256


@pytest.fixture(scope="module")
def reward_data(tiny_data, tmp_path_factory):
    """1,500 of the bundled pairs prepared with the tiny tokenizer (5% held out), the last 200 of the set, never
    trained on, as records, and a recipe for a reward model of the tiny shape on them."""
    import gzip

    from fsdp_trainer.data.prepare import BUNDLED_PREFERENCES
    from tests.conftest import prepare_pairs

    root = tmp_path_factory.mktemp("reward")
    with gzip.open(BUNDLED_PREFERENCES, "rt") as f:
        lines = f.readlines()
    (root / "pairs.jsonl").write_text("".join(lines[:1500]))
    (root / "held_out.jsonl").write_text("".join(lines[-200:]))
    prepare_pairs(tiny_data, root, [root / "pairs.jsonl"], "--val_fraction", "0.05")
    recipe = json.loads(tiny_data.read_text())
    recipe["model"].update(max_seq_len=REWARD_SEQ, num_labels=1)
    recipe["data"].update(train_path=str(root / "train.bin"), val_path=str(root / "val.bin"), seq_len=REWARD_SEQ,
                          micro_batch_size=4)  # fmt: skip
    recipe["reward"] = {"center_rewards_coefficient": 0.01}
    recipe["optim"] = {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2}
    recipe["train"].update(eval_every=5, eval_steps=4)
    (root / "reward.yaml").write_text(json.dumps(recipe))
    return root


@pytest.fixture(scope="module")
def trained_reward(reward_data, tmp_path_factory):
    """A reward model trained 60 steps on one process: its run directory."""
    out = tmp_path_factory.mktemp("trained") / "run"
    train_cli(run_args(reward_data / "reward.yaml", out, 60, train={"eval_every": 60}, checkpoint={"every": 60}))
    return out


@pytest.mark.slow
def test_reward_model_two_ranks_equal_one_process_and_resume_bitwise(reward_data, tmp_path):
    """2 ranks FULL_SHARD equal 1 process x accumulation 2 over 10 steps (loss, accuracy, margin and the rewards'
    mean and deviation; validation too), with no warning printed; a resume from step 5 is bitwise."""
    recipe, every = reward_data / "reward.yaml", {"every": 5, "keep_last": 0}
    two, one = tmp_path / "two", tmp_path / "one"
    proc = train_cli(run_args(recipe, two, 10, checkpoint=every), nproc=2)
    assert "accuracy" in proc.stdout + proc.stderr and "Warning" not in proc.stderr
    train_cli(run_args(recipe, one, 10, data={"grad_accum_steps": 2}, train={"eval_steps": 8}))
    records_two, records_one = read_metrics(two), read_metrics(one)
    assert any("val_accuracy" in r for r in records_two)
    for a, b in zip(records_two, records_one, strict=True):
        for key in {"loss", "accuracy", "margin", "mean_reward", "std_reward", "val_loss", "val_accuracy"} & set(a):
            # margin and the mean: sums of rewards of either sign, so to the rewards' own float error
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5 if "reward" in key or "margin" in key else 0)

    rewind(two, 5)
    train_cli(run_args(recipe, two, 10, checkpoint=every), nproc=2)
    resumed = {r["step"]: r for r in read_metrics(two) if "loss" in r}
    for record in (r for r in records_two if "loss" in r and r["step"] > 5):
        assert (resumed[record["step"]]["loss"], resumed[record["step"]]["accuracy"]) == (
            record["loss"], record["accuracy"]), record["step"]  # fmt: skip


def tool(name: str, *args) -> str:
    """What tools/`name` prints, run in this process (as its command line would run it)."""
    import contextlib
    import importlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        importlib.import_module(f"tools.{name.removesuffix('.py')}").main(list(map(str, args)))
    return printed.getvalue()


def hf_scores(hf_model, tokenizer, conversations: list[list[int]]) -> torch.Tensor:
    """transformers' rewards of token id lists, in one right-padded batch (the last token that is not padding)."""
    longest = max(map(len, conversations))
    ids = torch.full((len(conversations), longest), tokenizer.pad_token_id)
    for row, conversation in enumerate(conversations):
        ids[row, : len(conversation)] = torch.tensor(conversation)
    with torch.no_grad():
        return hf_model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long()).logits[:, 0]


@pytest.mark.slow
def test_held_out_accuracy_and_the_exports_score_as_ours_in_transformers_and_peft(reward_data, trained_reward,
                                                                                 tmp_path):  # fmt: skip
    """Trained 60 steps from scratch, the model ranks 200 pairs it never saw above chance (tools/score.py). Exported,
    transformers' AutoModelForSequenceClassification loads it (num_labels 1, the tokenizer's pad id) and gives our
    scores in a padded batch; imported again, it is a reward model. A LoRA run from it trains adapters and the head
    (PEFT's modules_to_save): its PEFT adapter on the exported model, and its merged export, score as ours."""
    from fsdp_trainer.convert import import_hf, load_model
    from fsdp_trainer.data.chat import ChatEncoder, preference_of
    from fsdp_trainer.generation import score

    held_out = reward_data / "held_out.jsonl"
    line = tool("score.py", trained_reward, "--pairs", held_out)
    accuracy = float(line.split()[1])
    print(line)
    assert accuracy > 0.75 and "over 200 pairs" in line

    model, tokenizer = load_model(trained_reward)
    encoder = ChatEncoder(tokenizer)
    conversations = []
    for record in map(json.loads, held_out.read_text().splitlines()[:12]):
        prompt, chosen, rejected = preference_of(record)
        pair = [encoder.encode_messages(prompt + answer)[0].tolist() for answer in (chosen, rejected)]
        conversations += pair if max(map(len, pair)) <= REWARD_SEQ else []
    ours_scores = score(model, [torch.tensor(c) for c in conversations])

    tool("consolidate.py", trained_reward, tmp_path / "hf", "--verify", "hf", "--check_logits")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["id2label"] == {"0": "LABEL_0"}
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf.config.num_labels == 1 and hf.config.pad_token_id == hf_tokenizer.pad_token_id is not None
    torch.testing.assert_close(hf_scores(hf, hf_tokenizer, conversations), ours_scores, rtol=1e-5, atol=1e-5)
    single = float(tool("score.py", tmp_path / "hf", "--prompt", "Who goes there?", "--answer", "Nay, answer me."))
    assert single == pytest.approx(float(tool("score.py", trained_reward, "--prompt", "Who goes there?", "--answer",
                                              "Nay, answer me.")), rel=1e-5)  # fmt: skip
    import_hf(str(tmp_path / "hf"), str(tmp_path / "imported"))
    assert "num_labels: 1" in (tmp_path / "imported" / "model.yaml").read_text()

    lora = tmp_path / "lora"
    train_cli(run_args(reward_data / "reward.yaml", lora, 10, lora={"rank": 4, "alpha": 8},
                       checkpoint={"resume": trained_reward, "every": 10}))  # fmt: skip
    tuned, _ = load_model(lora)
    assert not torch.equal(tuned.score.weight, model.score.weight)  # the head trained beside the adapters
    tool("consolidate.py", lora, tmp_path / "adapter", "--lora", "adapter")
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["task_type"] == "SEQ_CLS" and adapter_config["modules_to_save"] == ["score"]
    peft = pytest.importorskip("peft")
    adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    tuned_scores = score(tuned, [torch.tensor(c) for c in conversations])
    torch.testing.assert_close(hf_scores(adapted, hf_tokenizer, conversations), tuned_scores, rtol=1e-5, atol=1e-5)
    tool("consolidate.py", lora, tmp_path / "merged", "--verify", "hf", "--check_logits")


def test_a_reward_recipe_that_asks_for_what_a_reward_model_lacks_is_one_line():
    """A reward model with a language model's kind, lm-eval tasks or an adapter on an output layer it does not have,
    or a classifier of several labels: one line naming the key; and it neither generates nor is scored as a language
    model."""
    from fsdp_trainer.config import EvalConfig, LoraConfig, ModelConfig, PreferenceConfig, Recipe
    from fsdp_trainer.data.chat import BadConversation, PreferenceEncoder
    from fsdp_trainer.generation import generate, score

    for section, message in [
        ({"preference": PreferenceConfig(loss="sigmoid")}, "model.num_labels 1 trains a reward model"),
        ({"eval": EvalConfig(tasks=["hellaswag"])}, "eval.tasks score a language model"),
        ({"lora": LoraConfig(rank=4, targets=["q_proj", "lm_head"])}, "leave lm_head out"),
    ]:
        with pytest.raises(ValueError, match=message):
            Recipe(model=ModelConfig(num_labels=1), **section)
    with pytest.raises(ValueError, match=r"model.num_labels=2: 1 \(a reward model's scalar score\) or null"):
        ModelConfig(num_labels=2)
    with pytest.raises(BadConversation, match="'margin' is 'big': it must be a number"):
        PreferenceEncoder.margin(None, {"margin": "big"})  # prepare_data.py names the file and line

    small = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)
    reward, language = Transformer(replace(small, num_labels=1)), Transformer(small)
    with pytest.raises(ValueError, match="this is a reward model: it scores text"):
        generate(reward, torch.tensor([1, 2]), 2)
    with pytest.raises(ValueError, match="it has no score head"):
        score(language, [torch.tensor([1, 2])])
    assert not hasattr(reward, "lm_head") and reward(torch.tensor([[1, 2, 3]])).shape == (1, 3, 1)


def test_the_planner_prices_a_score_head_in_place_of_the_output_layer():
    """Qwen3-0.6B as a reward model: no logits to hold (a score per token, not 151,936), the head's weights in the
    state, and the output layer's FLOPs gone from the step."""
    from fsdp_trainer.config import parse_recipe
    from fsdp_trainer.metrics import flops_per_token
    from fsdp_trainer.planner.memory import estimate
    from tests.helpers import REPO

    recipe = ["--recipe", str(REPO / "recipes" / "reward_qwen3_0.6b.yaml")]
    reward, language = parse_recipe(recipe), parse_recipe([*recipe, "--model.num_labels", "null"])
    rows = [estimate(r, 8, 1, "FULL_SHARD", "full", "cuda") for r in (reward, language)]
    tokens = reward.data.micro_batch_size * reward.data.seq_len

    def logits(classes: int) -> float:  # fp32 log-softmax and its two gradients; beside them the head's bf16 gradient
        head = 2 * classes * 1024
        return max(12 * tokens * classes + head, 8 * tokens * classes + 2 * head, 3 * head) / 1e9

    assert reward.train.loss_chunks == language.train.loss_chunks == 1
    assert rows[0].logits_gb == pytest.approx(logits(1)) and rows[1].logits_gb == pytest.approx(logits(151_936))
    assert rows[0].state_gb - rows[1].state_gb == pytest.approx(16 * 1024 / 8 / 1e9)  # fp32 weight, grad, 2 moments
    saved = flops_per_token(language.model, 2048) - flops_per_token(reward.model, 2048)
    assert saved == 6 * 1024 * (151_936 - 1)
