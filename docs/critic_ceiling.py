"""The explained variance of a policy's true value function on the reverse toy: the most any
critic can reach on its samples.

    python docs/critic_ceiling.py MODEL_DIR [PROMPTS]

The only completion rewarded 1 is the answer's tokens and EOS, so V(s_t) is 1[the sampled prefix
is the answer's] x the policy's probability of the rest of the answer, one forward of the answer
per prompt. Samples: 8 per prompt at temperature 1; returns: GAE with V, as PPO computes them.
Beside it, how much a critic that only tells a right prefix from a wrong one explains: 0 after a
wrong token, else the mean return of the right prefixes at that token's position.
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge.losses.advantages import explained_variance, gae
from forge.tasks import generate, get_task
from forge.types import Episode, collate

GROUP = 8


def true_values(sampled: list[int], right: list[int], step_p: torch.Tensor) -> list[float]:
    """V(s_t) for each sampled token t: the probability of finishing the answer from there."""
    return [
        float(step_p[t:].prod()) if t < len(right) and sampled[:t] == right[:t] else 0.0 for t in range(len(sampled))
    ]


def samples(model, tok, prompts: int, seed: int = 7) -> tuple[list[Episode], list[float], list[list[float]]]:
    task, episodes, rewards, values = get_task("reverse"), [], [], []
    for s in generate("reverse", prompts, seed=seed):
        p = tok(s.prompt)["input_ids"]
        right = tok(s.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([p + right])).logits[0].float(), -1)
            out = model.generate(
                torch.tensor([p] * GROUP), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=12, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            )  # fmt: skip
        step_p = torch.stack([lp[len(p) - 1 + k, t] for k, t in enumerate(right)]).exp()
        for row in out[:, len(p) :].tolist():
            row = row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
            rewards.append(float(task.score(tok.decode(row, skip_special_tokens=True), s.answer) == 1.0))
            values.append(true_values(row, right, step_p))
            episodes.append(Episode(p + row, [0] * len(p) + [1] * len(row), [0.0] * (len(p) + len(row))))
    return episodes, rewards, values


def detection_only(values: torch.Tensor, returns: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """0 where the prefix has gone wrong (V = 0), else the mean return of the right prefixes at
    the same position of the answer."""
    right = (values > 0) & own
    position = (own.cumsum(1) - 1).clamp(min=0)
    out = torch.zeros_like(values)
    for t in position[own].unique():
        at = right & (position == t)
        out[at] = returns[at].mean()
    return out


def main(path: str, prompts: int) -> None:
    torch.manual_seed(0)
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    episodes, rewards, per_episode = samples(model, tok, prompts)
    batch, reward = collate(episodes, pad_id=0), torch.tensor(rewards)
    own, values = batch.loss_mask > 0, torch.zeros_like(batch.gen_logprobs)
    for i, v in enumerate(per_episode):
        values[own & (batch.doc_ids == i)] = torch.tensor(v)
    print(f"{path}: {len(episodes)} samples, reward mean {reward.mean():.3f}")
    for lam in (1.0, 0.95):
        returns = gae(batch, values, reward, 1.0, lam)[1]
        print(
            f"  lam {lam}: the true value function's explained variance {explained_variance(values, returns, own):.3f}, "
            f"right-or-wrong prefix alone {explained_variance(detection_only(values, returns, own), returns, own):.3f}"
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 64)
