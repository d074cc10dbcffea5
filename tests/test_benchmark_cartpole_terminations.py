"""benchmarks/cartpole_terminations.py names what ended each CartPole episode."""

import cartpole_terminations
import gymnasium as gym
import numpy as np


class RulePolicy:
    """Stands in for the world model's `policy_step`: a fixed rule of the observation."""

    def __init__(self, rule):
        self.rule = rule

    def initial_carry(self, batch_size):
        return None

    def policy_step(self, carry, obs, is_first, seed, explore):
        return np.eye(2)[None, self.rule(obs.numpy()[0])], carry


def test_play_names_the_cause_from_the_final_state():
    rules = {
        "pole": lambda o: 1,  # always pushing right: the pole falls left within ~10 steps
        # angle feedback alone balances the pole but lets the cart wander; with a bias it drifts
        "cart": lambda o: int(o[2] + 0.5 * o[3] + 0.02 > 0),
        "truncated": lambda o: int(0.1 * o[0] + 0.5 * o[1] + 10 * o[2] + 2 * o[3] > 0),
    }
    env = gym.make("CartPole-v1")
    for cause, rule in rules.items():
        length, found, obs, carries = cartpole_terminations.play(RulePolicy(rule), env, 0, False, 0)
        assert found == cause and len(carries) == length
        assert (length == 500) == (cause == "truncated")
        assert (abs(obs[0]) > 2.4) == (cause == "cart")
        assert (abs(obs[2]) > 12 * 2 * np.pi / 360) == (cause == "pole")
