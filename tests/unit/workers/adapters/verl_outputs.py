"""What verl's agent loop returns for one session (``AgentLoopOutput.model_dump()``), for tests."""

from __future__ import annotations

from typing import Any


def agent_output(step: int = 0) -> dict[str, Any]:
    """A two-token answer to a two-token prompt, generated with weights labelled `step`."""
    return {
        "prompt_ids": [1, 2],
        "response_ids": [5, 6],
        "response_mask": [1, 1],
        "response_logprobs": [-1.0, -1.0],
        "reward_score": 1.0,
        "extra_fields": {"min_global_steps": step, "max_global_steps": step},
    }
