"""The sandbox service: results, limits, and an adversarial suite. Every hostile program runs
through the service; after each, no process of the sandbox's uids is left, the host's files
are untouched, and the pool still serves. Network tests target only a listener this test
opens on 127.0.0.1."""

import asyncio
import base64
import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
import zlib
from pathlib import Path

import pytest

from services.sandbox import _ENV, Sandbox, default_python
from services.schema import SandboxConfig

WORKERS = 4
CFG = SandboxConfig(workers=WORKERS, run_timeout=5.0, max_output_bytes=4096, uid_base=61000)
SECRET = f"forge-secret-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def sandbox(loop):
    os.environ["FORGE_TEST_SECRET"] = SECRET  # in the sandbox actor's environment: no run may read it
    try:
        sb = loop.run_until_complete(Sandbox.options().as_service(CFG))
    finally:
        del os.environ["FORGE_TEST_SECRET"]
    isolation = loop.run_until_complete(sb.isolation.route())
    assert isolation == {"namespaces": True, "own_uid": True, "cgroups": True, "syscall_filter": True}
    yield sb
    loop.run_until_complete(sb.shutdown())


@pytest.fixture
def host_dir():
    """A directory of the host outside /tmp (the sandbox has its own /tmp; the checkout may be
    under it), world-readable."""
    d = Path("/run") / f"forge-sandbox-test-{uuid.uuid4().hex}"
    d.mkdir(parents=True)
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


def sandbox_pids() -> list[int]:
    """Processes of the sandbox's slot uids, anywhere on the host."""
    uids = range(CFG.uid_base, CFG.uid_base + 64)
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and d.stat().st_uid in uids:
                pids.append(int(d.name))
        except OSError:
            pass
    return pids


def run(loop, sandbox, code, **kw):
    result = loop.run_until_complete(sandbox.run.route(code, **kw))
    assert sandbox_pids() == [], f"processes of the run outlived its result: {result}"
    return result


def test_results_stdin_files_and_exit_codes(loop, sandbox):
    r = run(loop, sandbox, "print(input()[::-1])", stdin="abc")
    assert (r.status, r.exit_code, r.stdout, r.stderr) == ("ok", 0, "cba\n", "")
    assert 0 < r.wall_s < 5
    files = {"data/in.txt": base64.b64encode(b"42").decode()}
    r = run(loop, sandbox, "import os; print(open('data/in.txt').read(), os.getuid() != 0, os.getcwd())", files=files)
    assert r.stdout == "42 True /tmp\n"
    r = run(loop, sandbox, "import sys; print('x', file=sys.stderr); sys.exit(3)")
    assert (r.status, r.exit_code, r.stderr) == ("error", 3, "x\n")
    r = run(loop, sandbox, "echo $((6*7)); exit 2", language="bash")
    assert (r.status, r.exit_code, r.stdout) == ("error", 2, "42\n")
    r = run(loop, sandbox, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert (r.status, r.exit_code, r.signal) == ("killed", None, "SIGSEGV")


def test_unit_tests_count_passes(loop, sandbox):
    r = run(loop, sandbox, "def f(x):\n    return 2 * x\n", tests=["assert f(2) == 4", "assert f(3) == 7", "f(1)"])
    assert (r.status, r.tests_passed, r.tests_total) == ("error", 2, 3)
    assert "test 1 failed: AssertionError" in r.stderr
    r = run(loop, sandbox, "def f(x):\n    return 2 * x\n", tests=["assert f(2) == 4"])
    assert (r.status, r.pass_fraction) == ("ok", 1.0)
    r = run(loop, sandbox, "raise SystemExit(0)\ndef f(): pass", tests=["assert f() is None"])
    assert r.tests_passed == 0  # the program ended before its tests ran: none passed


def test_plain_data_crosses_to_the_tests(loop, sandbox):
    """Tests compare the program's results as plain data, outside its process: tuples stay tuples,
    sets, dicts with tuple keys, bytes, floats (nan, inf), the program's constants and stdlib
    modules it imported; an exception the program raises fails its test, not the others."""
    code = (
        "import math\nLIMIT = 3\n"
        "def f(x):\n    return (x, [x], {x}, {(x, 1): b'a'}, math.inf, float('nan'))\n"
        "def g(x):\n    raise ValueError(x)\n"
    )
    tests = [
        "assert f(2)[:5] == (2, [2], {2}, {(2, 1): b'a'}, math.inf) and f(2)[5] != f(2)[5]",
        "assert LIMIT == 3 and math.isclose(math.sqrt(LIMIT) ** 2, 3)",
        "assert all(f(i)[0] == i for i in range(LIMIT))",
        "g(1)",
        "assert sorted(f(1)[1] * 3) == [1, 1, 1] and f(x=4)[0] == 4",
    ]
    r = run(loop, sandbox, code, tests=tests)
    assert (r.tests_passed, r.tests_total) == (4, 5) and "test 3 failed: ProgramError: ValueError: 1" in r.stderr


def test_the_standard_librarys_kinds_of_plain_data_cross_as_their_data(loop, sandbox):
    """A right program returning a Counter, an OrderedDict, a defaultdict, a namedtuple, an
    IntEnum (MBPP's own solutions do) or an int of more than 4300 digits passes the tests its
    own process passes: each crosses as its plain data."""
    code = (
        "import collections, enum, math\nP = collections.namedtuple('P', 'x y')\n"
        "class Color(enum.IntEnum):\n    RED = 1\n"
        "def counts(s):\n    return collections.Counter(s)\n"
        "def grouped():\n    d = collections.defaultdict(list)\n    d[1].append(2)\n    return d\n"
        "def ordered():\n    return collections.OrderedDict(a=1)\n"
        "def point():\n    return P(1, 2)\n"
        "def red():\n    return Color.RED\n"
        "def fact(n):\n    return math.factorial(n)\n"
    )
    tests = [
        "assert counts('aab') == {'a': 2, 'b': 1}",
        "assert grouped() == {1: [2]} and ordered() == {'a': 1}",
        "assert point() == (1, 2) and red() == 1",
        "import math\nassert fact(3000) == math.factorial(3000) and fact(5) == 120",
    ]
    r = run(loop, sandbox, code, tests=tests)
    assert (r.status, r.tests_passed, r.tests_total) == ("ok", 4, 4), r.stderr


def test_a_test_catches_the_builtin_exception_the_program_raises(loop, sandbox):
    """A test that expects a ValueError (or a KeyError, a UnicodeDecodeError as a ValueError)
    catches it as from the program's own process; one the program ends itself with (SystemExit)
    never ends the grader, and an exception of another kind is not caught."""
    code = (
        "def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return {}[x]\n"
        "def g():\n    b'\\xff'.decode()\n"
        "def h():\n    raise SystemExit(0)\n"
    )
    expect = "try:\n    {call}\nexcept {kind} as e:\n    assert {check}\nelse:\n    raise AssertionError"
    tests = [
        expect.format(call="h()", kind="Exception", check="True"),
        expect.format(call="f(-1)", kind="ValueError", check="'negative' in str(e)"),
        expect.format(call="f(1)", kind="KeyError", check="True"),
        expect.format(call="g()", kind="ValueError", check="'codec' in str(e)"),
        expect.format(call="f(-1)", kind="KeyError", check="True"),  # a ValueError is no KeyError
    ]
    r = run(loop, sandbox, code, tests=tests)
    assert (r.tests_passed, r.tests_total) == (4, 5), r.stderr
    assert "test 4 failed: ProgramError: ValueError: negative" in r.stderr, r.stderr


def test_a_program_cannot_end_a_tests_iteration_by_raising_stop_iteration(loop, sandbox):
    """A StopIteration (or StopAsyncIteration) the program raises is no end of an iteration in
    a test: in `all(map(f, xs))` it would end the map at once and `all` of nothing is True, a
    pass for a function that answers nothing. It reaches the test as a ProgramError only."""
    code = "def f(x):\n    raise StopIteration\ndef g(x):\n    raise StopAsyncIteration\n"
    tests = ["assert all(map(f, [1, 2]))", "assert list(map(f, [1])) == []", "assert all(map(g, [1]))"]
    r = run(loop, sandbox, code, tests=tests)
    assert (r.tests_passed, r.tests_total) == (0, 3), r.stderr


def test_a_program_under_tests_is_the_main_module_as_when_run_alone(loop, sandbox):
    """Under tests the program is still `__main__` (sys.modules): what it pickles by reference
    (a multiprocessing pool's function, its own class) is found there, as when it runs alone."""
    code = (
        "import multiprocessing, pickle, sys\n"
        "class Box:\n    def __init__(self, v):\n        self.v = v\n"
        "def square(x):\n    return x * x\n"
        "def squares(n):\n    with multiprocessing.Pool(2) as p:\n        return p.map(square, range(n))\n"
        "def unboxed(v):\n    return pickle.loads(pickle.dumps(Box(v))).v\n"
        "def main_is_me():\n    return sys.modules['__main__'].square is square\n"
    )
    tests = ["assert squares(4) == [0, 1, 4, 9]", "assert unboxed(3) == 3", "assert main_is_me()"]
    alone = run(loop, sandbox, code + "print(squares(4), unboxed(3), main_is_me())")
    assert (alone.status, alone.stdout) == ("ok", "[0, 1, 4, 9] 3 True\n"), alone.stderr
    r = run(loop, sandbox, code, tests=tests)
    assert (r.status, r.tests_passed, r.tests_total) == ("ok", 3, 3), r.stderr


def test_a_program_with_many_threads_runs_within_its_memory_limit(loop, sandbox):
    """Each thread reserves address space it never touches (its stack, a malloc arena): 48
    threads of a few kB of data each run under the default memory_limit_MB, which bounds the
    memory the run uses (its cgroup), not what it reserves."""
    code = (
        "import concurrent.futures\n"
        "def work(i):\n    return len([bytearray(1000) for _ in range(100)])\n"
        "with concurrent.futures.ThreadPoolExecutor(max_workers=48) as ex:\n"
        "    print(sum(ex.map(work, range(480))))\n"
    )
    r = run(loop, sandbox, code, run_timeout=30)
    assert (r.status, r.stdout) == ("ok", "48000\n"), r.stderr[-500:]


# A program that games its grade: each passed every test on the old harness (the tests ran in the
# program's process, which held the report fd 3, and the tests' file was readable to the run).
GRADE_ATTACKS = {
    "writes the report fd": "import os\nos.write(3, b'{\"passed\": 999}')\nos._exit(0)",
    "writes the report fd, then fails": "import os\nos.write(3, b'{\"passed\": 2}' + b' ' * 5000)\ndef f(x):\n    return 0",
    "an object equal to anything": "class E:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return E()",
    "an int equal to anything": "class E(int):\n    __eq__ = lambda self, other: True\ndef f(x):\n    return E(0)",
    "reads the expected values": (
        "import json, os, re\ntable = {}\n"
        "try:\n    tests = json.load(open(os.path.join(os.path.dirname(__file__), '.forge_tests.json')))\n"
        "except OSError:\n    tests = []\n"
        "for t in tests:\n    m = re.match(r'assert f\\((.*)\\) == (.*)', t)\n    if m:\n        table[int(m[1])] = int(m[2])\n"
        "def f(x):\n    return table[x]"
    ),
    "shadows a builtin the tests use": "def f(x):\n    return [0]\ndef len(x):\n    return 3",
}


@pytest.mark.parametrize("name", GRADE_ATTACKS)
def test_a_program_cannot_grade_itself(loop, sandbox, name):
    tests = ["assert len(f(3)) == 3"] if "builtin" in name else ["assert f(1) == 2", "assert f(2) == 5"]
    r = run(loop, sandbox, GRADE_ATTACKS[name], tests=tests)
    assert (r.tests_passed, r.tests_total) == (0, len(tests)), (r.stdout, r.stderr)


# Python programs run in an interpreter the launcher forked, already started: each must end as
# under its own `python3 -I` (exit status, stdout, stderr up to the script's path).
AS_OWN_PROCESS = {
    "output": "print('a')\nimport sys\nsys.stdout.write('b')\nprint('e', file=sys.stderr)",
    "traceback": "def f():\n    raise ValueError('x')\nf()",
    "syntax error": "x = (",
    "SystemExit text": "raise SystemExit('bye')",
    "exit code": "import sys\nsys.exit(300)",
    "KeyboardInterrupt": "raise KeyboardInterrupt",
    "argv and flags": "import sys\nprint(sys.argv == [__file__], __name__, sys.flags.isolated, sys.path[0])",
    "environment": "import os\nprint(sorted(k for k in os.environ if k not in ('HOME', 'TMPDIR')))",
    "thread outlives main": "import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.2), print('late'))).start()",
    "atexit": "import atexit\natexit.register(print, 'at exit')",
    "file left open": "out = open(1, 'w', closefd=False)\nout.write('flushed at exit')",
    "finalizer": "class A:\n    def __del__(self):\n        print('finalized')\na = A()",
    "stdout closed": "import os\nos.close(1)\nprint('x', end='')",
}


@pytest.mark.parametrize("name", AS_OWN_PROCESS)
def test_python_programs_end_as_in_their_own_interpreter(loop, sandbox, tmp_path, name):
    code = AS_OWN_PROCESS[name]
    main = tmp_path / "main.py"
    main.write_text(code)
    bare = subprocess.run([default_python(), "-I", main], cwd=tmp_path, env=_ENV, capture_output=True, text=True)
    r = run(loop, sandbox, code)
    status = r.exit_code if r.exit_code is not None else -signal.Signals[r.signal]
    assert (status, r.stdout) == (bare.returncode, bare.stdout)
    if name != "stdout closed":  # its own interpreter also says "Exception ignored" of the flush
        path = r.stderr.split('"')[1] if '"' in r.stderr else "main.py"
        assert r.stderr.replace(path, "main.py") == bare.stderr.replace(str(main), "main.py")


@pytest.mark.parametrize(
    "request_, error",
    [
        (dict(code="x", language="cobol"), "unknown 'language' 'cobol'; known: python, bash"),
        (dict(code="x", files={"../x": ""}), "file '../x' is not a relative path"),
        (dict(code="x", files={"/etc/x": ""}), "file '/etc/x' is not a relative path"),
        (dict(code="x", files={"a": "not base64!"}), "file 'a': content is not base64"),
        (dict(code="x", run_timeout=0), "'run_timeout' and 'memory_limit_MB' must be > 0"),
        (dict(code="x", language="bash", tests=["true"]), "'tests' are Python statements"),
    ],
)
def test_bad_requests_are_errors_naming_the_field(loop, sandbox, request_, error):
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(")", r"\)")):
        loop.run_until_complete(sandbox.run.route(**request_))


FORK_BOMB = """\
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""
MEMORY_BOMB = "x = []\nwhile True:\n    x.append(bytearray(1 << 24))\n"
BIG_STDOUT = "import sys\nchunk = b'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.buffer.write(chunk)\n"
DAEMON = """\
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(60)
    os._exit(0)
print('parent done')
"""
SETSID_ESCAPE = """\
import os, time
os.setsid()
if os.fork() == 0:
    os.setsid()
    time.sleep(60)
time.sleep(60)
"""
CLOSE_STDOUT = "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)\n"


@pytest.mark.parametrize(
    "name, code, timeout, statuses",
    [
        ("infinite loop", "while True: pass", 1.0, {"timeout"}),
        ("fork bomb", FORK_BOMB, 2.0, {"timeout"}),
        ("memory bomb", MEMORY_BOMB, 5.0, {"oom"}),
        ("setsid escape", SETSID_ESCAPE, 1.0, {"timeout"}),
        ("closes stdout and sleeps", CLOSE_STDOUT, 1.0, {"timeout"}),
        ("daemon outliving the program", DAEMON, 5.0, {"ok"}),
    ],
)
def test_hostile_programs_end_with_their_status_and_leave_nothing(loop, sandbox, name, code, timeout, statuses):
    start = time.perf_counter()
    r = run(loop, sandbox, code, run_timeout=timeout)
    assert r.status in statuses, (name, r)
    assert time.perf_counter() - start < timeout + 5, (
        f"{name}: the result came {time.perf_counter() - start:.1f} s late"
    )
    assert run(loop, sandbox, "print(1)").stdout == "1\n"  # the pool keeps serving


def test_a_gigabyte_of_stdout_is_capped(loop, sandbox):
    r = run(loop, sandbox, BIG_STDOUT, run_timeout=30)
    assert r.status == "ok" and r.truncated
    assert r.stdout == "x" * CFG.max_output_bytes


def test_no_network_even_to_loopback(loop, sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    code = f"""\
import socket
s = socket.socket()
s.settimeout(2)
try:
    s.connect(("127.0.0.1", {port}))
    print("connected")
except OSError as e:
    print("refused", type(e).__name__)
"""
    try:
        r = run(loop, sandbox, code)
        assert r.stdout.startswith("refused"), r
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever reached the listener
    finally:
        listener.close()


def test_no_reading_other_processes_or_host_files(loop, sandbox, host_dir):
    secret_file = host_dir / "secret.txt"
    secret_file.write_text(SECRET)
    secret_file.chmod(0o600)
    code = f"""\
import os
found = [k for k, v in os.environ.items() if "{SECRET}" in v]
for pid in os.listdir("/proc"):
    try:
        if pid.isdigit() and b"{SECRET}" in open(f"/proc/{{pid}}/environ", "rb").read():
            found.append(pid)
    except OSError:
        pass
try:
    found.append(open("{secret_file}").read())
except OSError as e:
    print(type(e).__name__)
print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
print("found", found)
"""
    r = run(loop, sandbox, code)
    assert "FileNotFoundError" in r.stdout and "found []" in r.stdout, r  # the host's file is not in its root
    pids = eval(r.stdout.split("pids ")[1].splitlines()[0])
    assert max(pids) < 20  # its own pid namespace: none of the host's processes


def test_no_writing_outside_the_working_directory(loop, sandbox, host_dir):
    host_tmp = Path("/tmp") / f"forge-escape-{uuid.uuid4().hex}"
    code = f"""\
for path in ("{host_dir}/planted", "/etc/planted", "/tmp/../etc/planted2"):
    try:
        open(path, "w").write("x")
        print("wrote", path)
    except OSError as e:
        print("denied", path, e.strerror)
open("{host_tmp}", "w").write("x")  # the sandbox's own /tmp
print("tmp ok")
"""
    r = run(loop, sandbox, code)
    # the host's directory is not in its root; its /etc is read-only
    assert r.stdout.count("No such file") == 1 and r.stdout.count("Read-only file system") == 2, r
    assert "tmp ok" in r.stdout, r
    assert not (host_dir / "planted").exists() and not Path("/etc/planted").exists()
    assert not host_tmp.exists()  # its /tmp was private


def test_more_runs_than_workers_wait_for_a_slot(loop, sandbox):
    async def many():
        return await asyncio.gather(
            *(sandbox.run.route(f"import time; time.sleep(0.3); print({i})") for i in range(3 * WORKERS))
        )

    start = time.perf_counter()
    results = loop.run_until_complete(many())
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(3 * WORKERS)]
    assert time.perf_counter() - start >= 0.9  # three waves of 0.3 s: at most WORKERS at once
    assert sandbox_pids() == []


# ---- the code_tests reward ----------------------------------------------------------------

MBPP_ROW = {
    "prompt": "Write a function f that doubles x.",
    "answer": "def f(x):\n    return 2 * x",
    "task": "mbpp",
    "test_setup_code": "import math",
    "test_list": ["assert f(1) == 2", "assert f(2) == 4", "assert f(0) == math.inf"],
}


def test_code_tests_reward_runs_the_completion_against_the_row(loop):
    from forge.tasks import generate
    from forge.types import RewardInput
    from services.rewards.code_tests import CodeTests
    from services.schema import CodeTestsConfig

    reward = CodeTests(CodeTestsConfig(sandbox=SandboxConfig(workers=2, uid_base=61100, site_packages=False)))
    row = generate("pyrev", 1)[0].row()
    right = row["answer"]

    def score(r, row, text):
        return loop.run_until_complete(r(RewardInput(row, text)))

    assert score(reward, row, right) == {"reward": 1.0, "correct": True}
    assert score(reward, row, f"Here it is:\n```python\n{right}\n```\n") == {"reward": 1.0, "correct": True}
    assert score(reward, row, "print('zzz')") == {"reward": 0.0, "correct": False}
    assert score(reward, row, "print(") == {"reward": 0.0, "correct": False}  # a syntax error is a wrong answer
    mbpp = "```python\ndef f(x):\n    return 2 * x\n```"
    assert score(reward, MBPP_ROW, mbpp) == {"reward": pytest.approx(2 / 3), "correct": False}
    all_pass = CodeTests(CodeTestsConfig(all_pass=True, sandbox=SandboxConfig(workers=1, uid_base=61200)))
    assert score(all_pass, MBPP_ROW, mbpp) == {"reward": 0.0, "correct": False}
    with pytest.raises(ValueError, match="no 'tests', 'test_list' or 'expected_output' column"):
        loop.run_until_complete(reward(RewardInput({"prompt": "p", "answer": "a"}, right)))


def test_printing_the_expected_output_passes_only_a_program_that_ends_cleanly(loop):
    """A program that prints the expected output, then crashes, is killed or outlives its
    timeout is a wrong answer (as a judge has it), not a right one."""
    from forge.tasks import generate
    from forge.types import RewardInput
    from services.rewards.code_tests import CodeTests
    from services.schema import CodeTestsConfig

    reward = CodeTests(CodeTestsConfig(sandbox=SandboxConfig(workers=2, uid_base=62100, run_timeout=2.0)))
    row = generate("pyrev", 1)[0].row()
    right = row["answer"] + "\nimport os, sys, time\nsys.stdout.flush()\n"
    endings = {"ends": "", "crashes": "raise ValueError", "is killed": "os.abort()", "hangs": "time.sleep(60)"}
    scores = {
        name: loop.run_until_complete(reward(RewardInput(row, right + end)))["reward"] for name, end in endings.items()
    }
    assert scores == {"ends": 1.0, "crashes": 0.0, "is killed": 0.0, "hangs": 0.0}
    # With tests as well, a failed test is not the program's crash: the output still counts
    # when the program ended cleanly, and not when it crashed after printing.
    both = {**row, "tests": ["assert 1 == 2"]}
    scores = {
        name: loop.run_until_complete(reward(RewardInput(both, right + end)))["reward"]
        for name, end in endings.items()
        if name != "hangs"
    }
    assert scores == {"ends": 0.5, "crashes": 0.0, "is killed": 0.0}
    assert sandbox_pids() == []


def test_a_sandbox_that_crashes_makes_the_reward_unavailable(loop):
    from forge.types import RewardInput, RewardUnavailable
    from services.rewards.code_tests import CodeTests
    from services.schema import CodeTestsConfig

    reward = CodeTests(CodeTestsConfig(sandbox=SandboxConfig(workers=2, uid_base=61300)))
    slow = "import time\ntime.sleep(10)\ndef f(x):\n    return 2 * x"
    assert loop.run_until_complete(reward(RewardInput(MBPP_ROW, "def f(x): return 2 * x")))["reward"] > 0

    async def crash_during_a_run():
        scoring = asyncio.ensure_future(reward(RewardInput(MBPP_ROW, slow)))
        await asyncio.sleep(1.0)
        os.kill(reward.pool.launcher.proc.pid, 9)  # the sandbox's launcher dies under a run
        return await scoring

    start = time.perf_counter()
    with pytest.raises(RewardUnavailable) as e:
        loop.run_until_complete(crash_during_a_run())
    assert e.value.kind == "sandbox" and "launcher process died" in str(e.value)
    assert time.perf_counter() - start < 5 and sandbox_pids() == []  # the run was killed with it, no wait
    # the next sample gets a new launcher
    assert loop.run_until_complete(reward(RewardInput(MBPP_ROW, "def f(x): return 2 * x")))["reward"] > 0


def test_reward_service_scores_with_code_tests(loop):
    from forge.tasks import generate
    from forge.types import RewardInput
    from services.rewards import Rewards
    from services.schema import CodeTestsConfig, RewardsConfig

    cfg = CodeTestsConfig(sandbox=SandboxConfig(workers=2, uid_base=61400))
    rewards = loop.run_until_complete(Rewards.options().as_service(RewardsConfig({"code_tests": 1.0}, code_tests=cfg)))
    try:
        row = generate("pyrev", 1)[0].row()
        scores = loop.run_until_complete(
            rewards.score.route([RewardInput(row, row["answer"]), RewardInput(row, "print('no')")])
        )
        assert [(s.reward, s.correct, s.unavailable) for s in scores] == [(1.0, 1.0, None), (0.0, 0.0, None)]
    finally:
        loop.run_until_complete(rewards.shutdown())


def test_a_program_cannot_pass_for_a_sandbox_that_failed(loop):
    """The sentinel attack: a program that prints the launcher's set-up message and exits with its
    code used to raise SandboxError, so its reward was 'unavailable' and GRPO masked its whole
    group (a policy could escape every bad group this way). Set-up failures now travel on a pipe
    the program never holds: the fake is an ordinary failing program, and a real set-up failure
    (here: a working directory that does not exist) is still reported as one."""
    from forge.types import RewardInput, RewardUnavailable
    from services.rewards.code_tests import CodeTests
    from services.schema import CodeTestsConfig

    reward = CodeTests(CodeTestsConfig(sandbox=SandboxConfig(workers=2, uid_base=61500)))
    fake = "import sys\nprint('forge sandbox launcher: OSError: boom', file=sys.stderr)\nsys.exit(125)\n"
    assert loop.run_until_complete(reward(RewardInput(MBPP_ROW, fake)))["reward"] == 0.0
    spec = reward.pool._spec
    reward.pool._spec = lambda *a: {**spec(*a), "cwd": "/nonexistent-forge-cwd"}
    with pytest.raises(RewardUnavailable) as e:
        loop.run_until_complete(reward(RewardInput(MBPP_ROW, "def f(x): return 2 * x")))
    assert "could not set up the run" in str(e.value) and "nonexistent-forge-cwd" in str(e.value)
    assert sandbox_pids() == []


def test_a_program_faking_its_counts_scores_at_most_its_tests(loop):
    """The reward of the fd attack (it was 499.5): 0, and never past 1 whatever the report says."""
    from forge.types import RewardInput
    from services.rewards.code_tests import CodeTests
    from services.sandbox import _passed
    from services.schema import CodeTestsConfig

    reward = CodeTests(CodeTestsConfig(sandbox=SandboxConfig(workers=1, uid_base=61600)))
    spoof = "import os\nos.write(3, b'{\"passed\": 999}')\nos._exit(0)"
    assert loop.run_until_complete(reward(RewardInput(MBPP_ROW, spoof))) == {"reward": 0.0, "correct": False}
    assert [_passed(r, 3) for r in ({"passed": 999}, {"passed": -1}, {"passed": True}, {"passed": 2.0}, [], None)] == [
        0
    ] * 6
    assert _passed({"passed": 2}, 3) == 2


# 20 children of 400 MB each (8 GB: safe on this machine without the cgroup), each under the
# address-space rlimit of 512 MB; each writes a byte once its memory is touched.
MANY_CHILDREN = """\
import os, select, time
r, w = os.pipe()
for _ in range(20):
    if os.fork() == 0:
        block = bytearray(b"x") * (400 << 20)
        os.write(w, b"1")
        time.sleep(30)
        os._exit(0)
os.close(w)
got, deadline = 0, time.time() + 20
while time.time() < deadline and select.select([r], [], [], deadline - time.time())[0]:
    chunk = os.read(r, 64)
    if not chunk:
        break
    got += len(chunk)
print(got, flush=True)
"""
FILES = """\
import os
n = 0
try:
    while n < 1_000_000:
        open(f"/tmp/f{n}", "w").close()
        n += 1
except OSError as e:
    print(e.errno, end=" ")
print(n)
"""


def test_a_run_is_bounded_as_a_whole_not_per_process(loop, sandbox):
    """Its processes together hold at most the run's memory_limit_MB (a cgroup per slot); the
    kernel kills the run's processes first (oom_score_adj) and the status says oom."""
    r = run(loop, sandbox, MANY_CHILDREN, run_timeout=40, memory_limit_MB=512)
    assert r.status == "oom" and (r.stdout.strip() or "0") in {"0", "1"}, r
    assert run(loop, sandbox, "print(open('/proc/self/oom_score_adj').read())").stdout == "1000\n\n"


def test_a_million_files_in_tmp_stop_at_its_inode_limit(loop, sandbox):
    r = run(loop, sandbox, FILES, run_timeout=60)
    errno, made = r.stdout.split()
    assert r.status == "ok" and errno == "28" and int(made) < CFG.tmpfs_inodes, r  # ENOSPC


def test_isolation_auto_refuses_what_it_cannot_isolate(monkeypatch):
    """Without a cgroup per slot (or namespaces, or root), `auto` refuses to run untrusted code,
    naming what is missing and the key that overrides it; `unsafe_local` runs, and says so."""
    from services import sandbox as sb

    monkeypatch.setattr(sb.SlotCgroups, "make", classmethod(lambda cls, pid: "no cgroup memory controller (test)"))

    async def start(isolation):
        pool = sb.SandboxPool(SandboxConfig(workers=1, uid_base=61500, isolation=isolation))
        await pool.start()
        try:
            return (await pool.run("print(2)")).stdout
        finally:
            await pool.stop()

    with pytest.raises(
        sb.SandboxError,
        match=r"missing a cgroup per slot \(no cgroup memory controller \(test\)\).*"
        r"sandbox.isolation: unsafe_local for trusted code only",
    ):
        asyncio.run(start("auto"))
    assert asyncio.run(start("unsafe_local")) == "2\n"
    with pytest.raises(Exception, match="'sandbox.isolation' must be one of auto, unsafe_local, got 'namespaces'"):
        SandboxConfig(isolation="namespaces").validate()


def test_slot_cgroups_on_cgroup_v2(tmp_path):
    """The v2 layout (a fake cgroupfs): the slots' base under this process's cgroup, controllers
    enabled for its children, a run's limits, the kernel's oom kills read back, stale bases of
    sandboxes gone removed."""
    from services.sandbox_cgroup import SlotCgroups

    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    own = tmp_path / "job"
    (own / "forge-sandbox-4000000").mkdir(parents=True)  # a sandbox gone
    cg = SlotCgroups.make(os.getpid(), root=tmp_path, proc_cgroup="0::/job\n")
    assert isinstance(cg, SlotCgroups) and cg.v2
    assert not (own / "forge-sandbox-4000000").exists()
    assert (own / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    base = own / f"forge-sandbox-{os.getpid()}"
    assert cg.slot(60001) == [str(base / "60001" / "cgroup.procs")]
    cg.limit(60001, 512 << 20, 64, 0.5)
    assert (base / "60001" / "memory.max").read_text() == str(512 << 20)
    assert (base / "60001" / "cpu.max").read_text() == "50000 100000"  # half of each 100 ms
    assert (base / "60001" / "pids.max").read_text() == "64"
    (base / "60001" / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    assert cg.oom_kills(60001) == 2
    assert SlotCgroups.make(1, root=tmp_path / "none", proc_cgroup="0::/\n").startswith("no cgroup memory and pids")


WORLD_WRITABLE = """\
import os, stat
wrote = []
for top in ("/", "/dev", "/run", "/var", "/tmp", "/etc", "/usr", "/opt", "/srv", "/home", "/root", "/mnt"):
    for root, dirs, files in os.walk(top):
        if root.startswith(("/proc", "/sys")):
            dirs[:] = []
            continue
        try:
            writable = os.stat(root).st_mode & stat.S_IWOTH
        except OSError:
            continue
        if writable:
            try:
                with open(os.path.join(root, "MARK"), "w") as f:
                    f.write("planted")
                wrote.append(root)
            except OSError:
                pass
print(sorted(set(wrote)))
"""
READ_MARKS = """\
import os
found = []
for root, dirs, files in os.walk("/"):
    if root.startswith(("/proc", "/sys")):
        dirs[:] = []
    elif "MARK" in files:
        found.append(root)
print(sorted(found))
"""


def test_no_world_writable_host_directory_carries_anything_to_a_later_run(loop, sandbox):
    """A run writes into every world-writable directory it can see (the host's /run/lock,
    /var/tmp, /dev/shm, /dev/mqueue, ... before its root was its own); a later run, in another
    slot, finds none of it: its root is the interpreter, its libraries and its own tmpfs."""
    mark = f"forge-mark-{uuid.uuid4().hex}"
    wrote = run(loop, sandbox, WORLD_WRITABLE.replace("MARK", mark), run_timeout=60)
    found = run(loop, sandbox, READ_MARKS.replace("MARK", mark), run_timeout=60)
    try:
        written = eval(wrote.stdout)
        assert set(written) <= {"/tmp", "/var/tmp", "/dev/shm"}, written  # its own tmpfs only
        assert eval(found.stdout) == [], found
    finally:  # the unprotected sandbox planted its marks in the host's directories
        subprocess.run(["find", "/", "-xdev", "-name", mark, "-delete"], capture_output=True)


def test_the_host_is_not_in_a_runs_root(loop, sandbox):
    """Nothing of the host's but the system's programs and libraries: not the checkout, not
    forge's runs, not the host's /etc or /home."""
    here = Path(__file__).resolve().parent.parent
    code = f"""\
import os
print([p for p in ("{here}/README.md", "/etc/hostname", "/etc/os-release", "/root", "/home") if os.path.exists(p)])
print(sorted(os.listdir("/dev")))
"""
    r = run(loop, sandbox, code)
    visible, dev = r.stdout.splitlines()
    assert eval(visible) == [], r
    assert set(eval(dev)) <= {"fd", "full", "null", "random", "shm", "stderr", "stdin", "stdout", "urandom", "zero"}, (
        dev
    )


def test_root_never_writes_or_chowns_through_a_symlink_in_a_slot(tmp_path):
    """A symlink left in a slot's directory (under `unsafe_local` it is the program's own
    directory) where the next run's files go: root replaces it, never writes or chowns its
    target."""
    from services import sandbox as sb

    victim = tmp_path / "victim"
    victim.write_text("precious")
    pool = sb.SandboxPool(SandboxConfig(workers=1, uid_base=61650))
    work = pool.dir / "61650"
    work.mkdir(mode=0o750, exist_ok=True)
    (work / "main.py").symlink_to(victim)
    (work / "files").mkdir(exist_ok=True)
    (work / "files" / "data.txt").symlink_to(victim)
    pool.namespaces = True
    pool._write_files(work, sb._Request("print(1)", "python", b"", files={"data.txt": b"mine"}), 61650)
    assert victim.read_text() == "precious" and victim.stat().st_uid == os.geteuid()
    assert (work / "main.py").read_text() == "print(1)" and not (work / "main.py").is_symlink()
    sb._empty(work)


def test_a_run_never_reads_the_slots_previous_program(loop):
    """A slot keeps its program's file between runs (written over in place): a later run of the
    slot, in either language, finds neither the previous program's code nor its other-language file."""
    from services import sandbox as sb

    async def runs() -> list:
        pool = sb.SandboxPool(SandboxConfig(workers=1, uid_base=61660))
        await pool.start()
        try:
            look = 'cat "$(dirname "$0")"/main.py "$(dirname "$0")"/main.sh 2>/dev/null'
            return [
                await pool.run("print('SECRET-ONE-' * 40)", "python"),
                await pool.run(look, "bash"),
                await pool.run("echo SECRET-TWO-SECRET-TWO-SECRET-TWO", "bash"),
                await pool.run("import pathlib; print(pathlib.Path(__file__).with_name('main.sh').exists())", "python"),
                await pool.run("echo x", "bash"),
                await pool.run(look, "bash"),
            ]
        finally:
            await pool.stop()

    one, looked, two, sees_sh, _, looked_again = loop.run_until_complete(runs())
    assert one.status == two.status == "ok" and "SECRET" not in looked.stdout, looked
    assert looked.stdout.startswith("cat "), looked  # it reads the slot's directory: its own program, only
    assert sees_sh.stdout == "False\n" and "SECRET" not in looked_again.stdout, (sees_sh, looked_again)


def open_fds() -> set[str]:
    """What this process's descriptors refer to (each with its number)."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fds.add(f"{os.readlink(f'/proc/self/fd/{fd}')} (fd {fd})")
    return fds


@pytest.mark.parametrize("language", ["python", "bash"])
def test_a_caller_that_gives_up_while_its_run_starts_leaves_nothing(loop, language):
    """The caller is cancelled after the run's start was asked of the launcher (a Python
    program's fork, or the namespaces of a slot before its first exec'd program) and before the
    answer: the run that starts is killed and gone before the slot serves again, no answer comes
    to a future nobody awaits, and no descriptor is left open."""
    from services import sandbox as sb

    uids = [61670, 61671]  # the probe at start takes the first: the call below gets the second, new
    errors = []
    code = "import time; time.sleep(30)" if language == "python" else "sleep 30"

    async def scenario() -> tuple:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: errors.append(ctx.get("message")))
        fds_before = open_fds()
        pool = sb.SandboxPool(SandboxConfig(workers=2, uid_base=uids[0]))
        await pool.start()
        try:
            pending = pool.launcher.waiting if language == "python" else pool.launcher.asked
            task = asyncio.ensure_future(pool.run(code, language))
            deadline = time.monotonic() + 10
            while not pending and time.monotonic() < deadline:  # asked of the launcher, not yet answered
                await asyncio.sleep(0)
            assert pending, "the run never asked the launcher"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.3)  # where the run was left to itself, it has started by now
            left = [p for uid in uids for p in sb._pids_of_uid(uid)]
            after = [await pool.run("echo next", "bash") for _ in uids]  # each slot serves again
        finally:
            await pool.stop()
        await asyncio.sleep(0.2)  # a late answer would land by now
        # but the pool's locks on its directory and uids, held while this process lives
        return left, after, [f for f in open_fds() - fds_before if not f.startswith(str(pool.dir.parent))]

    left, after, leaked = loop.run_until_complete(scenario())
    assert left == [], f"the cancelled run's processes outlived the call: {left}"
    assert [r.stdout for r in after] == ["next\n"] * 2 and errors == [] and leaked == [], (after, errors, leaked)


def test_a_run_whose_start_fails_midway_leaves_nothing_and_never_runs_twice(loop, monkeypatch):
    """The pool's own calls fail while it starts the helper of an exec'd program (the slot's
    server): a descriptor not duplicated (nothing started: the launcher's fork runs it, no
    descriptor left open), or the started helper's process not watchable (the run fails with why,
    its process is killed and reaped, and it is not started a second time by the launcher)."""
    from services import sandbox as sb

    uid = 61680
    real_fcntl, real_pidfd_open = sb.fcntl.fcntl, sb.os.pidfd_open
    failures = {"fcntl": 0, "pidfd_open": 0}

    def fcntl(fd, cmd, arg=0):
        if cmd == sb.fcntl.F_DUPFD_CLOEXEC and failures["fcntl"]:
            failures["fcntl"] -= 1
            if failures["fcntl"] == 0:  # the third duplicate of the run
                raise OSError(24, "Too many open files")
        return real_fcntl(fd, cmd, arg)

    def pidfd_open(pid, flags=0):
        if failures["pidfd_open"]:
            failures["pidfd_open"] = 0
            raise OSError(24, "Too many open files")
        return real_pidfd_open(pid, flags)

    async def scenario() -> tuple:
        pool = sb.SandboxPool(SandboxConfig(workers=1, uid_base=uid))
        await pool.start()
        try:
            await pool.run("echo warm", "bash")  # the slot's namespaces exist
            await pool.servers[uid].stop()  # so the next run starts the slot's server
            before = open_fds()
            monkeypatch.setattr(sb.fcntl, "fcntl", fcntl)
            monkeypatch.setattr(sb.os, "pidfd_open", pidfd_open)
            failures["fcntl"] = 3
            dup_failed = await pool.run("echo once", "bash")
            failures["pidfd_open"] = 1
            with pytest.raises(sb.SandboxError, match="could not watch the run's process: .*Too many open files"):
                await pool.run("sleep 30", "bash")
            left = sb._pids_of_uid(uid)
            after = await pool.run("echo next", "bash")
            await pool.servers[uid].stop()
            leaked = [f for f in open_fds() - before if not f.startswith(str(pool.dir.parent))]
        finally:
            await pool.stop()
        return dup_failed, left, after, leaked

    dup_failed, left, after, leaked = loop.run_until_complete(scenario())
    assert dup_failed.stdout == "once\n" and after.stdout == "next\n", (dup_failed, after)
    assert left == [] and leaked == [], (left, leaked)


# ---- second round: the kernel's surface, the CPU, the grader, the tests file, the hash seed ---

# Raw syscalls (x86_64 numbers): each printed with its errno (0: it worked). Creating a user
# namespace, keyrings (a per-uid keyring outlives a run: a later run of the slot reads it),
# ptrace, mount, bpf, perf and modules are the kernel's surface a program has no use for.
KERNEL_SURFACE = """\
import ctypes, os, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(nr, *args)
    if r == 0 and nr == 56:  # clone's child
        os._exit(0)
    if r > 0 and nr == 56:
        os.waitpid(r, 0)
    return ctypes.get_errno() if r == -1 else 0
attr = ctypes.create_string_buffer(128)
got = {
    "unshare(NEWUSER)": call(272, 0x10000000),
    "clone(NEWUSER)": call(56, 0x10000000 | 17, 0, 0, 0, 0),
    "clone3": call(435, 0, 0),
    "setns": call(308, os.open("/proc/self/ns/net", os.O_RDONLY), 0),
    "add_key": call(248, b"user", b"forge", b"carried", 7, ctypes.c_long(-4)),
    "keyctl": call(250, 0, ctypes.c_long(-4), 0),
    "request_key": call(249, b"user", b"forge", None, 0),
    "mount": call(165, b"none", b"/tmp", b"tmpfs", 0, None),
    "bpf": call(321, 0, attr, 128),
    "perf_event_open": call(298, attr, 0, -1, -1, 0),
    "init_module": call(175, None, 0, b""),
    "io_uring_setup": call(425, 1, attr),
    "userfaultfd": call(323, 0),
}
t = threading.Thread(target=lambda: None)
t.start()
t.join()
still = subprocess.run(["/bin/sh", "-c", "echo works"], capture_output=True, text=True).stdout.strip()
pid = os.fork()
if pid == 0:
    os._exit(7)
print(got)
print(still, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
print(call(101, 0, 0, 0, 0), flush=True)  # PTRACE_TRACEME, last: its tracer is the run's pid 1
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the program's syscall numbers are x86_64's")
def test_a_program_cannot_reach_the_kernels_surface(loop, sandbox):
    """A seccomp filter in every run: namespaces, keyrings, ptrace, mounts, bpf, perf, modules,
    io_uring, userfaultfd fail with EPERM (clone3 with ENOSYS, so libc falls back to clone, where
    the filter sees the flags); threads, fork and exec keep working."""
    r = run(loop, sandbox, KERNEL_SURFACE)
    got, still, traceme = (r.stdout.splitlines() + ["", "", ""])[:3]
    errnos = {**eval(got or "{}"), "ptrace(TRACEME)": int(traceme or -1)}
    assert errnos.pop("clone3") == 38, r  # ENOSYS
    assert errnos == dict.fromkeys(errnos, 1), r  # EPERM, every one
    assert still == "works 7", r
    r = run(loop, sandbox, "print(open('/proc/self/status').read())")
    assert "Seccomp:\t2" in r.stdout, r


UNLISTED = """\
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    return ctypes.get_errno() if libc.syscall(nr, *args) == -1 else 0
print({"sysfs": call(139, 3), "personality": call(135, 0xFFFFFFFF), "modify_ldt": call(154, 0, None, 0)})
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the program's syscall numbers are x86_64's")
def test_a_syscall_on_no_list_is_not_there_for_a_program(loop, sandbox):
    """The filter is an allow-list: syscalls that are on neither list (sysfs, personality,
    modify_ldt; under a denylist all three ran and returned 0) fail with ENOSYS, as on a kernel
    without them."""
    r = run(loop, sandbox, UNLISTED)
    assert r.status == "ok" and eval(r.stdout) == {"sysfs": 38, "personality": 38, "modify_ldt": 38}, r


# What programs and their tools do, each of which needs its syscalls on the allow-list.
PYTHON_WORKLOAD = """\
import asyncio, concurrent.futures, hashlib, mmap, multiprocessing, os, select, signal, socket
import sqlite3, subprocess, tempfile, threading, time, zlib
def square(x):
    return x * x
a, b = socket.socketpair()
a.sendall(b"ping")
got = b.recv(4)
with multiprocessing.get_context("fork").Pool(2) as pool:
    squares = pool.map(square, range(4))
with concurrent.futures.ThreadPoolExecutor(4) as ex:
    threads = sum(ex.map(square, range(4)))
with tempfile.TemporaryDirectory() as d:
    db = sqlite3.connect(os.path.join(d, "x.db"))
    db.execute("create table t (x)"); db.execute("insert into t values (1)"); db.commit()
    rows = db.execute("select count(*) from t").fetchone()[0]
    with open(os.path.join(d, "m"), "w+b") as f:
        f.write(b"0" * 4096); f.flush()
        m = mmap.mmap(f.fileno(), 4096); m[0:1] = b"1"; mapped = m[0:1]; m.close()
    os.rename(os.path.join(d, "m"), os.path.join(d, "n")); os.symlink("n", os.path.join(d, "l"))
    listed = sorted(os.listdir(d))
signal.signal(signal.SIGALRM, lambda *_: None); signal.setitimer(signal.ITIMER_REAL, 0.01); time.sleep(0.05)
ep = select.epoll(); ep.register(a.fileno(), select.EPOLLOUT); polled = len(ep.poll(0.1))
sub = subprocess.run(["python3", "-c", "print(6 * 7)"], capture_output=True, text=True).stdout.strip()
loop = asyncio.new_event_loop(); ran = loop.run_until_complete(asyncio.sleep(0.01, "asyncio")); loop.close()
print(got, squares, threads, rows, mapped, listed, polled, sub, ran, hashlib.sha256(zlib.compress(b"x")).hexdigest()[:4])
"""
BASH_WORKLOAD = """\
set -euo pipefail
printf 'b\\na\\nc\\n' > in.txt
sort in.txt | tr a-z A-Z | head -2 | paste -sd, -
cat in.txt | wc -l; sed -n 2p in.txt; grep -c . in.txt; wc -l < in.txt
mkdir -p d/e && cp in.txt d/e/ && find d -type f | xargs cat | md5sum | cut -c1-4
tar czf d.tgz d && tar tzf d.tgz | wc -l; ln -s in.txt l && readlink l && stat -c %s in.txt
(sleep 0.01 & wait); seq 3 | while read -r i; do echo -n "$i"; done; echo; date +%Y > /dev/null; echo ok
"""


def test_python_and_bash_with_their_tools_run_under_the_allow_list(loop, sandbox):
    """Threads, fork pools, sockets, epoll, asyncio, timers, mmap, sqlite, subprocesses; and a
    bash pipeline of coreutils, sed, grep, find, tar, gzip: every syscall they make is allowed."""
    r = run(loop, sandbox, PYTHON_WORKLOAD)
    assert r.status == "ok" and r.stdout == (
        "b'ping' [0, 1, 4, 9] 14 1 b'1' ['l', 'n', 'x.db'] 1 42 asyncio "
        + hashlib.sha256(zlib.compress(b"x")).hexdigest()[:4]
        + "\n"
    ), r
    r = run(loop, sandbox, BASH_WORKLOAD, language="bash")
    md5 = hashlib.md5(b"b\na\nc\n").hexdigest()[:4]
    assert r.status == "ok" and r.stdout == f"A,B\n3\na\n3\n3\n{md5}\n3\nin.txt\n6\n123\nok\n", r


# Four processes busy for 2 s of wall time: the cores they got, from their CPU time.
BUSY = """\
import os, time
deadline = time.time() + 2.0
for _ in range(4):
    if os.fork() == 0:
        while time.time() < deadline:
            pass
        os._exit(0)
for _ in range(4):
    os.wait()
t = os.times()
print(round((t.children_user + t.children_system) / 2.0, 2))
"""


def test_a_slots_busy_processes_get_at_most_its_cpu_share():
    """Busy processes in every slot took the host's cores from the trainer and the generators for
    the whole timeout; a slot's cgroup now bounds its CPU (`sandbox.cpu_cores`): 4 busy processes
    of a slot get at most its 0.05 cores (unbounded, on this loaded 2-core machine, they took
    0.24-2 cores: the bound is set low so that the test tells the two apart under any load)."""
    from services import sandbox as sb

    async def cores():
        pool = sb.SandboxPool(SandboxConfig(workers=1, uid_base=61700, cpu_cores=0.05))
        await pool.start()
        try:
            return await pool.run(BUSY, run_timeout=20)
        finally:
            await pool.stop()

    r = asyncio.run(cores())
    assert r.status == "ok" and float(r.stdout) < 0.12, r
    with pytest.raises(Exception, match="'sandbox.cpu_cores' must be > 0"):
        SandboxConfig(cpu_cores=0).validate()


def test_the_grader_imports_no_module_the_program_names(loop, sandbox):
    """The program's side said which module a name is, and the grader imported it: a class
    called `module` with `__name__ = "this"` made the grader import `this` (its import prints).
    The grader now imports only a standard library module named as the test names it."""
    fake = 'class module:\n    __name__ = "this"\nf = module()\n'
    r = run(loop, sandbox, fake, tests=["assert f(1) == 2"])
    assert "Beautiful is better than ugly" not in r.stdout and r.tests_passed == 0, r
    real = "import math\nimport collections as c\n"
    r = run(loop, sandbox, real, tests=["assert math.sqrt(4) == 2", "assert c.Counter('aa')['a'] == 2"])
    assert r.tests_passed == 1 and "test 1 failed" in r.stderr, r  # the program's alias is not the test's name


def test_unsafe_local_as_root_never_hands_the_tests_to_the_program(monkeypatch):
    """Without namespaces (isolation: unsafe_local) the slot's uid owned the working directory,
    the tests' file included: the program read the expected values and passed. The tests now
    reach the grader on a file descriptor only, never a file."""
    from services import sandbox as sb

    async def no_namespaces(self):
        return False

    monkeypatch.setattr(sb.SandboxPool, "_probe_namespaces", no_namespaces)

    async def grade():
        pool = sb.SandboxPool(SandboxConfig(workers=1, uid_base=61800, isolation="unsafe_local"))
        await pool.start()
        try:
            assert not pool.namespaces
            return await pool.run(GRADE_ATTACKS["reads the expected values"], tests=["assert f(1) == 2"])
        finally:
            await pool.stop()

    r = asyncio.run(grade())
    assert (r.tests_passed, r.tests_total) == (0, 1), r


def test_fresh_interpreter_gives_each_run_its_own_hash_seed(loop):
    """Forked from one interpreter, every run saw the same hash() (a program could learn it in
    one run and use it in the next); `sandbox.fresh_interpreter` execs a new one per run."""
    from services import sandbox as sb

    async def hashes(fresh):
        pool = sb.SandboxPool(SandboxConfig(workers=1, uid_base=61900, fresh_interpreter=fresh))
        await pool.start()
        try:
            code = "import sys\nprint(hash('forge'), sys.flags.isolated, sys.argv == [__file__])"
            return [(await pool.run(code)).stdout for _ in range(2)]
        finally:
            await pool.stop()

    forked = asyncio.run(hashes(False))
    assert forked[0] == forked[1]  # the fork server's one seed: why the option exists
    fresh = asyncio.run(hashes(True))
    assert fresh[0] != fresh[1] and all(h.endswith(" 1 True\n") for h in fresh), fresh


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_syscall_filters_numbers_are_the_kernels(machine):
    """The filter's syscall numbers, per arch, as libseccomp (where the host has it) knows them."""
    import ctypes

    from services.sandbox_seccomp import AUDIT_ARCH, SYSCALLS, syscall_filter

    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        pytest.skip("no libseccomp on this host to check against")
    lib.seccomp_syscall_resolve_name_arch.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    theirs = {n: lib.seccomp_syscall_resolve_name_arch(AUDIT_ARCH[machine], n.encode()) for n in SYSCALLS[machine]}
    assert theirs == SYSCALLS[machine]
    assert syscall_filter("s390x") is None and len(syscall_filter(machine)) % 8 == 0


def run_filter(program: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    """The verdict of a seccomp filter (its cBPF, as the kernel runs it) for one syscall."""
    import struct

    ins, pc, acc = list(struct.iter_unpack("=HBBI", program)), 0, 0
    data = {0: nr, 4: arch, 16: arg0}
    while True:
        code, jt, jf, k = ins[pc]
        pc += 1
        if code == 0x20:
            acc = data[k]
        elif code == 0x06:
            return k
        elif code == 0x05:
            pc += k
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: acc & k != 0}[code]
            pc += jt if taken else jf


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_syscall_filters_verdict_for_every_number(machine):
    """Every syscall number gets its list's verdict from the filter's search: allowed, EPERM
    (denied), ENOSYS (on no list, or past the last known number); clone only without a
    CLONE_NEW* flag; another arch (and x86_64's x32 numbers) EPERM."""
    import errno

    from services.sandbox_seccomp import ALLOWED, AUDIT_ARCH, DENIED, SYSCALLS, X32_SYSCALL_BIT, syscall_filter

    program, nrs, arch = syscall_filter(machine), SYSCALLS[machine], AUDIT_ARCH[machine]
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    want = {nrs[n]: allow for n in ALLOWED if n in nrs} | {nrs[n]: eperm for n in DENIED if n in nrs}
    want |= {nrs["clone3"]: enosys, nrs["clone"]: allow}
    for nr in range(max(nrs.values()) + 100):
        assert run_filter(program, nr, arch) == want.get(nr, enosys), (machine, nr)
    assert run_filter(program, nrs["clone"], arch, arg0=0x20000000) == eperm  # CLONE_NEWPID
    assert run_filter(program, nrs["read"], arch ^ 1) == eperm
    if machine == "x86_64":
        assert run_filter(program, X32_SYSCALL_BIT | nrs["read"], arch) == eperm


# What an exec'd program sees of its sandbox (each line the same for every run of it)
EXEC_PROBE = """\
[ "$(id -u)" != 0 ] && echo not-root; echo "pid $$ home $HOME cwd $PWD"
grep -E '^(Seccomp|NoNewPrivs|CapEff):' /proc/self/status
echo fds $(ls /proc/$$/fd); echo processes $(ls /proc | grep -c '^[0-9]')
(echo > /dev/tcp/127.0.0.1/1) 2>/dev/null && echo network || echo no-network
touch /usr/forge-x 2>/dev/null && echo root-writable || echo root-read-only
echo tmp > /tmp/f && cat /tmp/f; ls / | tr '\\n' ' '; echo
echo limits $(ulimit -v) $(ulimit -u) $(ulimit -n) $(ulimit -f) $(ulimit -t)
echo oom_score_adj $(cat /proc/self/oom_score_adj) cgroups $(grep -c "/$(id -u)\\$" /proc/self/cgroup)
env | sort | tr '\\n' ' '; echo
setsid sleep 100 > /dev/null 2>&1 &
"""


def test_exec_d_programs_are_isolated_alike_with_or_without_the_exec_helper():
    """An exec'd program starts from services/sandbox_exec.c (compiled on start) or, where the
    host has no C compiler, from the launcher's forks: the same uid, syscall filter, namespaces,
    root, limits, environment and fds either way, and nothing of the run outlives it; a set-up
    failure is the sandbox's error naming what failed, an exit code 125 the program's own."""
    from services import sandbox as sb

    async def probe(helper: bool, uid_base: int) -> tuple:
        pool = sb.SandboxPool(SandboxConfig(workers=1, uid_base=uid_base, run_timeout=5.0))
        if not helper:
            pool_build, sb._build_exec_helper = sb._build_exec_helper, lambda _: None
        try:
            await pool.start()
        finally:
            if not helper:
                sb._build_exec_helper = pool_build
        leak = os.open(os.devnull, os.O_RDONLY)  # an fd of the pool's process, inheritable: never the program's
        os.set_inheritable(leak, True)
        try:
            assert (pool.exec_helper is not None) == helper
            probe = await pool.run(EXEC_PROBE, "bash")
            os.close(leak)
            left = sb._pids_of_uid(uid_base)
            timeout = await pool.run("setsid sleep 100 & sleep 100", "bash", run_timeout=0.5)
            own_125 = await pool.run("exit 125", "bash")
            spec = pool._spec
            pool._spec = lambda *a: {**spec(*a), "cwd": "/nonexistent-forge-cwd"}
            with pytest.raises(sb.SandboxError, match="could not set up the run.*nonexistent-forge-cwd"):
                await pool.run("echo never", "bash")
            return probe, left, timeout.status, (own_125.status, own_125.exit_code), sb._pids_of_uid(uid_base)
        finally:
            await pool.stop()

    fast = asyncio.run(probe(True, 61800))
    forked = asyncio.run(probe(False, 61810))
    assert fast[0].status == "ok" and fast[0].stdout == forked[0].stdout, (fast[0], forked[0])
    lines = fast[0].stdout.splitlines()
    assert lines[:6] == [
        "not-root",
        "pid 2 home /tmp cwd /tmp",
        "CapEff:\t0000000000000000",
        "NoNewPrivs:\t1",
        "Seccomp:\t2",
        "fds 0 1 2 255 3 4",  # the run's 4, bash's script (255) and its $(...) pipe
    ], lines
    assert lines[6:10] == ["processes 5", "no-network", "root-read-only", "tmp"], lines
    assert lines[12] == "oom_score_adj 1000 cgroups 3", lines  # the slot's memory, pids and cpu cgroups
    for run_ in (fast, forked):
        assert run_[1:] == ([], "timeout", ("error", 125), []), run_


# ---- a slot's server: the runs of exec'd programs share its namespaces, never their state ----

NEXT_RUN_ATTACKS = {  # what a run leaves for the next in its slot, and what the next then sees
    "files": (
        "echo x > /tmp/f; mkdir /tmp/d; echo y > /dev/shm/g; echo z > /var/tmp/h",
        "ls -A /tmp /dev/shm /var/tmp",
    ),
    "tmp's mode": ("chmod 750 /tmp", "stat -c %a /tmp"),
    "tmp's times": (  # a fresh /tmp's mtime is its mount's: within a minute of now, never the one set
        "touch -d @12345 /tmp",
        't=$(stat -c %Y /tmp); [ $(( $(date +%s) - t )) -lt 60 ] && echo recent || echo "$t"',
    ),
    "tmp's flags": ("chattr +d /tmp", "lsattr -d /tmp"),
    "SysV IPC": ("ipcmk -M 4096 && ipcmk -Q", "ipcs -m -q | grep -c '^0x' || true"),
    "processes": (
        "setsid sleep 100 >/dev/null 2>&1 </dev/null & nohup sleep 100 >/dev/null 2>&1 &",
        "n=0; for p in /proc/[0-9]*; do n=$((n + 1)); done; echo $n",  # bash's own glob: no process of its own
    ),
    "pid numbers": ("for i in $(seq 40); do /bin/true; done", "echo $$"),
    "tmp's extended attributes": (  # a Python program, exec'd: a fresh interpreter
        "import os; os.setxattr('/tmp', 'user.note', b'for the next run')",
        "import os; print(os.listxattr('/tmp'))",
    ),
    "the order of the tmpfs mounts": (  # which tmpfs were mounted afresh
        "touch /tmp/x",
        "cut -d' ' -f5 /proc/self/mountinfo | grep -E '^/(tmp|var/tmp|dev/shm)$'",
    ),
}
# Sockets sent over a unix socket no process holds (fds in flight) outlive the run's processes,
# with the names they bound (in the slot's network namespace) and the files they hold (charged to
# the slot's memory): until the kernel collects them, the next run reads the names, and runs out of
# memory where it would not have.
IN_FLIGHT = """
import os, socket
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(b"\\0left-by-the-last-run: the tests call f(17)")
fds = [s.fileno(), a.fileno(), b.fileno()]
for n in range(3):  # 30 MB each in /tmp, unlinked
    fd = os.open(f"/tmp/big{n}", os.O_RDWR | os.O_CREAT)
    os.unlink(f"/tmp/big{n}")
    os.write(fd, b"x" * (30 << 20))
    fds.append(fd)
socket.send_fds(b, [b"x"], fds)  # into a's own queue: a cycle no process holds
"""
LOOK_IN_FLIGHT = (
    "print([line.split('@')[1] for line in open('/proc/net/unix') if '@left' in line])\nx = b'x' * (60 << 20)"
)
for kind in ("exec'd", "forked"):
    NEXT_RUN_ATTACKS[f"sockets left in flight ({kind} Python)"] = (IN_FLIGHT, LOOK_IN_FLIGHT)


@pytest.mark.parametrize("attack", NEXT_RUN_ATTACKS)
def test_a_run_leaves_nothing_the_next_run_in_its_slot_can_see(loop, attack):
    """Exec'd programs of a slot run in one server's pid and mount namespaces, one after another:
    whatever a run leaves there (files in its tmpfs, their root's mode or times, SysV IPC objects,
    processes that left its session, how far the pids went, which tmpfs it changed) is gone when
    the next run starts, which sees what a first run sees. Sockets left in flight are collected
    after a run in either path (the slot's network namespace and memory are every run's)."""
    from services import sandbox as sb

    leave, look = NEXT_RUN_ATTACKS[attack]
    language = "python" if "import" in leave else "bash"
    fresh = language == "python" and "forked" not in attack  # exec'd through the slot's server
    cfg = SandboxConfig(workers=1, uid_base=61690, fresh_interpreter=fresh, memory_limit_MB=128)

    async def scenario() -> tuple[tuple, tuple]:
        pool = sb.SandboxPool(cfg)
        await pool.start()
        try:
            first = await pool.run(look, language)
            left = await pool.run(leave, language)
            assert left.status == "ok", left
            after = await pool.run(look, language)
            assert [s.alive for s in pool.servers.values()] == [True]  # one server served them
            return (first.status, first.stdout), (after.status, after.stdout)
        finally:
            await pool.stop()

    first, after = loop.run_until_complete(scenario())
    assert after == first and first[0] == "ok", (attack, first, after)


def test_a_slot_whose_server_died_between_runs_starts_another(loop):
    """A slot's server killed while idle (by the kernel out of memory, by an operator): the next
    run starts a new one and runs as any other; nothing of the old one is left."""
    from services import sandbox as sb

    async def scenario() -> list:
        pool = sb.SandboxPool(SandboxConfig(workers=1, uid_base=61695))
        await pool.start()
        try:
            results = [await pool.run("echo $$", "bash")]
            for victim in ("server", "its pid 1"):
                server = next(iter(pool.servers.values()))
                pid = server.pid
                if victim == "its pid 1":
                    pid = int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])
                os.kill(pid, signal.SIGKILL)
                await asyncio.wait_for(asyncio.shield(server.reaped), 5)
                results.append(await pool.run("echo $$", "bash"))
            results.append(sb._pids_of_uid(pool.uids[0]))
            return results
        finally:
            await pool.stop()

    *runs, left = loop.run_until_complete(scenario())
    assert [(r.status, r.stdout) for r in runs] == [("ok", "2\n")] * 3 and left == [], (runs, left)


def test_a_run_its_server_cannot_fork_is_that_run_s_set_up_error(loop):
    """The slot's pid 1 cannot fork a run (here: the slot's process limit holds only the server):
    that run is the sandbox's error naming why, on the run's own set-up pipe (never its output),
    and the server serves the next run."""
    from services import sandbox as sb

    async def scenario() -> tuple:
        pool = sb.SandboxPool(SandboxConfig(workers=1, uid_base=61696))
        await pool.start()
        try:
            first = await pool.run("echo one", "bash")
            pool.cfg.max_processes = 2  # the server's two processes
            with pytest.raises(sb.SandboxError, match="could not set up the run: OSError: fork: Resource"):
                await pool.run("echo two", "bash")
            pool.cfg.max_processes = SandboxConfig().max_processes
            return first, await pool.run("echo three", "bash"), [s.alive for s in pool.servers.values()]
        finally:
            await pool.stop()

    first, after, alive = loop.run_until_complete(scenario())
    assert (first.stdout, after.stdout, alive) == ("one\n", "three\n", [True])


LEAVE_SHM = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
size = 160 << 20
sid = libc.shmget(0, ctypes.c_size_t(size), 0o1600)  # IPC_PRIVATE, never removed
addr = libc.shmat(sid, None, 0)
ctypes.memset(addr, 1, size)  # its pages, charged to the slot's memory
libc.shmdt(ctypes.c_void_p(addr))
print(sid)
"""


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "exec'd"])
def test_shared_memory_a_run_leaves_is_not_charged_to_the_next(loop, fresh):
    """A run that leaves a SysV shared-memory segment of its slot's memory: its IPC namespace is
    freed only some ms after its last process ends, and until then the segment stays charged to
    the slot, where the next run (another episode) would run out of memory at a use its limit
    allows. The run's SysV objects are removed before its result returns."""
    from services import sandbox as sb

    cfg = SandboxConfig(workers=1, uid_base=61697, fresh_interpreter=fresh, memory_limit_MB=256)

    async def scenario() -> list[int]:
        pool = sb.SandboxPool(cfg)
        await pool.start()
        try:
            if pool.cgroups is None or "memory" not in pool.cgroups.dirs:
                pytest.skip("no memory cgroup on this machine")
            slot = pool.cgroups.dirs["memory"] / str(pool.uids[0])
            usage = slot / ("memory.current" if (slot / "memory.current").exists() else "memory.usage_in_bytes")
            charged = []
            for _ in range(3):
                await pool.run("print('warm')", "python")
                before = int(usage.read_text())
                left = await pool.run(LEAVE_SHM, "python")
                assert left.status == "ok", left
                charged.append((int(usage.read_text()) - before) >> 20)  # as the next run would start
            return charged
        finally:
            await pool.stop()

    charged = loop.run_until_complete(scenario())
    assert max(charged) < 64, charged  # MB of the 160 the runs left


def test_a_run_cannot_raise_the_limits_of_core_dumps_or_priorities(loop, sandbox):
    """Limits a run could raise to their host's hard values are pinned: core dumps (a host's
    core_pattern may hand them to a root helper), real-time priority (a real-time task escapes
    the cgroup's CPU share), nice, POSIX message queues' bytes."""
    code = (
        "import resource as r\n"
        "print([r.getrlimit(getattr(r, n)) for n in ('RLIMIT_CORE', 'RLIMIT_RTPRIO', 'RLIMIT_NICE', 'RLIMIT_MSGQUEUE')])\n"
    )
    out = run(loop, sandbox, code)
    assert out.stdout == f"{[(0, 0), (0, 0), (0, 0), (819200, 819200)]}\n", out


def test_slots_that_may_hold_more_memory_than_the_host_are_said(loop, caplog):
    """Each slot's memory limit holds, but slots that may together hold more than the host has
    leave the kernel to kill the largest run of any slot (another episode's) under pressure: said
    when the sandbox starts, with the numbers."""
    from services import sandbox as sb

    async def start() -> None:
        pool = sb.SandboxPool(SandboxConfig(workers=2, uid_base=61699, memory_limit_MB=64 << 20))
        await pool.start()
        await pool.stop()

    with caplog.at_level("WARNING"):
        loop.run_until_complete(start())
    assert "may hold 134217728 MB (workers 2 x memory_limit_MB 67108864)" in caplog.text, caplog.text
