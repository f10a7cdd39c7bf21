"""GRPO end to end through the real services (vLLM generator, torchtitan trainer, TorchStore)."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from conftest import as_a_user
from safetensors.torch import load_file

from apps.grpo import Config, batch_rows, run_together
from forge import checkpoint
from forge.cli import run
from forge.config import ConfigError, load_config
from forge.data import FilePrompts
from services.roles import check_shareable
from services.titan import load_hf_model

CONFIG = "configs/grpo_tiny.yaml"
# The warm-started tiny model these runs share (built by the first run that needs it, cached).
MODEL = Path(__file__).resolve().parent.parent / ".cache/forge/models/test-reverse-sft20"
SANDBOXED = "{task: 1.0, grpo_rollouts:sandboxed: 1.0}"  # partial credit, and a reward whose sandbox can crash
FIELDS = {
    "step",
    "wall_s",
    "reward_mean",
    "reward_std",
    "accuracy",
    "loss",
    "kl",
    "entropy",
    "staleness_mean",
    "staleness_max",
    "is_ratio_mean",
    "tokens_per_s",
    "time/wait_s",
    "time/train_s",
    "time/push_s",
}


def small(tmp_path, **extra) -> list[str]:
    over = {
        "runs_dir": str(tmp_path),
        "run_name": "e2e",
        "group_size": 4,
        "groups_per_step": 2,
        "steps": 3,
        "max_staleness": 1,
        "rollout_tasks": 2,
        "checkpoint_every": 2,
        "metrics": "[jsonl]",
        "model.path": str(MODEL),
        "model.tiny.sft_steps": 20,
        "generator.sampling.max_tokens": 8,
        "rewards.weights": "{task: 1.0}",
    }  # partial credit: a barely trained model still gets a signal
    over.update(extra)
    return [f"{k}={v}" for k, v in over.items()]


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def eval_rows(run_dir) -> list[dict]:
    return [r for r in rows(run_dir) if "eval/accuracy" in r]


def test_grpo_steps_then_resume(tmp_path):
    """Steps, a checkpoint, resume; with a user's reward function by import path beside the
    built-in partial credit (it adds 1 to every reward, or 0 had it failed); held-out evals
    beside the loop, each on one pinned policy version."""
    evals = {
        "eval.every": 2,
        "eval.before_train": "true",
        "eval.prompts": 6,
        "eval.n": 2,
        "eval.k": "[1,2]",
        "eval.temperature": 1.0,
    }
    run(CONFIG, small(tmp_path, **{"rewards.weights": "{task: 1.0, grpo_rollouts:knows_its_task: 1.0}"}, **evals))
    run_dir = tmp_path / "e2e"
    first = [r for r in rows(run_dir) if "eval/accuracy" not in r]
    assert [r["step"] for r in first] == [1, 2, 3]
    # before training, every 2 steps, and the last step
    assert [(r["step"], r["eval/prompts"], r["eval/errors"]) for r in eval_rows(run_dir)] == [
        (0, 6, 0),
        (2, 6, 0),
        (3, 6, 0),
    ]
    for r in eval_rows(run_dir):
        assert r["eval/version"] == r["eval/version_max"] >= r["step"]  # pinned: no swap landed mid-eval
        assert r["eval/pass@2"] >= r["eval/pass@1"] and r["eval/reward_mean"] >= 1.0
    assert all(r["reward_mean"] >= 1.0 and r.get("reward_failures", 0) == 0 for r in first)
    assert all(FIELDS <= r.keys() for r in first), FIELDS - first[0].keys()
    assert all(r["staleness_max"] <= 1 for r in first)  # every trained episode within max_staleness
    trained = load_file(run_dir / "model/model.safetensors")
    initial = load_file(MODEL / "model.safetensors")
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)  # parameters changed
    saved = checkpoint.load_run_state(checkpoint.latest(run_dir))
    assert saved["step"] == 3 and saved["version"] == 3 and saved["prompts"]["stream"]["index"] > 0
    assert (run_dir / "reward.png").stat().st_size > 0 and (run_dir / "config.yaml").exists()

    run(None, ["steps=5"], resume=str(run_dir))  # continues at step 4 with the saved state
    after = [r for r in rows(run_dir) if "eval/accuracy" not in r]
    assert [r["step"] for r in after] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in eval_rows(run_dir)] == [0, 2, 3, 4, 5]
    resumed = checkpoint.load_run_state(checkpoint.latest(run_dir))
    assert resumed["step"] == 5 and resumed["version"] == 5
    assert resumed["prompts"]["stream"]["index"] > saved["prompts"]["stream"]["index"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("rewards.weights={tsk: 1.0}", "unknown reward(s) ['tsk'] (config key 'rewards.weights')"),
        ("group_size=1", "config key 'group_size' must be >= 2"),
        ("steps=-1", "config key 'steps' must be >= 1, got -1"),  # it crashed the trainer's LR schedule
        (
            "trainer_procs=3",
            "batch of 64 (group_size x groups_per_step) does not split over trainer_procs x trainer.grad_accum = 3",
        ),
        ("trainer.loss.name=ppo9", "unknown loss 'ppo9'"),
        ("rollout=nowhere:rollout", "config key 'rollout': cannot import 'nowhere:rollout'"),
        ("rollout=forge.rollout", "config key 'rollout': expected 'package.module:name'"),
        ("task=gsm9k", "config key 'task': unknown task 'gsm9k'"),
        ("algorithm=ppo9", "config key 'algorithm': 'ppo9' is not one of grpo, ppo, distill"),
        ("ppo.lam=1.5", "config key 'ppo.lam' must be in [0, 1], got 1.5"),
        ("ppo.critic.head=lm", "config keys 'ppo.critic.head' and 'ppo.critic.loss.name': a score head trains"),
        ("ppo.critic.loss.name=bradley_terry", "'ppo.critic.loss.name': a critic is a score head trained with"),
        ("algorithm=distill", "config key 'distill.teachers': algorithm 'distill' learns from teachers"),
        ("distill.teachers=[{path: m, weight: 0}]", "config key 'distill.teachers[0].weight' must be > 0"),
        ("distill.teachers=[{weight: 1}]", "config key 'distill.teachers[0].path': a teacher needs a model"),
        (
            "distill.teachers=[{path: m, tasks: [add]}]",
            "config key 'distill.teachers[0].tasks': ['add'] not among the run's data sources ['reverse']",
        ),
    ],
)
def test_bad_config_fails_before_spawning(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, [override], Config)
    assert message in str(e.value)


def test_the_critics_warmup_must_leave_the_policy_steps_only_with_a_critic():
    """PPO's warm-up of `steps` or more leaves the policy none; without a critic (grpo) it is unused."""
    with pytest.raises(ConfigError, match="config key 'ppo.critic_warmup': 300 steps of critic alone"):
        load_config(CONFIG, ["algorithm=ppo", "ppo.critic_warmup=300"], Config)
    assert load_config(CONFIG, ["algorithm=grpo", "ppo.critic_warmup=300"], Config).ppo.critic_warmup == 300


def test_gpu_gsm8k_config_is_valid(tmp_path, tiny_model_dir):
    """The documented GPU config loads with only its model and data paths replaced."""
    from test_data import gsm8k_like

    data = gsm8k_like(tmp_path / "train.jsonl")
    cfg = load_config(
        "configs/grpo_qwen3_1.7b_gsm8k.yaml", [f"model.path={tiny_model_dir}", f"dataset.path={data}"], Config
    )
    assert cfg.rewards.weights == {"math": 1.0} and cfg.generator.kv_cache_memory_bytes is None
    assert cfg.trainer.param_dtype == "bfloat16" and cfg.batch_size == 128
    # Chat prompts, no hand-written template: the model's own chat template renders them
    [user] = FilePrompts(cfg.dataset).next().prompt
    assert user["role"] == "user" and 'output the final answer after "####"' in user["content"]
    assert cfg.dataset.template == "{question}" and cfg.generator.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(
    "config, model",
    [("llama3.2_1b", "tiny_llama_dir"), ("qwen3_30b_a3b", "tiny_moe_dir"), ("qwen3_8b_lora", "tiny_model_dir")],
)
def test_gpu_model_family_configs_are_valid(tmp_path, request, config, model):
    """The documented GPU configs of the other families load with their model (a tiny one of the
    same family: `model.family` must match it) and data paths replaced; their trainer and vLLM
    engine keys are ones the trainer and vLLM take."""
    from test_data import gsm8k_like

    from services.generator import engine_args
    from services.trainer import Trainer

    path = request.getfixturevalue(model)
    data = gsm8k_like(tmp_path / "train.jsonl")
    cfg = load_config(f"configs/grpo_{config}_gsm8k.yaml", [f"model.path={path}", f"dataset.path={data}"], Config)
    assert cfg.rewards.weights == {"math": 1.0} and cfg.generator.kv_cache_memory_bytes is None  # from the base
    Trainer.check_args(path, cfg.trainer)
    engine = engine_args(cfg.generator, str(path), [cfg.trainer.lora])
    if config == "llama3.2_1b":
        assert cfg.model.family == "llama3" and cfg.dataset.chat[0]["role"] == "user"  # the base's, Llama's template
    elif config == "qwen3_8b_lora":  # the adapters' keys are ones the trainer's model takes
        assert cfg.trainer.lora.rank == 32 and cfg.trainer_procs == 1
        adapted = load_hf_model(path, lora=cfg.trainer.lora)
        assert sum(".lora_a." in n for n, _ in adapted.named_parameters()) == 7 * 4  # every linear, 4 layers
        assert engine.enable_lora and engine.max_lora_rank == 32
        return
    else:
        assert cfg.model.family == "qwen3_moe" and cfg.trainer.expert_parallel == cfg.trainer_procs == 8
        assert cfg.generator.routing_replay and engine.enable_expert_parallel and engine.tensor_parallel_size == 8
        assert cfg.job.kind == "slurm" and cfg.trainer.serve_weights_on == "0.0.0.0"
    dense = request.getfixturevalue("tiny_model_dir")
    with pytest.raises(ConfigError, match="holds a qwen3 model"):
        load_config(f"configs/grpo_{config}_gsm8k.yaml", [f"model.path={dense}", f"dataset.path={data}"], Config)


def test_gpu_tool_config_is_valid(tmp_path, tiny_model_dir):
    """The documented multi-turn tool config loads with its paths replaced; its environment
    answers a calculator call and scores the final answer."""
    from test_data import gsm8k_like

    from forge.config import import_object

    data = gsm8k_like(tmp_path / "train.jsonl")
    cfg = load_config(
        "configs/grpo_qwen3_1.7b_gsm8k_tools.yaml", [f"model.path={tiny_model_dir}", f"dataset.path={data}"], Config
    )
    assert cfg.agentic.enabled and cfg.agentic.gateway.tool_parser == "hermes" and cfg.batch_size == 128
    assert cfg.agentic.sampling["extra_body"]["chat_template_kwargs"] == {"enable_thinking": False}
    env = import_object("agentic.env", cfg.agentic.env)()
    messages, tools = env.reset({"prompt": "2 boxes of 36?", "answer": "... #### 72"})
    assert tools[0]["function"]["name"] == "calculator"
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2*36"}'}}
    step = env.step({"role": "assistant", "content": "", "tool_calls": [call]})
    assert step.messages == [{"role": "tool", "tool_call_id": "c1", "content": "72"}] and not step.done
    bad = {**call, "function": {"name": "calculator", "arguments": '{"expression": "__import__(1)"}'}}
    assert (
        env.step({"role": "assistant", "tool_calls": [bad]}).messages[0]["content"].startswith("error: not arithmetic")
    )
    done = env.step({"role": "assistant", "content": "So #### 72"})
    assert done.done and done.reward == 1.0 and done.info["tool_calls"] == 2


@pytest.mark.slow  # 57 s: a whole `forge run` process, interrupted
def test_ctrl_c_saves_and_leaves_no_processes(tmp_path):
    """SIGINT mid-run: a checkpoint of the step reached, exit, and no process left behind; the
    console holds forge's lines alone, the libraries' are in the run's logs/."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    over = small(tmp_path, steps=1000, checkpoint_every=0)
    # As from a terminal: SIGINT raises KeyboardInterrupt even where this test itself was started
    # in the background (a shell without job control starts background jobs with SIGINT ignored,
    # and a child keeps an ignored signal ignored).
    as_from_a_terminal = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv[0] = 'forge'; runpy.run_module('forge.cli', run_name='__main__')"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", as_from_a_terminal, "run", CONFIG, *over],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # As a user runs it (conftest sets FORGE_LOGS and VLLM_LOGGING_LEVEL for the tests' own processes)
        env={**as_a_user(os.environ), "PYTHONUNBUFFERED": "1"},
    )
    metrics = tmp_path / "e2e" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children  # the services' processes
    titled = {p.pid: p.cmdline()[0] for p in children if p.cmdline() and p.cmdline()[0].startswith("forge:")}
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        for p in [psutil.Process(proc.pid), *children]:
            p.kill()
        pytest.fail(f"no exit 120 s after SIGINT; its output ended with: {proc.communicate()[0][-3000:]}")
    assert "interrupted at step" in out, out[-3000:]
    # The console holds forge's own lines (the bar, its messages) and nothing else: vLLM's,
    # Monarch's and torch's go to runs/NAME/logs, one file per process, ROLE-PID.log as `ps` shows it.
    foreign = [line for line in re.split(r"[\r\n]+", out) if line.strip() and not re.match(r"(grpo|sft|forge): ", line)]
    assert not foreign, foreign[:20]
    logs = tmp_path / "e2e" / "logs"
    assert {"forge:generator", "forge:trainer", "forge:store"} <= set(titled.values())
    for pid, title in titled.items():
        assert (logs / f"{title.removeprefix('forge:')}-{pid}.log").is_file(), (title, sorted(logs.iterdir()))
    (generator,) = [logs / f"generator-{pid}.log" for pid, t in titled.items() if t == "forge:generator"]
    assert "pause state" in generator.read_text()  # vLLM's INFO line on every weight swap: there, not here
    saved = checkpoint.load_run_state(checkpoint.latest(tmp_path / "e2e"))
    assert saved["step"] >= 2 and (checkpoint.latest(tmp_path / "e2e") / "trainer").is_dir()
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline() for p in alive]


@pytest.fixture(scope="module")
def services(loop, tmp_path_factory):
    """One set of GRPO services for the tests that run `train` on them: the partial-credit
    reward and `grpo_rollouts:sandboxed`, whose sandbox crashes for half the prompts."""
    from apps.sft import warm_start
    from services.roles import Roles

    cfg = load_config(CONFIG, small(tmp_path_factory.mktemp("grpo"), **{"rewards.weights": SANDBOXED}), Config)
    s = loop.run_until_complete(Roles.start(cfg, warm_start))
    yield s
    loop.run_until_complete(s.shutdown())


def test_broken_rollouts_stop_the_run_with_a_clear_error(tmp_path, loop, services):
    """A rollout that returns a malformed score, one that always raises and one that never
    returns each end the run within bounded time, with an error that says what went wrong."""
    import time

    from apps.grpo import train
    from forge.checkpoint import RunStopped

    cases = {
        "grpo_rollouts:score_without_reward": r"rollout 'grpo_rollouts:score_without_reward': scores\[0\] has no field 'reward'",
        "grpo_rollouts:always_raises": r"\d+ rollouts failed in a row \(config key 'max_rollout_failures'\); the last: "
        r"ConnectionError: tool server unreachable",
        "grpo_rollouts:never_returns": r"no batch of 2 groups usable by policy version \d+ within 3.0 s \(config key "
        r"'sample_timeout_s'\): the buffer holds 0 .*; rollouts last failed with: nothing",
    }
    for name, message in cases.items():
        cfg = load_config(
            CONFIG,
            small(
                tmp_path,
                rollout=name,
                max_rollout_failures=5,
                sample_timeout_s=3,
                run_name=name.split(":")[1],
                **{"rewards.weights": SANDBOXED},
            ),
            Config,
        )
        start = time.monotonic()
        with pytest.raises(RunStopped, match=message) as e:
            loop.run_until_complete(train(cfg, services))
        assert "the run stopped at step 0" in str(e.value) and "It saved no checkpoint to resume" in str(e.value)
        assert time.monotonic() - start < 60, name


def test_run_stopped_names_the_checkpoint_to_resume(tmp_path):
    from forge.checkpoint import RunStopped

    assert "It saved no checkpoint to resume from" in str(RunStopped(tmp_path, 3, "x"))
    checkpoint.save_run_state(checkpoint.partial_dir(tmp_path, 20), {"step": 20})
    assert str(RunStopped(tmp_path, 23, "Trainer replica 0 died (Killed)")) == (
        f"the run stopped at step 23: Trainer replica 0 died (Killed). Resume it from its checkpoint of step 20: "
        f"forge run --resume {tmp_path}"
    )


def test_a_checkpoint_is_complete_or_absent(tmp_path):
    """A checkpoint is written under a partial name and renamed once complete: one cut short
    (a second Ctrl-C) is neither the latest nor counted when the oldest are pruned."""
    for step in (10, 20):
        checkpoint.save_run_state(checkpoint.partial_dir(tmp_path, step), {"step": step})
    (checkpoint.partial_dir(tmp_path, 30) / "trainer").mkdir()  # cut short: no run_state.pt
    assert checkpoint.latest(tmp_path) == checkpoint.step_dir(tmp_path, 20)
    assert checkpoint.save_run_state(checkpoint.partial_dir(tmp_path, 40), {"step": 40}) == checkpoint.step_dir(
        tmp_path, 40
    )
    assert sorted(d.name for d in (tmp_path / "checkpoints").iterdir()) == ["step_000020", "step_000040"]


def test_unavailable_rewards_mask_their_group_or_score_zero(tmp_path, loop, services):
    """A reward whose sandbox crashes for some prompts (RewardUnavailable): `mask` keeps their
    groups out of training (`groups_masked`), `zero` trains on them with that reward at 0;
    both count `reward_failures/sandbox`."""
    from apps.grpo import train

    for mode in ("mask", "zero"):
        over = small(
            tmp_path,
            steps=2,
            checkpoint_every=0,
            run_name=mode,
            reward_unavailable=mode,
            **{"rewards.weights": SANDBOXED},
        )
        loop.run_until_complete(train(load_config(CONFIG, over, Config), services))
    masked, zero = rows(tmp_path / "mask"), rows(tmp_path / "zero")
    for r in (masked, zero):
        assert [x["step"] for x in r] == [1, 2]
        assert sum(x.get("reward_failures/sandbox", 0) for x in r) > 0
    assert sum(x.get("groups_masked", 0) for x in masked) > 0 and all(x["reward_mean"] >= 1.0 for x in masked)
    assert sum(x.get("groups_masked", 0) for x in zero) == 0


def test_distillation_alone_scores_the_sampled_tokens_with_the_teacher(tmp_path, loop, services, tiny_model_dir):
    """Algorithm `distill` with the current policy as its teacher, on-policy: the first step's
    reverse KL is the generator's numerics only (a teacher scoring other tokens, or shifted by
    one, is off by nats); no reward is computed. A teacher of another tokenizer is named."""
    import dataclasses
    import shutil

    from apps.grpo import train
    from services.reference import Reference
    from services.roles import check_tokenizer

    policy = tmp_path / "policy"  # the shared services' trainer may have trained in earlier tests
    loop.run_until_complete(services.trainer.export_hf.route(str(policy)))
    over = small(tmp_path, steps=2, checkpoint_every=0, max_staleness=0, algorithm="distill")
    cfg = load_config(CONFIG, [*over, f"distill.teachers=[{{path: {policy}}}]"], Config)
    teacher = loop.run_until_complete(Reference.options().as_service(str(policy)))
    try:
        loop.run_until_complete(train(cfg, dataclasses.replace(services, rewards=None, teachers=[teacher])))
    finally:
        loop.run_until_complete(teacher.shutdown())
    steps = rows(tmp_path / "e2e")
    assert [r["step"] for r in steps] == [1, 2]
    assert abs(steps[0]["distill/reverse_kl"]) < 1e-3, steps[0]
    assert all("accuracy" not in r and r["reward_mean"] == 0 for r in steps)

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    (other / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"config key 'distill.teachers\[1\].path': .* the policy's tokenizer"):
        check_tokenizer(str(MODEL), str(other), "distill.teachers[1].path")


def test_a_ppo_batch_splits_over_the_critics_ranks_and_micro_batches_too():
    """The batch goes to the policy's trainer and to the critic, each splitting its rows over its
    own processes x grad_accum; prefix sharing makes the row count hard to foresee."""
    cfg = load_config("configs/ppo_tiny.yaml", ["ppo.critic.grad_accum=2"], Config)
    assert batch_rows(cfg) == 2
    cfg = load_config("configs/ppo_tiny.yaml", ["trainer.grad_accum=2", "ppo.critic.grad_accum=3"], Config)
    assert batch_rows(cfg) == 6
    assert batch_rows(load_config("configs/grpo_tiny.yaml", ["trainer.grad_accum=2"], Config)) == 2


def advantages_of(tmp_path, make, *args) -> dict[str, float]:
    """Run `make(*args)` (apps/grpo.py's critic_advantages or distill, on stand-ins of the roles)
    in a metrics scope of its own; the metrics it recorded."""
    import asyncio

    from forge.metrics import MetricWriter, metrics_scope

    async def main():
        with metrics_scope():
            await make(*args)
            writer = MetricWriter(tmp_path, ["jsonl"])
            try:
                return await writer.flush(1)
            finally:
                writer.close()

    return asyncio.run(main())


def four_episodes_in_two_groups():
    from forge.types import Episode, Score, collate

    rewards = (1.0, 0.0, 1.0, 0.0)
    eps = [
        Episode([1, 5, 6], [0, 1, 1], [0.0, -0.5, -0.7], score=Score(r), group=i // 2) for i, r in enumerate(rewards)
    ]
    return eps, collate(eps, pad_id=0)


def a_step_survives(batch) -> bool:
    """Whether a policy step on `batch` has a finite gradient (theta: every logprob's parameter)."""
    from forge.losses import LOSSES, importance_weight
    from forge.schema import LossConfig

    theta = torch.zeros((), requires_grad=True)
    lp = batch.gen_logprobs + theta
    cfg = LossConfig(name="grpo")
    LOSSES["grpo"](lp, batch, importance_weight(lp, batch, cfg), cfg).backward()
    return bool(theta.grad.isfinite())


def test_a_group_with_a_value_that_is_not_finite_leaves_the_batch_not_the_step(tmp_path):
    """PPO: a critic's NaN on one episode's token costs that episode's group, counted
    (`groups_nonfinite`); the other group's advantages are whitened without it, and nothing the
    critic read off the episodes' tokens (an inf on a prompt) reaches the values, returns or the
    explained variance. The step trains on the rest."""
    from types import SimpleNamespace

    from apps.grpo import critic_advantages

    eps, batch = four_episodes_in_two_groups()
    values = torch.full(batch.input_ids.shape, 0.5)
    values[:, 0] = float("inf")
    values[3, 1] = float("nan")

    async def route(_):
        return values

    critic = SimpleNamespace(values=SimpleNamespace(route=route))
    cfg = load_config("configs/ppo_tiny.yaml", [], Config)
    row = advantages_of(tmp_path, critic_advantages, cfg, SimpleNamespace(critic=critic), batch, eps)
    kept = batch.loss_mask > 0
    assert kept.tolist() == [[False, True, True]] * 2 + [[False, False, False]] * 2
    assert all(getattr(batch, name).isfinite().all() for name in ("advantages", "values", "returns"))
    assert batch.advantages[~kept].abs().max() == 0 and batch.advantages[kept].mean().abs() < 1e-6
    assert row["groups_nonfinite"] == 1 and math.isfinite(row["critic/explained_variance"])
    assert a_step_survives(batch)


def test_ppo_advantages_of_an_episode_recorded_as_two_samples_are_those_of_the_episode(tmp_path):
    """A multi-turn episode the gateway recorded as two samples (parts 0 and 1, the second
    re-rendering the first turn) gets the advantages it has whole: its reward once, at its end,
    the first sample's return running on into the second's."""
    from types import SimpleNamespace

    from apps.grpo import critic_advantages
    from forge.types import Episode, Score, collate

    def advantages(eps, values):
        async def route(_):
            return values

        batch = collate(eps, pad_id=0)
        s = SimpleNamespace(critic=SimpleNamespace(values=SimpleNamespace(route=route)))
        advantages_of(tmp_path, critic_advantages, load_config("configs/ppo_tiny.yaml", [], Config), s, batch, eps)
        return batch.advantages

    other = Episode([1, 5, 6, 7], [0, 1, 1, 1], [0.0] * 4, score=Score(0.0))  # whitened with it
    episode = Episode([1, 5, 8, 6], [0, 1, 0, 1], [0.0] * 4, score=Score(1.0))
    whole = advantages([episode, other], torch.tensor([[0, 0.2, 0, 0.9], [0, 0.3, 0.5, 0.1]]))
    parts = [
        Episode([1, 5], [0, 1], [0.0] * 2, score=Score(1.0), part=("e", 0)),
        Episode([1, 7, 8, 6], [0, 0, 0, 1], [0.0] * 4, score=Score(1.0), part=("e", 1)),
    ]
    split = advantages([*parts, other], torch.tensor([[0, 0.2, 0, 0], [0, 0, 0, 0.9], [0, 0.3, 0.5, 0.1]]))
    assert [split[0, 1].item(), split[1, 3].item()] == pytest.approx([whole[0, 1].item(), whole[0, 3].item()])
    assert split[2].tolist() == pytest.approx(whole[1].tolist())


def test_a_group_with_a_teacher_logprob_that_is_not_finite_leaves_the_batch_not_the_step(tmp_path):
    """Distillation: a teacher's NaN on one episode's model token costs that episode's group; a
    teacher's -inf on the prompts (never scored) costs nothing. The teacher's weight, however
    small (1e-50: below float32's range), makes it the teacher."""
    from types import SimpleNamespace

    from apps.grpo import distill
    from services.schema import DistillConfig, TeacherConfig

    eps, batch = four_episodes_in_two_groups()
    teacher = torch.full(batch.input_ids.shape, -0.2)
    teacher[:, 0] = float("-inf")
    teacher[0, 2] = float("nan")

    async def route(_):
        return teacher

    cfg = SimpleNamespace(algorithm="distill", distill=DistillConfig([TeacherConfig("t", weight=1e-50)], coef=1.0))
    s = SimpleNamespace(teachers=[SimpleNamespace(logprobs=SimpleNamespace(route=route))])
    row = advantages_of(tmp_path, distill, cfg, s, batch, eps)
    assert (batch.loss_mask > 0).tolist() == [[False, False, False]] * 2 + [[False, True, True]] * 2
    assert batch.advantages.isfinite().all() and batch.advantages[:2].abs().max() == 0
    torch.testing.assert_close(batch.advantages[2:, 1:], torch.tensor([[0.3, 0.5]] * 2))  # teacher - student
    assert row["groups_nonfinite"] == 1 and row["distill/reverse_kl"] == pytest.approx(-0.4)
    assert a_step_survives(batch)


def test_the_reverse_kl_metric_is_the_mean_over_the_tokens_a_teacher_scores(tmp_path):
    """A teacher of one data source (`tasks: [a]`) beside another source no teacher scores:
    `distill/reverse_kl` is the teacher's distance on the tokens it scores, not diluted by the
    other source's tokens (no teacher, no reverse KL: they are not 0 nats from one)."""
    from types import SimpleNamespace

    from apps.grpo import distill
    from services.schema import DistillConfig, TeacherConfig

    eps, batch = four_episodes_in_two_groups()
    for e in eps:
        e.task = "a" if e.group == 0 else "b"
    teacher = torch.full(batch.input_ids.shape, -0.2)

    async def route(_):
        return teacher

    cfg = SimpleNamespace(algorithm="grpo", distill=DistillConfig([TeacherConfig("t", tasks=["a"])], coef=1.0))
    s = SimpleNamespace(teachers=[SimpleNamespace(logprobs=SimpleNamespace(route=route))])
    row = advantages_of(tmp_path, distill, cfg, s, batch, eps)
    assert row["distill/reverse_kl"] == pytest.approx(-0.4)  # (-0.5 + 0.2 - 0.7 + 0.2) / 2, source a's
    assert batch.advantages[2:].abs().max() == 0  # source b: no teacher, no advantage from one


def test_resuming_a_run_of_another_algorithm_as_ppo_is_refused_before_spawning(tmp_path, monkeypatch):
    """A GRPO run's checkpoint holds no critic: resumed with algorithm=ppo, the run stops naming
    the config key before any service starts (not once all run, at the critic's load)."""
    import asyncio

    import apps.grpo as grpo

    part = checkpoint.partial_dir(tmp_path / "e2e", 2)
    (part / "trainer").mkdir(parents=True)
    checkpoint.save_run_state(part, {"step": 2, "version": 2, "app": "grpo"})
    cfg = load_config(CONFIG, small(tmp_path, steps=5, algorithm="ppo", **{"ppo.critic_warmup": 1}), Config)
    cfg.resume = str(tmp_path / "e2e")

    async def spawned(*args, **kwargs):
        raise AssertionError("the roles started")

    monkeypatch.setattr(grpo.Roles, "start", spawned)
    with pytest.raises(ConfigError, match=r"config key 'algorithm': ppo resumes its critic .* holds none"):
        asyncio.run(grpo.run(cfg))


def test_a_group_with_a_reference_logprob_that_is_not_finite_leaves_the_batch_not_the_step(tmp_path):
    """The KL term's reference: a NaN on one episode's model token (the reference model's
    numerics) costs that episode's group, counted, as a teacher's or a critic's does; its
    -inf on a prompt token (never read) costs nothing. The policy's step on the rest has a
    finite gradient (not a NaN in every weight)."""
    from types import SimpleNamespace

    from apps.grpo import step
    from forge.losses import LOSSES, importance_weight
    from forge.schema import LossConfig

    eps, _ = four_episodes_in_two_groups()
    trained = []

    async def returns(value):
        return value

    async def ref_logprobs(batch):
        ref = torch.full(batch.input_ids.shape, -0.6)
        ref[:, 0] = float("-inf")
        ref[3, 2] = float("nan")
        return ref

    async def train_step(batch):
        trained.append(batch)
        return 1, {}

    async def training(calls):
        return await calls

    cfg = load_config(CONFIG, small(tmp_path, **{"trainer.loss.kl_coef": 0.1}), Config)
    s = SimpleNamespace(
        ref=SimpleNamespace(logprobs=SimpleNamespace(route=ref_logprobs)),
        critic=None,
        teachers=[],
        trainer=SimpleNamespace(train_step=SimpleNamespace(route=train_step)),
        weights=SimpleNamespace(push=lambda: returns(1)),
    )
    run = SimpleNamespace(version=0, step=0, training=training, end_step=returns)
    loops = SimpleNamespace(batch=lambda version, policy_steps: returns(eps))
    buffer = SimpleNamespace(notify_version=SimpleNamespace(call_one=returns))
    row = advantages_of(tmp_path, step, cfg, s, run, loops, buffer)
    batch = trained[0]
    assert (batch.loss_mask > 0).tolist() == [[False, True, True]] * 2 + [[False, False, False]] * 2
    assert row["groups_nonfinite"] == 1
    theta = torch.zeros((), requires_grad=True)
    lp = batch.gen_logprobs + theta
    loss_cfg = LossConfig(name="grpo", kl_coef=0.1)
    LOSSES["grpo"](lp, batch, importance_weight(lp, batch, loss_cfg), loss_cfg).backward()
    assert theta.grad.isfinite() and theta.grad != 0


def test_a_teacher_or_critic_must_have_the_policys_tokenizer_whatever_files_hold_it(tmp_path, tiny_model_dir):
    """The tokenizers are compared as transformers loads them (vocabulary, special tokens): a
    policy whose tokenizer is a GPT-2 style vocab.json + merges.txt refuses a teacher of another;
    the same tokenizer in a file written differently passes; one that does not load cannot be
    compared, and is refused."""
    import shutil

    from services.roles import check_tokenizer

    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (policy / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "<|endoftext|>": 2}))
    (policy / "merges.txt").write_text("#version: 0.2\n")
    key = "distill.teachers[0].path"
    with pytest.raises(
        ConfigError, match=r"config key 'distill.teachers\[0\].path': .* not have the policy's tokenizer"
    ):
        check_tokenizer(str(policy), str(tiny_model_dir), key)
    same = tmp_path / "same"
    shutil.copytree(tiny_model_dir, same)
    (same / "tokenizer.json").write_text(json.dumps(json.loads((same / "tokenizer.json").read_text()), indent=1))
    check_tokenizer(str(tiny_model_dir), str(same), key)
    (same / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"cannot tell whether .* has the policy's tokenizer"):
        check_tokenizer(str(tiny_model_dir), str(same), key)


def test_ppo_critic_trains_alone_then_beside_the_policy_and_resumes(tmp_path, loop, services):
    """A critic's step changes the critic and nothing of the policy. Algorithm `ppo`: during the
    critic's warm-up the policy does not move (no policy loss, the same version), after it both
    train; the critic's checkpoint is saved beside the trainer's and a resume loads it."""
    import dataclasses

    from apps.grpo import train
    from forge.types import Episode, collate
    from services.roles import spawn_critic

    over = small(tmp_path, steps=3, checkpoint_every=2, algorithm="ppo", **{"ppo.critic_warmup": 1})
    cfg = load_config(CONFIG, [*over, "ppo.critic_updates=2"], Config)
    critic = loop.run_until_complete(spawn_critic(cfg, str(MODEL), None))
    try:
        batch = collate([Episode([1, 5, 6, 7], [0, 1, 1, 1], [0.0] * 4)], pad_id=0)
        policy = loop.run_until_complete(services.trainer.logprobs.route(batch))
        batch.values = loop.run_until_complete(critic.values.route(batch))
        assert batch.values[0, 0] == 0 and batch.values[0, 1:].abs().min() > 0  # token t: the output at t - 1
        batch.returns = batch.values + batch.loss_mask
        loop.run_until_complete(critic.train_step.route(batch))
        assert torch.equal(loop.run_until_complete(services.trainer.logprobs.route(batch)), policy)
        moved = loop.run_until_complete(critic.values.route(batch)) - batch.values
        assert moved[0, 1:].min() > 0  # toward the returns, above every value

        start = loop.run_until_complete(services.trainer.policy_version.route())
        with_critic = dataclasses.replace(services, critic=critic)
        loop.run_until_complete(train(cfg, with_critic))
        steps = rows(tmp_path / "e2e")
        assert [r["step"] for r in steps] == [1, 2, 3]
        assert "loss" not in steps[0] and all("loss" in r for r in steps[1:])  # the policy waited one step
        assert all({"critic/loss", "critic/explained_variance", "critic/value_clip_frac"} <= r.keys() for r in steps)
        assert loop.run_until_complete(services.trainer.policy_version.route()) == start + 2
        ckpt = checkpoint.latest(tmp_path / "e2e")
        assert (ckpt / "critic").is_dir() and (ckpt / "trainer").is_dir()

        # Back to step 2 with nothing left to train: the critic holds step 2's weights, not step 3's.
        values = loop.run_until_complete(critic.values.route(batch))
        cfg = load_config(CONFIG, [*over, "steps=2"], Config)
        loop.run_until_complete(train(cfg, with_critic, resume_from=checkpoint.step_dir(tmp_path / "e2e", 2)))
        assert not torch.equal(loop.run_until_complete(critic.values.route(batch)), values)
    finally:
        loop.run_until_complete(critic.shutdown())


def test_code_configs_are_valid(tmp_path, tiny_model_dir):
    """The code toy config loads as documented; the MBPP GPU config loads with its paths
    replaced and its prompt template fills in from an MBPP row."""
    from forge.data import FilePrompts

    cfg = load_config("configs/grpo_code_tiny.yaml", [], Config)
    assert (
        cfg.task == "pyrev"
        and cfg.rewards.weights == {"code_tests": 1.0}
        and cfg.rewards.code_tests.sandbox.workers == 8
    )
    row = {
        "task_id": 2,
        "text": "Write a function to double x.",
        "code": "def double(x):\n    return 2 * x",
        "test_setup_code": "",
        "test_list": ["assert double(2) == 4", "assert double(0) == 0"],
    }
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(row) + "\n")
    cfg = load_config(
        "configs/grpo_qwen3_1.7b_mbpp.yaml", [f"model.path={tiny_model_dir}", f"dataset.path={data}"], Config
    )
    assert cfg.rewards.weights == {"code_tests": 1.0} and cfg.reward_unavailable == "mask" and cfg.batch_size == 128
    sample = next(iter(FilePrompts(cfg.dataset, cfg.seed)))
    assert "Your code should pass this test:\nassert double(2) == 4\n" in sample.prompt[0]["content"]
    assert sample.answer == row["code"] and sample.row()["test_list"] == row["test_list"]


@pytest.mark.parametrize(
    "path, task, env, agent",
    [
        ("configs/grpo_tool_tiny.yaml", "calc", "services.envs.calculator:Calculator", None),
        ("configs/grpo_tool_agent_tiny.yaml", "calc", None, "services.envs.calculator:calculator_agent"),
        ("configs/grpo_guess_tiny.yaml", "guess", "services.envs.guess:GuessWord", None),
        ("configs/grpo_guess_agent_tiny.yaml", "guess", None, "services.envs.guess:guess_agent"),
    ],
)
def test_agentic_toy_configs_are_valid(path, task, env, agent):
    """The agentic toys load as documented: an agent config is its environment config with the
    agent in the environment's place (`base:`), the same task, model and training."""
    from forge.cli import app_config

    app, cfg = app_config(path, [])
    assert app == "grpo" and cfg.task == task and cfg.model.tiny.task == task
    assert cfg.agentic.env == env and cfg.agentic.agent == agent
    assert cfg.groups_per_step * cfg.group_size == 32 and cfg.trainer.lr == 1e-4


@pytest.mark.slow  # 70 s: two runs' trainers and one generator
def test_two_lora_runs_share_one_generator(tmp_path):
    """Two GRPO runs at once (reverse and sort), each training its own adapter, on one generator:
    each run's generator logprobs are its trainer's within 1e-3 at every step (an adapter of the
    other run, or the base, would be far off once the adapters trained), its rows its own (its
    task's accuracy), its adapter its own."""
    import asyncio

    lora = {"trainer.lora.rank": 8, "trainer.lr": 1e-2}  # adapters far apart within 4 steps
    cfgs = [
        load_config(CONFIG, small(tmp_path, run_name=name, task=task, steps=4, **lora), Config)
        for name, task in (("rev", "reverse"), ("srt", "sort"))
    ]
    last = asyncio.run(run_together(cfgs))
    assert [r["step"] for r in last] == [4, 4]
    for name in ("rev", "srt"):
        got = rows(tmp_path / name)
        assert [r["step"] for r in got] == [1, 2, 3, 4]
        assert all(r["mismatch/abs_logprob_max"] <= 1e-3 for r in got), [r["mismatch/abs_logprob_max"] for r in got]
    adapters = [load_file(tmp_path / name / "model/adapter_model.safetensors") for name in ("rev", "srt")]
    assert adapters[0].keys() == adapters[1].keys()
    assert any(not torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0] if ".lora_B." in k)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([["run_name=a"], ["run_name=a"]], "names of their own"),
        ([["run_name=a"], ["run_name=b", "trainer.lora.rank=0"]], "'b', config key 'trainer.lora.rank'"),
        (
            [["run_name=a"], ["run_name=b", "generator.max_model_len=128"]],
            "'b', config keys generator, generator_replicas",
        ),
        ([["run_name=a"], ["run_name=b", "model.tiny.task=sort"]], "'b', config key 'model.path'"),
    ],
)
def test_runs_that_cannot_share_a_generator_are_named(overrides, message):
    cfgs = [load_config(CONFIG, ["trainer.lora.rank=8", *extra], Config) for extra in overrides]
    with pytest.raises(ConfigError, match=message):
        check_shareable(cfgs)
