"""Generated, verifiable toy tasks: what the tiny model learns offline.

A task makes prompts from a seeded RNG and scores a response in [0, 1] with partial
credit. Prompts are plain text ending in "=", answers are what the model should write
before its end-of-sequence token, so the same sample serves SFT (prompt + answer) and
RL (prompt -> score(completion)).
"""

from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LETTERS = string.ascii_lowercase[:10]  # the letter tasks' alphabet


@dataclass(frozen=True)
class Sample:
    prompt: str | list[dict[str, Any]]  # raw text, or chat messages that the generator renders
    answer: str
    task: str
    meta: dict[str, Any] = field(default_factory=dict)  # a dataset file's other columns
    tools: list[dict[str, Any]] | None = None  # OpenAI-format tools the chat template shows the model

    def row(self) -> dict[str, Any]:
        """The task as rewards and agents see it: the file's columns, then prompt, answer, task."""
        return {**self.meta, "prompt": self.prompt, "answer": self.answer, "task": self.task}


def char_overlap(response: str, answer: str) -> float:
    """Fraction of answer positions the response gets right, penalising extra length."""
    if not answer:
        return float(response == "")
    hits = sum(a == b for a, b in zip(response, answer))
    return hits / max(len(response), len(answer))


def corrupt(text: str, p: float, rng: random.Random) -> str:
    """Each character replaced with probability p by a random one of its kind (digit or
    letter): a noisy demonstration."""
    return "".join(rng.choice(string.digits if c.isdigit() else LETTERS) if rng.random() < p else c for c in text)


class Task:
    """A prompt generator plus a verifier. Subclasses set `name` and `make`."""

    name: str = ""

    def make(self, rng: random.Random) -> tuple[str, str]:
        raise NotImplementedError

    def sample(self, rng: random.Random) -> Sample:
        prompt, answer = self.make(rng)
        return Sample(prompt=prompt, answer=answer, task=self.name)

    def corrupt(self, answer: str, noise: float, rng: random.Random) -> str:
        """A noisy demonstration of `answer` (the SFT warm start's)."""
        return corrupt(answer, noise, rng)

    def near_miss(self, answer: str, rng: random.Random) -> str:
        """A plausible wrong answer (a preference pair's rejected one): two neighbouring
        characters swapped, or one replaced by another of its kind."""
        swaps = [i for i in range(len(answer) - 1) if answer[i] != answer[i + 1]]
        if swaps and rng.random() < 0.5:
            i = rng.choice(swaps)
            return answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :]
        i = rng.randrange(len(answer))
        kind = string.digits if answer[i].isdigit() else LETTERS
        return answer[:i] + rng.choice([c for c in kind if c != answer[i]]) + answer[i + 1 :]

    def wrong_answer(self, answer: str, rng: random.Random) -> str:
        """A preference pair's rejected answer: a near miss three times in four, else a failure
        of another shape (a character dropped or doubled, the first character alone, the answer
        twice, random letters). A reward model that never saw such shapes scores them at random,
        and RL against it finds the ones it scores high."""
        if rng.random() < 0.75:
            return self.near_miss(answer, rng)
        i = rng.randrange(len(answer))
        shapes = (
            answer[:i] + answer[i + 1 :],
            answer[: i + 1] + answer[i:],
            answer[0],
            answer + answer,
            "".join(rng.choices(LETTERS, k=rng.randint(1, 2 * len(answer)))),
        )
        wrong = rng.choice(shapes)
        return wrong if wrong.strip() and wrong != answer else self.near_miss(answer, rng)

    def score(self, response: str, answer: str) -> float:
        """1.0 for an exact answer; otherwise half the positional overlap (so that a
        near miss still gives a learning signal but never looks like a solve)."""
        response = response.strip()
        if response == answer:
            return 1.0
        return 0.5 * char_overlap(response, answer)


class Reverse(Task):
    """`rev abc=` -> `cba`: reverse a short lowercase string."""

    name = "reverse"

    def __init__(self, min_len: int = 3, max_len: int = 5):
        self.min_len, self.max_len = min_len, max_len

    def make(self, rng: random.Random) -> tuple[str, str]:
        n = rng.randint(self.min_len, self.max_len)
        s = "".join(rng.choice(LETTERS) for _ in range(n))
        return f"rev {s}=", s[::-1]


class Add(Task):
    """`12+7=` -> `19`: add two small non-negative integers."""

    name = "add"

    def __init__(self, max_value: int = 99):
        self.max_value = max_value

    def make(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(0, self.max_value), rng.randint(0, self.max_value)
        return f"{a}+{b}=", str(a + b)

    def score(self, response: str, answer: str) -> float:
        # Digits are compared right-aligned: the units digit is the units digit.
        response = response.strip()
        if response == answer:
            return 1.0
        return 0.5 * char_overlap(response[::-1], answer[::-1])


class Sort(Task):
    """`sort dbca=` -> `abcd`: sort the letters of a short string."""

    name = "sort"

    def make(self, rng: random.Random) -> tuple[str, str]:
        s = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 5)))
        return f"sort {s}=", "".join(sorted(s))


class CalcTool(Task):
    """`345+678=` -> `1023`, with a calculator tool (services/envs/calculator.py): the model
    calls `calc 345+678`, reads the tool's answer and gives it. Three-digit sums are beyond the
    tiny model alone; with the tool it only copies. Exact answers only."""

    name = "calc"
    CALL = re.compile(r"^calc (\d{1,4})\+(\d{1,4})$")

    def make(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        return f"{a}+{b}=", str(a + b)

    def score(self, response: str, answer: str) -> float:
        return float(response.strip() == answer)

    def tool(self, call: str) -> str | None:
        """The calculator: the sum a well-formed call asks for, else None."""
        m = self.CALL.match(call.strip())
        return str(int(m[1]) + int(m[2])) if m else None

    def conversation(self, sample: Sample, noise: float, rng: random.Random) -> list[dict[str, str]]:
        """A demonstration with copying mistakes: each digit the model writes (the call, then the
        answer read from the tool) is wrong with probability `noise`; the tool answers the call made."""

        def slip(text: str) -> str:
            return "".join(rng.choice(string.digits) if c.isdigit() and rng.random() < noise else c for c in text)

        call = "calc " + slip(sample.prompt[:-1])
        result = self.tool(call) or ""
        return [
            {"role": "user", "content": sample.prompt},
            {"role": "assistant", "content": call},
            {"role": "tool", "content": result, "tool_call_id": "calc"},
            {"role": "assistant", "content": slip(result)},
        ]


class Guess(Task):
    """`guess ???=`: find a hidden word of three letters from `abcd` in turns. Each guess is
    answered with its letters that are in their right place (`.a.`: only the middle one); the
    environment (services/envs/guess.py) ends the episode when a guess is right or after
    `max_turns` guesses. The canonical play keeps every letter the last answer confirmed and
    moves every other one to the next letter of the alphabet: it needs 1 + the highest letter's
    rank turns (`best_turns`: 4 for `dab`, 3.4 on average), which no play that ignores the
    answers can match; `reward` is best_turns / turns taken (at most 1), 0 unsolved."""

    name = "guess"
    ALPHABET = LETTERS[:4]
    LENGTH = 3
    max_turns = 6

    def make(self, rng: random.Random) -> tuple[str, str]:
        return f"guess {'?' * self.LENGTH}=", "".join(rng.choice(self.ALPHABET) for _ in range(self.LENGTH))

    def score(self, response: str, answer: str) -> float:
        return float(response.strip() == answer)

    def feedback(self, guess: str, secret: str) -> str:
        """The environment's answer: the guess's letters in their right place, `.` elsewhere."""
        guess = guess.strip()
        return "".join(g if g == s else "." for g, s in zip(guess.ljust(len(secret)), secret))

    def best_turns(self, secret: str) -> int:
        return 1 + max(self.ALPHABET.index(c) for c in secret)

    def reward(self, secret: str, turns: int, solved: bool) -> float:
        return min(1.0, self.best_turns(secret) / turns) if solved else 0.0

    def next_guess(self, guess: str, feedback: str) -> str:
        """The canonical play: keep what the feedback confirms, advance the rest."""
        a = self.ALPHABET
        return "".join(
            f if f != "." else a[(a.index(g) + 1) % len(a)] if g in a else a[0] for g, f in zip(guess, feedback)
        )

    def conversation(self, sample: Sample, noise: float, rng: random.Random) -> list[dict[str, str]]:
        """A demonstration of the canonical play in which each letter the model writes is a random
        one with probability `noise`; the environment answers the guess made."""
        messages = [{"role": "user", "content": sample.prompt}]
        guess = self.ALPHABET[0] * self.LENGTH
        for turn in range(1, self.max_turns + 1):
            guess = "".join(rng.choice(self.ALPHABET) if rng.random() < noise else c for c in guess)
            messages.append({"role": "assistant", "content": guess})
            if guess == sample.answer or turn == self.max_turns:  # the environment's end
                break
            reply = self.feedback(guess, sample.answer)
            messages.append({"role": "user", "content": reply})
            guess = self.next_guess(guess, reply)
        return messages


class PrintReverse(Reverse):
    """`py rev abc=` -> `print('cba')`: a Python line that prints the reversed string. Its
    `expected_output` column lets the `code_tests` reward run the program in the sandbox and
    check what it prints; `score` (partial credit on the program's text) serves evaluation
    without a sandbox. Noisy demonstrations misspell the printed letters only."""

    name = "pyrev"

    def sample(self, rng: random.Random) -> Sample:
        prompt, reversed_ = self.make(rng)
        return Sample(f"py {prompt}", f"print('{reversed_}')", self.name, {"expected_output": reversed_})

    def corrupt(self, answer: str, noise: float, rng: random.Random) -> str:
        return f"print('{corrupt(answer[7:-2], noise, rng)}')"


TASKS: dict[str, Task] = {t.name: t for t in (Reverse(), Add(), Sort(), CalcTool(), Guess(), PrintReverse())}


def end_of_turn(tokenizer) -> str:
    """The token that ends an assistant turn in `tokenizer`'s chat template: the first one it
    writes after a turn's content (Qwen3's `<|im_end|>`, Llama 3's `<|eot_id|>`). The template
    owns it, so a model of any family, or one whose template differs from its family's, gets its own."""
    marker = "forge-end-of-turn-probe"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "?"}, {"role": "assistant", "content": marker}], tokenize=False
    )
    if marker not in text:
        raise ValueError("the tokenizer's chat template does not write an assistant turn's content as given")
    after = text[text.rindex(marker) + len(marker) :]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    token = tokenizer.convert_ids_to_tokens(ids[0]) if ids else ""
    own = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())  # not a piece of text
    if token not in own or not after.startswith(token):
        raise ValueError(f"the tokenizer's chat template ends an assistant turn with no token of its own: {after!r}")
    return token


def chat_tokens(
    tokenizer,
    messages: list[dict[str, str]],
    end_of_turn: str,
    plain: bool = False,
    first: int = 0,
    tools: list[dict] | None = None,
) -> tuple[list[int], list[int]]:
    """A conversation as the chat template renders it: its token ids, and the labels to train
    on (the assistant turns' tokens, up to and with their `end_of_turn` token, the template's
    (`end_of_turn(tokenizer)`); -100 elsewhere). `plain`: the assistant turns' own text with
    special-token strings as text (a policy's: it spells "<|im_end|>", it does not end a turn).
    `first`: the first message that may train; assistant turns before it are context (a
    completion's prompt may hold earlier turns of the conversation). `tools`: the tools the
    template shows (a system turn of their own, or the first's)."""
    ids: list[int] = []
    labels: list[int] = []
    rendered = ""
    whole = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)

    def add(text: str, train: bool, own: bool = False) -> None:
        piece = tokenizer(text, add_special_tokens=False, split_special_tokens=own and plain)["input_ids"]
        ids.extend(piece)
        labels.extend(piece if train else [-100] * len(piece))

    for k, m in enumerate(messages):
        if m["role"] != "assistant" or k < first:
            continue
        prompt = tokenizer.apply_chat_template(messages[:k], tools=tools, add_generation_prompt=True, tokenize=False)
        turn = _turn(tokenizer, messages, k, prompt, whole, end_of_turn, tools)
        end = turn.rindex(end_of_turn)  # the template's end of the turn; what follows it is the template's too
        add(prompt[len(rendered) :], False)
        add(turn[:end], True, own=True)
        add(turn[end : end + len(end_of_turn)], True)
        add(turn[end + len(end_of_turn) :], False)
        rendered = prompt + turn
    return ids, labels


def _turn(
    tokenizer, messages: list[dict[str, str]], k: int, prompt: str, whole: str, end_of_turn: str, tools: list | None
) -> str:
    """Assistant turn k's text after its generation prompt `prompt`, as the template renders the
    whole conversation (`whole`). A template may render a turn otherwise once a user turn
    follows it (Qwen3's drops its reasoning): then it is `whole`'s, through its end of turn."""
    full = tokenizer.apply_chat_template(messages[: k + 1], tools=tools, tokenize=False)
    if whole.startswith(full) or not whole.startswith(prompt):
        return full[len(prompt) :]
    return whole[len(prompt) : whole.index(end_of_turn, len(prompt)) + len(end_of_turn)]


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def generate(task: str, n: int, seed: int = 0) -> list[Sample]:
    """`n` samples of `task`, the same list for the same seed."""
    t, rng = get_task(task), random.Random(f"{task}:{seed}")
    return [t.sample(rng) for _ in range(n)]


def preference_pair(task: Task, sample: Sample, rng: random.Random) -> tuple[str, str]:
    """(chosen, rejected) for `sample`: its answer, and a wrong one (`Task.wrong_answer`)."""
    return sample.answer, task.wrong_answer(sample.answer, rng)


def write_dataset(
    path: str | Path,
    task: str,
    n: int = 10_000,
    seed: int = 0,
    system: str | None = None,
    preferences: bool = False,
) -> Path:
    """Write `n` samples as JSON lines (prompt, answer, task): loadable with
    `datasets.load_dataset("json", data_files=path)` (and `dataset.path` of an app). With
    `system`, each prompt is chat messages: that system turn and the task as the user's
    (`dataset.messages_key: prompt`). With `preferences`, each row also has `chosen` (the
    answer) and `rejected` (a wrong answer), chat messages of the assistant with `system`, as
    TRL's conversational preference datasets."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    t, rng = get_task(task), random.Random(f"{task}:{seed}:preferences")
    with tmp.open("w") as f:
        for s in generate(task, n, seed):
            row = s.row()
            if preferences:
                row["chosen"], row["rejected"] = preference_pair(t, s, rng)
            if system is not None:
                row["prompt"] = [{"role": "system", "content": system}, {"role": "user", "content": s.prompt}]
                for key in ("chosen", "rejected") if preferences else ():
                    row[key] = [{"role": "assistant", "content": row[key]}]
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    return path
