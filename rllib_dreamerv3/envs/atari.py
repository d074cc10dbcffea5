"""Atari environments as in the DreamerV3 paper's Atari experiments, from ale-py and gymnasium.

`make_atari_env("ALE/Pong-v5", env_config)` gives an env with action repeat 4 with the last
two frames max-pooled, 64×64 uint8 RGB observations (area interpolation), no life-loss signal,
and episodes truncated (not terminated) after 108,000 emulator frames, under one of two
protocols (`env_config={"protocol": ...}`), as in the author's configs:

- `"atari"` (default; the paper's 200M-frame Atari setup): the full 18-action set, sticky
  actions (p = 0.25, applied by the ALE on every emulator frame), no no-op starts;
- `"atari100k"` (the Atari100k benchmark): the game's minimal action set (6 in Pong), no sticky
  actions, and 1 to 30 no-op emulator frames after each reset (drawn from the env's seeded RNG).

One `step` is one agent step: 4 emulator frames. ale-py ships the ROMs.

Ids in the `ALE/` namespace are Atari ids here: v5 is built as above, other versions are
rejected rather than silently given the paper's setup. Legacy ids without the namespace (e.g.
`PongNoFrameskip-v4`) are not Atari ids here; they reach gymnasium unchanged.
"""

import difflib
import re

import gymnasium as gym

from rllib_dreamerv3.envs.settings import settings_with_defaults

# name -> (default, description). The only settings of an Atari env; everything else is fixed.
ENV_CONFIG = {
    "protocol": (
        "atari",
        (
            "'atari': 18 actions, sticky actions with p = 0.25 (the paper's Atari setup); "
            "'atari100k': the minimal action set, no sticky actions, up to 30 no-op starts "
            "(the Atari100k benchmark)"
        ),
    ),
    "grayscale": (
        False,
        ("True: one gray channel, observations (64, 64, 1); False: RGB, observations (64, 64, 3)"),
    ),
    "render_mode": (
        None,
        (
            "None, 'rgb_array' or 'human': the ALE's render mode "
            "(e.g. 'rgb_array' to record videos); observations are unchanged"
        ),
    ),
}
RENDER_MODES = (None, "rgb_array", "human")
STICKY_ACTION_PROBABILITY = {"atari": 0.25, "atari100k": 0.0}
FULL_ACTION_SPACE = {"atari": True, "atari100k": False}
NOOP_MAX = {"atari": 0, "atari100k": 30}
ACTION_REPEAT = 4
SCREEN_SIZE = 64
MAX_FRAMES_PER_EPISODE = 108_000  # 30 minutes of play at 60 frames per second

_ATARI_ID = re.compile(r"(?:ale_py:)?ALE/(?P<game>\w+)-v(?P<version>\d+)")


def is_atari_id(env):
    """Whether `env` is an ALE id, `"ALE/<Game>-v<N>"` (optionally prefixed `"ale_py:"`)."""
    return isinstance(env, str) and _ATARI_ID.fullmatch(env) is not None


def atari_settings(env_config=None):
    """`env_config` checked and completed with `ENV_CONFIG`'s defaults; `ValueError` if bad."""
    settings = settings_with_defaults(env_config, ENV_CONFIG, "Atari")
    if settings["protocol"] not in STICKY_ACTION_PROBABILITY:
        raise ValueError(
            f"Atari env_config protocol={settings['protocol']!r} is unknown; use "
            f"one of {list(STICKY_ACTION_PROBABILITY)}."
        )
    if not isinstance(settings["grayscale"], bool):
        raise ValueError(
            f"Atari env_config grayscale={settings['grayscale']!r} must be True or False."
        )
    if settings["render_mode"] not in RENDER_MODES:
        raise ValueError(
            f"Atari env_config render_mode={settings['render_mode']!r} is unknown; "
            f"use one of {list(RENDER_MODES)}."
        )
    return settings


def make_atari_env(env_id, env_config=None):
    """The Atari env `env_id` (`"ALE/<Game>-v5"`) set up as in the paper; see the module doc."""
    match = _ATARI_ID.fullmatch(env_id) if isinstance(env_id, str) else None
    if match is None:
        raise ValueError(f"{env_id!r} is not an Atari id; give one like 'ALE/Pong-v5'.")
    settings = atari_settings(env_config)
    game_id = f"ALE/{match['game']}-v5"
    if match["version"] != "5":
        raise ValueError(
            f"{env_id!r}: only the ALE's v5 ids are supported; use {game_id!r} "
            "(frame skip, sticky actions and action set are set as in the paper)."
        )
    import ale_py

    gym.register_envs(ale_py)
    if game_id not in gym.registry:
        known = [name for name in gym.registry if _ATARI_ID.fullmatch(name)]
        close = difflib.get_close_matches(game_id, known, n=3)
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(
            f"Unknown Atari game {env_id!r}.{hint} ale-py has {len(known)} games, "
            "e.g. 'ALE/Pong-v5', 'ALE/Breakout-v5'."
        )
    # Frame skipping is left to AtariPreprocessing (frameskip=1 here) so that it can max-pool
    # the last two frames; the ALE then applies sticky actions on every emulator frame.
    env = gym.make(
        game_id,
        frameskip=1,
        full_action_space=FULL_ACTION_SPACE[settings["protocol"]],
        repeat_action_probability=STICKY_ACTION_PROBABILITY[settings["protocol"]],
        max_num_frames_per_episode=MAX_FRAMES_PER_EPISODE,
        render_mode=settings["render_mode"],
    )
    return gym.wrappers.AtariPreprocessing(
        env,
        noop_max=NOOP_MAX[settings["protocol"]],
        frame_skip=ACTION_REPEAT,
        screen_size=SCREEN_SIZE,
        terminal_on_life_loss=False,
        grayscale_obs=settings["grayscale"],
        grayscale_newaxis=True,
        scale_obs=False,
    )
