import json
import subprocess
import sys

import pytest


def test_service_overhead_quick_writes_json(tmp_path):
    out = tmp_path / "service_overhead.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.service_overhead", "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "service_route" in r.stdout
    data = json.loads(out.read_text())
    for key in ("bare_call_one", "service_route"):
        assert data[key]["latency_us_median"] > 0 and data[key]["calls_per_s_median"] > 0
    assert data["route_latency_ratio"] > 0


def test_generation_quick_writes_json(tmp_path):
    out = tmp_path / "generation.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.generation", "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    for row in ("hf_generate", "bare_vllm", "service_1_replica"):
        assert data["rows"][row]["tokens_per_s"] > 0
    assert data["service_vs_bare_vllm"] > 0 and data["vllm_vs_hf_generate"] > 0 and data["reload_paused_s_median"] > 0


@pytest.mark.parametrize("name, keys", [
    ("weight_sync", ("fraction_of_memcpy", "torchstore_fraction_of_memcpy", "generator_sync")),
    ("trainer", ("bare_torchtitan_step_s", "forge_train_step_s", "overhead")),
])
def test_quick_benchmark_writes_json(tmp_path, name, keys):
    out = tmp_path / f"{name}.json"
    r = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert all(k in data for k in keys)


def test_async_vs_sync_quick_through_forge_bench(tmp_path):
    out = tmp_path / "async_vs_sync.json"
    r = subprocess.run([sys.executable, "-m", "forge.cli", "bench", "async_vs_sync", "--quick", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    for key in ("speedup_async_vs_sync", "speedup_one_step_vs_sync", "ideal_speedup"):
        assert data[key] > 0
    for mode, bound in (("max_staleness=0", 0), ("max_staleness=1", 1), ("max_staleness=4", 4)):
        assert data["modes"][mode]["staleness_max"] <= bound
        assert data["modes"][mode]["generator_busy_frac"] > 0 and data["modes"][mode]["trainer_busy_frac"] > 0
