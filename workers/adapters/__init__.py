"""Adapters that put rlstream into RL frameworks: verl 0.9.1's replay buffer, agent-loop manager and checkpoint
callback (docs/VERL.md). None imports the framework at module level."""
