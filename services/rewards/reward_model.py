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
import threading
from pathlib import Path
from typing import Any

import torch

from forge.data import completion_tokens, present
from forge.losses import sequence_scores
from forge.tasks import chat_tokens, end_of_turn
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
        # Forwards run in threads and the first ones start together: one loads, the rest wait
        # (else each loads its own copy of the checkpoint, and transformers' lazy imports race).
        self.loading = threading.Lock()

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
            scores = [e] * len(batch)
        for (_, future), score in zip(batch, scores):
            if future.done():
                continue
            if isinstance(score, Exception):
                future.set_exception(score)
            else:
                future.set_result(score)

    def scores(self, samples: list[RewardInput]) -> list[float | Exception]:
        """One forward over `samples` (a multi-turn episode: its whole conversation): each one's
        score, or the error that sample alone fails with (it does not fit the model's context,
        it cannot be tokenized), so that it never costs the others of its forward theirs."""
        with self.loading:
            if self.model is None:
                self._load()
        out: list[float | Exception] = []
        episodes = []
        for s in samples:
            try:
                episodes.append(self._episode(s))
                out.append(0.0)
            except Exception as e:
                out.append(e)
        if not episodes:
            return out
        # Completions of one prompt (a group's) read it once.
        batch = collate(episodes, pad_id=self.tokenizer.pad_token_id or 0, share_prefix=True)
        with torch.no_grad():
            token_scores = self._token_scores(self.model, batch.input_ids, batch.positions, batch.segments)
        scores = iter(sequence_scores(token_scores, batch).tolist())
        return [score if isinstance(score, Exception) else next(scores) for score in out]

    def _episode(self, s: RewardInput) -> Episode:
        """`s`'s tokens as the model reads them, trailing pads dropped (transformers' sequence
        classifiers skip them); an error if they do not fit the checkpoint's context."""
        ids, mask = rm_tokens(self.tokenizer, s, self.end_of_turn)
        end = len(ids)
        while end > 1 and ids[end - 1] == self.pad:  # transformers' sequence classifiers skip them
            end -= 1
        if not end:
            raise ValueError("the sample has no tokens to score")
        if self.limit is not None and end > self.limit:
            raise ValueError(
                f"the sample is {end} tokens, longer than the reward model's max_position_embeddings "
                f"({self.limit}, {self.cfg.path}/config.json)"
            )
        return Episode(ids[:end], mask[:end], [0.0] * end)

    def _load(self) -> None:
        from transformers import AutoTokenizer

        from services.titan import load_hf_model, token_scores

        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.path)
        self.end_of_turn = end_of_turn(self.tokenizer)
        config = json.loads((Path(self.cfg.path) / "config.json").read_text())
        self.pad, self.limit = config.get("pad_token_id"), config.get("max_position_embeddings")
        self.model = load_hf_model(self.cfg.path, head="score").eval().requires_grad_(False)
        self._token_scores = token_scores


def rm_tokens(tokenizer: Any, s: RewardInput, end_of_turn: str) -> tuple[list[int], list[int]]:
    """`s` as the reward model reads it: its prompt and completion as `completion_tokens` makes
    them (an episode's: its turns up to the policy's last), the policy's text plain: the
    generator decodes with special tokens skipped, so a "<|im_end|>" in it is the policy's
    spelling, which must not end its turn (and forge one after it) here, in any of its turns."""
    if s.messages:  # every assistant turn is the policy's, not only the last
        ids, labels = chat_tokens(tokenizer, present(s.messages), end_of_turn, plain=True)
        return ids, [int(label != -100) for label in labels]
    return completion_tokens(tokenizer, s.prompt, s.completion, end_of_turn, plain=True)
