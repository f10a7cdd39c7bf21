"""Reward models: the Bradley-Terry loss by hand, the RM app through the Trainer service, and
its export as a transformers sequence classifier."""

import json
import math

import pytest
import torch

from apps.rm import Config, main
from forge import tasks
from forge.config import ConfigError, load_config
from forge.losses import bradley_terry, score_metric_sums, sequence_scores
from forge.types import Episode, collate
from services.titan import load_hf_model, token_scores

CONFIG = "configs/rm_tiny.yaml"


def test_bradley_terry_by_hand():
    """Two pairs in two rows; a sequence's score is its last token's: pair 0 scores 2.0 vs
    -1.0, pair 1 0.5 vs 1.5. Loss: mean of -log sigmoid(3) and -log sigmoid(-1)."""
    eps = [Episode([1] * n, [0] + [1] * (n - 1), [0.0] * n) for n in (3, 2, 4, 2)]
    batch = collate(eps, pad_id=0, keep_together=2)
    scores = torch.full(batch.input_ids.shape, 9.0)  # every token but the last of each is ignored
    last = {0: 2.0, 1: -1.0, 2: 0.5, 3: 1.5}
    for doc, value in last.items():
        cols = (batch.doc_ids == doc).nonzero()
        scores[cols[-1, 0], cols[-1, 1]] = value
    assert sequence_scores(scores, batch).tolist() == [2.0, -1.0, 0.5, 1.5]
    expected = (math.log1p(math.exp(-3.0)) + math.log1p(math.exp(1.0))) / 2
    assert bradley_terry(scores, batch).item() == pytest.approx(expected, rel=1e-6)
    sums = score_metric_sums(scores, batch)
    assert sums["rewards/accuracy"].item() == 1 and sums["rewards/margin"].item() == pytest.approx(2.0)


def test_rm_config_errors():
    with pytest.raises(ConfigError, match="config keys 'trainer.head' and 'trainer.loss.name': a score head"):
        load_config(CONFIG, ["trainer.loss.name=dpo"], Config)
    with pytest.raises(ConfigError, match="config key 'trainer.head': 'value' is not one of lm, score"):
        load_config(CONFIG, ["trainer.head=value"], Config)


def test_reward_model_app_and_its_transformers_export(tmp_path, tiny_model_dir):
    """Steps on a pair file with held-out pairs beside the loop; the export loads in
    transformers' AutoModelForSequenceClassification with the scores forge's model gives (1e-5)."""
    from transformers import AutoModelForSequenceClassification

    data = tasks.write_dataset(tmp_path / "pairs.jsonl", "reverse", n=32, preferences=True)
    held = tasks.write_dataset(tmp_path / "held.jsonl", "reverse", n=8, seed=1, preferences=True)
    over = [
        f"runs_dir={tmp_path}",
        "run_name=rm",
        "model.tiny=null",
        f"model.path={tiny_model_dir}",
        f"data.path={data}",
        f"eval.dataset.path={held}",
        "eval.prompts=0",
        "eval.every=2",
        "steps=3",
        "batch_size=8",
        "trainer.lr=1e-3",
        "trainer.warmup_steps=0",
        "checkpoint_every=0",
        "metrics=[jsonl]",
    ]
    main(load_config(CONFIG, over, Config))
    rows = [json.loads(line) for line in (tmp_path / "rm/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert [(r["step"], r["eval/pairs"]) for r in rows if "eval/accuracy" in r] == [(0, 8), (2, 8), (3, 8)]
    assert next(r for r in rows if "loss" in r)["loss"] == pytest.approx(math.log(2), abs=0.3)

    export = tmp_path / "rm/model"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForSequenceClassification"] and config["num_labels"] == 1
    hf = AutoModelForSequenceClassification.from_pretrained(export, dtype=torch.float32).eval()
    ours = load_hf_model(export, head="score")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (4, 9), generator=g)
    with torch.no_grad():
        theirs = hf(ids).logits[:, 0]
        mine = token_scores(ours, ids)[:, -1]
    assert (theirs - mine).abs().max().item() <= 1e-5
    initial = load_hf_model(tiny_model_dir, head="score")  # a fresh head on the starting model
    with torch.no_grad():
        assert (token_scores(initial, ids)[:, -1] - mine).abs().max().item() > 1e-4  # it trained
    with pytest.raises(ValueError, match="sequence-classification checkpoint"):
        load_hf_model(export)  # not a policy: no LM head
