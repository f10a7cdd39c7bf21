"""What the Tinker tests do through the real `tinker` SDK, as a user's script would: run in the
test's process, or as a process of its own (`python tests/tinker_client.py URL KEY STEP ...`)."""

from __future__ import annotations

import json
import sys

import numpy as np
import tinker
from tinker import types

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def supervised_data(tokenizer, n: int = 8, offset: int = 0) -> list[types.Datum]:
    """`n` toy examples ("3+3=" -> "6"), the loss on the answer and its end only."""
    out = []
    for i in range(offset, offset + n):
        prompt = tokenizer.encode(f"{i}+{i}=", add_special_tokens=False)
        answer = tokenizer.encode(str(2 * i), add_special_tokens=False) + [tokenizer.eos_token_id]
        full = prompt + answer
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
            )
        )
    return out


def letter_ids(tokenizer, letters: str = LETTERS) -> set[int]:
    return {tokenizer.encode(c, add_special_tokens=False)[0] for c in letters}


def rl_step(tc, sampler, tokenizer, prompt: list[int], good: set[int], group: int = 16, lr: float = 3e-2) -> float:
    """One step of the RL loop: sample a group, reward each sample by its share of `good` tokens,
    train with importance sampling on reward - the group's mean. Returns the mean reward."""
    res = sampler.sample(
        types.ModelInput.from_ints(prompt),
        num_samples=group,
        sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0),
    ).result()
    rewards = [float(np.mean([t in good for t in s.tokens])) if s.tokens else 0.0 for s in res.sequences]
    data = []
    for s, adv in zip(res.sequences, np.array(rewards) - np.mean(rewards)):
        if not s.tokens:
            continue
        full = prompt + s.tokens
        pad = len(prompt) - 1
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={
                    "target_tokens": full[1:],
                    "logprobs": [0.0] * pad + list(s.logprobs),
                    "advantages": [0.0] * pad + [float(adv)] * len(s.tokens),
                },
            )
        )
    tc.forward_backward(data, "importance_sampling").result()
    tc.optim_step(types.AdamParams(learning_rate=lr)).result()
    return float(np.mean(rewards))


def train_on_letters(url: str, key: str, letters: str, steps: int) -> dict:
    """A training client of its own that learns to write `letters`; then the logprobs of what its
    sampler draws, as the sampler and as its trainer (forward) give them, and the trainer's of a probe."""
    sc = tinker.ServiceClient(base_url=url, api_key=key)
    base = (
        tinker.RestClient(base_url=url, api_key=key).get_server_capabilities().result().supported_models[0].model_name
    )
    tc = sc.create_lora_training_client(base_model=base, rank=4, seed=1).result()
    tok = tc.get_tokenizer()
    prompt = tok.encode("x=", add_special_tokens=False)
    rewards = [
        rl_step(tc, tc.save_weights_and_get_sampling_client().result(), tok, prompt, letter_ids(tok, letters))
        for _ in range(steps)
    ]
    # What its sampler draws, and its trainer's logprobs of those very tokens (temperature 1: the same
    # distribution); and its trainer's logprobs of a fixed probe.
    sampler = tc.save_weights_and_get_sampling_client().result()
    drawn = sampler.sample(
        types.ModelInput.from_ints(prompt), num_samples=4, sampling_params=types.SamplingParams(max_tokens=6)
    ).result()
    sampled, trained = [], []
    for s in drawn.sequences:
        full = prompt + s.tokens
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},
        )
        out = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        sampled += list(s.logprobs)
        trained += out[len(prompt) - 1 :]
    probe = prompt + tok.encode("abcabc", add_special_tokens=False)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(probe[:-1]),
        loss_fn_inputs={"target_tokens": probe[1:], "weights": [1.0] * (len(probe) - 1)},
    )
    probed = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    return {"rewards": rewards, "sampler": sampled, "trainer": trained, "probe": probed}


if __name__ == "__main__":
    url, key, letters, steps = sys.argv[1:5]
    print(json.dumps(train_on_letters(url, key, letters, int(steps))))
