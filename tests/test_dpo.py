"""Preference pairs (toy, text and chat files, broken rows) and the DPO app through the
Trainer and Reference services."""

import json
import random

import pytest
from test_sft import write_jsonl
from transformers import AutoTokenizer

from apps.dpo import Config, main, pair_batch
from forge import tasks
from forge.config import ConfigError, load_config
from forge.data import PreferencePairs, completion_tokens, loss_start
from forge.schema import PreferenceDataConfig
from forge.tasks import end_of_turn
from services.trainer import _pairs_whole

CONFIG = "configs/dpo_tiny.yaml"


def completion(tok, ids_mask) -> str:
    ids, mask = ids_mask
    return tok.decode([t for t, m in zip(ids, mask) if m])


def test_toy_pairs_are_the_answer_and_a_wrong_one(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rng = random.Random(0)
    task = tasks.get_task("reverse")
    for _ in range(50):
        answer = task.sample(rng).answer
        wrong = task.near_miss(answer, rng)
        assert wrong != answer and len(wrong) == len(answer) and task.score(wrong, answer) < 1
        rejected = task.wrong_answer(answer, rng)
        assert rejected.strip() and task.score(rejected, answer) < 1
    lengths = {len(task.wrong_answer("abcde", rng)) for _ in range(200)}
    assert {1, 4, 5, 6, 10} <= lengths  # other shapes than near misses: cut, dropped, doubled, twice
    pairs = PreferencePairs(PreferenceDataConfig(), tok, "reverse", seed=3)
    chosen, rejected = pairs.sample(0)
    prompt_len = chosen[1].index(1)
    assert chosen[0][:prompt_len] == rejected[0][:prompt_len]  # one prompt
    c, r = completion(tok, chosen), completion(tok, rejected)
    assert c.endswith("<|eos|>") and r.endswith("<|eos|>") and c != r
    prompt = tok.decode(chosen[0][:prompt_len])
    assert c.removesuffix("<|eos|>") == prompt.split()[-1].rstrip("=")[::-1]  # `rev abc=` -> `cba`
    # As a file, chat format (TRL's conversational preference rows): the same pairs load from it.
    path = tasks.write_dataset(tmp_path / "p.jsonl", "reverse", n=4, system="Reverse.", preferences=True)
    row = json.loads(path.read_text().splitlines()[0])
    assert row["chosen"] == [{"role": "assistant", "content": row["answer"]}] and row["rejected"] != row["chosen"]
    chat = PreferencePairs(PreferenceDataConfig(path=str(path)), tok, "reverse")
    chosen, rejected = chat.sample(0)
    assert {completion(tok, chosen), completion(tok, rejected)} <= {
        json.loads(line)[k][0]["content"] + "<|im_end|>"
        for line in path.read_text().splitlines()
        for k in ("chosen", "rejected")
    }


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"prompt": "a=", "chosen": "b"}], r"missing \['rejected'\]"),
        (
            [{"prompt": "a=", "chosen": "b", "rejected": "c"}, {"prompt": "x=", "chosen": "y", "rejected": " "}],
            r"row 1: column 'rejected' is empty",
        ),
        (
            [{"prompt": "a=", "chosen": "b", "rejected": "c"}, {"prompt": "x=", "chosen": None, "rejected": "c"}],
            r"row 1: column 'chosen' is empty",
        ),
        (
            [
                {
                    "prompt": [{"role": "user", "content": "a"}],
                    "chosen": [{"role": "assistant", "content": ""}],
                    "rejected": "c",
                }
            ],
            r"row 0: column 'chosen' is empty",
        ),
        (
            [
                {
                    "prompt": "a=",
                    "chosen": [{"role": "assistant", "content": "b"}],
                    "rejected": [{"role": "assistant", "content": "c"}],
                }
            ],
            r"row 0: the prompt is text, so 'chosen' and 'rejected' must be too",
        ),
        (  # a pair that prefers a completion to itself trains nothing, and counts as one not won
            [{"prompt": "a=", "chosen": "b", "rejected": "c"}, {"prompt": "a=", "chosen": "b ", "rejected": "b"}],
            r"row 1: 'chosen' and 'rejected' are the same",
        ),
    ],
)
def test_a_broken_preference_row_is_named(tmp_path, tiny_model_dir, rows, message):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ConfigError, match=rf"config key 'data(.path)?': {path}.*{message}"):
        PreferencePairs(PreferenceDataConfig(path=path), tok, "reverse")


USER = [{"role": "user", "content": "rev abc="}]


@pytest.mark.parametrize(
    "row, max_tokens, message",
    [
        # ShareGPT's roles, or a user's 'chosen': no loss token, no token at all once tokenized
        (
            {
                "prompt": USER,
                "chosen": [{"role": "gpt", "content": "cba"}],
                "rejected": [{"role": "gpt", "content": "a"}],
            },
            1024,
            r"row 0: column 'chosen' has no 'assistant' message to train on \(roles \['gpt'\]\)",
        ),
        (
            {"prompt": USER, "chosen": [{"role": "assistant", "content": "cba"}], "rejected": USER},
            1024,
            r"row 0: column 'rejected' has no 'assistant' message",
        ),
        # a prompt that fills max_tokens: the cut leaves nothing of either completion
        (
            {"prompt": "rev " + "abcdefgh" * 40 + "=", "chosen": "x", "rejected": "y"},
            64,
            r"row 0: its prompt is \d+ tokens",
        ),
        ({"prompt": USER * 20, "chosen": "cba", "rejected": "abc"}, 64, r"row 0: its prompt is \d+ tokens"),
        (
            {"prompt": "2+3=", "chosen": 5, "rejected": {"text": "6"}},
            1024,
            r"row 0: column 'rejected' holds .*\(dict\), not text or chat messages",
        ),
    ],
)
def test_a_pair_with_no_loss_token_is_named(tmp_path, tiny_model_dir, row, max_tokens, message):
    """Such a pair would train nothing and count as one its chosen does not win; an empty
    episode would also shift every pair after it in the trainer's shards."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    path = write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(ConfigError, match=rf"config key 'data.path': {path} {message}"):
        PreferencePairs(PreferenceDataConfig(path=path, max_tokens=max_tokens), tok, "reverse")
    if max_tokens < 1024:  # one token more: the completions' first loss token fits
        room = loss_start(tok, row["prompt"], row["chosen"]) + 1
        pairs = PreferencePairs(PreferenceDataConfig(path=path, max_tokens=room), tok, "reverse")
        assert all(sum(mask) == 1 for _, mask in pairs.sample(0))


@pytest.mark.parametrize(
    "prompt, completion",
    [
        ("rev abc=", "cba"),
        (USER, "cba"),
        (USER, [{"role": "assistant", "content": "cba"}]),
        ([*USER, {"role": "assistant", "content": "cba"}, {"role": "user", "content": "again"}], "cba"),
        (
            USER,
            [
                {"role": "assistant", "content": "c"},
                {"role": "user", "content": "more"},
                {"role": "assistant", "content": "ba"},
            ],
        ),
        ([{"role": "system", "content": "Reverse."}], [*USER, {"role": "assistant", "content": "cba"}]),
    ],
)
def test_loss_start_is_where_the_completion_tokens_loss_starts(tiny_model_dir, prompt, completion):
    """The load check tokenizes what precedes a completion alone: it must count what
    `completion_tokens` does."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    _, mask = completion_tokens(tok, prompt, completion, end_of_turn(tok))
    assert loss_start(tok, prompt, completion) == mask.index(1)


def test_numeric_completions_read_as_text(tmp_path, tiny_model_dir):
    """A JSON number, or a CSV's column inferred as numbers, is the completion's text, as SFT reads it."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    csv = tmp_path / "p.csv"
    csv.write_text("prompt,chosen,rejected\n2+3=,5,6.5\n")
    for path in (write_jsonl(tmp_path / "p.jsonl", [{"prompt": "2+3=", "chosen": 5, "rejected": 6.5}]), str(csv)):
        chosen, rejected = PreferencePairs(PreferenceDataConfig(path=path), tok, "add").sample(0)
        assert (completion(tok, chosen), completion(tok, rejected)) == ("5<|eos|>", "6.5<|eos|>")
    chat = write_jsonl(
        tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": "2+3="}], "chosen": 5, "rejected": 6}]
    )
    chosen, _ = PreferencePairs(PreferenceDataConfig(path=chat), tok, "add").sample(0)
    assert completion(tok, chosen) == "5<|im_end|>"


def test_a_chat_prompts_assistant_turns_are_context(tmp_path, tiny_model_dir):
    """TRL's conversational rows often hold earlier turns in the prompt: only the completion trains."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = [*USER, {"role": "assistant", "content": "cba"}, {"role": "user", "content": "rev xyz="}]
    row = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "zyx"}], "rejected": "xyz"}
    chosen, rejected = PreferencePairs(
        PreferenceDataConfig(path=write_jsonl(tmp_path / "p.jsonl", [row])), tok, "reverse"
    ).sample(0)
    assert (completion(tok, chosen), completion(tok, rejected)) == ("zyx<|im_end|>", "xyz<|im_end|>")
    assert tok.decode(chosen[0]).startswith(tok.apply_chat_template(prompt, tokenize=False))  # the turns are there


def test_the_trainer_refuses_pairs_with_an_empty_episode():
    """An episode with no token would vanish when a shard renumbers its episodes, and every pair
    after it would be read as one pair's rejected and the next one's chosen."""
    whole = pair_batch([(([1, 2], [0, 1]), ([1, 3], [0, 1]))] * 2, pad_id=0, rows_multiple_of=1)
    _pairs_whole(whole)
    empty = pair_batch(
        [(([1, 2], [0, 1]), ([], [])), (([1, 5], [0, 1]), ([1, 6], [0, 1]))], pad_id=0, rows_multiple_of=1
    )
    with pytest.raises(ValueError, match=r"episodes \[1\] of the batch's pairs have no tokens"):
        _pairs_whole(empty)


def test_dpo_config_errors():
    with pytest.raises(ConfigError, match="the DPO app trains with one of dpo, ipo, got 'grpo'"):
        load_config(CONFIG, ["trainer.loss.name=grpo"], Config)
    for key in ("beta=0", "rpo_alpha=-1"):
        with pytest.raises(ConfigError, match=f"config key 'trainer.loss.{key.split('=')[0]}' must be"):
            load_config(CONFIG, [f"trainer.loss.{key}"], Config)


def test_dpo_through_the_trainer_and_reference_services(tmp_path, tiny_model_dir):
    """Three steps on a pair file: the first step's policy is its reference (loss log 2, no
    margin); then the chosen completions' implicit reward rises above the rejected's."""
    data = tasks.write_dataset(tmp_path / "pairs.jsonl", "reverse", n=16, preferences=True)
    over = [
        f"runs_dir={tmp_path}",
        "run_name=dpo",
        "model.tiny=null",
        f"model.path={tiny_model_dir}",
        f"data.path={data}",
        "steps=3",
        "batch_size=8",
        "trainer.lr=1e-3",
        "trainer.loss.rpo_alpha=0",  # plain DPO: log 2 while the policy is its reference
        "trainer.warmup_steps=0",
        "checkpoint_every=0",
        "eval.every=0",
        "eval.before_train=false",
        "metrics=[jsonl]",
    ]
    main(load_config(CONFIG, over, Config))
    rows = [json.loads(line) for line in (tmp_path / "dpo/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["loss"] == pytest.approx(0.693147, abs=1e-4) and abs(rows[0]["rewards/margin"]) < 1e-5
    assert rows[-1]["rewards/margin"] > 0 and rows[-1]["rewards/accuracy"] > 0.5
    assert rows[-1]["rewards/chosen"] > rows[-1]["rewards/rejected"]


def test_pair_batch_keeps_each_pair_in_one_row():
    pairs = [(([1, 2, 3], [0, 1, 1]), ([1, 4], [0, 1])), (([1, 5], [0, 1]), ([1, 6, 7, 8], [0, 1, 1, 1]))]
    b = pair_batch(pairs, pad_id=0, rows_multiple_of=1)
    assert b.doc_ids.tolist() == [[0, 0, 0, 1, 1, -1], [2, 2, 3, 3, 3, 3]]
    assert b.positions.tolist() == [[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 2, 3]]
