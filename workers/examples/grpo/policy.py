"""The tiny policy: a GRU language model over the task's vocabulary, sampled token by token.

`sample` generates a prompt group's answers at temperature 1 and returns the logprob of every
sampled token, which rollouts publish as `generation_logprobs`; `token_logprobs` recomputes the
logprob of each token of padded rows (teacher forcing), which the trainer compares with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class PolicyShape:
    vocab: int = 16
    embed: int = 32
    hidden: int = 64


class TinyPolicy(nn.Module):
    """Embedding -> one GRU layer -> logits over the vocabulary for the next token."""

    def __init__(self, shape: PolicyShape = PolicyShape()):
        super().__init__()
        self.shape = shape
        self.embed = nn.Embedding(shape.vocab, shape.embed)
        self.gru = nn.GRU(shape.embed, shape.hidden, batch_first=True)
        self.head = nn.Linear(shape.hidden, shape.vocab)
        # A small output layer: the untrained policy samples nearly uniformly, i.e. starts near chance.
        nn.init.normal_(self.head.weight, std=0.01)
        nn.init.zeros_(self.head.bias)

    def forward(self, ids: torch.Tensor, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        out, state = self.gru(self.embed(ids), state)
        return self.head(out), state

    @torch.no_grad()
    def sample(self, prompts: torch.Tensor, answer_len: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Answers [n, answer_len] sampled after prompts [n, p], and each sampled token's logprob."""
        logits, state = self(prompts)
        last = logits[:, -1]
        tokens, logprobs = [], []
        for _ in range(answer_len):
            logp = torch.log_softmax(last.float(), dim=-1)
            tok = torch.multinomial(logp.exp(), 1, generator=gen)
            tokens.append(tok)
            logprobs.append(logp.gather(1, tok))
            logits, state = self(tok, state)
            last = logits[:, -1]
        return torch.cat(tokens, dim=1), torch.cat(logprobs, dim=1)

    def token_logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, L] logprob of each token given the ones before it (0 at position 0, which nothing predicts)."""
        logits, _ = self(input_ids[:, :-1])
        logp = torch.log_softmax(logits.float(), dim=-1).gather(2, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)


def state_to_cpu(policy: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the weights, to hand to rollout actors (through Ray, not Kafka)."""
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}
