"""Chaos: SIGKILL each role of a real GRPO run (tiny model). The run survives three deaths of
its only generator and a trainer death, rewinds to its checkpoint instead of resetting, and a killed controller leaves
no process and no /dev/shm file once the next run has started."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from roles import role

from forge import shm

CONFIG = "configs/grpo_tiny.yaml"


class Run:
    """`forge run` in a subprocess, watched through its metrics rows and its output."""

    def __init__(self, args: list[str], log: Path):
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "forge.cli", "run", *args],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.rewards: dict[int, float] = {}  # step -> reward, as first written (rows after a rewind are rewritten)

    def rows(self, run_dir: Path) -> list[dict]:
        path = run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def wait_step(self, run_dir: Path, step: int, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while True:
            for r in self.rows(run_dir):
                self.rewards.setdefault(r["step"], r["reward_mean"])
            if any(r["step"] >= step for r in self.rows(run_dir)):
                return
            assert self.proc.poll() is None and time.time() < deadline, self.log.read_text()[-4000:]
            time.sleep(0.2)

    def wait_output(self, text: str, timeout: float = 180) -> str:
        deadline = time.time() + timeout
        while text not in self.log.read_text():
            assert self.proc.poll() is None and time.time() < deadline, self.log.read_text()[-4000:]
            time.sleep(0.2)
        return self.log.read_text()


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


@pytest.mark.slow  # 4 min: a GRPO run through three generator deaths, a trainer's and its controller's
def test_kill_generator_trainer_controller(tmp_path):
    run_dir = tmp_path / "chaos"
    args = [
        CONFIG,
        f"runs_dir={tmp_path}",
        "run_name=chaos",
        "steps=40",
        "checkpoint_every=10",
        "metrics=[jsonl]",
        f"model.path={tmp_path.parent / 'chaos-model'}",
        "model.tiny.sft_steps=100",
    ]
    run = Run(args, tmp_path / "run1.log")
    controller = psutil.Process(run.proc.pid)

    # 1. The only generator's process, three times: the service respawns it on the latest
    # weights while rollouts wait for it; no step is lost.
    run.wait_step(run_dir, 2, timeout=600)  # the first run here also builds the model
    for step in (3, 5, 7):
        role(controller, "generator").kill()
        run.wait_step(run_dir, step)
    assert [r["step"] for r in run.rows(run_dir)] == list(range(1, len(run.rows(run_dir)) + 1))
    assert "rollouts failed in a row" not in run.log.read_text()

    # 2. The trainer's process, 4 steps past its checkpoint of step 10: a new trainer restores
    # that checkpoint (weights, optimizer, version) and the run continues from step 10.
    run.wait_step(run_dir, 14)
    role(controller, "trainer").kill()
    killed_at = max(run.rewards)
    out = run.wait_output("the run continues from step 10")
    assert "Trainer replica 0 died (" in out and "restored" in out and "checkpoints/step_000010/trainer" in out
    run.wait_step(run_dir, 10 + 10)
    after = {r["step"]: r["reward_mean"] for r in run.rows(run_dir)}
    before = mean(run.rewards[s] for s in range(killed_at - 9, killed_at + 1))
    # Not a reset: the 10 steps after the rewind learn on from the checkpoint.
    assert abs(mean(after[s] for s in range(11, 21)) - before) <= 0.15, (before, after)
    assert any(r.get("trainer_restores") == 1 for r in run.rows(run_dir))

    # 3. The controller: its processes exit with it; its /dev/shm files go once the next run starts.
    run.wait_step(run_dir, 24)
    children = controller.children(recursive=True)
    weights_dirs = list(shm.user_root().glob(f"run-{controller.pid}-*"))
    assert weights_dirs and any(d.glob("*.safetensors") for d in weights_dirs)
    controller.kill()
    run.proc.wait(timeout=30)
    _, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, [p.cmdline() for p in alive]

    resumed = Run(["--resume", str(run_dir), "steps=26"], tmp_path / "run2.log")
    resumed.wait_output("grpo: ", timeout=300)  # its services are up: it resumed from the checkpoint of step 20
    assert not any(d.exists() for d in weights_dirs)
    assert resumed.proc.wait(timeout=300) == 0, (tmp_path / "run2.log").read_text()[-3000:]
    assert [r["step"] for r in resumed.rows(run_dir)] == list(range(1, 27))
    assert not list(shm.user_root().glob(f"run-{resumed.proc.pid}-*"))  # a run that ends clears its own
