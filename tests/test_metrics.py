import json
import math
import sys
import time

import pytest

from apps.schema import APPS
from forge import curves
from forge.config import ConfigError, load_config
from forge.metrics import MetricWriter


def test_jsonl_tensorboard_console(tmp_path, capsys):
    w = MetricWriter(tmp_path, ["console", "jsonl", "tensorboard"], start_time=0.0)
    w.write(1, {"loss": 0.5, "reward": 0.25})
    w.write(2, {"loss": 0.25, "reward": 0.5})
    w.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["reward"] == 0.5 and rows[0]["wall_s"] > 0
    assert "loss=0.5" in capsys.readouterr().out

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("reward")] == [0.25, 0.5]


def test_unknown_backend_is_named(tmp_path):
    with pytest.raises(ValueError, match="unknown metrics backend.*'wandbx'"):
        MetricWriter(tmp_path, ["wandbx"])
    # with the config, before any service starts
    with pytest.raises(ConfigError, match=r"config key 'metrics': unknown backend\(s\) \['wandbx'\]"):
        load_config("configs/sft_tiny.yaml", ["metrics=[jsonl,wandbx]"], APPS["sft"])


def test_a_key_logged_every_step_is_tabled_per_step_beside_eval_rows(tmp_path):
    """Each eval is a row of its own (without reward_mean): reward_mean is still per step."""
    rows, wall = [], 0.0
    for step in range(1, 61):
        wall += 0.5
        rows.append({"step": step, "wall_s": wall, "reward_mean": 0.5})
        if step % 10 == 0:
            rows.append({"step": step, "wall_s": wall + 0.01, "eval/accuracy": 0.7})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert {"first 3 steps", "20-step mean >= 0.8", "last 25 steps"} <= set(
        curves.summary(curves.series(tmp_path), "reward_mean", 20)
    )
    assert "last 3 evals" in curves.summary(curves.series(tmp_path), "eval/accuracy", 2)


def test_record_metric_reduces_across_three_processes(tmp_path):
    import asyncio

    import numpy as np
    from service_actors import Recorder
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from forge.metrics import Reduce, record_metric

    per_rank = [[1.0, 2.0], [3.0], [10.0, -4.0, 0.5]]
    every = [v for vs in per_rank for v in vs] + [7.0]  # the controller records 7.0 too

    async def main():
        writer = MetricWriter(tmp_path, ["jsonl", "tensorboard"])
        actors = await Recorder.options(procs=3).as_actor()
        try:
            for reduce in Reduce:
                await actors.record.call(f"x_{reduce.value}", per_rank, reduce.value)
                record_metric(f"x_{reduce.value}", 7.0, reduce)
            row = await writer.flush(1)
            assert await writer.flush(2) == {"step": 2, "wall_s": pytest.approx(0, abs=60)}  # drained
        finally:
            await actors.shutdown()
            writer.close()
        return row

    row = asyncio.run(main())
    expected = {
        "mean": np.mean(every),
        "sum": np.sum(every),
        "max": 10.0,
        "min": -4.0,
        "std": np.std(every),
        "p50": 2.0,
        "p99": 10.0,
    }  # 7 values: the 4th and the 7th in order
    for name, value in expected.items():
        assert row[f"x_{name}"] == pytest.approx(value, rel=1e-9)
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["x_std"] == pytest.approx(expected["std"]) and first["step"] == 1
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert acc.Scalars("x_sum")[0].value == pytest.approx(expected["sum"])


def test_runs_in_one_process_flush_their_own_metrics(tmp_path):
    """Two runs in one controller (apps/grpo.py run_together), each in a metrics_scope: a run's
    flush holds what its tasks recorded and what its own processes recorded, never the other's."""
    import asyncio

    from service_actors import Recorder

    from forge.metrics import Reduce, metrics_scope, record_metric

    async def one(name: str, value: float, gate: asyncio.Barrier) -> dict:
        with metrics_scope():
            writer = MetricWriter(tmp_path / name, ["jsonl"])
            actors = await Recorder.options(procs=1).as_actor()
            try:
                await actors.record.call("procs", [[value]], "sum")
                record_metric("controller", value, Reduce.SUM)
                await gate.wait()  # both have recorded before either flushes
                return await writer.flush(1)
            finally:
                await actors.shutdown()
                writer.close()

    async def main():
        gate = asyncio.Barrier(2)
        return await asyncio.gather(one("a", 1.0, gate), one("b", 10.0, gate))

    a, b = asyncio.run(main())
    assert (a["procs"], a["controller"]) == (1.0, 1.0)
    assert (b["procs"], b["controller"]) == (10.0, 10.0)


def test_one_key_one_reduction():
    from forge.metrics import Reduce, _drain, record_metric

    record_metric("k", 1.0, Reduce.SUM)
    with pytest.raises(ValueError, match="'k' recorded with reduce=sum and max"):
        record_metric("k", 1.0, Reduce.MAX)
    _drain()


def wandb_log(run_dir, *written: bytes) -> bytes:
    """The bytes of a run's offline W&B log, once `written` are all in it: W&B's own process
    writes the file after `finish` returns."""
    (log,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    for _ in range(600):
        if all(w in log.read_bytes() for w in written):
            break
        time.sleep(0.1)
    return log.read_bytes()


def test_a_runs_wandb_log_has_its_rows_and_config_without_secrets(tmp_path):
    """W&B (offline, for `wandb sync` to upload) gets the run's rows and its resolved config, with
    an API key read into it masked (config.yaml keeps it, private to the user)."""
    from forge.run import Run

    overrides = [f"runs_dir={tmp_path}", "run_name=w", "metrics=[wandb]", "rewards.judge.api_key=sk-not-for-wandb"]
    run = Run("grpo", load_config("configs/grpo_tiny.yaml", overrides, APPS["grpo"]))
    run.writer.write(1, {"loss": 0.5})
    run.writer.close()
    logged = wandb_log(run.dir, b"loss", b"group_size")
    assert b"loss" in logged and b"group_size" in logged and b"sk-not-for-wandb" not in logged
    assert "sk-not-for-wandb" in (run.dir / "config.yaml").read_text()


def test_new_run_starts_empty_and_resume_drops_later_rows(tmp_path):
    w = MetricWriter(tmp_path, ["jsonl"], start_time=time.time() - 10.0)  # 10 s into the run
    for step in (1, 2, 3):
        w.write(step, {"loss": float(step)})
    w.close()
    resumed = MetricWriter(tmp_path, ["jsonl"], resume_step=2)  # checkpoint at 2, the run had reached 3
    assert 9.9 < time.time() - resumed.start < 20  # wall time goes on from step 2's row
    resumed.write(3, {"loss": 30.0})
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    MetricWriter(tmp_path, ["jsonl"]).close()  # the same run name started afresh
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_resume_that_cannot_write_keeps_the_metrics_it_had(tmp_path, monkeypatch):
    """A resume rewrites metrics.jsonl without the rows after its checkpoint; a full disk
    meanwhile must not leave it emptied (every row of the run lost)."""
    import pathlib

    w = MetricWriter(tmp_path, ["jsonl"])
    for step in (1, 2, 3):
        w.write(step, {"loss": float(step)})
    w.close()
    real_open = pathlib.Path.open

    class Full:
        def __init__(self, f):
            self.f = f

        def writelines(self, lines):
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def full_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return Full(f) if "w" in mode or "a" in mode else f

    monkeypatch.setattr(pathlib.Path, "open", full_open)
    with pytest.raises(OSError, match="No space left"):
        MetricWriter(tmp_path, ["jsonl"], resume_step=2)
    monkeypatch.setattr(pathlib.Path, "open", real_open)
    rows = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[:2] == [1, 2]


def _write_rows(run_dir, rows) -> None:
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_summary_counts_the_last_step_and_every_failure_and_skips_non_finite_values(tmp_path):
    """An eval of step 10 that ends after step 12's row is written last: the run still did 12
    steps. A step whose loss overflowed (inf, its update skipped) is left out of the trend as a
    NaN one is. Groups left out of a batch for non-finite values, and respawns that failed, are
    failures the run recovered from, as the metrics file counts them."""
    from forge.summary import summary

    rows = [{"step": s, "wall_s": 2.0 * s, "loss": 1.0, "groups_nonfinite": float(s == 3)} for s in range(1, 13)]
    rows[-1]["loss"] = float("inf")
    rows[5]["service/respawn_failures"] = 2.0
    rows.append({"step": 10, "wall_s": 30.0, "eval/accuracy": 0.5})
    _write_rows(tmp_path, rows)
    lines = summary(tmp_path, ("loss",)).splitlines()
    assert lines[0] == f"{tmp_path.name}: 12 steps in 30s"
    assert lines[1] == "  loss 1.000 -> 1.000 (mean of the first and last 1 steps)"
    assert lines[3] == "  failures: groups_nonfinite 1, service/respawn_failures 2"


def test_curves_leave_out_values_that_are_not_finite(tmp_path):
    """A NaN or inf (a diverged step) is no point of a curve: it would spread through the
    moving mean and the table's means, and a curves file holding it is not JSON."""
    for name, bad in (("nan", float("nan")), ("inf", float("inf"))):
        rows = [{"step": s, "wall_s": float(s), "reward_mean": 0.5} for s in range(1, 41)]
        rows[30]["reward_mean"] = bad
        (tmp_path / name).mkdir()
        _write_rows(tmp_path / name, rows)
    data = curves.save(tmp_path / "c.json", [tmp_path / "nan", tmp_path / "inf"])
    json.loads((tmp_path / "c.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in a curves file"))
    assert [curves.summary(s)["last 25 steps"] for s in data["runs"].values()] == [0.5, 0.5]


def test_the_curves_table_times_steps_by_their_training_rows(tmp_path):
    """Each eval is a row of its own, at its step, written when it ends (seconds later): a
    threshold reached at a step is timed by that step's training row, the seconds per step
    are between training rows, and an eval at step 0 (the starting policy) reaching a
    threshold is reached there."""
    rows = [{"step": 0, "wall_s": 0.0, "eval/accuracy": 0.9}]
    for step in range(1, 31):
        rows.append({"step": step, "wall_s": 2.0 * step, "reward_mean": 1.0})
        if step % 5 == 0:
            rows.append({"step": step, "wall_s": 2.0 * step + 1.5, "eval/accuracy": 0.9})
    _write_rows(tmp_path, rows)
    s = curves.series(tmp_path)
    row = curves.summary(s, "reward_mean", 20)
    assert row["20-step mean >= 0.8"] == "step 20 (40 s)" and row["median s / step"] == 2.0
    assert curves.summary(s, "eval/accuracy", 1)["first eval >= 0.8"] == "step 0 (0 s)"


def test_console_rows_do_not_run_into_the_progress_bar(tmp_path, capsys):
    """The `console` backend's rows go between the progress bar's redraws: printed over it,
    a row would go on the bar's line."""
    from tqdm import tqdm

    bar = tqdm(total=3, desc="grpo", file=sys.stdout)
    w = MetricWriter(tmp_path, ["console"], start_time=0.0)
    w.write(1, {"loss": 0.5})
    bar.close()
    (line,) = [line for line in capsys.readouterr().out.split("\n") if "loss=0.5" in line]
    assert line.split("\r")[-1].startswith("step=1 "), repr(line)


def test_a_slow_flush_costs_that_flush_alone(tmp_path, caplog):
    """A process whose values do not come within a flush's timeout (a busy host) loses that
    flush's values, counted and warned; its later values still reach later flushes."""
    import asyncio

    from forge.metrics import Reduce, _Acc, _scope, metrics_scope

    class Slow:
        """A collector whose first drain never answers, then answers each time."""

        def __init__(self):
            self.calls = 0
            self.drain = self

        async def call(self):
            self.calls += 1
            if self.calls == 1:
                await asyncio.Event().wait()
            acc = _Acc(Reduce.MEAN)
            acc.add(float(self.calls))
            return {0: {"loss": acc}}

    async def main():
        with metrics_scope():
            _scope.get().collectors[1] = Slow()
            writer = MetricWriter(tmp_path, ["jsonl"])
            try:
                return [await writer.flush(step, timeout=0.2) for step in (1, 2, 3)]
            finally:
                writer.close()

    with caplog.at_level("WARNING", logger="forge"):
        first, second, third = asyncio.run(main())
    assert first.get("metrics/flush_timeouts") == 1 and "loss" not in first
    assert (second["loss"], third["loss"]) == (2.0, 3.0) and "metrics/flush_timeouts" not in third
    assert sum("metrics" in r.getMessage() and "timed out" in r.getMessage() for r in caplog.records) == 1


def test_wandb_keeps_rows_written_after_a_later_step(tmp_path):
    """An eval's row is written when it ends, after later steps' rows, and a rewind writes its
    steps again: W&B drops a row logged at a step below the last one's, unless rows are
    plotted against their own `step`."""
    w = MetricWriter(tmp_path, ["wandb"])
    w.write(12, {"loss": 0.5})
    w.write(10, {"eval/accuracy": 0.75})
    w.rewind(10)
    w.write(11, {"entropy": 0.1})
    w.write(13, {"tokens_per_s": 9.0})
    w.close()
    logged = wandb_log(tmp_path, b"tokens_per_s")
    assert b"tokens_per_s" in logged and b"eval/accuracy" in logged and b"entropy" in logged


@pytest.mark.parametrize("reduce", ["max", "min"])
def test_a_nan_is_the_max_and_min_of_what_holds_one(reduce):
    """A NaN recorded (a step's grad_norm) is what MAX and MIN report, in any order and across
    processes, never hidden behind the other values."""
    from forge.metrics import Reduce, _Acc

    for order in ([1.0, math.nan, 2.0], [math.nan, 1.0], [1.0, math.nan]):
        acc = _Acc(Reduce(reduce))
        for v in order:
            acc.add(v)
        assert math.isnan(acc.value()), order
    one, other = _Acc(Reduce(reduce)), _Acc(Reduce(reduce))
    one.add(1.0)
    other.add(math.nan)
    one.merge("k", other)
    assert math.isnan(one.value())
