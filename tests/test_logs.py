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


def run_script(tmp_path, where: str, script: str = SCRIPT, **env: str) -> subprocess.CompletedProcess:
    """`script` in tmp_path, as a user runs forge (plus `env`), capturing to `where`."""
    out = subprocess.run(
        [sys.executable, "-c", script, where],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**as_a_user(os.environ), **env},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_library_output_goes_to_each_process_s_log_and_forge_s_lines_to_the_console(tmp_path):
    """A process that captured (an entry point) and an actor it spawns: what a library writes
    (stdout, fd 2, a logger, a warning) lands in logs/ROLE-PID.log and logs/main-PID.log; forge's
    lines, the actor's included, reach the console, which holds nothing else."""
    out = run_script(tmp_path, str(tmp_path / "logs"))
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
    out = run_script(tmp_path, str(tmp_path / "logs"), FORGE_LOGS="console")
    assert not (tmp_path / "logs").exists()
    for line in ("library chatter on stdout", "C++ chatter on fd 2", "controller chatter on fd 2"):
        assert line in out.stdout + out.stderr


def test_without_capture_spawned_processes_still_write_to_runs_logs(tmp_path):
    """A REPL (no entry point captured): the processes forge spawns write to runs/logs in the
    working directory; their forge lines reach the console they inherited."""
    out = run_script(tmp_path, "no-capture")
    pid = int(out.stdout.split("forge: done ")[1])
    assert "forge: a reward failed in the actor" in out.stderr
    assert "library chatter on stdout" not in out.stdout + out.stderr
    assert "C++ chatter on fd 2" in (tmp_path / "runs/logs" / f"noisy-{pid}.log").read_text()


RELAY = """
import os, subprocess, sys
from forge import logs

logs.capture(sys.argv[1])
pipe = logs.destination().console
# Another local user (nobody) tries to put a line on this run's console through its relay.
other = subprocess.run(
    ["/bin/sh", "-c", 'printf "forge: fake\\n" > "$1"', "sh", pipe], user=65534, capture_output=True, text=True
)
print("refused" if other.returncode and "Permission denied" in other.stderr else f"written: {other.returncode} {other.stderr[-300:]}")
"""


def test_another_local_user_cannot_write_to_the_console_relay(tmp_path):
    """The named pipe whose lines reach the console (from the run's processes) is this user's
    alone: another local user's process cannot open it to print lines that look like forge's."""
    out = run_script(tmp_path, str(tmp_path / "logs"), RELAY)
    assert out.stdout.strip() == "refused" and "fake" not in out.stderr, (out.stdout, out.stderr)


SPAWNED = """
import logging, sys
from pathlib import Path
from forge import logs

logs.process_to_file(logs.Destination(Path(sys.argv[1])), "rewards")  # as a process forge spawns
forge = logging.getLogger("forge")
for i in range(50):
    forge.warning("forge: reward %r failed on %r: judge at http://127.0.0.1:9/v1: APIConnectionError", "judge", f"answer {i}")
forge.warning("forge: reward 'code_tests' failed on 'x': sandbox: namespaces failed")
"""


def test_a_warning_per_sample_in_a_spawned_process_is_one_console_line(tmp_path):
    """A reward that fails on every sample (its judge unreachable) warns per sample, thousands
    in a run: the console shows the first of each kind, as for episodes' failures; the log
    file keeps every one."""
    out = subprocess.run(
        [sys.executable, "-c", SPAWNED, str(tmp_path / "logs")], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-3000:]
    console = out.stderr.splitlines()
    assert len(console) == 2 and "'answer 0'" in console[0] and "code_tests" in console[1], console
    (log,) = (tmp_path / "logs").glob("rewards-*.log")
    assert log.read_text().count("APIConnectionError") == 50


CRASH = """
import asyncio, sys
from forge import logs
from service_actors import Crashing

logs.capture(sys.argv[1])

async def main():
    crashing = await Crashing.options().as_actor()
    try:
        return await crashing.start_one.call_one()
    finally:
        await crashing.shutdown()

print(*asyncio.run(main()))
"""


def test_a_native_crash_in_a_spawned_process_leaves_its_python_stack_in_the_log(tmp_path):
    """A process of a role, or one it starts (vLLM's engine core), that dies of a native fault
    (SIGSEGV, SIGILL) writes where it was in Python to the role's log, not just its death."""
    pid, enabled = run_script(tmp_path, str(tmp_path / "logs"), CRASH).stdout.split()
    log = (tmp_path / "logs" / f"crashing-{pid}.log").read_text()
    assert enabled == "True" and "Fatal Python error: Segmentation fault" in log and "string_at" in log, log
