"""The toy task: copy a short prompt of symbols after a separator; the reward is the fraction copied right.

Token 0 pads, token 1 separates prompt from answer, tokens 2 .. 2 + symbols - 1 are the symbols. A
policy sampling uniformly over the whole vocabulary scores 1 / vocab per answer token, so an
untrained policy starts near chance and every correct token it learns shows in the mean reward.
Partial credit (rather than all-or-nothing) gives GRPO a non-zero group spread from the first step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD = 0
SEP = 1
FIRST_SYMBOL = 2


@dataclass(frozen=True)
class CopyTask:
    """Prompts of `length` symbols (drawn from `symbols` of them) + SEP; the answer copies the symbols."""

    vocab: int = 16
    symbols: int = 6
    length: int = 3

    def __post_init__(self) -> None:
        if self.symbols < 2 or FIRST_SYMBOL + self.symbols > self.vocab or self.length < 1:
            raise ValueError(f"bad task sizes: vocab {self.vocab}, symbols {self.symbols}, length {self.length}")

    @property
    def answer_len(self) -> int:
        return self.length

    def prompt(self, gen: torch.Generator) -> torch.Tensor:
        """One prompt: `length` random symbols, then SEP."""
        body = torch.randint(FIRST_SYMBOL, FIRST_SYMBOL + self.symbols, (self.length,), generator=gen)
        return torch.cat([body, torch.tensor([SEP])]).to(torch.int64)

    def prompt_at(self, index: int, seed: int) -> torch.Tensor:
        """Prompt number `index` of a run seeded `seed`: the same wherever and whenever it is drawn, so a
        group handed back (its rows lost with the job) is generated again for the same prompt."""
        return self.prompt(torch.Generator().manual_seed((seed << 32) + index))

    def prompts(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """[n, length + 1] prompts."""
        return torch.stack([self.prompt(gen) for _ in range(n)])

    def reward(self, prompt: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
        """Fraction of answer positions equal to the prompt symbol there; prompt [.., L + 1], answer [.., L]."""
        target = prompt[..., : self.length]
        return (answer == target).float().mean(dim=-1)
