import json
import subprocess
import sys


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
