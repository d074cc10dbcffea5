"""A short learning run: fails if DreamerV3 stops improving on CartPole.

Uses the settings of `tuned_examples/cartpole.yaml` (micro model, raised learning rates) at
training ratio 512 for 4,000 env steps (1,500 updates), about three minutes on two CPU cores:
the example's own ratio, 2048, spends four times the updates on those steps, and what this
checks is the learning signal, not the example's speed. A random policy averages ~22; these
settings reached 217 after 3,500 steps when this test was written.
"""

import os

import yaml

from rllib_dreamerv3 import DreamerV3Config

TUNED = os.path.join(os.path.dirname(__file__), "..", "tuned_examples", "cartpole.yaml")


def test_cartpole_improves():
    with open(TUNED) as f:
        spec = next(iter(yaml.safe_load(f).values()))
    config = (
        DreamerV3Config()
        .update_from_dict({**spec["config"], "training_ratio": 512})
        .environment(spec["env"])
        .debugging(seed=0)
    )
    algo = config.build_algo()
    try:
        returns = []
        while True:
            result = algo.train()
            returns.append(result["env_runners"].get("episode_return_mean", 0.0))
            if result["env_runners"]["num_env_steps_sampled_lifetime"] >= 4000:
                break
    finally:
        algo.stop()
    assert max(returns[-2:]) >= 60, returns
