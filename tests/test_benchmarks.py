"""Each benchmark's --quick smoke run writes its JSON (the full runs are `forge bench NAME`)."""

import json
import subprocess
import sys

import pytest


def bench(tmp_path, name: str, timeout: float = 600, through_cli: bool = False) -> tuple[str, dict]:
    """Run benchmark `name` with --quick; its stdout and its JSON result."""
    out = tmp_path / f"{name}.json"
    cmd = ["forge.cli", "bench", name] if through_cli else [f"benchmarks.{name}"]
    args = [sys.executable, "-m", *cmd, "--quick", "--out", str(out)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout, json.loads(out.read_text())


def test_service_overhead_quick_writes_json(tmp_path):
    stdout, data = bench(tmp_path, "service_overhead", timeout=300)
    assert "service_route" in stdout
    for key in ("bare_call_one", "service_route"):
        assert data[key]["latency_us_median"] > 0 and data[key]["calls_per_s_median"] > 0
    assert data["route_latency_ratio"] > 0


@pytest.mark.slow  # 60 s; the generator's figures are checked by tests/test_generator.py
def test_generation_quick_writes_json(tmp_path):
    _, data = bench(tmp_path, "generation")
    for row in ("hf_generate", "bare_vllm", "service_1_replica"):
        assert data["rows"][row]["tokens_per_s"] > 0
    assert data["service_vs_bare_vllm"] > 0 and data["vllm_vs_hf_generate"] > 0 and data["reload_paused_s_median"] > 0


@pytest.mark.parametrize(
    "name, keys",
    [
        pytest.param(
            "weight_sync",
            ("fraction_of_memcpy", "cross_host_fraction_of_tcp", "generator_sync"),
            marks=pytest.mark.slow,
        ),
        ("trainer", ("bare_torchtitan_step_s", "forge_train_step_s", "overhead")),
        pytest.param(
            "gateway",
            ("gateway_fraction_of_direct", "added_latency_ms_p50", "added_latency_ms_p99", "models"),
            marks=pytest.mark.slow,
        ),
        ("sandbox", ("fraction_of_bare", "fraction_of_bare_exec", "rows")),
    ],
)
def test_quick_benchmark_writes_json(tmp_path, name, keys):
    _, data = bench(tmp_path, name)
    assert all(k in data for k in keys)


@pytest.mark.slow  # 110 s: the GRPO loop itself runs in tests/test_grpo.py
def test_async_vs_sync_quick_through_forge_bench(tmp_path):
    """Both variants: single-turn rollouts, and two-turn environment episodes through the gateway."""
    _, data = bench(tmp_path, "async_vs_sync", through_cli=True)
    for variant in (data, data["agentic"]):
        for key in ("speedup_async_vs_sync", "speedup_one_step_vs_sync", "ideal_speedup"):
            assert variant[key] > 0
        for mode, bound in (("max_staleness=0", 0), ("max_staleness=1", 1), ("max_staleness=4", 4)):
            assert variant["modes"][mode]["staleness_max"] <= bound
            assert variant["modes"][mode]["generator_busy_frac"] > 0 and variant["modes"][mode]["trainer_busy_frac"] > 0


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
