"""The SFT app through the Trainer service: which tokens carry loss, training from a chat file
(packed rows) with evals beside it, checkpoints and resume."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from apps.sft import Config, main
from forge import checkpoint
from forge.config import ConfigError, load_config
from forge.data import FilePrompts, SFTExamples
from forge.losses import sft
from forge.schema import LossConfig, SFTDataConfig
from forge.tasks import end_of_turn
from forge.types import Episode, collate

CHAT = [
    {"role": "system", "content": "reverse"},
    {"role": "user", "content": "abc"},
    {"role": "assistant", "content": "cba"},
    {"role": "user", "content": "xy"},
    {"role": "assistant", "content": "yx"},
]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_only_assistant_and_completion_tokens_carry_loss(tmp_path, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    chats = SFTExamples(SFTDataConfig(path=write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])), tok, "add")
    ids, mask = chats.sample(0)
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    assert trained == "cba<|im_end|>yx<|im_end|>"  # the assistant turns and their end-of-turn, nothing else
    rendered = tok.apply_chat_template(CHAT, tokenize=False)
    assert ids == tok(rendered, add_special_tokens=False)["input_ids"]  # the whole rendered chat is the input
    rows = [{"prompt": "2+2=", "completion": "4"}]
    pairs = SFTExamples(SFTDataConfig(path=write_jsonl(tmp_path / "p.jsonl", rows)), tok, "add")
    ids, mask = pairs.sample(0)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "4<|eos|>"
    # The loss is the mean NLL of exactly those tokens: other tokens' logprobs do not move it.
    batch = collate([Episode(ids, mask, [0.0] * len(ids))], pad_id=0)
    lp = -torch.rand(batch.input_ids.shape)
    moved = lp + (1 - batch.loss_mask) * 5.0
    expected = -(lp * batch.loss_mask).sum() / batch.loss_mask.sum()
    assert torch.allclose(sft(lp, batch, lp, LossConfig()), expected)
    assert torch.allclose(sft(moved, batch, moved, LossConfig()), expected)


def test_system_cut_trains_the_task_behind_system_turns_of_every_length(tiny_model_dir):
    """`data.system_cut`: that fraction of toy examples take a random-length start of the system
    turn (none at length 0), the rest the whole; the answer is trained on either way."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    system = "Reverse the word after rev, letter by letter, and write only the reversed word."
    cfg = SFTDataConfig(system=system, system_cut=0.5)
    cfg.validate()
    examples, lengths = SFTExamples(cfg, tok, "reverse", seed=0), []
    for i in range(1000):
        ids, mask = examples.sample(i)
        text = tok.decode(ids)
        turn = text.split("<|im_start|>system\n", 1)[1].split("<|im_end|>")[0] if "system" in text else ""
        assert system.startswith(turn) and tok.decode([t for t, m in zip(ids, mask) if m]).endswith("<|im_end|>")
        lengths.append(len(turn))
    whole = lengths.count(len(system)) / len(lengths)
    assert 0.45 < whole < 0.6 and 0 in lengths and len(set(lengths)) > 40
    uncut = SFTExamples(SFTDataConfig(system=system), tok, "reverse", seed=0)
    assert all(f"system\n{system}<|im_end|>" in tok.decode(uncut.sample(i)[0]) for i in range(50))
    for bad, match in (({"system_cut": 1.5, "system": system}, "must be in"), ({"system_cut": 0.5}, "not set")):
        with pytest.raises(ConfigError, match=f"config key 'data.system_cut'.*{match}"):
            SFTDataConfig(**bad).validate()


@pytest.mark.parametrize("key, value", [("system", "Be brief."), ("noise", 0.1)])
def test_a_toy_task_key_beside_a_file_is_named_not_ignored(tmp_path, key, value):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    with pytest.raises(ConfigError, match=f"config key 'data.{key}': .*toy task"):
        SFTDataConfig(path=path, **{key: value}).validate()


def test_a_file_without_the_columns_is_named_before_anything_starts(tmp_path, tiny_model_dir):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match=r"has columns \['text'\]: neither 'messages' \(data.messages_key\)"):
        SFTExamples(SFTDataConfig(path=path), tok, "add")
    with pytest.raises(ConfigError, match="config key 'eval.dataset.path': a run on a dataset file evaluates"):
        load_config("configs/sft_tiny.yaml", [f"data.path={path}"], Config)
    with pytest.raises(ConfigError, match="config key 'trainer.loss.name': the SFT app trains with 'sft'"):
        load_config("configs/sft_tiny.yaml", ["trainer.loss.name=grpo"], Config)


@pytest.mark.parametrize(
    "bad, why",
    [
        ({"prompt": "9+9=", "completion": None}, r"no value in \['completion'\]"),  # never trained as "None"
        ({"prompt": None, "completion": "4"}, r"no value in \['prompt'\]"),
        ({"messages": [{"role": "user", "content": "no answer"}]}, "no assistant message to train on"),
        ({"messages": "abc"}, "column 'messages' is not a list of chat messages"),
        ({"messages": CHAT[2:]}, "its first message is the assistant's"),  # no prompt to render it after
        ({"prompt": [], "completion": "4"}, "its first message is the assistant's"),
        ({"prompt": "1+" * 600, "completion": "4"}, r"first 1024 tokens \(data.max_tokens\) hold none of its loss"),
        ({"messages": [{"role": "user", "content": "1+" * 600}, *CHAT[2:3]]}, "hold none of its loss tokens"),
        ({"prompt": "2+2=", "completion": CHAT[2:3]}, "the prompt is text, so 'completion' must be too"),
        ({"prompt": CHAT[:2], "completion": CHAT[1:2]}, "'completion' has no assistant message"),
        ({"messages": CHAT, "tools": '["calc"]'}, "column 'tools' .* not a list of OpenAI tools"),
    ],
)
def test_every_row_is_checked_when_the_file_loads(tmp_path, tiny_model_dir, bad, why):
    """A bad row is named when the file loads, not when the loop reaches it mid-run; a file may
    mix chat rows and prompt/completion rows (datasets fills each's absent columns with null)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    row = dict.fromkeys(("messages", "prompt", "completion"))  # JSON lines' rows name the same keys
    rows = [{**row, "messages": CHAT}, {**row, "prompt": "2+2=", "completion": "4"}] * 20
    examples = SFTExamples(SFTDataConfig(path=write_jsonl(tmp_path / "ok.jsonl", rows)), tok, "add")
    assert len({tuple(examples.sample(i)[0]) for i in range(40)}) == 2
    path = write_jsonl(tmp_path / "bad.jsonl", rows + [{**row, **bad}])
    with pytest.raises(ConfigError, match=f"config key 'data.path': {path} row 40: .*{why}"):
        SFTExamples(SFTDataConfig(path=path), tok, "add")


def test_a_row_the_chat_template_rejects_is_named_when_the_file_loads(tmp_path, tiny_model_dir):
    """A template may refuse a conversation (Qwen3's, one with no user turn): the row is named
    when the file loads, not when the loop reaches it mid-run."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    no_user = (
        "{%- if not (messages | selectattr('role', 'equalto', 'user') | list) %}"
        "{{ raise_exception('No user query found in messages.') }}{% endif -%}"
    )
    tok.chat_template = no_user + tok.chat_template
    rows = [{"messages": CHAT}, {"messages": [CHAT[0], CHAT[2]]}]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    with pytest.raises(ConfigError, match=f"config key 'data.path': {path} row 1: .*No user query found"):
        SFTExamples(SFTDataConfig(path=path), tok, "add")


def test_chat_prompt_and_completion_rows_train_the_completion_in_the_chat_template(tmp_path, tiny_model_dir):
    """TRL's conversational prompt/completion rows: the prompt's messages (its assistant turns
    context) then the completion, a text or the assistant's messages, rendered by the chat
    template; the loss on the completion's assistant turns and their end of turn only."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [{"prompt": CHAT[:4], "completion": CHAT[4:]}, {"prompt": CHAT[:4], "completion": "yx"}]
    examples = SFTExamples(SFTDataConfig(path=write_jsonl(tmp_path / "pc.jsonl", rows)), tok, "add")
    for ids, mask in (examples.sample(0), examples.sample(1)):
        assert ids == tok(tok.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)["input_ids"]
        assert tok.decode([t for t, m in zip(ids, mask) if m]) == "yx<|im_end|>"


def test_a_tools_column_is_rendered_with_its_chat_row(tmp_path, tiny_model_dir):
    """A row's tools (the `tools` column, as TRL's) are rendered by the chat template as the
    policy sees them when it calls them; the loss stays on the assistant's turns: its calls, its
    answer."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tool = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
    call = {"type": "function", "function": {"name": "calc", "arguments": '{"x": "2+2"}'}}
    chat = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "4"},
    ]
    rows = [{"messages": chat, "tools": json.dumps([tool])}, {"messages": CHAT, "tools": None}]
    examples = SFTExamples(SFTDataConfig(path=write_jsonl(tmp_path / "tools.jsonl", rows)), tok, "add")
    got = {len(ids): (ids, mask) for ids, mask in (examples.sample(0), examples.sample(1))}
    assert len(got) == 2
    ids, mask = got[max(got)]
    rendered = tok.apply_chat_template(chat, tools=[tool], tokenize=False)
    assert "# Tools" in rendered and ids == tok(rendered, add_special_tokens=False)["input_ids"]
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == (
        '<tool_call>{"name": "calc", "arguments": {"x": "2+2"}}</tool_call><|im_end|>4<|im_end|>'
    )
    ids, _ = got[min(got)]  # a row without tools: none shown
    assert ids == tok(tok.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)["input_ids"]


@pytest.mark.slow  # 57 s: two SFT runs with a generator for evals
def test_sft_from_a_chat_file_through_the_trainer_service_then_resume(tmp_path, tiny_model_dir):
    chats = [
        {"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": w[::-1]}]}
        for w in ("abc", "hello", "forge", "xyz", "trainer", "qwen", "tiny", "model")
    ]
    data = write_jsonl(tmp_path / "chats.jsonl", chats)
    held = write_jsonl(
        tmp_path / "held.jsonl", [{"question": "abc", "answer": "cba"}, {"question": "xy", "answer": "yx"}]
    )
    over = [
        f"runs_dir={tmp_path}",
        "run_name=chat",
        "model.tiny=null",
        f"model.path={tiny_model_dir}",
        f"data.path={data}",
        "steps=4",
        "batch_size=4",
        "data.pack_to=64",  # the 4 chats of a step in fewer rows
        "checkpoint_every=2",
        "eval.every=2",
        "eval.before_train=false",
        f"eval.dataset.path={held}",
        "eval.prompts=0",
        "metrics=[jsonl]",
    ]
    main(load_config("configs/sft_tiny.yaml", over, Config))
    run_dir = tmp_path / "chat"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and train[-1]["loss"] < train[0]["loss"]
    assert [(r["step"], r["eval/prompts"], r["eval/version"]) for r in rows if "eval/prompts" in r] == [
        (2, 2, 2),
        (4, 2, 4),
    ]
    trained, initial = load_file(run_dir / "model/model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)
    saved = checkpoint.load_run_state(checkpoint.latest(run_dir))
    assert saved["step"] == 4 and saved["examples"]["index"] == 16

    # Resumed without evals (no generator to start): the rows, optimizer and data carry on.
    main(load_config(str(run_dir / "config.yaml"), ["steps=6", "eval.every=0", f"resume={run_dir}"], Config))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if "eval/prompts" in r] == [2, 4]
    resumed = checkpoint.load_run_state(checkpoint.latest(run_dir))
    assert resumed["step"] == 6 and resumed["examples"]["index"] == 24


def test_the_walkthroughs_script_and_configs(tmp_path, tiny_model_dir, monkeypatch):
    """The walkthrough (docs/guides/your-task.md): its script writes the task's files, and its two configs load
    against them (the reward function imported by path from the working directory)."""
    import subprocess
    from pathlib import Path

    from apps.grpo import Config as GRPOConfig

    root = Path(__file__).resolve().parent.parent
    readme = (root / "docs/guides/your-task.md").read_text()
    script = readme.split("python3 - <<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    monkeypatch.chdir(tmp_path)
    subprocess.run(["python3", "-"], input=script, text=True, check=True)
    lines = {name: (tmp_path / "runs/upper" / name).read_text().splitlines() for name in ("sft.jsonl", "eval.jsonl")}
    assert len(lines["sft.jsonl"]) == 3000 and len(lines["eval.jsonl"]) == 64
    sft_cfg = load_config(root / "configs/sft_upper.yaml", ["model.tiny=null", f"model.path={tiny_model_dir}"], Config)
    grpo = load_config(root / "configs/grpo_upper.yaml", [f"model.path={tiny_model_dir}"], GRPOConfig)
    for cfg in (sft_cfg, grpo):
        assert cfg.eval.dataset.path == "runs/upper/eval.jsonl" and "runs.upper.reward:score" in cfg.rewards.weights
        assert cfg.eval.dataset.messages_key == "prompt"  # chat prompts everywhere: training, evals
    system, user = FilePrompts(grpo.dataset).next().prompt
    assert system == {"role": "system", "content": "Upper-case."} and user["content"].startswith("up ")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids, mask = SFTExamples(sft_cfg.data, tok, sft_cfg.task).sample(0)
    trained = tok.decode([t for t, m in zip(ids, mask) if m])  # the assistant's turn, and its end
    assert trained.endswith(end_of_turn(tok)) and trained[: -len(end_of_turn(tok))].isupper()
