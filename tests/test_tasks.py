import itertools
import random
import statistics

import pytest

from forge import tasks

# Each task solved independently of forge/tasks.py, from its prompt alone.
SOLVE = {
    "add": lambda p: str(sum(int(x) for x in p[:-1].split("+"))),
    "reverse": lambda p: p[len("rev ") : -1][::-1],
    "sort": lambda p: "".join(sorted(p[len("sort ") : -1])),
}


@pytest.mark.parametrize(
    "name,prompt,answer",
    [("add", "12+7=", "19"), ("reverse", "rev abc=", "cba"), ("sort", "sort dbca=", "abcd")],
)
def test_known_answers(name, prompt, answer):
    t = tasks.get_task(name)
    assert SOLVE[name](prompt) == answer  # the hand-checked case checks the independent solver
    # every generated prompt comes with the answer the solver finds, and only that one scores 1
    for s in tasks.generate(name, 200, seed=5):
        assert s.task == name and s.prompt.endswith("=")
        assert s.answer == SOLVE[name](s.prompt), s
        assert t.score(s.answer, s.answer) == 1.0 and t.score(s.answer + "x", s.answer) < 1.0
    assert t.score(f" {answer}\n", answer) == 1.0  # surrounding whitespace tolerated


def test_add_prompt_matches_answer():
    for s in tasks.generate("add", 200, seed=3):
        a, b = s.prompt[:-1].split("+")
        assert int(s.answer) == int(a) + int(b)


def test_partial_credit_in_unit_interval():
    add, rev = tasks.get_task("add"), tasks.get_task("reverse")
    assert add.score("18", "19") == pytest.approx(0.25)  # tens digit right, half credit
    assert add.score("9", "19") == pytest.approx(0.25)  # right-aligned units digit
    assert add.score("", "19") == 0.0
    assert rev.score("cbx", "cba") == pytest.approx(0.5 * 2 / 3)
    assert rev.score("cbaaaa", "cba") == pytest.approx(0.5 * 3 / 6)  # extra length costs
    for s in tasks.generate("reverse", 100, seed=1):
        assert 0.0 <= rev.score(s.answer[:-1] + "z", s.answer) < 1.0


def test_unknown_task_is_named():
    with pytest.raises(ValueError, match="unknown task 'mul'"):
        tasks.get_task("mul")


def test_dataset_reproducible_and_loadable(tmp_path):
    import datasets

    a = tasks.write_dataset(tmp_path / "a.jsonl", "add", n=10_000, seed=7)
    b = tasks.write_dataset(tmp_path / "b.jsonl", "add", n=10_000, seed=7)
    c = tasks.write_dataset(tmp_path / "c.jsonl", "add", n=10_000, seed=8)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()

    ds = datasets.load_dataset("json", data_files=str(a), split="train")  # HF datasets, from the local file
    assert len(ds) == 10_000 and set(ds.column_names) == {"prompt", "answer", "task"}
    assert ds[0]["prompt"] == tasks.generate("add", 1, seed=7)[0].prompt

    from torchdata.nodes import Batcher, IterableWrapper, Loader

    loader = Loader(Batcher(IterableWrapper(ds), batch_size=32))
    first = next(iter(loader))
    assert len(first) == 32 and first[0]["answer"] == ds[0]["answer"]


def test_corrupt_keeps_kind_and_rate():
    rng = random.Random(0)
    text = "abcdefghij0123456789" * 50
    noisy = tasks.corrupt(text, 0.3, rng)
    changed = sum(a != b for a, b in zip(text, noisy)) / len(text)
    assert 0.2 < changed < 0.33  # p = 0.3, minus replacements that drew the same character
    assert all(a.isdigit() == b.isdigit() for a, b in zip(text, noisy)) and set(noisy) <= set(text)
    assert tasks.corrupt(text, 0.0, rng) == text


def test_calc_tool_and_its_demonstrations(tiny_model_dir):
    """The calculator answers well-formed calls only; a clean demonstration calls it with the
    prompt's sum and gives the tool's answer; chat_tokens trains exactly the assistant turns
    (each through its <|im_end|>), never the prompt or the tool's reply."""
    from transformers import AutoTokenizer

    calc = tasks.get_task("calc")
    assert calc.tool("calc 345+678") == "1023" and calc.tool(" calc 1+2 ") == "3"
    assert calc.tool("345+678") is None and calc.tool("calc 3x5+6") is None and calc.tool("calc 1+2 then") is None
    for s in tasks.generate("calc", 100, seed=2):
        a, b = s.prompt[:-1].split("+")
        assert s.answer == str(int(a) + int(b)) and calc.score(s.answer, s.answer) == 1.0
        assert calc.score(s.answer[:-1], s.answer) == 0.0  # exact answers only

    s = tasks.generate("calc", 1, seed=4)[0]
    clean = calc.conversation(s, 0.0, random.Random(0))
    assert [m["role"] for m in clean] == ["user", "assistant", "tool", "assistant"]
    assert clean[1]["content"] == "calc " + s.prompt[:-1] and clean[2]["content"] == clean[3]["content"] == s.answer
    noisy = [calc.conversation(s, 0.5, random.Random(k)) for k in range(20)]
    assert any(c[1]["content"] != clean[1]["content"] for c in noisy)
    assert all(c[2]["content"] == (calc.tool(c[1]["content"]) or "") for c in noisy)  # the tool answers the call made

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids, labels = tasks.chat_tokens(tok, clean, tasks.end_of_turn(tok))
    assert ids == tok.apply_chat_template(clean, tokenize=True, return_dict=False)
    trained = [i for i, label in zip(ids, labels) if label != -100]
    assert trained == [i for i, label in zip(ids, labels) if label == i] and len(labels) == len(ids)
    assert tok.decode(trained) == f"calc {s.prompt[:-1]}<|im_end|>{s.answer}<|im_end|>"


def test_pyrev_asks_for_a_program_and_keeps_what_it_must_print():
    t = tasks.get_task("pyrev")
    for s in tasks.generate("pyrev", 100, seed=2):
        letters = s.prompt[len("py rev ") : -1]
        assert s.answer == f"print('{letters[::-1]}')" and s.row()["expected_output"] == letters[::-1]
    rng = random.Random(0)
    noisy = [t.corrupt("print('abcde')", 0.5, rng) for _ in range(50)]
    assert all(n.startswith("print('") and n.endswith("')") and len(n) == 14 for n in noisy)  # only letters change
    assert any(n != "print('abcde')" for n in noisy)


def test_guess_answers_and_the_best_play():
    """The environment's answer shows the guess's letters in their right place; the best play,
    which keeps them and moves the rest on, finds every one of the 64 words in exactly
    `best_turns` guesses (3.4 on average), and a clean demonstration is that play; guessing
    `aaa`, `bbb`, ... without reading the answers finds only the words of one letter."""
    g = tasks.get_task("guess")
    assert (
        g.feedback("aab", "cab") == ".ab" and g.feedback(" abc\n", "abc") == "abc" and g.feedback("a", "cab") == "..."
    )
    assert g.best_turns("dab") == 4 and g.best_turns("aaa") == 1
    assert g.reward("dab", 4, True) == g.reward("dab", 2, True) == 1.0 and g.reward("dab", 5, True) == 0.8
    assert g.reward("dab", 6, False) == 0.0
    words = ["".join(w) for w in itertools.product(g.ALPHABET, repeat=g.LENGTH)]
    for w in words:
        conv = g.conversation(tasks.Sample("guess ???=", w, "guess"), 0.0, random.Random(0))
        guesses = [m["content"] for m in conv[1::2]]
        assert [m["role"] for m in conv] == ["user"] + ["assistant", "user"] * (len(guesses) - 1) + ["assistant"]
        assert guesses[-1] == w and len(guesses) == g.best_turns(w) and guesses[0] == "aaa"
        assert all(conv[k]["content"] == g.feedback(conv[k - 1]["content"], w) for k in range(2, len(conv), 2))
    assert statistics.mean(g.best_turns(w) for w in words) == pytest.approx(3.44, abs=0.01)
    blind = [w for w in words if any(w == c * g.LENGTH for c in g.ALPHABET[: g.max_turns])]
    assert len(blind) == 4  # the rest need the answers

    for s in tasks.generate("guess", 100, seed=3):
        assert s.prompt == "guess ???=" and len(s.answer) == 3 and set(s.answer) <= set(g.ALPHABET)
    noisy = [g.conversation(tasks.Sample("guess ???=", "dcb", "guess"), 0.5, random.Random(k)) for k in range(20)]
    assert any(len(c) != 7 for c in noisy) and all(
        len(c) <= 2 * g.max_turns and c[-1]["role"] == "assistant" for c in noisy
    )
    assert all(set(m["content"]) <= set(g.ALPHABET) for c in noisy for m in c[1::2])


def test_chat_tokens_render_a_conversation_as_its_chat_template_does(tiny_model_dir):
    """A template that drops an earlier assistant turn's reasoning once a user turn follows
    (Qwen3's, the tiny model's): the tokens are the template's rendering of the whole
    conversation, and each assistant turn trains as it appears there, its end-of-turn token too."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "user", "content": "rev abc="},
        {"role": "assistant", "content": "<think>reverse it</think>cba"},
        {"role": "user", "content": "rev xyz="},
        {"role": "assistant", "content": "<think>again</think>zyx"},
    ]
    ids, labels = tasks.chat_tokens(tok, messages, tasks.end_of_turn(tok))
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)
    trained = [i for i, label in zip(ids, labels) if label != -100]
    assert tok.decode(trained) == "cba<|im_end|><think>again</think>zyx<|im_end|>"
