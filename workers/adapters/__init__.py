"""Adapters that hand rlstream's finalized groups to RL frameworks (verl: verl_sampler.py)."""
