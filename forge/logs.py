"""Where the libraries' output goes: one file per process in the run's `logs/` directory, so the
console holds forge's own lines (the progress bar, forge's messages, errors, the summary).

    logs.capture("runs/NAME/logs")   # an entry point (forge run, an app, forge bench/serve/eval), once
    spawn_procs(...)                 # each proc writes to runs/NAME/logs/ROLE-PID.log

A process forge spawns (forge.actor.spawn_procs) sends its stdout and stderr (vLLM, Monarch, torch,
triton, tracebacks) to `ROLE-PID.log`, ROLE its process title without `forge:` (what `ps` shows) and
PID its pid; its "forge" logger's warnings go there and to the console (the first of each kind),
through a pipe the capturing process relays (between the progress bar's redraws). The process
that calls `capture` sends what is written to its file descriptors 1 and 2 (Rust, C++, child
processes) and its libraries' logging and warnings to `main-PID.log`; Python's sys.stdout and
sys.stderr stay on the console. Without `capture` (a REPL), procs write to $FORGE_LOGS or
runs/logs. `forge -v` (FORGE_LOGS=console) leaves everything on the console.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from forge import console

ENV = "FORGE_LOGS"  # the directory, inherited by every process forge starts; "console": none
DEFAULT = "runs/logs"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True)
class Destination:
    """Where a spawned process writes: its file in `directory`; forge's own lines to `console`,
    the pipe the capturing process relays to its console, when on its host."""

    directory: Path
    console: str | None = None
    host: str = ""


def destination() -> Destination | None:
    """Where processes spawned now write (None: they keep the console)."""
    where = os.environ.get(ENV, DEFAULT)
    if where == "console":
        return None
    return Destination(Path(where).absolute(), _relay, socket.gethostname())


def show_everything() -> None:
    """`forge -v`: the libraries' output stays on the console, in every process forge starts."""
    os.environ[ENV] = "console"


def _redirect(d: Path, role: str) -> None:
    """This process's fds 1 and 2 to `d/ROLE-PID.log`."""
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / f"{role}-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


class _Plain(logging.Formatter):
    """The message alone: without the `[actor=...]` that Monarch puts before it in an actor."""

    def format(self, record: logging.LogRecord) -> str:
        text, prefix = super().format(record), getattr(record, "actor_prefix", "")
        while prefix and text.startswith(prefix):
            text = text.removeprefix(prefix)
        return text


def _to_console(logger: logging.Logger, stream) -> logging.Handler:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_Plain("%(message)s"))
    handler.setLevel(logging.WARNING)
    logger.addHandler(handler)
    return handler


class _FirstOfEachKind(logging.Filter):
    """The first record of each kind (`console.first`): a warning per sample (a reward failing
    on each) is one console line, not thousands."""

    def filter(self, record: logging.LogRecord) -> bool:
        return console.first(record.name, record.getMessage())


def advise(key: str, message: str) -> None:
    """forge's advice on something the user can fix (a library that costs speed when missing):
    on the console once per log directory, whichever process of the run sees it first."""
    to = destination()
    if to is not None:
        to.directory.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(to.directory / f".advised-{key}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return
    logging.getLogger("forge").warning("forge: %s", message)


def _relayed(to: Destination) -> int | None:
    if to.console is None or to.host != socket.gethostname():
        return None
    try:  # O_NONBLOCK: a relay that falls behind loses lines, it never stops this process
        return os.open(to.console, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return None


def process_to_file(to: Destination, role: str) -> None:
    """In a spawned process, first thing: fds 1 and 2 to `DIRECTORY/ROLE-PID.log`; the "forge"
    logger's warnings there and to the console, the first of each kind."""
    console_fd = _relayed(to)
    stream = os.fdopen(os.dup(2) if console_fd is None else console_fd, "w", buffering=1)
    _redirect(to.directory, role)
    forge = logging.getLogger("forge")
    _to_console(forge, stream).addFilter(_FirstOfEachKind())
    to_file = logging.StreamHandler(sys.stderr)  # every one, in the log file
    to_file.setFormatter(logging.Formatter(_FORMAT))
    forge.addHandler(to_file)


def _console_stream(stream, fd: int):
    """A stream on the console that `stream` writes to, if it writes to `fd` (else `stream`
    itself: a notebook's sys.stdout is the notebook's, not fd 1's)."""
    try:
        on_fd = stream.fileno() == fd
    except (AttributeError, OSError, ValueError):
        on_fd = False
    if not on_fd:
        return stream
    stream.flush()
    return os.fdopen(os.dup(fd), "w", buffering=1, encoding=stream.encoding, errors="backslashreplace")


_relay: str | None = None  # the pipe whose lines this process (it captured) writes to its console


def _start_relay() -> str:
    """A named pipe, in a directory of this user's alone, whose lines a thread writes to the
    console (sys.stderr): a spawned process writing to the console itself would write over this
    one's lines where the console is a file (`forge run ... 2> out.txt`)."""
    where = Path(tempfile.mkdtemp(prefix="forge-console-")) / "pipe"
    os.mkfifo(where, 0o600)
    fd = os.open(where, os.O_RDWR)  # read and write: never at end-of-file while the writers come and go
    atexit.register(shutil.rmtree, where.parent, ignore_errors=True)

    def relay() -> None:
        with os.fdopen(fd, "r", errors="replace") as lines:
            for line in lines:
                tqdm.write(line.rstrip("\n"), file=sys.stderr)

    threading.Thread(target=relay, daemon=True, name="forge-console-relay").start()
    return str(where)


def capture(d: str | Path) -> None:
    """For the rest of this process (an entry point's): the libraries' output to
    `d/main-PID.log`, and the processes it spawns to `d`; sys.stdout and sys.stderr (print,
    tqdm, tracebacks) stay on the console. Nothing with `forge -v` (FORGE_LOGS=console)."""
    global _relay
    if os.environ.get(ENV) == "console":
        return
    d = Path(d).absolute()
    os.environ[ENV] = str(d)
    # transformers' and huggingface_hub's progress bars (saving, loading) would draw on sys.stderr,
    # and vLLM's logger, made when vLLM is imported here (a benchmark's engine), on sys.stdout.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.__stdout__")
    again = _relay is not None  # a second run in this process: its own directory, the same handlers
    if not again:
        sys.stdout, sys.stderr = _console_stream(sys.stdout, 1), _console_stream(sys.stderr, 2)
        _relay = _start_relay()
    _redirect(d, "main")
    if again:
        return
    to_file = logging.StreamHandler(os.fdopen(2, "w", buffering=1, closefd=False))
    to_file.setFormatter(logging.Formatter(_FORMAT))
    root = logging.getLogger()
    root.addHandler(to_file)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)  # py.warnings -> the root logger -> the file
    forge = logging.getLogger("forge")
    forge.setLevel(logging.INFO)  # forge's INFO lines go to the file; its warnings to the console too
    _to_console(forge, sys.stderr)
