"""The `code_tests` reward: each completion's program run against its task row's tests in the
sandbox (services/sandbox.py), MBPP/HumanEval style.

    rewards: {weights: {code_tests: 1.0}, code_tests: {all_pass: false, sandbox: {workers: 8}}}
"""

from __future__ import annotations

import asyncio
import re

from forge.types import RewardInput, RewardUnavailable
from services.sandbox import SandboxError, SandboxPool
from services.schema import CodeTestsConfig

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)


def extract_code(text: str) -> str:
    """The program in a completion: its last fenced code block, else the whole text."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def _tests(row: dict) -> list[str]:
    """The row's test statements; a ValueError naming the column when they are not a list of
    strings (a string alone would run character by character, its spaces passing)."""
    column = "tests" if row.get("tests") else "test_list"
    tests = row.get(column) or []
    if not isinstance(tests, (list, tuple)) or not all(isinstance(t, str) for t in tests):
        raise ValueError(
            f"code_tests: the task row's {column!r} must be a list of strings (Python statements), got {tests!r:.80}"
        )
    return list(tests)


class CodeTests:
    """The `code_tests` reward function: runs the completion's program against the task row's
    tests, MBPP/HumanEval style: `tests` (or MBPP's `test_list`, after its `test_setup_code`),
    assert statements run after the program, and/or `expected_output`, what it must print (given
    `stdin`). Returns the fraction passing (or all-or-nothing) and `correct`. Its sandbox runs in
    the reward service's process; a sandbox that cannot run the program makes the reward
    unavailable (RewardUnavailable("sandbox")), never wrong."""

    reward_range = (0.0, 1.0)  # the reward service fails anything else

    def __init__(self, cfg: CodeTestsConfig | None = None):
        self.cfg = cfg or CodeTestsConfig()
        self.cfg.sandbox.validate()
        self.pool: SandboxPool | None = None
        self.started: asyncio.Task | None = None

    async def __call__(self, s: RewardInput) -> dict[str, float]:
        row = s.task
        tests = _tests(row)
        expected = row.get("expected_output")
        if not tests and expected is None:
            raise ValueError("code_tests: the task row has no 'tests', 'test_list' or 'expected_output' column")
        code = extract_code(s.completion)
        if row.get("test_setup_code"):
            code = f"{row['test_setup_code']}\n{code}"
        try:
            r = await (await self._pool()).run(code, stdin=row.get("stdin") or "", tests=tests)
        except SandboxError as e:
            raise RewardUnavailable("sandbox", str(e)) from e
        # What it printed counts only if it then ended cleanly: output followed by a crash, a kill
        # or a timeout is a wrong answer. With tests, "error" may be a failed test's: the grader
        # says how the program itself ended.
        ended = r.program_exit == 0 if tests else r.status == "ok"
        printed = expected is not None and ended and r.stdout.strip() == str(expected).strip()
        passed, total = r.tests_passed + printed, len(tests) + (expected is not None)
        return {"reward": float(passed == total) if self.cfg.all_pass else passed / total, "correct": passed == total}

    async def _pool(self) -> SandboxPool:
        if self.started is None:  # started once, on the event loop that scores
            self.pool = SandboxPool(self.cfg.sandbox)
            self.started = asyncio.ensure_future(self.pool.start())
        await asyncio.shield(self.started)
        return self.pool
