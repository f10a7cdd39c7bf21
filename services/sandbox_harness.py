"""The code_tests harness: grades a program against its tests from a process the program cannot
touch. Standard library only: the sandbox runs it as a Python program of its own.

    forge_harness.py REPORT_FD TESTS_FD MAIN       # the tests as JSON on TESTS_FD; the count and the
                                                   # program's exit code out on REPORT_FD

The program runs in a child (its own process, the run's uid). The tests run here, in a process the
program cannot read or signal its way into undetected (not dumpable: no /proc/PID/mem, fds or
ptrace for the same uid), and never see the program's objects: each name a test uses that the
program defines is asked of the child, a function as a stub whose calls the child makes, a value
as plain data (None, bool, int, float, str, bytes, list, tuple, set, frozenset, dict of these, by
their exact types; a subclass's value as its base's), an exception as the builtin one it is, a
module only as the standard library's module of the name the test uses (checked here: the
program's side says what it likes). So a test compares plain data here: a
program cannot print or write its own counts (it holds neither REPORT_FD nor TESTS_FD), read the
expected values (they never leave this process), return an object that equals anything, or have
this process import a module of its choosing. A test that needs the program's own objects (a
class it defines, an argument it mutates in place, a module under its alias) fails.
"""

import ast
import builtins
import ctypes
import json
import os
import struct
import sys
import traceback
import types

PR_SET_DUMPABLE = 4
PLAIN = (type(None), bool, int, float, str, bytes)
CONTAINERS = (list, tuple, set, frozenset, dict)
# A subclass of a plain type (a Counter, a namedtuple, an IntEnum) crosses as its base's data,
# read by the base's own methods: no method of the program's class decides what is compared.
AS_BASE = {
    int: int.__int__,
    float: float.__float__,
    str: str.__str__,
    bytes: lambda x: bytes(memoryview(x)),
    **{t: lambda x, t=t: t(t.__iter__(x)) for t in (list, tuple, set, frozenset)},
    dict: lambda x: dict(dict.items(x)),
}
# What ends an iteration, not an error: the program's would end a test's `map(f, xs)` as empty.
ITERATION_ENDS = (StopIteration, StopAsyncIteration)
BIG_INT_BITS = 10_000  # past ~3000 digits an int crosses as hex: JSON's decimal stops at 4300
MAX_MESSAGE = 64 << 20  # the largest answer the grader reads: beyond it the program is wrong


class NotPlain(TypeError):
    pass


def encode(x, depth=0):
    """`x` as JSON-able data, by exact type (no subclass can carry its own __eq__ across: one
    of a plain type crosses as its base's value)."""
    if depth > 100:
        raise NotPlain("nested more than 100 deep")
    t = type(x)
    if t not in PLAIN and t not in CONTAINERS:
        x, t = as_base(x)
    if t is bytes:
        return {"b": x.hex()}
    if t is int and x.bit_length() > BIG_INT_BITS:
        return {"i": hex(x)}
    if t in PLAIN:
        return x if t is not float else {"f": repr(x)}  # repr keeps nan and inf exact
    if t in (list, tuple, set, frozenset):
        return {t.__name__: [encode(v, depth + 1) for v in x]}
    return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in x.items()]}


def as_base(x):
    """`x`, of a subclass of a plain type, as that type's own value; and the type."""
    for base, copy in AS_BASE.items():
        if issubclass(type(x), base):
            return copy(x), base
    raise NotPlain(f"a {type(x).__module__}.{type(x).__qualname__}, not plain data")


def decode(x):
    if not isinstance(x, dict):
        return x
    [(tag, v)] = x.items()
    if tag == "b":
        return bytes.fromhex(v)
    if tag == "i":
        return int(v, 16)
    if tag == "f":
        return float(v)
    if tag == "dict":
        return {decode(k): decode(w) for k, w in v}
    return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](decode(w) for w in v)


def send(fd, msg):
    data = json.dumps(msg).encode()
    os.write(fd, struct.pack("<I", len(data)))
    while data:
        data = data[os.write(fd, data) :]


def receive(fd):
    head = read_exactly(fd, 4)
    if head is None:
        return None
    size = struct.unpack("<I", head)[0]
    if size > MAX_MESSAGE:
        raise ValueError(f"a message of {size} bytes, over {MAX_MESSAGE}")
    return json.loads(read_exactly(fd, size) or b"null")


def read_exactly(fd, n):
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            return None
        out += chunk
    return out


# ---- the program's side -------------------------------------------------------------------


def serve(main, asks, answers):
    """The child: run the program, then answer the grader's questions about its names."""
    # its own __main__ module, as when it runs alone: what it pickles by name is looked up there
    module = types.ModuleType("__main__")
    module.__file__, module.__builtins__ = main, builtins
    sys.modules["__main__"] = module
    ns = module.__dict__
    sys.argv = [main]
    with open(main) as f:
        exec(compile(f.read(), main, "exec"), ns)
    while (ask := receive(asks)) is not None:
        try:
            send(answers, {"ok": answer(ns, ask)})
        except BaseException as e:  # noqa: BLE001 - the test sees the program's exception
            send(answers, {"error": f"{type(e).__name__}: {e}"[:2000], "type": type(e).__name__})


def answer(ns, ask):
    if "call" in ask:
        return encode(ns[ask["call"]](*decode(ask["args"]), **decode(ask["kwargs"])))
    value = ns.get(ask["name"], ask)  # `ask` itself: the program has no such name
    if value is ask:
        return {"missing": True}
    if type(value).__name__ == "module" and value.__name__ in sys.stdlib_module_names:
        return {"module": value.__name__}
    if callable(value):
        return {"callable": True}
    return {"value": encode(value)}


# ---- the grader's side --------------------------------------------------------------------


class ProgramError(Exception):
    """What the program raised (or why its answer was refused), as the test sees it."""


def program_error(reply):
    """The program's exception as a test catches it: a ProgramError that is also the builtin
    exception it names (or the nearest base of it that one can be made of), so a test expecting a
    ValueError gets one. Never one that is no Exception (SystemExit would end the grader), nor one
    that ends an iteration."""
    message = str(reply["error"])
    kind = getattr(builtins, str(reply.get("type")), None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)) or issubclass(kind, ITERATION_ENDS):
        return ProgramError(message)
    for base in kind.__mro__:
        try:
            return type("ProgramError", (ProgramError, base), {"__str__": BaseException.__str__})(message)
        except TypeError:  # a layout or constructor it cannot share (UnicodeDecodeError's)
            continue
    return ProgramError(message)


class Program:
    def __init__(self, asks, answers):
        self.asks, self.answers = asks, answers
        self.broken = None  # why the program's answers stopped making sense: no later one is read

    def ask(self, msg):
        if self.broken:
            raise ProgramError(self.broken)
        send(self.asks, msg)
        try:
            reply = receive(self.answers)
        except ValueError as e:  # its framing or JSON: what follows may be anything
            self.broken = f"the program's answer: {e}"
            raise ProgramError(self.broken) from None
        if type(reply) is not dict:
            raise ProgramError(
                "the program's process ended" if reply is None else "the program's answer is not an object"
            )
        if "error" in reply:
            raise program_error(reply)
        return reply["ok"]

    def stub(self, name):
        def call(*args, **kwargs):
            return decode(self.ask({"call": name, "args": encode(list(args)), "kwargs": encode(kwargs)}))

        call.__name__ = call.__qualname__ = name
        return call

    def names(self, test):
        """The program's names that `test` reads: stubs for its functions, its values as data.
        Builtins stay this process's own: a program's `len` never stands in for the test's."""
        found = {}
        for node in ast.walk(ast.parse(test)):
            if isinstance(node, ast.Name) and node.id not in found and not hasattr(builtins, node.id):
                got = self.ask({"name": node.id})
                if type(got) is not dict:
                    raise ProgramError(f"the program's answer for {node.id!r} is not an object")
                if "callable" in got:
                    found[node.id] = self.stub(node.id)
                elif "module" in got and got["module"] == node.id and node.id in sys.stdlib_module_names:
                    found[node.id] = __import__(node.id)  # as the test names it: never one the program chose
                elif "value" in got:
                    found[node.id] = decode(got["value"])
        return found


def grade(tests, program):
    passed = 0
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"<test {i}>", "exec"), {"__builtins__": builtins, **program.names(test)})
            passed += 1
        except Exception as e:  # noqa: BLE001 - a failed test, reported on stderr as before
            print(f"test {i} failed: {type(e).__name__}: {e}", file=sys.stderr)
    return passed


def main():
    report, tests_fd, main_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # before the fork: never readable by the program's uid
    asks_r, asks_w = os.pipe()
    answers_r, answers_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        for fd in (report, tests_fd, asks_w, answers_r):
            os.close(fd)
        libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # the program's process, as its own would be
        try:
            serve(main_path, asks_r, answers_w)
        except SystemExit as e:  # the program ended itself before its tests ran
            os._exit(e.code if isinstance(e.code, int) else 0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - as the interpreter prints it
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        sys.stdout.flush()
        os._exit(0)
    os.close(asks_r)
    os.close(answers_w)
    with os.fdopen(tests_fd, "rb") as f:
        tests = json.loads(f.read())
    passed = grade(tests, Program(asks_w, answers_r))
    os.close(asks_w)  # the child's loop ends
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    # The program's own ending beside the count: this process's exit code is a failed test's too.
    os.write(report, json.dumps({"passed": passed, "program_exit": code}).encode())
    os.close(report)
    sys.exit(code if code > 0 else 0 if passed == len(tests) else 1)


if __name__ == "__main__":
    main()
