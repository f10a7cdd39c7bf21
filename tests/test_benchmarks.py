"""Each benchmark's --quick smoke run writes its JSON (the full runs are `forge bench NAME`)."""

import asyncio
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import as_a_user


def bench(tmp_path, name: str, timeout: float = 600, through_cli: bool = False) -> tuple[str, dict]:
    """Run benchmark `name` with --quick; its stdout and its JSON result. Through the CLI, as a
    user runs it (in tmp_path): nothing on stderr but forge's lines (the libraries' output is in
    runs/bench-NAME/logs)."""
    out = tmp_path / f"{name}.json"
    cmd = ["forge.cli", "bench", name] if through_cli else [f"benchmarks.{name}"]
    args = [sys.executable, "-m", *cmd, "--quick", "--out", str(out)]
    env = as_a_user(os.environ) if through_cli else None
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    if through_cli:
        foreign = [
            line for line in re.split(r"[\r\n]+", r.stderr) if line.strip() and not re.match("(grpo|forge): ", line)
        ]
        assert not foreign, foreign[:20]
        assert list((tmp_path / f"runs/bench-{name}/logs").glob("main-*.log"))
    return r.stdout, json.loads(out.read_text())


def test_service_overhead_quick_writes_json(tmp_path):
    stdout, data = bench(tmp_path, "service_overhead", timeout=300)
    assert "service_route" in stdout
    for key in ("bare_call_one", "service_route"):
        assert data[key]["latency_us_median"] > 0 and data[key]["calls_per_s_median"] > 0
    assert data["route_latency_ratio"] > 0


@pytest.mark.slow  # 60 s; the generator's figures are checked by tests/test_generator.py
def test_generation_quick_writes_json(tmp_path):
    """Through `forge bench`: its table alone on the console."""
    stdout, data = bench(tmp_path, "generation", through_cli=True)
    rows = ("system", "hf_generate", "bare_vllm", "service_1_replica", "service/bare vLLM", "reload: call")
    assert [line.split()[0] for line in stdout.splitlines()] == [r.split()[0] for r in rows], stdout
    for row in ("hf_generate", "bare_vllm", "service_1_replica"):
        assert data["rows"][row]["tokens_per_s"] > 0
    assert data["service_vs_bare_vllm"] > 0 and data["vllm_vs_hf_generate"] > 0 and data["reload_paused_s_median"] > 0


@pytest.mark.parametrize(
    "name, positive",
    [
        pytest.param(
            "weight_sync",
            ("fraction_of_memcpy", "cross_host_fraction_of_tcp", "cross_host_gb_s", "tcp_gb_s"),
            marks=pytest.mark.slow,
        ),
        ("trainer", ("bare_torchtitan_step_s", "forge_train_step_s")),
        # slow: 1-2 min each; chunked logprobs and prefix sharing are tested in their own files
        pytest.param("logprobs", ("peak_memory_ratio", "step_time_ratio"), marks=pytest.mark.slow),
        pytest.param("prefix", (), marks=pytest.mark.slow),
        pytest.param("gateway", ("tiny_fraction_of_direct", "added_latency_ms_p99"), marks=pytest.mark.slow),
        ("sandbox", ("fraction_of_bare", "bash_fraction_of_bare", "fraction_of_bare_fresh")),
        pytest.param(
            "mismatch", ("moe_kl_without_replay", "moe_kl_with_replay", "qwen3_kl", "llama3_kl"), marks=pytest.mark.slow
        ),
        pytest.param(
            "lora",
            ("sync_speedup_vs_full", "optimizer_bytes_ratio", "generation_fraction_of_base"),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_quick_benchmark_writes_json(tmp_path, name, positive):
    """Each figure measured (a positive, finite number), and the tables behind them complete."""
    _, data = bench(tmp_path, name)
    for key in positive:
        assert 0 < data[key] < float("inf"), (key, data[key])
    if name == "trainer":  # forge's step is the bare step plus its overhead
        assert data["forge_train_step_s"] == pytest.approx(data["bare_torchtitan_step_s"] * (1 + data["overhead"]))
    if name == "logprobs":  # the same logprobs and gradients, in a fraction of the memory
        assert data["max_logprob_diff"] <= 1e-5 and data["max_grad_diff"] <= 1e-5 and data["peak_memory_ratio"] < 0.5
    if name == "prefix":  # the same logprobs and gradients, from fewer tokens
        assert data["max_logprob_diff"] <= 1e-5 and data["max_grad_diff"] <= 1e-5
        assert all(0 < s < float("inf") for s in data["step_speedup"].values()) and len(data["rows"]) == 2
        group = data["rows"]["tiny_2.4M/group"]["tokens"]
        assert group["prompt shared"] < group["a row per sample"] / 2
    if name == "sandbox":
        assert data["rows"] and all(r["runs"] > 0 and r["sandbox_runs_per_s"] > 0 for r in data["rows"].values())
    if name == "weight_sync":
        assert data["rows"] and all(g["publish_to_live_s_median"] > 0 for g in data["generator_sync"])
        # a bf16 version one step from the last goes as its delta: a small part of the file
        assert 0 < data["delta_bytes_ratio"] < 0.2 and data["delta_time_ratio_loopback"] > 0


@pytest.mark.slow  # 110 s: the GRPO loop itself runs in tests/test_grpo.py
def test_async_vs_sync_quick_through_forge_bench(tmp_path):
    """Both variants: single-turn rollouts, and two-turn environment episodes through the gateway.
    Triton's leak report at the interpreter's exit stays off the console."""
    stdout, data = bench(tmp_path, "async_vs_sync", through_cli=True)
    assert "nanobind" not in stdout and "leaked" not in stdout
    for variant in (data, data["agentic"]):
        for key in ("speedup_async_vs_sync", "speedup_one_step_vs_sync", "ideal_speedup"):
            assert variant[key] > 0
        assert variant["expected_residual"]["fill_s"] > 0 and variant["async_fraction_of_ideal_less_residual"] > 0
        for mode, bound in (("max_staleness=0", 0), ("max_staleness=1", 1), ("max_staleness=4", 4)):
            assert variant["modes"][mode]["staleness_max"] <= bound
            assert variant["modes"][mode]["generator_busy_frac"] > 0 and variant["modes"][mode]["trainer_busy_frac"] > 0


@pytest.mark.slow  # 50 s
def test_scale_quick_runs_the_loop_over_simulated_replicas(tmp_path):
    """The real GRPO loop over 8 simulated generators: on-policy generates exactly what it trains,
    every mode keeps its staleness bound, and async beats sync on the heavy-tailed workload."""
    stdout, data = bench(tmp_path, "scale")
    assert "agentic" in stdout
    run = data["runs"]["agentic/8"]
    sync = run["modes"]["max_staleness=0"]
    assert sync["generated_episodes"] == sync["trained_episodes"] == 3 * 8 * 4
    for k in (0, 1, 4):
        assert run["modes"][f"max_staleness={k}"]["staleness_max"] <= k
    assert data["speedup_async_vs_sync"] > 1.5 and 0 < data["share_of_ideal"] and data["ideal_speedup"] > 2
    assert data["controller_cpu_ms_per_episode"] > 0


def test_async_vs_sync_bounds_the_work_its_rollouts_do(monkeypatch):
    """The ideal's bound comes from the work the runs do: the single-turn rollout generates each
    sample's drawn length, waits its drawn latency and records its group's least time (the slowest
    sample's generation alone plus its latency, then scoring); an agentic episode's tool waits its
    task's latency and records it; the bound is the longer of training and that work over the
    rollout slots."""
    from benchmarks import async_vs_sync as avs
    from forge.metrics import _drain, reduce_states
    from forge.tasks import Sample
    from forge.types import Completion, Score

    sample = Sample("rev abcd=", "dcba", "reverse")
    asked, slept = [], []

    async def generate(prompt, n, sampling):
        asked.append(sampling["max_tokens"])
        return [Completion([1], [2], [-0.5], "x", "length")]

    async def score(inputs):
        return [Score(0.0)] * len(inputs)

    async def sleep(seconds):
        slept.append(seconds)

    gen = SimpleNamespace(generate=SimpleNamespace(route=generate))
    rewards = SimpleNamespace(score=SimpleNamespace(route=score))
    monkeypatch.setattr(avs.asyncio, "sleep", sleep)
    alone = {"generate_s": {n: 0.01 * n for n in (*range(2, 9), avs.CAP)}, "score_s": 0.002, "episode_s": 0.1}
    monkeypatch.setattr(avs, "ALONE", alone)
    _drain()  # this process's metrics so far
    group, _ = asyncio.run(avs.heavy_tail_rollout(sample, gen, rewards, None))
    draws = avs.sample_draws(sample.prompt)
    assert len(group) == avs.GROUP_SIZE and sorted(asked) == sorted(n for n, _ in draws)
    assert sorted(slept) == sorted(latency for _, latency in draws)
    least = max(0.01 * n + latency for n, latency in draws) + 0.002
    assert reduce_states([_drain()])["bench/least_group_s"] == pytest.approx(least)

    env, slept[:] = avs.SlowToolEnv(), []
    env.reset(sample.row())
    for _ in range(2):  # the tool call, then the answer
        asyncio.run(env.step({"role": "assistant", "content": "x"}))
    recorded = reduce_states([_drain()])
    assert slept == [avs.task_latency(sample.prompt)] and recorded == {"bench/episodes": 1, "bench/tool_s": slept[0]}

    def run(least_rollouts_s, train_s_per_step):
        return {"wall_s": 10.0, "least_rollouts_s": least_rollouts_s, "train_push_s_per_step": train_s_per_step}

    r = avs.compare({0: run(9.0, 0.2), 1: run(3.0, 0.3), 4: run(4.0, 0.3)}, 10, fill_s=1.0)
    assert r["least_wall_s"] == {"rollouts_s": 4.0, "training_s": 2.0, "wall_s": 4.0}  # the async run's work
    assert r["ideal_speedup"] == 2.5 and r["async_fraction_of_ideal"] == 0.4
    # Rollouts bound it: the last step's training (0.2 s) follows the last group.
    assert r["expected_residual"]["wall_s"] == pytest.approx(0.2)
    assert r["async_fraction_of_ideal_less_residual"] == pytest.approx(4.0 / 9.8)
    r = avs.compare({0: run(9.0, 0.6), 1: run(3.0, 0.3), 4: run(4.0, 0.3)}, 10, fill_s=1.5)
    assert r["least_wall_s"]["wall_s"] == 6.0 and r["expected_residual"]["wall_s"] == pytest.approx(1.5)  # training

    # The fill: the first 8 groups to finish on 8 slots. One slow group (10 s) and fast ones (1 s):
    # 7 slots finish at 1 s, the 8th group is a fast slot's second, at 2 s (not the slow one's 10 s).
    assert avs.expected_fill_s(lambda prompt: 10.0 if int(prompt.split()[1]) % 8 == 0 else 1.0, trials=1) == 2.0
    assert avs.expected_fill_s(lambda prompt: 0.5) == 0.5


def test_scale_takes_the_swap_pause_weight_sync_measured(tmp_path, monkeypatch):
    """`forge bench scale`'s swap pause is weight_sync's staged, same-host swap of its largest
    model; without that file it keeps its fixed 1 s."""
    from benchmarks import scale

    def row(mb, staged, cross_host, paused):
        return {"model_mb": mb, "staged": staged, "cross_host": cross_host, "paused_s_median": paused}

    rows = [
        row(9, True, False, 0.01),
        row(465, False, False, 0.4),
        row(465, True, True, 0.09),
        row(465, True, False, 0.07),
    ]
    path = tmp_path / "weight_sync.json"
    path.write_text(json.dumps({"generator_sync": rows}))
    assert scale.measured_swap_s(path)["swap_s"] == 0.07 and scale.measured_swap_s(path)["model_mb"] == 465
    assert scale.measured_swap_s(path.with_name("none.json")) is None
    w = scale.WORKLOADS["agentic"]
    fast, slow = scale.ideal(w, 8, samples=200), scale.ideal(scale.replace(w, swap_s=1.0), 8, samples=200)
    assert w.swap_s == 1.0 and fast == slow
    assert scale.ideal(scale.replace(w, swap_s=0.07), 8, samples=200)["sync_step_s"] < slow["sync_step_s"]


def test_quick_run_keeps_the_committed_full_results(tmp_path, monkeypatch):
    """`forge bench NAME --quick` writes under runs/, not over benchmarks/results/NAME.json (the
    full run's figures, which the manual renders); a full run writes there; --out wins."""
    from benchmarks import common

    monkeypatch.setattr(common.logs, "capture", lambda d: None)
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.chdir(tmp_path)
    committed = common.ROOT / "benchmarks/results/sandbox.json"
    quick = common.parse_args("sandbox", "", "", ["--quick"])
    assert quick.out == str(Path("runs/bench-sandbox/sandbox.json"))
    assert common.parse_args("sandbox", "", "", []).out == str(committed)
    assert common.parse_args("sandbox", "", "", ["--quick", "--out", "x.json"]).out == "x.json"


def test_the_options_a_benchmark_names_are_in_its_help(capsys, monkeypatch):
    """Each option a benchmark's usage line names is one `forge bench NAME --help` lists."""
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    root = Path(__file__).resolve().parent.parent / "benchmarks"
    checked = 0
    for path in sorted(root.glob("*.py")):
        usage = re.findall(r"^ +(?:python -m benchmarks\.\w+|forge bench \w+) (.*)$", path.read_text(), re.M)
        named = set(re.findall(r"--[a-z-]+", " ".join(usage))) - {"--quick"}
        if not named:
            continue
        with pytest.raises(SystemExit):
            importlib.import_module(f"benchmarks.{path.stem}").main(["--help"])
        shown = capsys.readouterr().out.split("\n\n")[0]  # argparse's usage, before the docstring
        assert not [opt for opt in named if opt not in shown], (path.name, shown)
        checked += 1
    assert checked
