"""benchmarks/cartpole_terminations.py names what ended each CartPole episode."""

import sys

import cartpole_terminations
import gymnasium as gym
import numpy as np
import pytest


class RulePolicy:
    """Stands in for the world model's `policy_step`: a fixed rule of the observation."""

    def __init__(self, rule):
        self.rule = rule

    def initial_carry(self, batch_size):
        return None

    def policy_step(self, carry, obs, is_first, seed, explore):
        return np.eye(2)[None, self.rule(obs.numpy()[0])], carry


@pytest.mark.parametrize(
    "rule, cause",
    [
        (lambda o: 1, "pole"),  # always pushing right: the pole falls left within ~10 steps
        # angle feedback alone balances the pole but lets the cart wander; with a bias it drifts
        (lambda o: int(o[2] + 0.5 * o[3] + 0.02 > 0), "cart"),
        (lambda o: int(0.1 * o[0] + 0.5 * o[1] + 10 * o[2] + 2 * o[3] > 0), "truncated"),
    ],
)
def test_play_names_the_cause_from_the_final_state(rule, cause):
    env = gym.make("CartPole-v1")
    length, found, obs, carries = cartpole_terminations.play(RulePolicy(rule), env, 0, False, 0)
    assert found == cause
    assert len(carries) == length
    if cause == "truncated":
        assert length == 500
    else:
        assert length < 500
        x_limit, angle_limit = env.unwrapped.x_threshold, env.unwrapped.theta_threshold_radians
        assert x_limit == 2.4 and np.isclose(angle_limit, 12 * 2 * np.pi / 360)
        assert (abs(obs[0]) > x_limit) == (cause == "cart")
        assert (abs(obs[2]) > angle_limit) == (cause == "pole")


def test_a_directory_without_a_module_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["cartpole_terminations.py", str(tmp_path)])
    with pytest.raises(SystemExit, match="algo.save_to_path"):
        cartpole_terminations.main()
