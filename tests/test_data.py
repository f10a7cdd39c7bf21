"""Prompt streams: generated toy tasks and local dataset files, both resumable."""

import json

import pytest

from forge.config import ConfigError
from forge.data import FilePrompts, TaskPrompts
from forge.schema import DatasetConfig


def gsm8k_like(path, n=5):
    with path.open("w") as f:
        for i in range(n):
            f.write(
                json.dumps(
                    {
                        "question": f"What is {i} plus {i + 1}?",
                        "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}",
                    }
                )
                + "\n"
            )
    return path


def test_file_prompts_epochs_and_resume(tmp_path):
    cfg = DatasetConfig(path=str(gsm8k_like(tmp_path / "train.jsonl")), template="Q: {question}\nA:")
    node = FilePrompts(cfg, seed=1)
    node.reset()
    first = [next(node) for _ in range(10)]
    assert sorted(s.prompt for s in first[:5]) == sorted(f"Q: What is {i} plus {i + 1}?\nA:" for i in range(5))
    assert sorted(s.prompt for s in first[5:]) == sorted(s.prompt for s in first[:5])  # a full second epoch
    assert [s.prompt for s in first[:5]] != [s.prompt for s in first[5:]]  # reshuffled
    assert first[0].answer.endswith(f"#### {first[0].answer.split('= ')[1].split()[0]}")

    resumed = FilePrompts(cfg, seed=1)
    resumed.reset({"index": 7})
    assert [next(resumed).prompt for _ in range(3)] == [s.prompt for s in first[7:10]]


def test_task_prompts_resume():
    a, b = TaskPrompts("reverse", seed=3), TaskPrompts("reverse", seed=3)
    a.reset()
    seen = [next(a) for _ in range(6)]
    b.reset({"index": 4})
    assert [next(b) for _ in range(2)] == seen[4:]


def test_bad_dataset_is_named(tmp_path):
    with pytest.raises(ConfigError, match="dataset.path': file not found"):
        DatasetConfig(path=str(tmp_path / "nope.jsonl")).validate()
    with pytest.raises(ConfigError, match="is not one of"):
        DatasetConfig(path=str(tmp_path / "x.txt")).validate()
    path = gsm8k_like(tmp_path / "t.jsonl")
    with pytest.raises(ConfigError, match=r"missing \['problem'\]"):
        FilePrompts(DatasetConfig(path=str(path), template="{problem}"))


def test_chat_format_prompts(tmp_path):
    """`forge make-dataset --system` writes chat prompts (a system turn, the task as the user's);
    `dataset.messages_key` reads them as messages, in place of `template`; a column of plain
    strings, or both keys set, is a config error naming them."""
    from forge.tasks import write_dataset

    path = write_dataset(tmp_path / "chat.jsonl", "reverse", n=5, system="Reverse the letters.")
    s = FilePrompts(DatasetConfig(path=str(path), messages_key="prompt")).next()
    assert s.prompt == [
        {"role": "system", "content": "Reverse the letters."},
        {"role": "user", "content": s.prompt[1]["content"]},
    ]
    assert s.prompt[1]["content"].startswith("rev ") and s.prompt[1]["content"][4:-1][::-1] == s.answer
    raw = write_dataset(tmp_path / "raw.jsonl", "reverse", n=5)
    with pytest.raises(ConfigError, match="row 0 of .*raw.jsonl holds 'rev .* not a list of chat messages"):
        FilePrompts(DatasetConfig(path=str(raw), messages_key="prompt"))
    with pytest.raises(ConfigError, match="dataset.messages_key, dataset.template: each makes the prompt"):
        DatasetConfig(path=str(path), messages_key="prompt", template="{prompt}").validate()


def test_chat_prompts_from_plain_columns(tmp_path):
    """`dataset.chat`: message templates filled from a row's columns (GSM8K's question inside a
    user turn); any two of chat, messages_key and template are a config error."""
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "answer": "4"}) + "\n")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "{question} After ####."}]
    s = FilePrompts(DatasetConfig(path=str(path), chat=chat)).next()
    assert s.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? After ####."}]
    with pytest.raises(ConfigError, match="dataset.messages_key, dataset.chat: each makes the prompt"):
        DatasetConfig(path=str(path), chat=chat, messages_key="prompt").validate()
    with pytest.raises(ConfigError, match=r"missing \['query'\]"):
        FilePrompts(DatasetConfig(path=str(path), chat=[{"role": "user", "content": "{query}"}]))


def test_tools_column(tmp_path):
    """`dataset.tools_key`: each row's tools (a list, or that list as JSON, as schemas differ by
    row) go with its chat prompt to the generator; a row without tools has none; a column that
    is not OpenAI tools, or tools with raw-text prompts, is a config error naming the key."""
    tool = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
    path = tmp_path / "tools.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4", "tools": json.dumps([tool])},
        {"prompt": [{"role": "user", "content": "3+3?"}], "answer": "6", "tools": ""},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    node = FilePrompts(DatasetConfig(path=str(path), messages_key="prompt", tools_key="tools"))
    got = {s.answer: s.tools for s in (node.next(), node.next())}
    assert got == {"4": [tool], "6": None}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**rows[0], "tools": '["calc"]'}) + "\n")
    with pytest.raises(
        ConfigError, match=r"dataset.tools_key': row 0 of .*bad.jsonl holds .* not a list of OpenAI tools"
    ):
        FilePrompts(DatasetConfig(path=str(bad), messages_key="prompt", tools_key="tools"))
    with pytest.raises(ConfigError, match="tools are shown by a chat template"):
        DatasetConfig(path=str(path), template="{prompt}", tools_key="tools").validate()
