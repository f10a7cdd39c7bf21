"""The `reward_model` reward: a trained sequence classifier scores each completion.

    rewards:
      weights: {reward_model: 1.0}          # alone, or beside other rewards
      reward_model: {path: runs/rm_tiny/model}
      replicas: 2                           # reward service replicas, each with the model

The checkpoint is a transformers *ForSequenceClassification with one label (the rm app's
export), loaded as forge's torchtitan model with a score head; a sample is its prompt and
completion tokenized as the reward model was trained (`forge.data.completion_tokens`, the
policy's text read as plain text), and its score is the last token's that is not the
checkpoint's pad_token_id, where transformers reads it (forge's exports pad with a token no
sequence ends with; a checkpoint whose pad is its EOS was trained on the token before).
Samples arriving together (a group, several groups) share one forward.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import torch

from forge.data import completion_tokens
from forge.losses import sequence_scores
from forge.tasks import end_of_turn
from forge.types import Episode, RewardInput, collate
from services.schema import RewardModelConfig


class RewardModel:
    """The `reward_model` reward function: a RewardInput in, the model's score out. Loaded on
    first use, in the process that scores (each reward service replica)."""

    def __init__(self, cfg: RewardModelConfig):
        self.cfg = cfg
        self.model: Any = None
        self.pending: list[tuple[RewardInput, asyncio.Future]] = []
        self.timer: asyncio.TimerHandle | None = None

    async def __call__(self, s: RewardInput) -> float:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((s, future))
        if len(self.pending) >= self.cfg.batch_size:
            self._flush()
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.cfg.max_wait_s, self._flush)
        return await future

    def _flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        batch, self.pending = self.pending, []
        if batch:
            asyncio.ensure_future(self._score(batch))

    async def _score(self, batch: list[tuple[RewardInput, asyncio.Future]]) -> None:
        try:
            scores = await asyncio.to_thread(self.scores, [s for s, _ in batch])
        except Exception as e:  # every sample of the forward fails alike; the service counts each
            for _, future in batch:
                if not future.done():
                    future.set_exception(e)
            return
        for (_, future), score in zip(batch, scores):
            if not future.done():
                future.set_result(score)

    def scores(self, samples: list[RewardInput]) -> list[float]:
        """One forward over `samples` (a multi-turn episode: its whole conversation)."""
        if self.model is None:
            self._load()
        episodes = []
        for s in samples:
            ids, mask = rm_tokens(self.tokenizer, s, self.end_of_turn)
            end = len(ids)
            while end > 1 and ids[end - 1] == self.pad:  # transformers' sequence classifiers skip them
                end -= 1
            episodes.append(Episode(ids[:end], mask[:end], [0.0] * end))
        # Completions of one prompt (a group's) read it once.
        batch = collate(episodes, pad_id=self.tokenizer.pad_token_id or 0, share_prefix=True)
        with torch.no_grad():
            scores = self._token_scores(self.model, batch.input_ids, batch.positions, batch.segments)
            return sequence_scores(scores, batch).tolist()

    def _load(self) -> None:
        from transformers import AutoTokenizer

        from services.titan import load_hf_model, token_scores

        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.path)
        self.end_of_turn = end_of_turn(self.tokenizer)
        self.pad = json.loads((Path(self.cfg.path) / "config.json").read_text()).get("pad_token_id")
        self.model = load_hf_model(self.cfg.path, head="score").eval().requires_grad_(False)
        self._token_scores = token_scores


def rm_tokens(tokenizer: Any, s: RewardInput, end_of_turn: str) -> tuple[list[int], list[int]]:
    """`s` as the reward model reads it: its prompt and completion (an episode's: its turns,
    the last the completion) as `completion_tokens` makes them, the policy's text plain: the
    generator decodes with special tokens skipped, so a "<|im_end|>" in it is the policy's
    spelling, which must not end its turn (and forge one after it) here."""
    prompt = s.messages[:-1] if s.messages else s.prompt
    completion = s.messages[-1:] if s.messages else s.completion
    return completion_tokens(tokenizer, prompt, completion, end_of_turn, plain=True)
