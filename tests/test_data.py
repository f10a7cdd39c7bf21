"""Prompt streams: generated toy tasks, local dataset files and save_to_disk directories, Hugging
Face datasets by name, reasoning-gym generators; all resumable, and each bad key named."""

import json
import re

import pytest

from forge import sources
from forge.config import ConfigError
from forge.data import FilePrompts, TaskPrompts, prompt_source
from forge.schema import DatasetConfig, ReasoningGymConfig
from forge.sources import ReasoningGymPrompts


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


def test_a_bad_row_costs_its_own_sample_and_a_null_prompt_column_is_named(tmp_path):
    """A row whose prompt column is null is a ConfigError naming its row and column (never the
    prompt "None"); the stream has moved past it, so a retry takes the next row, not it again."""
    rows = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(4)] + [{"question": None, "answer": "7"}]
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    node = FilePrompts(DatasetConfig(path=str(path), template="{question}"))
    node.reset()
    prompts, errors = [], []
    for _ in range(10):  # two epochs
        try:
            prompts.append(next(node).prompt)
        except ConfigError as e:
            errors.append(str(e))
    assert sorted(prompts) == sorted([f"{i}+1=" for i in range(4)] * 2) and node.index == 10
    assert len(errors) == 2 and all("row 4 of" in e and "column(s) ['question']" in e for e in errors)


@pytest.mark.parametrize(
    "text, why",
    [("", "is empty"), ('{"question": "1+1=", "answer": "2"}\n{"answer": "4"}\n', "cannot read it as json")],
)
def test_a_file_datasets_cannot_read_is_a_config_error_naming_the_key_and_file(tmp_path, text, why):
    """An empty file, or JSON lines whose rows lack a key others have: `datasets` raises
    StopIteration or KeyError there, which forge names."""
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"config key 'eval.dataset.path': {path}.*{why}"):
        FilePrompts(DatasetConfig(path=str(path)), key="eval.dataset")


def test_json_lines_integer_answers_beside_a_fractional_one_keep_their_text(tmp_path):
    """The reader makes a column of integers and one 5.5 all floats: 72 stays "72" (the `exact`
    reward compares text), not "72.0"."""
    path = tmp_path / "q.jsonl"
    rows = [{"question": "a", "answer": 72}, {"question": "b", "answer": 5.5}, {"question": "c", "answer": -3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    node = FilePrompts(DatasetConfig(path=str(path)))
    node.reset()
    assert dict((s.prompt, s.answer) for s in (next(node) for _ in range(3))) == {"a": "72", "b": "5.5", "c": "-3"}


def test_a_csv_files_cells_are_read_as_written(tmp_path):
    """A CSV cell is its text: "02134" keeps its zero, an integer column with an empty cell does
    not read "3" as "3.0", and "NA" (sodium) is text; only an empty cell has no value."""
    path = tmp_path / "q.csv"
    path.write_text("question,answer\nzip of Boston?,02134\nhalf of 6?,3\nsymbol of sodium?,NA\nno answer?,\n")
    node = FilePrompts(DatasetConfig(path=str(path), template="{question}"))
    node.reset()
    got = dict((s.prompt, s.answer) for s in (next(node) for _ in range(4)))
    assert got == {"zip of Boston?": "02134", "half of 6?": "3", "symbol of sodium?": "NA", "no answer?": ""}


@pytest.mark.parametrize(
    "line, why",
    [
        (b"\n", "line 4 is blank"),
        (b'{"question": "x", answer: 3}\n', "line 4, column 19: Expecting property name"),
        (b'{"question": "\xff\xfe", "answer": "3"}\n', "line 4: not UTF-8"),
        (b'{"question": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "line 4: nested too deep"),
        (b'["x", "3"]\n', "line 4: a list, not an object of columns"),
        (b'\xef\xbb\xbf{"question": "x", "answer": "3"}\n', "line 4 starts with a byte order mark"),
        (
            b'{"question": "x", "answer": 18446744073709551616}\n',
            "line 4: 18446744073709551616 is past 64-bit integers",
        ),
    ],
)
def test_a_json_lines_error_names_the_line(tmp_path, line, why):
    """A bad line among many: the error names the file and the line (and column), not only
    an offset in a block of the reader's."""
    good = b'{"question": "1+1=", "answer": "2"}\n'
    path = tmp_path / "bad.jsonl"
    path.write_bytes(good * 3 + line + good)
    with pytest.raises(ConfigError, match=f"config key 'dataset.path': {path}: cannot read it as json") as e:
        FilePrompts(DatasetConfig(path=str(path)))
    assert why in str(e.value)


def test_a_json_column_of_decimal_numbers_is_read_as_written(tmp_path):
    """Arrow reads a column of numbers as float64 when one is a decimal or past int64: 72 would be
    "72.0" in a prompt and a completion, 0.00001 "1e-05" and 1.50 "1.5" as an answer the `exact`
    reward compares, and an integer past 2**53 rounded (18446744073709551615 as
    1.8446744073709552e19). Such a column is the text written, as a CSV's cells are."""
    path = tmp_path / "q.jsonl"
    rows = [[72, 3, "0.00001"], [5.5, 1, "1.50"], [2**64 - 1, 2, "2"], [9007199254740993, 0.5, "-0.0"]]
    lines = [f'{{"question": "What is {a} plus {{b}}?", "a": {a}, "b": {b}, "answer": {c}}}' for a, b, c in rows]
    path.write_text("".join(line.replace("{b}", str(b)) + "\n" for line, (_, b, _) in zip(lines, rows)))
    node = FilePrompts(DatasetConfig(path=str(path), template="{a} plus {b}?"))
    got = [(s.prompt, s.answer) for s in (node.sample(i) for i in range(4))]
    want = [("72 plus 3?", "0.00001"), ("5.5 plus 1?", "1.50"), (f"{2**64 - 1} plus 2?", "2")]
    want.append(("9007199254740993 plus 0.5?", "-0.0"))
    assert sorted(got) == sorted(want)
    path = tmp_path / "big.json"  # one JSON document, a list of rows
    path.write_text(json.dumps([{"question": "q", "answer": 0.5}, {"question": "q", "answer": 2**64 - 1}]))
    assert FilePrompts(DatasetConfig(path=str(path))).rows["answer"] == ["0.5", str(2**64 - 1)]
    path.write_text(json.dumps({"question": "q", "answer": 0.5, "id": 2**62}) + "\n")  # int64: a number, exact
    assert FilePrompts(DatasetConfig(path=str(path))).rows["id"] == [2**62]


@pytest.mark.parametrize(
    "line, why",
    [
        (b"caf\xe9,3\n", "line 5: not UTF-8"),  # Latin-1, as a spreadsheet may save it
        (b"x,3,4\n", "line 5"),  # a field more than the header names
    ],
)
def test_a_csv_error_names_the_line(tmp_path, line, why):
    """A bad line among many in a CSV: the error names the file and the line, not only that
    `datasets` failed to generate the dataset."""
    path = tmp_path / "bad.csv"
    path.write_bytes(b"question,answer\n" + b"1+1=,2\n" * 3 + line + b"2+2=,4\n")
    with pytest.raises(ConfigError, match=f"config key 'dataset.path': {path}: cannot read it as csv") as e:
        FilePrompts(DatasetConfig(path=str(path)))
    assert why in str(e.value)


@pytest.mark.parametrize(
    "text, why",
    [
        (
            "question,answer\nWhat is 1,000 plus 2?,1002\nWhat is 5 plus 5?,10\n",
            "line 2 has 3 fields where its header names 2",
        ),
        ("question,answer\n2+2=,4\n3+3=\n", "line 3 has 1 fields where its header names 2"),
        ("question,answer,\n2+2=,4,\n", "its header's column 3 has no name"),
        ("question,answer,answer\n2+2=,4,5\n", "its header names column 'answer' twice"),
    ],
)
def test_a_csv_whose_rows_do_not_fit_its_header_is_an_error_not_shifted_columns(tmp_path, text, why):
    """Rows a field longer than the header (a comma left unquoted in every question) would be read
    with their first field as an index, every column one to the right; a short row's last cells
    as no value; an unnamed or repeated column renamed: each names its line or the header."""
    path = tmp_path / "q.csv"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"config key 'dataset.path': {path}: cannot read it as csv") as e:
        FilePrompts(DatasetConfig(path=str(path), template="{question}"))
    assert why in str(e.value)


def test_a_csv_whose_header_has_a_huge_cell_is_a_config_error(tmp_path):
    """A CSV without a header row reads its first row as one: a cell over the csv module's field
    limit there is an error naming the file, not a bare csv.Error."""
    path = tmp_path / "long.csv"
    path.write_text("x" * 200_000 + ",1\nq,2\n")
    with pytest.raises(ConfigError, match=f"config key 'dataset.path': {path}: cannot read it as csv"):
        FilePrompts(DatasetConfig(path=str(path)))


def test_a_csv_of_only_its_header_has_no_rows(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("question,answer\n")
    with pytest.raises(ConfigError, match=f"config key 'dataset.path': {path}: .*no rows below its header"):
        FilePrompts(DatasetConfig(path=str(path)))


@pytest.mark.parametrize(
    "keys", [{"template": "{tests[0]}"}, {"chat": [{"role": "user", "content": "Pass {tests[0]}"}]}]
)
def test_a_row_the_template_cannot_format_is_an_error_naming_the_row(tmp_path, keys):
    """A template that indexes a column fails on a row whose list is empty as an error naming the
    row, not a bare IndexError."""
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"tests": t, "answer": "1"}) + "\n" for t in (["a"], [])))
    node = FilePrompts(DatasetConfig(path=str(path), **keys))
    node.reset()
    errors = []
    for _ in range(2):
        try:
            next(node)
        except ConfigError as e:
            errors.append(str(e))
    assert len(errors) == 1 and f"row 1 of {path}" in errors[0] and "{tests[0]}" in errors[0], errors


@pytest.mark.parametrize("keys", [{"template": "Solve: {}"}, {"chat": [{"role": "user", "content": "{question} {}"}]}])
def test_a_template_field_that_names_no_column_fails_when_the_source_loads(tmp_path, keys):
    """`{}` formats no column of any row: an error before the run, not at every draw."""
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(ConfigError, match="config key 'dataset': .*a field `{}` that names no column"):
        FilePrompts(DatasetConfig(path=str(path), **keys))


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
    # A conversation that ends with the assistant's turn (an SFT file: its answer in the prompt)
    done = tmp_path / "done.jsonl"
    turns = [{"role": "user", "content": "6 times 7?"}, {"role": "assistant", "content": "42"}]
    done.write_text(json.dumps({"prompt": turns, "answer": "42"}) + "\n")
    with pytest.raises(ConfigError, match="row 0 of .*done.jsonl ends with the assistant's turn"):
        FilePrompts(DatasetConfig(path=str(done), messages_key="prompt"))


@pytest.mark.parametrize(
    "out, n, error",
    [("toy.parquet", 5, "--out .*toy.parquet: make-dataset writes JSON lines"), ("toy.jsonl", 0, "-n: .* got 0")],
)
def test_make_dataset_refuses_a_file_it_would_not_write_as_named(tmp_path, capsys, out, n, error):
    """JSON lines only (a .parquet or .csv name would be misread where it is used), one row at least."""
    from forge.cli import main

    with pytest.raises(SystemExit):
        main(["make-dataset", "--out", str(tmp_path / out), "-n", str(n)])
    assert re.search(error, capsys.readouterr().err) and not (tmp_path / out).exists()


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


def resumes(node, k: int = 3, more: int = 4) -> list:
    """The `more` samples after the first `k`, read again by a fresh stream that loads the state
    the first one had after `k` (as a resumed run's does from its checkpoint)."""
    node.reset()
    for _ in range(k):
        next(node)
    state = node.get_state()
    after = [next(node) for _ in range(more)]
    fresh = prompt_source(node.cfg, "reverse", node.seed)
    fresh.load_state_dict(state)
    assert [next(fresh) for _ in range(more)] == after
    return after


def qa(n: int, offset: int = 0) -> dict:
    return {"question": [f"q{i + offset}" for i in range(n)], "answer": [str(i + offset) for i in range(n)]}


def test_save_to_disk_directories(tmp_path):
    """`dataset.path` may be a `save_to_disk` directory: one dataset, or splits (`dataset.split`,
    default train); the sample's `task` is the directory's name; a missing split names the
    splits there are."""
    import datasets

    datasets.Dataset.from_dict(qa(4)).save_to_disk(tmp_path / "plain")
    node = FilePrompts(DatasetConfig(path=str(tmp_path / "plain"), template="Q: {question}"), seed=2)
    assert sorted(s.prompt for s in resumes(node, k=4, more=4)) == [f"Q: q{i}" for i in range(4)]
    assert node.sample(0).task == "plain" and node.size == 4
    split = datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict(qa(3)), "test": datasets.Dataset.from_dict(qa(2, 10))}
    )
    split.save_to_disk(tmp_path / "gsm")
    assert len(FilePrompts(DatasetConfig(path=str(tmp_path / "gsm"))).rows) == 3  # train
    test = FilePrompts(DatasetConfig(path=str(tmp_path / "gsm"), split="test"))
    assert sorted(test.sample(i).answer for i in range(2)) == ["10", "11"]
    with pytest.raises(
        ConfigError, match=r"config key 'dataset.split': .*gsm has no split 'validation'; its splits: train, test"
    ):
        FilePrompts(DatasetConfig(path=str(tmp_path / "gsm"), split="validation"))
    with pytest.raises(ConfigError, match="config key 'dataset.split': .*plain is one dataset without splits"):
        FilePrompts(DatasetConfig(path=str(tmp_path / "plain"), split="test"))
    with pytest.raises(ConfigError, match="config key 'dataset.path': no such file or directory"):
        DatasetConfig(path=str(tmp_path / "nope")).validate()
    with pytest.raises(ConfigError, match="config key 'dataset.split': a split of a Hugging Face dataset"):
        DatasetConfig(path=str(gsm8k_like(tmp_path / "t.jsonl")), split="test").validate()


@pytest.fixture
def offline(monkeypatch):
    """No hub: `datasets` and huggingface_hub as with HF_HUB_OFFLINE=1 (read at their import)."""
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_hugging_face_dataset_by_name(tmp_path, offline):
    """`dataset.hf`: whatever `datasets.load_dataset` loads by name, offline here (a local
    dataset directory of split files stands in for the hub's cache), its `split`; the prompt
    keys work on its rows as on a file's; a missing split names those there are, a name that
    does not load names the key."""
    repo = tmp_path / "hub" / "gsm_tiny"
    repo.mkdir(parents=True)
    for split, rows in (("train", qa(5)), ("test", qa(3, 100))):
        lines = [json.dumps({"question": q, "answer": a}) for q, a in zip(rows["question"], rows["answer"])]
        (repo / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    chat = [{"role": "user", "content": "{question}?"}]
    cfg = DatasetConfig(hf=str(repo), split="test", chat=chat)
    node = prompt_source(cfg, "reverse", seed=1)
    got = resumes(node, k=1, more=2)
    assert {s.prompt[0]["content"] for s in got} <= {"q100?", "q101?", "q102?"} and got[0].task == "gsm_tiny"
    assert len(prompt_source(DatasetConfig(hf=str(repo)), "reverse").rows) == 5  # train by default
    with pytest.raises(
        ConfigError, match=r"config key 'dataset.split': .*gsm_tiny has no split 'validation'; its splits: "
    ):
        prompt_source(DatasetConfig(hf=str(repo), split="validation"), "reverse")
    with pytest.raises(ConfigError, match=r"config key 'dataset': .*missing \['problem'\]"):
        prompt_source(DatasetConfig(hf=str(repo), template="{problem}"), "reverse")
    with pytest.raises(ConfigError, match="config key 'dataset.hf': cannot load 'nobody-here/no-such-dataset'"):
        prompt_source(DatasetConfig(hf="nobody-here/no-such-dataset"), "reverse")
    with pytest.raises(ConfigError, match="config key 'dataset.subset': a Hugging Face dataset's config name"):
        DatasetConfig(path=str(gsm8k_like(tmp_path / "t.jsonl")), subset="main").validate()


ARITHMETIC = ReasoningGymConfig(  # configs/grpo_rg_tiny.yaml's: "Calculate 12 + 7." -> "19"
    task="basic_arithmetic",
    config={
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 2,
        "operators": ["+"],
        "allow_parentheses": False,
        "allow_negation": False,
    },
)


def test_reasoning_gym_endless_is_one_unbounded_generator(monkeypatch):
    """`dataset.reasoning_gym` without a size: endless, entry i from (seed, i) alone: in chunks
    that together are reasoning-gym's own generator (of the seed's gym_seed), so a resumed
    stream (its index) goes on with the same prompts; another seed's stream is another, not
    the same shifted. Samples carry the task's name and the entry."""
    import reasoning_gym

    monkeypatch.setattr(sources, "GYM_CHUNK", 4)  # chunk boundaries at 4 and 8
    node = prompt_source(DatasetConfig(reasoning_gym=ARITHMETIC), "reverse", seed=3)
    assert isinstance(node, ReasoningGymPrompts) and node.size is None
    got = [node.sample(i) for i in range(10)]
    own = reasoning_gym.create_dataset("basic_arithmetic", **ARITHMETIC.config, seed=sources.gym_seed(3), size=10)
    assert [(s.prompt, s.answer) for s in got] == [(own[i]["question"], own[i]["answer"]) for i in range(10)]
    assert got[0].task == "basic_arithmetic" and got[0].prompt.startswith("Calculate ")
    assert got[0].meta["reasoning_gym"] == {"task": "basic_arithmetic", "config": ARITHMETIC.config}
    assert got[0].meta["metadata"] == own[0]["metadata"]
    resumes(node, k=3, more=6)  # across a chunk boundary
    other = prompt_source(DatasetConfig(reasoning_gym=ARITHMETIC), "reverse", seed=4)
    theirs = [other.sample(i).prompt for i in range(10)]
    assert theirs != [s.prompt for s in got] and theirs[:9] != [s.prompt for s in got[1:]]  # not shifted by one


def test_reasoning_gym_sized_set_epochs_and_resume():
    """With `size`: that many entries, each once per epoch, reshuffled each epoch; resumable."""
    sized = ReasoningGymConfig(task=ARITHMETIC.task, config=ARITHMETIC.config, size=5)
    node = prompt_source(DatasetConfig(reasoning_gym=sized, template="{question} ="), "reverse", seed=1)
    assert node.size == 5
    node.reset()
    first = [next(node).prompt for _ in range(10)]
    assert sorted(first[:5]) == sorted(first[5:]) and first[:5] != first[5:]
    assert all(p.endswith(". =") for p in first)
    resumes(node, k=4, more=3)


@pytest.mark.parametrize(
    "gym, message",
    [
        (
            {"task": "spell_backwards"},
            "config key 'dataset.reasoning_gym.task': no reasoning-gym task 'spell_backwards'; close: spell_backward",
        ),
        (
            {"task": "basic_arithmetic", "config": {"min_term": 2}},
            "config key 'dataset.reasoning_gym.config.min_term': not a key of basic_arithmetic's generator "
            "(BasicArithmeticDatasetConfig); its keys: ",
        ),
        (
            {"task": "basic_arithmetic", "config": {"min_terms": 0}},
            "config key 'dataset.reasoning_gym.config': basic_arithmetic rejects {'min_terms': 0}: "
            "AssertionError: min_terms must be positive",
        ),
        (
            {"task": "basic_arithmetic", "config": {"seed": 1}},
            "config key 'dataset.reasoning_gym.config.seed': forge sets it",
        ),
        ({"task": "basic_arithmetic", "size": -1}, "config key 'dataset.reasoning_gym.size' must be >= 0"),
        ({"config": {"min_terms": 2}}, "config key 'dataset.reasoning_gym.task': name a reasoning-gym task"),
    ],
)
def test_reasoning_gym_errors_name_the_key(gym, message):
    with pytest.raises(ConfigError) as e:
        DatasetConfig(reasoning_gym=ReasoningGymConfig(**gym)).validate()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_one_source_and_its_columns(tmp_path):
    path = str(gsm8k_like(tmp_path / "t.jsonl"))
    with pytest.raises(ConfigError, match="config keys dataset.path, dataset.reasoning_gym.task: each is a source"):
        DatasetConfig(path=path, reasoning_gym=ARITHMETIC).validate()
    with pytest.raises(
        ConfigError, match=r"config key 'dataset': reasoning-gym task basic_arithmetic .*missing \['problem'\]"
    ):
        prompt_source(DatasetConfig(reasoning_gym=ARITHMETIC, template="{problem}"), "reverse")
    assert DatasetConfig(path=path).source_name == "t" and DatasetConfig(hf="openai/gsm8k").source_name == "gsm8k"
    assert DatasetConfig(reasoning_gym=ARITHMETIC).source_name == "basic_arithmetic" and not DatasetConfig().enabled


def test_grpo_config_checks_sources_and_evaluates_reasoning_gym_from_the_held_out_seed(tmp_path):
    """Loading a GRPO config loads its sources (a bad split or column fails before anything is
    spawned, naming its key, the eval's too); a reasoning-gym run evaluates on its generator
    from `eval.seed`, prompts the training stream does not start with."""
    from apps.grpo import Config
    from forge.config import load_config
    from services.evals import held_out

    gym = ["dataset.reasoning_gym.task=basic_arithmetic", "dataset.reasoning_gym.config={max_digits: 2}"]
    cfg = load_config("configs/grpo_tiny.yaml", [*gym, "eval.every=10", "eval.prompts=8"], Config)
    assert cfg.eval.dataset.reasoning_gym == cfg.dataset.reasoning_gym
    evals = held_out(cfg.eval, cfg.task)
    train = prompt_source(cfg.dataset, cfg.task, cfg.seed)
    assert len(evals) == 8 and evals[0].task == "basic_arithmetic"
    assert not {s.prompt for s in evals} & {train.sample(i).prompt for i in range(64)}
    with pytest.raises(ConfigError, match="config key 'dataset.reasoning_gym.task': no reasoning-gym task 'chain_sun'"):
        load_config("configs/grpo_tiny.yaml", ["dataset.reasoning_gym.task=chain_sun"], Config)
    with pytest.raises(ConfigError, match="config key 'eval.dataset.reasoning_gym.config.digits': not a key"):
        load_config(
            "configs/grpo_tiny.yaml",
            [*gym, "eval.dataset.reasoning_gym={task: chain_sum, config: {digits: 1}}"],
            Config,
        )
    rows = gsm8k_like(tmp_path / "train.jsonl")
    with pytest.raises(ConfigError, match=r"config key 'dataset': .*train.jsonl has 5 rows .*missing \['problem'\]"):
        load_config("configs/grpo_tiny.yaml", [f"dataset.path={rows}", "dataset.template='{problem}'"], Config)
    with pytest.raises(ConfigError, match=r"config key 'eval.dataset': .*missing \['problem'\]"):
        load_config(
            "configs/grpo_tiny.yaml",
            [f"dataset.path={rows}", "eval.every=5", f"eval.dataset.path={rows}", "eval.dataset.template='{problem}'"],
            Config,
        )


def test_sft_examples_from_a_reasoning_gym_generator():
    """`data.reasoning_gym` (the tiny model's warm start, `model.tiny.sft_reasoning_gym`): SFT
    examples are the generator's question, then its answer as the loss tokens, `noise` applied
    as to a toy task's; a bad generator key is named under `data`."""
    import re

    from forge.data import SFTExamples
    from forge.schema import SFTDataConfig
    from services.tiny_model import build_tokenizer

    tok = build_tokenizer()
    examples = SFTExamples(SFTDataConfig(reasoning_gym=ARITHMETIC), tok, "add", seed=0)
    for i in range(5):
        ids, mask = examples.sample(i)
        prompt = tok.decode([t for t, m in zip(ids, mask) if not m], skip_special_tokens=True)
        answer = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True)
        a, b = map(int, re.fullmatch(r"Calculate (\d+) \+ (\d+)\.", prompt).groups())
        assert answer == str(a + b)
    noisy = SFTExamples(SFTDataConfig(reasoning_gym=ARITHMETIC, noise=1.0), tok, "add", seed=0)
    assert [noisy.sample(i)[0] for i in range(8)] != [examples.sample(i)[0] for i in range(8)]
    bad = ReasoningGymConfig(task="basic_arithmetic", config={"terms": 2})
    with pytest.raises(ConfigError, match="config key 'data.reasoning_gym.config.terms': not a key"):
        SFTDataConfig(reasoning_gym=bad).validate()


def test_reasoning_gym_entry_the_generator_fails_on_is_replaced_by_the_next(monkeypatch):
    """A generator that raises on an entry (basic_arithmetic's default config divides by zero
    now and then) costs that entry, the next one in its place, not the run; always failing stops it."""
    real = sources.gym_generator

    class Flaky:
        def __init__(self, *args):
            self.inner = real(*args)

        def __getitem__(self, j):
            if j == 1:
                raise ZeroDivisionError("integer division or modulo by zero")
            return self.inner[j]

    monkeypatch.setattr(sources, "gym_generator", lambda *a: Flaky(*a))
    warned = []  # forge's logger, whatever earlier tests in this process did to logging
    monkeypatch.setattr(sources.log, "warning", lambda msg, *args: warned.append(msg % args))
    node = prompt_source(DatasetConfig(reasoning_gym=ARITHMETIC), "reverse", seed=0)
    assert node.sample(1) == node.sample(2) != node.sample(0)
    assert any("basic_arithmetic failed on entry 1 (ZeroDivisionError" in w for w in warned), warned

    class Broken(Flaky):  # past its first entry (which the config check makes)
        def __getitem__(self, j):
            if j:
                raise ValueError("no")
            return self.inner[j]

    monkeypatch.setattr(sources, "gym_generator", lambda *a: Broken(*a))
    with pytest.raises(RuntimeError, match="reasoning-gym basic_arithmetic: 20 entries in a row from 5 failed"):
        ReasoningGymPrompts(DatasetConfig(reasoning_gym=ARITHMETIC)).sample(5)


def test_a_template_field_that_names_a_column_of_lists_is_an_error(tmp_path):
    """A .json file of columns ({"question": [...], "answer": [...]}) reads as one row of lists:
    its prompt would be the Python text of the whole list. Refused when the source loads, and
    for a row drawn later whose cell is a list; an indexed field of a list column is taken."""
    path = tmp_path / "cols.json"
    path.write_text(json.dumps({"question": ["What is 0 plus 0?", "What is 1 plus 1?"], "answer": ["0", "2"]}))
    with pytest.raises(ConfigError, match=r"row 0 of .*cols.json holds a list in column 'question'.*\{question\[0\]\}"):
        FilePrompts(DatasetConfig(path=str(path), template="{question}"))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"q": ["a", "b"], "answer": "a"}) + "\n")
    assert FilePrompts(DatasetConfig(path=str(rows), template="say {q[0]}")).next().prompt == "say a"


def test_a_resume_on_a_file_whose_rows_changed_says_so(tmp_path, capsys):
    """A run resumed after its data file lost a row (the user removed a bad one): the epoch's
    order follows the row count, so it is another from there; said on the console."""
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(20)))
    node = FilePrompts(DatasetConfig(path=str(path)))
    node.reset()
    [next(node) for _ in range(7)]
    state = node.state_dict()
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(19)))
    FilePrompts(DatasetConfig(path=str(path))).reset(state)
    assert "has 19 rows, the checkpoint's had 20" in capsys.readouterr().out
    FilePrompts(DatasetConfig(path=str(tmp_path / "q.jsonl"))).reset({**state, "rows": 19})
    assert "rows" not in capsys.readouterr().out
