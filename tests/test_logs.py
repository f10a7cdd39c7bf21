"""The console holds forge's own lines; the libraries' output goes to the run's logs/ (forge/logs.py).
`forge run`, `forge bench` and `forge serve` are checked end to end in test_grpo.py and test_benchmarks.py."""

import os
import subprocess
import sys

from conftest import as_a_user

SCRIPT = """
import asyncio, logging, os, sys, warnings
from forge import logs
from service_actors import Noisy

if sys.argv[1] != "no-capture":
    logs.capture(sys.argv[1])

async def main():
    noisy = await Noisy.options().as_service()
    pid = await noisy.speak.route()
    await noisy.shutdown()
    return pid

pid = asyncio.run(main())
os.write(2, b"controller chatter on fd 2\\n")
warnings.warn("a library's FutureWarning", FutureWarning)
logging.getLogger("torch").warning("a torch warning")
logging.getLogger("forge").warning("forge: a warning in the controller")
print(f"forge: done {pid}")
"""


def test_library_output_goes_to_each_process_s_log_and_forge_s_lines_to_the_console(tmp_path):
    """A process that captured (an entry point) and an actor it spawns: what a library writes
    (stdout, fd 2, a logger, a warning) lands in logs/ROLE-PID.log and logs/main-PID.log; forge's
    lines, the actor's included, reach the console, which holds nothing else."""
    env = as_a_user(os.environ)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    console = out.stdout.splitlines() + out.stderr.splitlines()
    pid = int(out.stdout.split("forge: done ")[1])
    assert sorted(console) == sorted(
        [f"forge: done {pid}", "forge: a reward failed in the actor", "forge: a warning in the controller"]
    ), console
    actor = (tmp_path / "logs" / f"noisy-{pid}.log").read_text()
    for line in ("library chatter on stdout", "C++ chatter on fd 2", "a vllm warning"):
        assert line in actor
    (main,) = (tmp_path / "logs").glob("main-*.log")
    main = main.read_text()
    for line in ("controller chatter on fd 2", "FutureWarning: a library's FutureWarning", "a torch warning"):
        assert line in main


def test_verbose_leaves_everything_on_the_console(tmp_path):
    """`forge -v` (FORGE_LOGS=console): no files, the libraries' lines on the console."""
    env = {**os.environ, "FORGE_LOGS": "console"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert not (tmp_path / "logs").exists()
    for line in ("library chatter on stdout", "C++ chatter on fd 2", "controller chatter on fd 2"):
        assert line in out.stdout + out.stderr


def test_without_capture_spawned_processes_still_write_to_runs_logs(tmp_path):
    """A REPL (no entry point captured): the processes forge spawns write to runs/logs in the
    working directory; their forge lines reach the console they inherited."""
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, "no-capture"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=as_a_user(os.environ),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    pid = int(out.stdout.split("forge: done ")[1])
    assert "forge: a reward failed in the actor" in out.stderr
    assert "library chatter on stdout" not in out.stdout + out.stderr
    assert "C++ chatter on fd 2" in (tmp_path / "runs/logs" / f"noisy-{pid}.log").read_text()
