"""The GRPO example's pure parts: the task's reward, group advantages, the clipped loss, the policy's logprobs."""

import torch

from workers.examples.grpo.loss import clipped_loss, group_advantages
from workers.examples.grpo.policy import PolicyShape, TinyPolicy
from workers.examples.grpo.task import SEP, CopyTask


def test_reward_is_the_fraction_of_positions_copied():
    task = CopyTask(vocab=16, symbols=6, length=3)
    prompt = torch.tensor([2, 3, 4, SEP])
    assert float(task.reward(prompt, torch.tensor([2, 3, 4]))) == 1.0
    assert abs(float(task.reward(prompt, torch.tensor([2, 9, 9]))) - 1 / 3) < 1e-6
    assert float(task.reward(prompt, torch.tensor([4, 3, 2])) * 3) == 1.0


def test_advantages_are_normalized_within_each_group_and_zero_for_a_uniform_one():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5])
    adv = group_advantages(rewards, [4, 3])
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-3)
    assert torch.equal(adv[4:], torch.zeros(3))


def test_the_loss_raises_the_logprob_of_tokens_with_positive_advantage_and_ignores_masked_ones():
    new = torch.zeros(2, 3, requires_grad=True)
    old = torch.zeros(2, 3)
    mask = torch.tensor([[False, True, True], [False, True, True]])
    loss, stats = clipped_loss(new, old, torch.tensor([1.0, -1.0]), mask)
    loss.backward()
    assert stats.mean_ratio == 1.0 and stats.clipped_fraction == 0.0
    assert (new.grad[0, 1:] < 0).all() and (new.grad[1, 1:] > 0).all()  # descent raises row 0, lowers row 1
    assert (new.grad[:, 0] == 0).all()


def test_the_clip_stops_the_gradient_once_the_ratio_left_the_range_in_the_advantage_direction():
    new = torch.full((1, 2), 0.5, requires_grad=True)  # ratio e^0.5 > 1.2
    loss, stats = clipped_loss(new, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool))
    loss.backward()
    assert stats.clipped_fraction == 1.0 and (new.grad == 0).all()


def test_recomputed_logprobs_match_the_sampled_ones():
    torch.manual_seed(0)
    task = CopyTask()
    policy = TinyPolicy(PolicyShape(vocab=task.vocab))
    gen = torch.Generator().manual_seed(1)
    prompts = task.prompts(5, gen)
    answers, logprobs = policy.sample(prompts, task.answer_len, gen)
    recomputed = policy.token_logprobs(torch.cat([prompts, answers], dim=1))[:, prompts.shape[1] :]
    assert torch.allclose(recomputed, logprobs, atol=1e-5)
