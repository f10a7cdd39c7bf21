"""Held-out evaluation: the pass@k estimator, the metrics of scored groups, the config, and
`forge eval` on a model directory. Eval during GRPO training is tested in test_grpo.py."""

import importlib
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from apps.grpo import Config
from forge.config import ConfigError, load_config
from forge.schema import DatasetConfig
from forge.types import Completion, Score
from services import evals
from services.evals import held_out, pass_at_k, summarize
from services.schema import EvalConfig


def brute_force_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The fraction of all k-subsets of the samples that hold a correct one."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n, c", [(5, 0), (5, 2), (5, 5), (10, 3), (8, 1)])
def test_pass_at_k_is_the_unbiased_estimator(n, c):
    outcomes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(outcomes, k))
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4) and pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2)


def completion(version: int, newest: int | None = None) -> Completion:
    return Completion([1], [2], [0.0], "x", "stop", policy_version=version, max_policy_version=newest)


def test_summary_of_hand_made_groups():
    cfg = EvalConfig(n=4, k=[1, 2, 4])
    groups = [
        # correct from the reward's own `correct`; 2 of 4
        ([completion(3)] * 4, [Score(0.5, correct=1.0), Score(0.2, correct=0.0), Score(1.0, correct=1.0), Score(0.0)]),
        # no `correct`: a full reward counts as right; 1 of 4, and one sample's reward unavailable (left out)
        (
            [completion(3), completion(3), completion(3), completion(3, 4)],
            [Score(1.0), Score(0.3), Score(0.0), Score(0.0, unavailable="sandbox")],
        ),
    ]
    out = summarize(cfg, groups, asked=3)
    hits = [1, 0, 1, 0, 1, 0, 0]  # the first group's 4th sample: correct None, reward 0
    assert out["eval/accuracy"] == pytest.approx(sum(hits) / 7)
    assert out["eval/reward_mean"] == pytest.approx((0.5 + 0.2 + 1.0 + 0.0 + 1.0 + 0.3 + 0.0) / 7)
    assert out["eval/mean@4"] == pytest.approx(sum(hits) / 7)
    assert out["eval/pass@1"] == pytest.approx((2 / 4 + 1 / 3) / 2)
    assert out["eval/pass@2"] == pytest.approx((pass_at_k(4, 2, 2) + pass_at_k(3, 1, 2)) / 2)
    assert out["eval/pass@4"] == pytest.approx(1.0)  # only the group with 4 usable samples counts
    assert (out["eval/prompts"], out["eval/errors"], out["eval/reward_failures"]) == (2, 1, 1)
    assert (out["eval/version"], out["eval/version_max"]) == (3, 3)  # the mixed sample was left out


@pytest.mark.parametrize(
    "override, message",
    [
        ("eval.k=[1,8]", "config key 'eval.k': each k must be in 1..eval.n=1, got [1, 8]"),
        ("eval.every=-1", "config key 'eval.every' must be >= 0"),
        ("eval.n=4", "config key 'eval.n' is 4: more than one sample per prompt needs eval.temperature > 0"),
        ("eval.rewards={nope: 1.0}", "unknown reward(s) ['nope'] (config key 'eval.rewards')"),
        ("eval.dataset.path=missing.jsonl", "config key 'eval.dataset.path': file not found: missing.jsonl"),
    ],
)
def test_bad_eval_config_names_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config("configs/grpo_tiny.yaml", [override], Config)
    assert message in str(e.value)


def test_held_out_prompts_differ_from_training_and_files_keep_their_columns(tmp_path):
    cfg = load_config("configs/grpo_tiny.yaml", ["eval.prompts=16"], Config)
    evals = held_out(cfg.eval, cfg.task)
    assert len(evals) == 16 and len({s.prompt for s in evals}) > 8
    from forge.data import TaskPrompts

    train = TaskPrompts(cfg.task, cfg.seed)
    assert [s.prompt for s in evals] != [train.sample(i).prompt for i in range(16)]
    rows = tmp_path / "held.jsonl"
    rows.write_text("".join(json.dumps({"q": f"say {i}", "a": str(i)}) + "\n" for i in range(5)))
    cfg = load_config(
        "configs/grpo_tiny.yaml",
        [f"eval.dataset.path={rows}", "eval.dataset.template='{q}'", "eval.dataset.answer_key=a", "eval.prompts=0"],
        Config,
    )
    samples = held_out(cfg.eval, cfg.task)
    assert sorted((s.prompt, s.answer) for s in samples) == [(f"say {i}", str(i)) for i in range(5)]


def test_an_evals_own_answer_key_is_kept_when_it_takes_the_runs_prompt_format(tmp_path):
    """The held-out file takes the run's template when it gives none; its own answer_key (another
    column than the run's) is still what its samples are scored against, alone or in a mixture."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"q": f"say {i}", "a": f"{i} long", "short": str(i)}) + "\n" for i in range(4)))
    run = [f"dataset.path={rows}", "dataset.template='{q}'", "dataset.answer_key=a", "eval.prompts=0"]
    cfg = load_config(
        "configs/grpo_tiny.yaml", [*run, f"eval.dataset.path={rows}", "eval.dataset.answer_key=short"], Config
    )
    assert sorted((s.prompt, s.answer) for s in held_out(cfg.eval, cfg.task)) == [
        (f"say {i}", str(i)) for i in range(4)
    ]
    mix = [f"dataset.mix=[{{path: {rows}, template: '{{q}}', answer_key: a}}]", "eval.prompts=0"]
    held = f"eval.dataset.mix=[{{path: {rows}, name: rows, answer_key: short}}]"
    cfg = load_config("configs/grpo_tiny.yaml", [*mix, held], Config)
    samples = held_out(cfg.eval, cfg.task, cfg.dataset.mix)
    assert sorted((s.prompt, s.answer) for s in samples) == [(f"say {i}", str(i)) for i in range(4)]


@pytest.mark.parametrize(
    "config", ["configs/grpo_tiny.yaml", pytest.param("configs/sft_tiny.yaml", marks=pytest.mark.slow)]
)  # 40 s each (an engine apiece); make test runs the GRPO one
def test_forge_eval_command_prints_a_table_and_writes_json(tmp_path, tiny_model_dir, config):
    out = tmp_path / "eval.json"
    cmd = [sys.executable, "-m", "forge.cli", "eval", config, "--model", str(tiny_model_dir)]
    cmd += ["--out", str(out), "eval.prompts=6", "eval.n=3", "eval.k=[1,3]", "eval.temperature=1.0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["eval/prompts"] == 6 and result["eval/errors"] == 0 and result["eval/version"] == 0
    for key in ("eval/accuracy", "eval/reward_mean", "eval/pass@1", "eval/pass@3", "eval/mean@3"):
        assert 0 <= result[key] <= 1 and key in r.stdout
    assert result["eval/pass@3"] >= result["eval/pass@1"]

    bad = subprocess.run([*cmd[:5], "--model", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "neither an HF model directory" in bad.stderr


def test_a_null_eval_row_costs_only_itself(tmp_path, monkeypatch):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(20)]
    rows[7]["question"] = None
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    warned = []  # forge's warning itself, whatever earlier tests did to logging
    monkeypatch.setattr(evals.log, "warning", lambda msg, *args: warned.append(msg % args))
    samples = held_out(EvalConfig(every=1, dataset=DatasetConfig(path=str(path)), prompts=0), "reverse")
    assert sorted(s.prompt for s in samples) == sorted(f"q{i}" for i in range(20) if i != 7)
    assert len(warned) == 1 and "row 7 of" in warned[0] and "the eval goes on without it" in warned[0]


def test_forge_eval_checks_where_its_result_goes_before_it_evaluates(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """An --out whose directory cannot be made fails at once (not after the whole eval); one
    that is new is made; a result that cannot be written is printed, not lost."""
    evaluate = importlib.import_module("apps.evaluate")
    ran = []

    async def fake(cfg, model):
        ran.append(model)
        return {"eval/accuracy": 0.5}

    monkeypatch.setattr(evaluate, "evaluate_model", fake)
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        evaluate.main(None, "c.yaml", str(tiny_model_dir), str(tmp_path / "file" / "out.json"))
    assert not ran and "--out" in capsys.readouterr().err
    evaluate.main(None, "c.yaml", str(tiny_model_dir), str(tmp_path / "new" / "out.json"))
    assert json.loads((tmp_path / "new" / "out.json").read_text())["eval/accuracy"] == 0.5
    monkeypatch.setattr(Path, "write_text", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(SystemExit):
        evaluate.main(None, "c.yaml", str(tiny_model_dir), str(tmp_path / "new" / "full.json"))
    assert '"eval/accuracy": 0.5' in capsys.readouterr().out


def test_forge_eval_of_a_dataset_run_evaluates_held_out_rows_not_the_toy_task(tmp_path, monkeypatch, capsys):
    """A run on a dataset file with no eval during training (eval.every 0): `forge eval` of it
    asks for the held-out rows (eval.dataset.path) instead of evaluating the toy `task`'s prompts."""
    from forge import cli

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": f"say {i}", "answer": str(i)}) + "\n" for i in range(5)))
    config = tmp_path / "c.yaml"
    config.write_text(f"base: {Path('configs/grpo_tiny.yaml').resolve()}\ndataset:\n  path: {rows}\n")
    ran = []
    fake = type(sys)("apps.evaluate")
    fake.main = lambda cfg, *args: ran.append(held_out(cfg.eval, cfg.task)) or {}
    monkeypatch.setitem(sys.modules, "apps.evaluate", fake)
    with pytest.raises(SystemExit):
        cli.evaluate(str(config), [], "model", None)
    assert not ran and "config key 'eval.dataset.path'" in capsys.readouterr().err
    cli.evaluate(str(config), [f"eval.dataset.path={rows}", "eval.prompts=0"], "model", None)
    assert sorted(s.prompt for s in ran[0]) == [f"say {i}" for i in range(5)]
