import json

import pytest

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
