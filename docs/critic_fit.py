"""Whether PPO's critic (the warm start's copy with a scalar head) can learn the reverse toy's
values at all: trained on fresh samples with the true value function as its target (no
bootstrapping, no noise in the targets), how much of the true values and of the returns it
explains on held-out samples.

    python docs/critic_fit.py MODEL_DIR [BATCHES [CRITIC_START]]

Samples as in docs/critic_ceiling.py (8 per prompt at temperature 1); batches of 64 episodes,
one AdamW step each (lr 1e-3); the value of token t is read from the output at t - 1, as
forge's critic reads it. CRITIC_START: a sequence classifier (a reward model) whose body starts
the critic, as with `ppo.critic_path` (here the head starts at zero whichever the body); default
MODEL_DIR's.
"""

import sys

import torch
from critic_ceiling import samples
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from forge.losses.advantages import explained_variance
from forge.types import collate

BATCH = 64


class Critic(torch.nn.Module):
    def __init__(self, path: str, start: str | None = None):
        super().__init__()
        body = AutoModelForSequenceClassification if start else AutoModelForCausalLM
        self.body = body.from_pretrained(start or path).model
        self.head = torch.nn.Linear(self.body.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        v = self.head(self.body(ids).last_hidden_state)[..., 0]
        return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], 1)  # token t's value: the output at t - 1


def tensors(episodes, rewards, values):
    """Token-aligned inputs, loss mask, returns (the episode's reward) and true values."""
    batch = collate(episodes, pad_id=0)
    own = batch.loss_mask > 0
    returns, true = torch.zeros_like(batch.gen_logprobs), torch.zeros_like(batch.gen_logprobs)
    for i, (r, v) in enumerate(zip(rewards, values)):
        where = own & (batch.doc_ids == i)
        returns[where], true[where] = r, torch.tensor(v)
    return batch.input_ids, own, returns, true


def main(path: str, batches: int, start: str | None = None) -> None:
    torch.manual_seed(0)
    tok, policy = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    ids, own, returns, true = tensors(*samples(policy, tok, 64, seed=99))
    print(f"held out: {int(own.sum())} tokens; the true values explain {explained_variance(true, returns, own):.3f}")
    critic = Critic(path, start)
    opt = torch.optim.AdamW(critic.parameters(), lr=1e-3, weight_decay=0.0)
    for step in range(batches):
        x, m, _, target = tensors(*samples(policy, tok, BATCH // 8, seed=1000 + step))
        loss = (((critic(x) - target) ** 2) * m).sum() / m.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
        opt.step()
        if (step + 1) % (25 if step < 300 else 100) == 0:
            with torch.no_grad():
                v = critic(ids)
            print(
                f"batch {step + 1}: explains {explained_variance(v, true, own):.3f} of the true values, "
                f"{explained_variance(v, returns, own):.3f} of the returns"
            )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 300, sys.argv[3] if len(sys.argv) > 3 else None)
