"""Prompt streams for RL apps, as torchdata nodes (stateful, so a resumed run continues
from the same data position)."""

from __future__ import annotations

import json
import random
import re
import string
from typing import Any

from jinja2 import TemplateError
from torchdata.nodes import BaseNode
from tqdm import tqdm

from forge.config import ConfigError
from forge.schema import (
    DatasetConfig,
    PreferenceDataConfig,
    RowsConfig,
    SFTDataConfig,
)
from forge.tasks import Sample, chat_tokens, end_of_turn, get_task, preference_pair


class IndexedPrompts(BaseNode[Sample]):
    """An endless prompt stream where sample i depends only on (seed, i): the index is the state."""

    size: int | None = None  # how many distinct samples (a dataset's rows); None: endless

    def __init__(self, seed: int = 0):
        super().__init__()
        self.seed, self.index = seed, 0

    def sample(self, i: int) -> Sample:
        raise NotImplementedError

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state and "index" not in initial_state:  # a mixture's (forge/mixture.py)
            names = ", ".join(initial_state.get("sources", {}))
            raise ConfigError(
                f"config key 'dataset.mix': the checkpoint's prompts are a mixture's ({names}), this run's one "
                "source; to go on from it, list that source alone in dataset.mix (it keeps its place)"
            )
        self.index = initial_state["index"] if initial_state else 0
        held = (initial_state or {}).get("rows")
        if held is not None and held != self.size:  # the epoch's order is the row count's
            tqdm.write(
                f"forge: {getattr(self, 'where', 'the data source')} has {self.size} rows, the checkpoint's had {held}: "
                "this epoch's order is another from here (until the next, some prompts may repeat or be skipped)"
            )

    def next(self) -> Sample:
        i, self.index = self.index, self.index + 1  # a bad row costs its own sample, not every retry
        return self.sample(i)

    def get_state(self) -> dict[str, Any]:
        # its name too: a run resumed as a mixture that lists this source goes on from its place
        return {"index": self.index, "source": getattr(self, "name", None), "rows": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # a run's checkpoint part (forge/run.py)
        self.reset(state)

    def shuffled(self, i: int, rows: int) -> int:
        """Which of `rows` rows sample i reads: every row once per epoch, reshuffled each epoch
        from the seed."""
        epoch, i = divmod(i, rows)
        if getattr(self, "_order", (-1,))[0] != epoch:
            order = list(range(rows))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1][i]


def prompt_source(dataset: DatasetConfig, task: str, seed: int = 0, key: str = "dataset") -> IndexedPrompts:
    """A run's prompt stream: the source `dataset` names (a file or save_to_disk directory, a
    Hugging Face dataset, a reasoning-gym generator), else the toy `task`'s samples. `key`: the
    config key errors name (an eval's: eval.dataset)."""
    if dataset.kind == "reasoning_gym":
        from forge.sources import ReasoningGymPrompts  # see FilePrompts

        return ReasoningGymPrompts(dataset, seed, key)
    return FilePrompts(dataset, seed, key) if dataset.enabled else TaskPrompts(task, seed)


class TaskPrompts(IndexedPrompts):
    """Generated toy-task samples."""

    def __init__(self, task: str, seed: int = 0):
        super().__init__(seed)
        self.task, self.name = get_task(task), task

    def sample(self, i: int) -> Sample:
        return self.task.sample(random.Random(f"{self.seed}:{i}"))


class RowPrompts(IndexedPrompts):
    """Prompts made from rows (a mapping of columns each) as the `dataset` section's prompt keys
    say: `template`, `chat` or `messages_key`, and `tools_key`. A subclass gives the row at a
    position (`entry`); sample i reads position i of an endless source, else a position
    reshuffled each epoch. The section's columns are checked against `columns` and the first
    row here, so a wrong key fails before the run, not mid-run."""

    def __init__(self, cfg: DatasetConfig, columns: list[str], size: int | None, seed: int, key: str, where: str):
        super().__init__(seed)
        self.cfg, self.key, self.where, self.name = cfg, key, where, cfg.source_name
        self.columns, self.size = list(columns), size
        count = "endless" if size is None else size
        # A field may index its column ({test_list[0]}): the column is the name before [ or .
        texts = [m["content"] for m in cfg.chat] or [cfg.template]
        fields = [name for text in texts for _, name, _, _ in string.Formatter().parse(text) if name is not None]
        if "" in fields:
            raise ConfigError(f"config key '{key}': its prompt has a field `{{}}` that names no column of {columns}")
        prompt = {cfg.messages_key} if cfg.messages_key else {re.split(r"[.\[]", name)[0] for name in fields}
        self.prompt_columns = sorted(prompt)
        self.whole_fields = [] if cfg.messages_key else sorted(set(fields) & prompt)  # a column put in whole
        wanted = prompt | {cfg.answer_key} | ({cfg.tools_key} if cfg.tools_key else set())
        missing = wanted - set(columns)
        if missing or size == 0:
            raise ConfigError(
                f"config key '{key}': {where} has {count} rows and columns {columns}; missing {sorted(missing)}"
            )
        if cfg.messages_key:
            self._messages(self.entry(0), 0)  # a column of plain strings fails here, not mid-run
        else:
            self._check_fields(self.entry(0), 0)  # a column of lists, likewise
        if cfg.tools_key:
            self._tools(self.entry(0), 0)

    def entry(self, at: int) -> dict[str, Any]:
        """The source's row at position `at`."""
        raise NotImplementedError

    def row(self, i: int) -> tuple[dict[str, Any], int]:
        """Sample i's row and its position in the source (for errors)."""
        at = i if self.size is None else self.shuffled(i, self.size)
        return self.entry(at), at

    def meta(self, row: dict[str, Any]) -> dict[str, Any]:
        """What goes with the sample to its rewards besides prompt, answer and task."""
        return dict(row)

    def sample(self, i: int) -> Sample:
        row, at = self.row(i)
        return Sample(
            prompt=self._prompt(row, at),
            answer=answer_text(row[self.cfg.answer_key]),
            task=self.name,
            meta=self.meta(row),
            tools=self._tools(row, at) if self.cfg.tools_key else None,
        )

    def _prompt(self, row: dict[str, Any], at: int) -> str | list[dict[str, Any]]:
        empty = [c for c in self.prompt_columns if row[c] is None]
        if empty:  # else its prompt would hold the text "None"
            raise ConfigError(f"config key '{self.key}': row {at} of {self.where} has no value in column(s) {empty}")
        self._check_fields(row, at)
        if self.cfg.chat:
            return [{"role": m["role"], "content": self._format(m["content"], row, at)} for m in self.cfg.chat]
        return self._messages(row, at) if self.cfg.messages_key else self._format(self.cfg.template, row, at)

    def _check_fields(self, row: dict[str, Any], at: int) -> None:
        """A field that names a whole column of lists or objects would put its Python text in the
        prompt ("['What is 0 plus 0?', ...]": a .json file of columns read as one row): refused."""
        for name in self.whole_fields:
            if isinstance(row[name], (list, dict)):
                raise ConfigError(
                    f"config key '{self.key}': row {at} of {self.where} holds a {type(row[name]).__name__} in "
                    f"column '{name}', which the prompt puts whole: index it ({{{name}[0]}}), or write a row "
                    "per prompt (a .json file is a list of rows, or JSON lines)"
                )

    def _format(self, text: str, row: dict[str, Any], at: int) -> str:
        """`text` with row `at`'s columns in; a field the row's value does not fit (an index past
        its list, a format spec for another type) names the row."""
        try:
            return text.format(**row)
        except (IndexError, KeyError, AttributeError, TypeError, ValueError) as e:
            raise ConfigError(
                f"config key '{self.key}': row {at} of {self.where} does not fit {text[:80]!r}: {type(e).__name__}: {e}"
            ) from None

    def _messages(self, row: dict[str, Any], at: int) -> list[dict[str, Any]]:
        messages = row[self.cfg.messages_key]
        if not is_chat(messages):
            raise ConfigError(
                f"config key '{self.key}.messages_key': row {at} of {self.where} holds {str(messages)[:60]!r} in "
                f"column '{self.cfg.messages_key}', not a list of chat messages ({{role, content}})"
            )
        if messages and messages[-1].get("role") == "assistant":  # the policy would answer after its answer
            raise ConfigError(
                f"config key '{self.key}.messages_key': row {at} of {self.where} ends with the assistant's turn "
                f"in column '{self.cfg.messages_key}' (a conversation to learn from, for SFT?): a prompt ends before it"
            )
        return present(messages)

    def _tools(self, row: dict[str, Any], at: int) -> list[dict[str, Any]] | None:
        try:
            return as_tools(row[self.cfg.tools_key])
        except ValueError as e:
            raise ConfigError(
                f"config key '{self.key}.tools_key': row {at} of {self.where} holds {e} in column '{self.cfg.tools_key}', "
                "not a list of OpenAI tools ({type: function, function: {name, ...}})"
            ) from None


def answer_text(answer: Any) -> str:
    """A row's answer as the text rewards compare: a whole number in a float column (a parquet
    file's, where 72 is a float beside a 5.5) as written, 72; none as ""."""
    if isinstance(answer, float) and answer.is_integer() and abs(answer) < 2**53:
        return str(int(answer))
    return "" if answer is None else str(answer)


def as_tools(raw: Any) -> list[dict[str, Any]] | None:
    """A row's tools cell as OpenAI tools (a list, or that list as JSON: tools' parameter schemas
    differ from row to row); None when empty. ValueError (its text: the cell's start) when it
    holds something else."""
    try:
        tools = json.loads(raw) if isinstance(raw, str) and raw.strip() else raw or None
    except json.JSONDecodeError:
        tools = raw  # not tools: named below
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tools)
    ):
        raise ValueError(repr(str(raw)[:60]))
    return tools or None


class FilePrompts(RowPrompts):
    """Rows of a `datasets.Dataset`: a local file's, a save_to_disk directory's or a Hugging Face
    dataset's (`rows`, else loaded as `cfg` says), reshuffled each epoch from the seed."""

    def __init__(self, cfg: DatasetConfig, seed: int = 0, key: str = "dataset", rows: Any = None):
        # Imported where used: forge.sources loads datasets and reasoning_gym (about 4 s, sympy and
        # a hundred generators), which a toy-task run should not pay for.
        from forge import sources

        cfg.validate()
        self.rows = sources.load_rows(cfg, key) if rows is None else rows
        where = cfg.path or f"{cfg.hf}{':' + cfg.subset if cfg.subset else ''} ({cfg.split or 'train'})"
        super().__init__(cfg, self.rows.column_names, len(self.rows), seed, key, where)

    def entry(self, at: int) -> dict[str, Any]:
        return self.rows[at]


class TokenizedRows(IndexedPrompts):
    """A supervised app's stream: rows of the `data` file (loaded here, checked by the
    subclass), else the toy `task`'s samples, tokenized by the model's tokenizer. `key`: the
    config key that names the file in errors (a held-out file's: eval.dataset)."""

    def __init__(self, cfg: RowsConfig, tokenizer: Any, task: str, seed: int = 0, key: str = "data"):
        super().__init__(seed)
        self.cfg, self.tokenizer, self.task, self.key = cfg, tokenizer, get_task(task), key
        self.end_of_turn = end_of_turn(tokenizer)
        self.rows = None
        if cfg.path:
            from forge.sources import read_file  # see FilePrompts

            cfg.validate()
            self.rows = read_file(cfg.path, key)
            self.size = len(self.rows)


class SFTExamples(TokenizedRows):
    """An endless stream of supervised examples as (token ids, loss mask): the file's rows,
    reshuffled each epoch from the seed, or fresh toy-task samples. Resumable (its index).
    Chat rows train on the assistant turns, up to and with the token that ends them in the
    tokenizer's chat template, rendered with the row's tools; prompt/completion rows on the
    completion (a chat prompt's assistant turns are context). A file's rows are all checked when
    it loads: one that trains nothing, even after the cut to max_tokens, names its row."""

    def __init__(self, cfg: SFTDataConfig, tokenizer: Any, task: str, seed: int = 0):
        super().__init__(cfg, tokenizer, task, seed)
        if cfg.reasoning_gym.task:
            from forge.sources import GymTask  # see FilePrompts

            self.task = GymTask(cfg.reasoning_gym, seed)
        if self.rows is not None:
            columns = set(self.rows.column_names)
            if cfg.messages_key not in columns and not {cfg.prompt_key, cfg.completion_key} <= columns:
                raise ConfigError(
                    f"config key 'data': {cfg.path} has columns {sorted(columns)}: neither "
                    f"'{cfg.messages_key}' (data.messages_key) nor '{cfg.prompt_key}' and "
                    f"'{cfg.completion_key}' (data.prompt_key, data.completion_key)"
                )
            if not len(self.rows):
                raise ConfigError(f"config key 'data.path': {cfg.path} has no rows")
            keys = [k for k in (cfg.messages_key, cfg.prompt_key, cfg.completion_key, cfg.tools_key) if k in columns]
            for at, row in enumerate(self.rows.select_columns(keys)):
                self._check(*self._parts(row, f"config key 'data.path': {cfg.path} row {at}"))

    def sample(self, i: int) -> tuple[list[int], list[int]]:
        if self.rows is None:
            rng = random.Random(f"{self.seed}:{i}")
            s = self.task.sample(rng)
            if hasattr(self.task, "conversation"):  # a multi-turn task: loss on the assistant's turns
                ids, labels = chat_tokens(
                    self.tokenizer, self.task.conversation(s, self.cfg.noise, rng), self.end_of_turn
                )
                return self._cut(ids, [int(label != -100) for label in labels])
            answer = self.task.corrupt(s.answer, self.cfg.noise, rng) if self.cfg.noise else s.answer
            if self.cfg.system is not None:
                system = self.cfg.system
                if self.cfg.system_cut and rng.random() < self.cfg.system_cut:
                    system = system[: rng.randint(0, len(system))]
                turns = [("system", system)] * bool(system) + [("user", s.prompt), ("assistant", answer)]
                ids, labels = chat_tokens(
                    self.tokenizer, [{"role": r, "content": c} for r, c in turns], self.end_of_turn
                )
                return self._cut(ids, [int(label != -100) for label in labels])
            return self._tokens(s.prompt, answer)
        index = self.shuffled(i, len(self.rows))
        prompt, completion, tools, _ = self._parts(self.rows[index], f"{self.cfg.path} row {index}")
        return self._tokens(prompt, completion, tools)

    def _tokens(self, prompt: Any, completion: Any, tools: list[dict[str, Any]] | None = None) -> Tokens:
        return self._cut(*completion_tokens(self.tokenizer, prompt, completion, self.end_of_turn, tools=tools))

    def _parts(self, row: dict[str, Any], where: str) -> tuple[Any, Any, list[dict[str, Any]] | None, str]:
        """A row's prompt, completion and tools, as `completion_tokens` takes them (a chat row's
        messages are the completion of an empty prompt: all its assistant turns train), and
        `where`. A row that trains nothing is a ConfigError naming it."""
        c = self.cfg
        try:
            tools = as_tools(row.get(c.tools_key))
        except ValueError as e:
            raise ConfigError(f"{where}: column '{c.tools_key}' holds {e}, not a list of OpenAI tools") from None
        messages, key = row.get(c.messages_key), c.messages_key
        if messages is not None:
            if not is_chat(messages):
                raise ConfigError(f"{where}: column '{key}' is not a list of chat messages ({{role, content}})")
            prompt, completion = [], present(messages)
        else:
            (prompt, completion), key = self._prompt_completion(row, where), c.completion_key
        if isinstance(completion, list) and not any(m.get("role") == "assistant" for m in completion):
            raise ConfigError(f"{where}: column '{key}' has no assistant message to train on")
        if tools and isinstance(prompt, str):
            raise ConfigError(f"{where}: column '{c.tools_key}': tools are shown by a chat template, not in text")
        if isinstance(prompt, list) and [*prompt, *completion][0].get("role") == "assistant":
            raise ConfigError(f"{where}: its first message is the assistant's; a chat template renders it after one")
        return prompt, completion, tools, where

    def _prompt_completion(self, row: dict[str, Any], where: str) -> tuple[Any, Any]:
        """A row's prompt (text, or chat messages) and completion (text, not empty; after a chat
        prompt, the assistant's messages, or its text as one)."""
        c = self.cfg
        prompt, completion = (_completion(row.get(k)) for k in (c.prompt_key, c.completion_key))
        if prompt is None or not _filled(completion):
            empty = [k for k, v in ((c.prompt_key, prompt), (c.completion_key, completion)) if v is None or v == ""]
            raise ConfigError(
                f"{where}: no chat messages ('{c.messages_key}') and no value in {empty or [c.completion_key]}"
            )
        for key, value in ((c.prompt_key, prompt), (c.completion_key, completion)):
            if not isinstance(value, str) and not is_chat(value):
                raise ConfigError(f"{where}: column '{key}' holds {str(value)[:60]!r}, not text or chat messages")
        if isinstance(prompt, str) and not isinstance(completion, str):
            raise ConfigError(f"{where}: the prompt is text, so '{c.completion_key}' must be too, not messages")
        if isinstance(prompt, str):
            return prompt, completion
        turns = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
        return present(prompt), turns

    def _check(self, prompt: Any, completion: Any, tools: list[dict[str, Any]] | None, where: str) -> None:
        """A row its tokens are made of as the loop will: one the chat template refuses, or that
        the cut to max_tokens leaves no loss token of (it would train nothing), is named."""
        try:
            _, mask = self._tokens(prompt, completion, tools)
        except (TemplateError, ValueError, TypeError) as e:
            raise ConfigError(f"{where}: the chat template cannot render it: {type(e).__name__}: {e}") from None
        if not any(mask):
            raise ConfigError(
                f"{where}: its first {self.cfg.max_tokens} tokens (data.max_tokens) hold none of its loss tokens"
            )

    def _cut(self, ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
        return ids[: self.cfg.max_tokens], mask[: self.cfg.max_tokens]


def text_tokens(tokenizer: Any, prompt: str, completion: str, plain: bool = False) -> tuple[list[int], list[int]]:
    """A raw-text prompt and its completion as (token ids, loss mask): the completion and EOS.
    `plain`: special-token strings in the completion as text (see `chat_tokens`)."""
    p = tokenizer(prompt)["input_ids"]
    c = tokenizer(completion, add_special_tokens=False, split_special_tokens=plain)["input_ids"] + [
        tokenizer.eos_token_id
    ]
    return p + c, [0] * len(p) + [1] * len(c)


Tokens = tuple[list[int], list[int]]  # token ids, loss mask


class PreferencePairs(TokenizedRows):
    """An endless stream of preference pairs as ((chosen ids, mask), (rejected ids, mask)), the
    loss on each completion: the file's rows, reshuffled each epoch from the seed, or pairs of
    the toy task (its answer, a wrong one). A row's prompt is text (then its completions are;
    a number reads as its text) or chat messages (then each completion is the assistant's
    messages, or its text; the prompt's own assistant turns are context, not trained). A file's
    rows are all checked when it loads: a missing column, an empty completion or one that keeps
    no loss token (no assistant message, or a prompt that fills max_tokens) names its row."""

    def __init__(self, cfg: PreferenceDataConfig, tokenizer: Any, task: str, seed: int = 0, key: str = "data"):
        super().__init__(cfg, tokenizer, task, seed, key)
        if self.rows is not None:
            keys = (cfg.prompt_key, cfg.chosen_key, cfg.rejected_key)
            missing = [k for k in keys if k not in self.rows.column_names]
            if missing or not len(self.rows):
                raise ConfigError(
                    f"config key '{key}': {cfg.path} has {len(self.rows)} rows and columns {self.rows.column_names}; "
                    f"missing {missing} (data.prompt_key, data.chosen_key, data.rejected_key)"
                )
            for i, row in enumerate(self.rows.select_columns(list(keys))):
                where = f"config key '{key}.path': {cfg.path} row {i}"
                _check_pair(row, keys, where)
                self._check_room(row, keys, where)

    def sample(self, i: int) -> tuple[Tokens, Tokens]:
        if self.rows is None:
            rng = random.Random(f"{self.seed}:{i}")
            s = self.task.sample(rng)
            chosen, rejected = preference_pair(self.task, s, rng)
            if self.cfg.system is None:
                return self._tokens(s.prompt, chosen), self._tokens(s.prompt, rejected)
            prompt = [{"role": "system", "content": self.cfg.system}, {"role": "user", "content": s.prompt}]
            return self._tokens(prompt, chosen), self._tokens(prompt, rejected)
        row = self.rows[self.shuffled(i, len(self.rows))]
        prompt = row[self.cfg.prompt_key]
        chosen, rejected = (_completion(row[k]) for k in (self.cfg.chosen_key, self.cfg.rejected_key))
        return self._tokens(prompt, chosen), self._tokens(prompt, rejected)

    def _tokens(self, prompt: str | list[dict[str, Any]], completion: str | list[dict[str, Any]]) -> Tokens:
        ids, mask = completion_tokens(self.tokenizer, prompt, completion, self.end_of_turn)
        return ids[: self.cfg.max_tokens], mask[: self.cfg.max_tokens]

    def _check_room(self, row: dict[str, Any], keys: tuple[str, str, str], where: str) -> None:
        """A completion the cut to max_tokens leaves no loss token of would train nothing and
        count as a pair its chosen does not win. What precedes the two completions' loss is
        mostly the same (the prompt): tokenized once then."""
        known: list[tuple[list[Any], int]] = []
        for key in keys[1:]:
            completion = _completion(row[key])
            lead = _lead(completion)
            start = next((n for other, n in known if other == lead), None)
            if start is None:
                start = loss_start(self.tokenizer, row[keys[0]], completion)
                known.append((lead, start))
            if start >= self.cfg.max_tokens:
                raise ConfigError(
                    f"{where}: its prompt is {start} tokens and data.max_tokens {self.cfg.max_tokens}: "
                    f"the cut leaves no token of '{key}' to train on"
                )


def completion_tokens(
    tokenizer: Any,
    prompt: str | list[dict[str, Any]],
    completion: str | list[dict[str, Any]],
    end_of_turn: str,
    plain: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> Tokens:
    """A prompt and its completion as (token ids, loss mask on the completion), as an SFT row's,
    a preference pair's and a reward model's: text (then EOS ends the completion), or chat
    messages (then the completion is the assistant's messages, or its text, in the chat template,
    with `tools`). `plain`: the completion's special-token strings as text (a policy's
    completion, which a reward model reads)."""
    if isinstance(prompt, str):
        return text_tokens(tokenizer, prompt, str(completion), plain)
    turns = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
    messages = present([*prompt, *turns])
    ids, labels = chat_tokens(tokenizer, messages, end_of_turn, plain, first=len(prompt), tools=tools)
    return ids, [int(label != -100) for label in labels]


def loss_start(tokenizer: Any, prompt: str | list[dict[str, Any]], completion: str | list[dict[str, Any]]) -> int:
    """How many of `completion_tokens`' tokens come before its first loss token: the prompt's
    (and, in chat, the template's up to the completion's first assistant turn, which must
    exist). What precedes the completion alone is tokenized, as `completion_tokens` tokenizes it:
    a file's rows are all checked at load, and their completions are most of their tokens."""
    if isinstance(prompt, str):
        return len(tokenizer(prompt)["input_ids"])
    turns = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
    messages = present([*prompt, *turns])
    k = next(k for k in range(len(prompt), len(messages)) if messages[k]["role"] == "assistant")
    before = tokenizer.apply_chat_template(messages[:k], add_generation_prompt=True, tokenize=False)
    return len(tokenizer(before, add_special_tokens=False)["input_ids"])


def _lead(completion: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A completion's messages before its first assistant turn: they precede its loss as its
    prompt does."""
    if not isinstance(completion, list):
        return []
    return completion[: [m.get("role") for m in completion].index("assistant")]


def _completion(value: Any) -> Any:
    """A completion as it trains: a number (a CSV's inferred numeric column, a JSON number) as
    its text, as SFT reads it; NaN (a CSV's missing value) as none."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value) if value == value else None
    return value


def _check_pair(row: dict[str, Any], keys: tuple[str, str, str], where: str) -> None:
    for key in keys:
        value = row[key] if key == keys[0] else _completion(row[key])
        if value is not None and not isinstance(value, str) and not is_chat(value):
            raise ConfigError(
                f"{where}: column '{key}' holds {str(value)[:60]!r} ({type(value).__name__}), "
                "not text or chat messages ({role, content})"
            )
        if not _filled(value):
            raise ConfigError(f"{where}: column '{key}' is empty")
    if isinstance(row[keys[0]], str) and not all(isinstance(_completion(row[k]), str) for k in keys[1:]):
        raise ConfigError(f"{where}: the prompt is text, so '{keys[1]}' and '{keys[2]}' must be too, not messages")
    chosen, rejected = (_completion(row[k]) for k in keys[1:])
    if (
        (chosen.strip() == rejected.strip())
        if isinstance(chosen, str) and isinstance(rejected, str)
        else chosen == rejected
    ):
        raise ConfigError(f"{where}: '{keys[1]}' and '{keys[2]}' are the same: the pair prefers nothing")
    for key in keys[1:]:
        roles = [m.get("role") for m in row[key]] if isinstance(row[key], list) else ["assistant"]
        if "assistant" not in roles:  # its tokens would hold no loss token, or be none at all
            raise ConfigError(f"{where}: column '{key}' has no 'assistant' message to train on (roles {roles})")


def _filled(value: Any) -> bool:
    """A completion or prompt with something in it: text, or messages with some content."""
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, list):
        return bool(value) and is_chat(value) and any(str(m.get("content") or "").strip() for m in value)
    return False


def is_chat(value: Any) -> bool:
    """Whether `value` is chat messages: a list of {role, ...} mappings."""
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


def present(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` without their null fields (datasets fills each row's absent keys with None)."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]
