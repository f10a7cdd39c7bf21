"""Mixtures of prompt sources (`dataset.mix`): sampling by weight, live weight changes (the REPL's
`set_weights`, the watched `dataset.mix_file`), checkpoint round trips, config errors, and the
per-source metrics and evals."""

import asyncio
import json
import os
from collections import Counter

import pytest
import torch

from apps.grpo import Config, record_batch
from forge.config import ConfigError, load_config, to_yaml
from forge.data import TaskPrompts
from forge.metrics import _drain, reduce_states
from forge.mixture import Mixture, build_prompts, register, running, source_stream
from forge.schema import DatasetConfig, MixSource
from forge.types import Completion, Episode, RewardInput, Score
from services.evals import evaluate, held_out
from services.rewards import builtin
from services.schema import EvalConfig

CONFIG = "configs/grpo_mix_tiny.yaml"


def mixture(weights: dict[str, float], seed: int = 0, **kw) -> Mixture:
    sources = {name: MixSource(task=name, weight=w) for name, w in weights.items()}
    return Mixture({n: TaskPrompts(n, seed) for n in weights}, weights, seed, sources=sources, **kw)


def shares(node: Mixture, n: int) -> dict[str, float]:
    counts = Counter(next(node).task for _ in range(n))
    return {name: counts[name] / n for name in node.names}


def test_fixed_weights_give_their_shares_and_each_source_reads_its_own_stream():
    node = mixture({"reverse": 3.0, "sort": 1.0, "add": 0.0})
    drawn = [next(node) for _ in range(4000)]
    got = Counter(s.task for s in drawn)
    assert got["reverse"] / 4000 == pytest.approx(0.75, abs=0.03)
    assert got["sort"] / 4000 == pytest.approx(0.25, abs=0.03)
    assert got["add"] == 0  # weight 0: a paused source
    # Each source's prompts are, in order, what a run of that source alone reads.
    alone = TaskPrompts("sort", 0)
    assert [s.prompt for s in drawn if s.task == "sort"][:50] == [next(alone).prompt for _ in range(50)]
    assert all(s.prompt.startswith("sort ") for s in drawn if s.task == "sort")


def test_a_weight_change_takes_effect_at_once_and_is_logged():
    lines = []
    node = mixture({"reverse": 3.0, "sort": 1.0}, say=lines.append)
    shares(node, 100)
    assert node.set_weights({"sort": 3.0}, "the REPL")
    assert lines == ["forge: mix weights from the REPL: reverse=3, sort=3 (were reverse=3, sort=1) from draw 100"]
    assert shares(node, 4000)["sort"] == pytest.approx(0.5, abs=0.03)
    assert node.set_weights({"reverse": 0.0})
    assert shares(node, 200) == {"reverse": 0.0, "sort": 1.0}


@pytest.mark.parametrize(
    "weights, problem",
    [
        ({"sorted": 1.0}, "no source named 'sorted'; sources: reverse, sort"),
        ({"sort": -1.0}, "the weight of 'sort' must be a number >= 0, got -1.0"),
        ({"reverse": 0, "sort": 0}, "every weight is 0"),
        ({"sort": "lots"}, "the weight of 'sort' must be a number >= 0, got 'lots'"),
        ({"sort": float("nan")}, "the weight of 'sort' must be a number >= 0"),
        ([1, 2], "expected {name: weight} for sources reverse, sort"),
    ],
)
def test_a_bad_weight_is_refused_with_a_line_and_the_old_weights_stay(weights, problem):
    lines = []
    node = mixture({"reverse": 3.0, "sort": 1.0}, say=lines.append)
    assert not node.set_weights(weights, "the REPL")
    assert len(lines) == 1 and problem in lines[0]
    assert lines[0].startswith("forge: mix weights from the REPL refused: ")
    assert lines[0].endswith("the run keeps reverse=3, sort=1")
    assert node.weights == {"reverse": 3.0, "sort": 1.0}


def test_the_watched_file_is_read_when_it_changes_and_weights_are_recorded_each_step(tmp_path):
    lines, path = [], tmp_path / "mix.yaml"
    node = mixture({"reverse": 3.0, "sort": 1.0}, watch=path, say=lines.append)
    _drain()
    node.between_steps()  # no file yet: the config's weights
    assert lines == [] and reduce_states([_drain()]) == {"mix/weight/reverse": 3.0, "mix/weight/sort": 1.0}

    path.write_text("sort: 2\n")
    node.between_steps()
    assert node.weights == {"reverse": 3.0, "sort": 2.0} and lines[-1].startswith(f"forge: mix weights from {path}: ")
    assert reduce_states([_drain()]) == {"mix/weight/reverse": 3.0, "mix/weight/sort": 2.0}
    node.between_steps()  # unchanged file: not read again
    assert len(lines) == 1

    path.write_text(json.dumps({"reverse": -1}))  # JSON too; refused
    os.utime(path, ns=(1, 1))  # a new mtime, whatever the clock's resolution
    node.between_steps()
    assert "refused: the weight of 'reverse' must be a number >= 0, got -1" in lines[-1]
    assert node.weights == {"reverse": 3.0, "sort": 2.0}
    path.write_text("{sort: [")
    os.utime(path, ns=(2, 2))
    node.between_steps()
    assert "refused: unreadable" in lines[-1] and node.weights == {"reverse": 3.0, "sort": 2.0}


def test_the_watched_file_is_read_as_config_files_are_and_re_read_once_written(tmp_path):
    """JSON's numbers with exponents are numbers (PyYAML alone reads 1e-05 as text); a file not
    in UTF-8 is refused with a line, not a crash; a file read while `echo ... >` had emptied it
    is read again once written, even where the clock gave both the same mtime."""
    lines, path = [], tmp_path / "mix.json"
    node = mixture({"reverse": 3.0, "sort": 1.0}, watch=path, say=lines.append)
    path.write_text(json.dumps({"reverse": 1e-05, "sort": 1e20}))
    node.between_steps()
    assert node.weights == {"reverse": 1e-05, "sort": 1e20}, lines
    path.write_bytes("# poids modifi\xe9s\nsort: 2\n".encode("latin-1"))
    node.between_steps()
    assert "refused: unreadable (UnicodeDecodeError)" in lines[-1] and node.weights["sort"] == 1e20
    with open(path, "w") as f:
        emptied = os.stat(path).st_mtime_ns
        node.between_steps()  # an empty file: no weights named, nothing changes
        f.write("sort: 5\n")
    os.utime(path, ns=(emptied, emptied))  # a coarse clock's stamp
    node.between_steps()
    assert node.weights == {"reverse": 1e-05, "sort": 5.0}, lines
    path.write_text("sort: 7\n")  # the same size, written within the same tick
    os.utime(path, ns=(emptied, emptied))
    node.between_steps()
    assert node.weights == {"reverse": 1e-05, "sort": 7.0}, lines


@pytest.mark.parametrize(
    "text, problem",
    [
        ("{reverse: 1e308, sort: 1e308}", "the weights must sum to a finite number"),
        ("{sort: 1" + "0" * 400 + "}", "the weight of 'sort' must be a number >= 0"),
        ("{sort: 1" + "0" * 5000 + "}", "unreadable (ValueError)"),  # more digits than Python converts
        # nested past the parser's stack
        ("".join("  " * i + "a:\n" for i in range(200)), "unreadable (RecursionError)"),
    ],
)
def test_weights_that_would_break_the_draws_are_refused_and_the_run_draws_on(tmp_path, text, problem):
    """Weights each finite whose sum is not (random.choices refuses to draw), an integer too
    large for a float or for Python to read, a nesting deeper than the parser's stack: each is
    refused with a line, and the next draws use the old weights."""
    lines, path = [], tmp_path / "mix.yaml"
    node = mixture({"reverse": 3.0, "sort": 1.0}, watch=path, say=lines.append)
    node.reset()
    path.write_text(text)
    node.between_steps()
    assert len(lines) == 1 and problem in lines[0] and "refused" in lines[0], lines
    assert node.weights == {"reverse": 3.0, "sort": 1.0}
    assert len([next(node) for _ in range(20)]) == 20


def test_a_weights_file_that_is_no_regular_file_costs_a_line_not_the_run(tmp_path):
    """A FIFO (reading it would wait for a writer), a device (/dev/zero never ends), a symlink
    loop, an oversized file: each is refused with one console line, and the run keeps its weights."""
    lines, path = [], tmp_path / "mix.yaml"
    node = mixture({"reverse": 3.0, "sort": 1.0}, watch=path, say=lines.append)
    os.mkfifo(path)
    node.between_steps()  # must not block waiting for a writer
    assert len(lines) == 1 and f"mix weights from {path} refused" in lines[0], lines
    path.unlink()
    path.symlink_to("/dev/zero")
    node.between_steps()
    assert len(lines) == 2 and "refused" in lines[1], lines
    path.unlink()
    path.symlink_to(path)  # a loop: stat fails with ELOOP
    node.between_steps()
    node.between_steps()  # the same problem again: no second line
    assert len(lines) == 3 and "refused" in lines[2], lines
    path.unlink()
    path.write_text("sort: 2\n" + "#" * (2 << 20))  # a weights file is a few lines, not megabytes
    node.between_steps()
    assert len(lines) == 4 and "refused" in lines[3], lines
    assert node.weights == {"reverse": 3.0, "sort": 1.0}
    path.write_text("sort: 2\n")
    node.between_steps()
    assert node.weights == {"reverse": 3.0, "sort": 2.0}, lines


def test_a_checkpoint_round_trip_gives_the_same_next_prompts_and_weights(tmp_path):
    path = tmp_path / "mix.yaml"
    path.write_text("sort: 2\n")
    node = mixture({"reverse": 3.0, "sort": 1.0}, seed=5, watch=path, say=lambda _: None)
    node.reset()
    [next(node) for _ in range(37)]
    node.poll()
    [next(node) for _ in range(10)]
    node.set_weights({"reverse": 1.0})  # the REPL, after the file
    torch.save(node.state_dict(), tmp_path / "state.pt")  # as a checkpoint holds it (forge/run.py)
    after = [next(node) for _ in range(50)]

    resumed = mixture({"reverse": 3.0, "sort": 1.0}, seed=5, watch=path, say=lambda _: None)
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
    resumed.poll()  # the file has not changed since the checkpoint: the REPL's weights stay
    assert resumed.weights == {"reverse": 1.0, "sort": 2.0}
    assert [next(resumed) for _ in range(50)] == after
    assert {s.task for s in after} == {"reverse", "sort"}


def test_the_config_builds_a_mixture_the_repl_can_reach():
    cfg = load_config(CONFIG, [], Config)
    prompts = build_prompts(cfg.dataset, cfg.task, cfg.seed)
    assert isinstance(prompts, Mixture) and prompts.weights == {"reverse": 3.0, "sort": 1.0}
    assert str(prompts.watch) == "runs/grpo_mix_tiny/mix_weights.yaml"
    unregister = register(cfg.run_name, prompts)
    assert running("grpo_mix_tiny") is prompts
    unregister()
    with pytest.raises(KeyError, match="no run 'grpo_mix_tiny' with a mixture"):
        running("grpo_mix_tiny")
    assert not isinstance(build_prompts(DatasetConfig(), "add"), Mixture)


def test_a_file_source_and_a_renamed_toy_task_carry_their_names(tmp_path):
    rows = tmp_path / "questions.jsonl"
    rows.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(4)))
    cfg = load_config(
        CONFIG,
        [f"dataset.mix=[{{path: {rows}, weight: 1}}, {{task: add, name: sums, weight: 1}}]", "eval.every=0"],
        Config,
    )
    node = build_prompts(cfg.dataset, cfg.task, cfg.seed)
    drawn = {s.task: s for s in (next(node) for _ in range(40))}
    assert set(drawn) == {"questions", "sums"}
    assert drawn["questions"].prompt.startswith("q")
    sums = drawn["sums"]
    row = RewardInput(sums.row(), sums.answer, "stop")
    assert row.task["task"] == "sums" and builtin.task(row) == 1.0  # the `task` reward finds its toy task


@pytest.mark.parametrize(
    "override, message",
    [
        ("dataset.mix=[{task: reverse, weight: -1}]", "config key 'dataset.mix[0].weight' must be >= 0, got -1.0"),
        (
            "dataset.mix=[{task: reverse, weight: 0}, {task: sort, weight: 0}]",
            "config key 'dataset.mix': every weight is 0",
        ),
        ("dataset.mix=[{task: sort}, {task: sort}]", "config key 'dataset.mix[1].name': 'sort' names dataset.mix[0]"),
        ("dataset.mix=[]", "config key 'dataset.mix' is empty"),
        ("dataset.mix=null", "config key 'dataset.mix_file': live weights are a mixture's"),
        ("dataset.template='Q: {question}'", "config keys 'dataset.mix' and 'dataset.template'"),
        ("dataset.mix=[{task: sorting}]", "config key 'dataset.mix[0].task': unknown task 'sorting'; known: add,"),
        ("dataset.mix=[{weight: 1}]", "config key 'dataset.mix[0]': no source"),
        ("dataset.mix=[{task: add, path: x.jsonl}]", "config key 'dataset.mix[0]': a toy `task` or a dataset's keys"),
        ("dataset.mix=[{path: x.jsonl}]", "config key 'dataset.mix[0].path': file not found: x.jsonl"),
        ("dataset.mix=[{path: x.txt}]", "config key 'dataset.mix[0].path': x.txt is not one of"),
        ("dataset.mix=[{task: add, mix_file: m.yaml}]", "config key 'dataset.mix[0]': a mixture's source is one"),
        ("eval.dataset.mix=[{task: add}]", "config key 'eval.dataset.mix': ['add'] not among the run's sources"),
        (
            "distill.teachers=[{path: m, tasks: [add]}]",
            "['add'] not among the run's data sources ['reverse', 'sort']",
        ),
    ],
)
def test_a_bad_mixture_config_names_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, [override], Config)
    assert message in str(e.value)


def test_dataset_sources_need_held_out_rows_and_the_task_reward_needs_toy_tasks(tmp_path):
    rows = tmp_path / "train.jsonl"
    rows.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    mix = f"dataset.mix=[{{path: {rows}}}, {{task: add}}]"
    with pytest.raises(ConfigError, match="config key 'eval.dataset.mix': source 'train' is a dataset file"):
        load_config(CONFIG, [mix], Config)
    with pytest.raises(ConfigError, match=r"the 'task' reward scores toy tasks, not the rows of dataset.mix\[0\]"):
        load_config(CONFIG, [mix, "rewards.weights={task: 1.0}", "eval.every=0"], Config)
    cfg = load_config(CONFIG, [mix, f"eval.dataset.mix=[{{name: train, path: {rows}}}]"], Config)
    assert [s.task for s in held_out(cfg.eval, cfg.task, cfg.dataset.mix)][-3:] == ["add"] * 3


def test_hugging_face_and_reasoning_gym_sources_in_a_mixture(tmp_path, monkeypatch):
    """Entries of the other source kinds: named by their source (the hf dataset's name, the
    generator's task); an hf source needs held-out rows, a generator's are its own from eval.seed;
    the reasoning_gym reward needs generators only; a missing column fails at load, naming its entry."""
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    repo = tmp_path / "gsm_tiny"
    repo.mkdir()
    for split, n in (("train", 5), ("test", 3)):
        lines = [json.dumps({"question": f"{split} q{i}", "answer": str(i)}) + "\n" for i in range(n)]
        (repo / f"{split}.jsonl").write_text("".join(lines))
    gym = "{reasoning_gym: {task: basic_arithmetic, config: {max_digits: 2}}}"
    mix = f"dataset.mix=[{{hf: {repo}}}, {gym}]"
    with pytest.raises(ConfigError, match="config key 'eval.dataset.mix': source 'gsm_tiny' is a Hugging Face"):
        load_config(CONFIG, [mix], Config)
    held = f"eval.dataset.mix=[{{name: gsm_tiny, hf: {repo}, split: test}}]"
    cfg = load_config(CONFIG, [mix, held, "eval.prompts=4"], Config)
    assert [s.source_name for s in cfg.dataset.mix] == ["gsm_tiny", "basic_arithmetic"]
    node = build_prompts(cfg.dataset, cfg.task, cfg.seed)
    assert {next(node).task for _ in range(40)} == {"gsm_tiny", "basic_arithmetic"}
    evals = held_out(cfg.eval, cfg.task, cfg.dataset.mix)
    assert [s.task for s in evals] == ["gsm_tiny"] * 3 + ["basic_arithmetic"] * 4  # all 3 test rows
    assert all(s.prompt.startswith("test q") for s in evals[:3])
    train = source_stream(cfg.dataset.mix[1], cfg.seed)
    assert not {s.prompt for s in evals[3:]} & {train.sample(i).prompt for i in range(64)}  # eval.seed's
    with pytest.raises(ConfigError, match=r"not the prompts of dataset.mix\[0\] \(gsm_tiny\)"):
        load_config(CONFIG, [mix, held, "rewards.weights={reasoning_gym: 1.0}"], Config)
    two = f"dataset.mix=[{gym}, {{reasoning_gym: {{task: chain_sum}}}}]"
    assert load_config(CONFIG, [two, "rewards.weights={reasoning_gym: 1.0}"], Config).dataset.mix[1].weight == 1.0
    with pytest.raises(ConfigError, match=r"config key 'dataset.mix\[0\]': .*missing \['problem'\]"):
        load_config(CONFIG, [f"dataset.mix=[{{hf: {repo}, template: '{{problem}}'}}, {gym}]", held], Config)


def test_per_source_rewards_and_accuracy_beside_the_overall_ones():
    episodes = [
        Episode([1, 2], [0, 1], [0.0, 0.0], score=Score(r, correct=c), task=t)
        for r, c, t in [(1.0, 1.0, "reverse"), (0.5, 0.0, "reverse"), (0.0, 0.0, "sort"), (0.2, None, "sort")]
    ]
    _drain()
    record_batch(episodes, 0, {}, per_source=True)
    row = reduce_states([_drain()])
    assert row["reward_mean"] == pytest.approx(0.425)
    assert row["reward/reverse"] == pytest.approx(0.75) and row["reward/sort"] == pytest.approx(0.1)
    assert row["accuracy/reverse"] == 0.5 and row["accuracy/sort"] == 0.0  # sort's unknown one left out
    record_batch(episodes, 0, {})
    assert not [k for k in reduce_states([_drain()]) if "/" in k]  # one source: the overall ones alone


def test_an_episode_recorded_as_several_samples_counts_once_in_the_rewards():
    """A multi-turn episode the gateway recorded as two samples (`Episode.part`) has one reward:
    the step's reward mean and accuracy count it once, not once per sample."""
    parts = [
        Episode([1, 2], [0, 1], [0.0, 0.0], score=Score(1.0, correct=1.0), part=("x", k), policy_version=k)
        for k in (0, 1)
    ]
    alone = Episode([1, 2], [0, 1], [0.0, 0.0], score=Score(0.0, correct=0.0))
    _drain()
    record_batch([*parts, alone], 2, {})
    row = reduce_states([_drain()])
    assert row["reward_mean"] == 0.5 and row["accuracy"] == 0.5, row
    assert row["staleness_max"] == 2  # of each sample trained on, its own


class Greedy:
    """A generator that answers each prompt right when it is a `reverse` one."""

    class generate:
        @staticmethod
        async def route(prompt, n, sampling, tools=None):
            text = prompt[4:-1][::-1] if prompt.startswith("rev ") else "x"
            return [Completion([1], [2], [0.0], text, "stop", policy_version=3)] * n


class Exact:
    class score:
        @staticmethod
        async def route(inputs):
            return [Score(float(i.completion == i.answer)) for i in inputs]


def test_evals_per_source():
    cfg = load_config(CONFIG, ["eval.prompts=8"], Config)
    samples = held_out(cfg.eval, cfg.task, cfg.dataset.mix)
    assert Counter(s.task for s in samples) == {"reverse": 8, "sort": 8}
    held, train = TaskPrompts("sort", cfg.eval.seed), TaskPrompts("sort", cfg.seed)
    sort = [s.prompt for s in samples if s.task == "sort"]
    assert sort == [next(held).prompt for _ in range(8)] != [next(train).prompt for _ in range(8)]  # held-out seed
    out = asyncio.run(evaluate(EvalConfig(), samples, Greedy, Exact))
    assert out["eval/accuracy"] == 0.5 and out["eval/reverse/accuracy"] == 1.0 and out["eval/sort/accuracy"] == 0.0
    assert out["eval/reverse/prompts"] == 8 and out["eval/sort/reward_mean"] == 0.0


def test_a_saved_config_loads_again_as_the_same_mixture(tmp_path):
    """`forge run --resume` reads the run's config.yaml: each source's keys written out in full."""
    cfg = load_config(CONFIG, [], Config)
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    again = load_config(tmp_path / "config.yaml", [], Config)
    assert again.dataset.mix == cfg.dataset.mix and again.dataset.mix_file == cfg.dataset.mix_file


def test_a_resume_with_a_source_added_or_removed_goes_on():
    """A run resumed with a source added to `dataset.mix` draws it from its start at its config's
    weight, the others from where they were under the weights in force; a source removed is
    dropped (not a KeyError at the first draw)."""
    old = mixture({"reverse": 1.0, "sort": 1.0})
    drawn = [next(old) for _ in range(20)]
    old.set_weights({"sort": 3.0})
    drawn += [next(old) for _ in range(20)]
    state = old.get_state()
    new = mixture({"reverse": 1.0, "sort": 1.0, "add": 2.0})
    new.reset(state)
    assert new.weights == {"reverse": 1.0, "sort": 3.0, "add": 2.0}
    after = [next(new) for _ in range(400)]
    fresh = TaskPrompts("add", 0)
    assert [s.prompt for s in after if s.task == "add"][:5] == [next(fresh).prompt for _ in range(5)]
    last_sort = [s.prompt for s in drawn if s.task == "sort"]
    alone = TaskPrompts("sort", 0)
    assert [next(alone).prompt for _ in range(len(last_sort) + 1)][-1] == next(
        s for s in after if s.task == "sort"
    ).prompt
    fewer = mixture({"reverse": 1.0})
    fewer.reset(state)
    assert fewer.weights == {"reverse": 1.0} and next(fewer).task == "reverse"


def test_a_resume_whose_remaining_sources_were_all_paused_takes_the_config_weights():
    """A source removed from `dataset.mix` on resume that held all the weight (the others paused
    at 0) leaves no weight to draw by: the run takes the config's weights, saying so, instead of
    failing every draw."""
    old = mixture({"reverse": 1.0, "sort": 1.0})
    old.reset()
    old.set_weights({"reverse": 0.0})
    [next(old) for _ in range(5)]
    lines = []
    fewer = mixture({"reverse": 2.0}, say=lines.append)
    fewer.reset(old.get_state())
    assert fewer.weights == {"reverse": 2.0} and next(fewer).task == "reverse"
    assert len(lines) == 1 and "reverse=2" in lines[0], lines


def test_a_source_named_by_a_number_takes_its_weight_from_the_file(tmp_path):
    """A source whose name reads as a number in YAML (data/2024.jsonl's stem) is named as written
    in the watched file, unquoted: `{2024: 2}` is its weight."""
    lines, path = [], tmp_path / "mix.yaml"
    node = Mixture({"2024": TaskPrompts("add"), "sort": TaskPrompts("sort")}, {"2024": 1.0, "sort": 1.0}, watch=path)
    node.say = lines.append
    path.write_text("{2024: 2}\n")
    node.between_steps()
    assert node.weights == {"2024": 2.0, "sort": 1.0}, lines


def test_a_mixtures_checkpoint_resumed_as_one_source_says_how_to_go_on():
    """A run resumed with `dataset.mix` replaced by one source: an error naming the key and the
    way on (a mixture of that source alone keeps its place), not a KeyError."""
    old = mixture({"reverse": 1.0, "sort": 1.0})
    old.reset()
    [next(old) for _ in range(5)]
    with pytest.raises(ConfigError, match=r"config key 'dataset.mix'.*reverse, sort"):
        TaskPrompts("reverse").load_state_dict(old.state_dict())


def test_a_bad_row_of_a_mixture_source_names_its_entry(tmp_path):
    """A row that fails when drawn (no value in a prompt column) names the mixture's entry, as
    the source's load errors do, not the single-source `dataset` key the run has no value for."""
    rows = tmp_path / "train.jsonl"
    rows.write_text(json.dumps({"question": None, "answer": "a"}) + "\n")
    cfg = load_config(CONFIG, [f"dataset.mix=[{{task: add}}, {{path: {rows}}}]", "eval.every=0"], Config)
    node = build_prompts(cfg.dataset, cfg.task, cfg.seed)
    with pytest.raises(ConfigError, match=r"config key 'dataset.mix\[1\]': row 0 of .*train.jsonl has no value"):
        for _ in range(40):
            next(node)
    rows.write_text("")
    with pytest.raises(ConfigError, match=r"config key 'dataset.mix\[1\].path': .* is empty"):
        build_prompts(cfg.dataset, cfg.task, cfg.seed)


def test_a_weight_the_config_changed_for_the_resume_is_taken_and_said():
    """`forge run --resume RUN dataset.mix[1].weight=0`: the config's new weight for that source
    is the one in force (said on the console); the others keep the checkpoint's, set at run time."""
    old = mixture({"reverse": 1.0, "sort": 1.0})
    old.reset()
    old.set_weights({"reverse": 3.0})
    [next(old) for _ in range(5)]
    lines = []
    new = mixture({"reverse": 1.0, "sort": 0.0}, say=lines.append)
    new.reset(old.get_state())
    assert new.weights == {"reverse": 3.0, "sort": 0.0}
    assert {next(new).task for _ in range(200)} == {"reverse"}
    assert len(lines) == 1 and "sort=0" in lines[0] and "config" in lines[0], lines


def test_a_single_sources_checkpoint_resumed_as_a_mixture_goes_on_where_it_was():
    """A run on one source resumed with that source and another in `dataset.mix`: the source goes
    on from its place (not from its first prompt again), the new one from its start, said on the
    console; a checkpoint of a source the mixture does not have is an error naming the key."""
    alone = TaskPrompts("reverse")
    drawn = [next(alone).prompt for _ in range(7)]
    lines = []
    mix = mixture({"reverse": 1.0, "sort": 1.0}, say=lines.append)
    mix.reset(alone.state_dict())
    after = [s.prompt for s in (next(mix) for _ in range(60)) if s.task == "reverse"]
    again = TaskPrompts("reverse")
    assert after[:3] == [next(again).prompt for _ in range(10)][7:10] and not set(after[:3]) & set(drawn)
    assert len(lines) == 1 and "reverse" in lines[0], lines
    other = mixture({"add": 1.0, "sort": 1.0})
    with pytest.raises(ConfigError, match=r"config key 'dataset.mix'.*'reverse'"):
        other.reset(alone.state_dict())
