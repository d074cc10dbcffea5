"""DeepMind Control Suite tasks as in the DreamerV3 paper's DMC experiments, through Farama's
shimmy bindings of dm_control (`pip install "rllib-dreamerv3[dmc]"`).

`make_dmc_env("DMC/walker-walk", env_config)` gives the task with action repeat 2 (rewards
summed over the repeated steps) and dm_control's time limit of 1,000 frames, so an episode is
500 agent steps; it ends truncated (`terminated=False`), as the suite's tasks never terminate.
Observations are a gymnasium Dict:

- proprio (default): the task's vector observations (e.g. `position`, `velocity`; float64
  from dm_control, float32 in the model);
- vision (`env_config={"vision": True}`): `{"image": 64×64×3 uint8}` rendered from camera 0
  (camera 2 for quadruped, as the author's code), as in the paper's DMC Vision benchmark;
  with `"proprio": True` the vector observations join the image.

Ids: `"DMC/<domain>-<task>"` with dm_control's names (`"DMC/cartpole-swingup"`,
`"DMC/ball_in_cup-catch"`, `"DMC/cup-catch"` as the paper writes it). One `step` is one agent
step: 2 frames.

Vision envs run in a child process of their own (:class:`RenderProcessEnv`): Mesa's software
OpenGL drivers (EGL, OSMesa), which headless machines render with, load an LLVM that clashes
with TensorFlow's XLA in one process (it aborts). So TensorFlow processes load no OpenGL
backend at all (:func:`opengl_disabled`, around rllib_dreamerv3's imports and the DMC envs'),
and the child, which imports dm_control but not TensorFlow, renders with the user's `MUJOCO_GL`
if set, else EGL, else OSMesa.
"""

import contextlib
import ctypes.util
import difflib
import os
import re
import subprocess
import sys
import traceback
from multiprocessing.connection import Connection

import gymnasium as gym
import numpy as np

ENV_CONFIG = {
    "vision": (False, "True: 64×64 RGB image observations ('image'); False: the vector ones"),
    "proprio": (
        None,
        "whether the vector observations are part of the Dict (None: unless vision is on)",
    ),
    "camera": (None, "the camera images come from (None: 0, or 2 for quadruped)"),
    "action_repeat": (2, "env frames per agent step (rewards summed)"),
}
IMAGE_SIZE = 64
DOMAIN_ALIASES = {"cup": "ball_in_cup"}  # the paper's task names
_DMC_ID = re.compile(r"DMC/(?P<domain>[a-z0-9_]+)-(?P<task>[a-z0-9_]+)")
CALL_TIMEOUT_S = 300  # a render process that answers no call for this long is stuck


@contextlib.contextmanager
def opengl_disabled():
    """While active, a first import of dm_control loads no OpenGL backend (`MUJOCO_GL=disable`
    for the duration); the user's `MUJOCO_GL` is restored on exit, so their own MuJoCo
    rendering (gymnasium's, which reads the variable when it renders) is untouched.

    dm_control chooses and loads its backend once, when first imported, and RLlib imports it
    wherever it is installed: Mesa's EGL or OSMesa would then share the process with TensorFlow
    (see the module doc), and GLFW warns without a display. rllib_dreamerv3 imports RLlib, and
    DMC envs import dm_control, inside this context. Does nothing once dm_control's backend is
    chosen.
    """
    if "dm_control._render" in sys.modules:
        yield
        return
    saved = os.environ.get("MUJOCO_GL")
    os.environ["MUJOCO_GL"] = "disable"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("MUJOCO_GL", None)
        else:
            os.environ["MUJOCO_GL"] = saved


def render_process_gl_backend():
    """MuJoCo's OpenGL backend for a render process: the user's `MUJOCO_GL` if set; else,
    without an X display, "egl" if libEGL is installed, else "osmesa" if libOSMesa is; else None
    (dm_control's own choice)."""
    user = os.environ.get("MUJOCO_GL", "")
    if user:
        return user
    if os.environ.get("DISPLAY"):
        return None
    for backend, library in (("egl", "EGL"), ("osmesa", "OSMesa")):
        if ctypes.util.find_library(library):
            return backend
    return None


def is_dmc_id(env):
    """Whether `env` is a DMC id, `"DMC/<domain>-<task>"`."""
    return isinstance(env, str) and _DMC_ID.fullmatch(env) is not None


def dmc_settings(env_config=None):
    """`env_config` checked and completed with `ENV_CONFIG`'s defaults; `ValueError` if bad."""
    # Imported here: the render process runs this file without the package (and TensorFlow).
    from rllib_dreamerv3.envs.settings import settings_with_defaults

    settings = settings_with_defaults(env_config, ENV_CONFIG, "DMC")
    if settings["proprio"] is None:
        settings["proprio"] = not settings["vision"]
    for name in ("vision", "proprio"):
        if not isinstance(settings[name], bool):
            raise ValueError(f"DMC env_config {name}={settings[name]!r} must be True or False.")
    if not (settings["vision"] or settings["proprio"]):
        raise ValueError(
            "DMC env_config vision=False, proprio=False leaves no observation; turn one on."
        )
    repeat = settings["action_repeat"]
    if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 1:
        raise ValueError(f"DMC env_config action_repeat={repeat!r} must be an integer >= 1.")
    return settings


def make_dmc_env(env_id, env_config=None):
    """The DMC task `env_id` (`"DMC/<domain>-<task>"`) as in the paper; see the module doc."""
    match = _DMC_ID.fullmatch(env_id) if isinstance(env_id, str) else None
    if match is None:
        raise ValueError(
            f"{env_id!r} is not a DMC id; give one like 'DMC/walker-walk' (domain-task)."
        )
    settings = dmc_settings(env_config)
    domain = DOMAIN_ALIASES.get(match["domain"], match["domain"])
    task = match["task"]
    try:
        with opengl_disabled():
            import shimmy  # noqa: F401  (the render process needs it too)
            from dm_control import suite
    except ImportError as err:
        raise ImportError(
            f"{env_id!r} needs dm_control and shimmy: pip install shimmy dm_control (in a "
            f"clone: pip install -e '.[dmc]') ({err})."
        ) from None
    if (domain, task) not in suite.ALL_TASKS:
        known = [f"DMC/{d}-{t}" for d, t in suite.ALL_TASKS]
        close = difflib.get_close_matches(f"DMC/{domain}-{task}", known, n=3)
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(
            f"Unknown DMC task {env_id!r}.{hint} dm_control has {len(known)} tasks, e.g. "
            "'DMC/walker-walk', 'DMC/cartpole-swingup', 'DMC/cup-catch'."
        )
    if settings["camera"] is not None:
        _check_camera(env_id, suite.load(domain, task).physics, settings["camera"])
    if settings["vision"]:
        return RenderProcessEnv(env_id, settings)
    return _local_env(domain, task, settings)


def _check_camera(env_id, physics, camera):
    """`ValueError` unless `camera` is an id or name of one of the task's cameras."""
    model = physics.model
    names = [model.id2name(i, "camera") for i in range(model.ncam)]
    if isinstance(camera, bool) or not isinstance(camera, (int, str)):
        valid = False
    else:
        valid = camera in names if isinstance(camera, str) else 0 <= camera < len(names)
    if not valid:
        raise ValueError(
            f"DMC env_config camera={camera!r} is not a camera of {env_id!r}, which has "
            f"{len(names)}: ids 0 to {len(names) - 1}, or the names {names}."
        )


def _local_env(domain, task, settings):
    """The task in this process (see :func:`make_dmc_env`)."""
    from dm_control import suite
    from shimmy.dm_control_compatibility import DmControlCompatibilityV0

    camera = settings["camera"]
    if camera is None:
        camera = 2 if domain == "quadruped" else 0
    env = DmControlCompatibilityV0(
        suite.load(domain, task),
        render_mode="rgb_array" if settings["vision"] else None,
        render_kwargs={"width": IMAGE_SIZE, "height": IMAGE_SIZE, "camera_id": camera},
    )
    env = ActionRepeat(env, settings["action_repeat"])
    if settings["vision"]:
        env = ImageObservation(env, keep_vectors=settings["proprio"])
    return env


class ActionRepeat(gym.Wrapper):
    """Repeat every action `repeat` times, summing the rewards; stops early if the episode
    ends."""

    def __init__(self, env, repeat):
        super().__init__(env)
        self.repeat = repeat

    def step(self, action):
        total = 0.0
        for _ in range(self.repeat):
            obs, reward, terminated, truncated, info = self.env.step(action)
            total += float(reward)
            if terminated or truncated:
                break
        return obs, total, terminated, truncated, info


class ImageObservation(gym.ObservationWrapper):
    """Dict observations `{"image": env.render()}`, plus the env's own (Dict) observations if
    `keep_vectors`. The env renders 64×64 RGB frames (`render_mode="rgb_array"`)."""

    def __init__(self, env, keep_vectors=False):
        super().__init__(env)
        self.keep_vectors = keep_vectors
        image = gym.spaces.Box(0, 255, (IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
        vectors = dict(env.observation_space.spaces) if keep_vectors else {}
        if "image" in vectors:
            raise ValueError("The env's observations have an 'image' entry already.")
        self.observation_space = gym.spaces.Dict({"image": image, **vectors})

    def observation(self, observation):
        image = np.asarray(self.env.render(), np.uint8)
        return {"image": image, **(observation if self.keep_vectors else {})}


class RenderProcessEnv(gym.Env):
    """A DMC vision env (see :func:`make_dmc_env`) stepped in a child Python process that
    renders its images, reached through two pipes; see the module doc for why.

    The child runs this file as a script (so it imports neither rllib_dreamerv3's package nor
    TensorFlow), builds the env, renders one frame to check that rendering works, and then
    answers `reset`, `step`, `render` and `close` calls. An error in the child is raised here
    as a `RuntimeError` with the child's traceback.
    """

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, env_id, settings):
        self.env_id = env_id
        self.render_mode = "rgb_array"
        self._closed = True  # until the process runs
        env = dict(os.environ)
        env.pop("MUJOCO_GL", None)
        backend = render_process_gl_backend()
        if backend is not None:
            env["MUJOCO_GL"] = backend
        child_in, to_child = os.pipe()  # (read end, write end)
        from_child, child_out = os.pipe()
        try:
            # Run as `-c` with the file's path, so that the child's sys.path does not start
            # with this package's directory (whose modules would shadow top-level ones).
            self._process = subprocess.Popen(
                [sys.executable, "-c", _CHILD_MAIN, os.path.abspath(__file__)]
                + [str(child_in), str(child_out)],
                pass_fds=(child_in, child_out),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            for fd in (child_in, to_child, from_child, child_out):
                os.close(fd)
            raise
        os.close(child_in)
        os.close(child_out)
        self._send = Connection(to_child, readable=False)
        self._receive = Connection(from_child, writable=False)
        self._closed = False
        self.observation_space, self.action_space = self._call("start", env_id, settings)

    def _call(self, method, *args, **kwargs):
        if self._closed:
            raise RuntimeError(f"The {self.env_id!r} env is closed.")
        try:
            self._send.send((method, args, kwargs))
            if not self._receive.poll(CALL_TIMEOUT_S):
                self.close()
                raise RuntimeError(
                    f"The render process of {self.env_id!r} did not answer {method}() within "
                    f"{CALL_TIMEOUT_S} s; it was stopped."
                )
            reply = self._receive.recv()
        except (EOFError, OSError):
            code = self._process.wait()
            self.close()
            raise RuntimeError(
                f"The render process of {self.env_id!r} exited (code {code}) during {method}(); "
                "its error is above in stderr."
            ) from None
        status, stage, result = reply
        if status == "ok":
            return result
        if method == "start":
            self.close()
        if stage in ("opengl", "render"):
            raise RuntimeError(
                f"{self.env_id!r} with vision=True cannot render (MUJOCO_GL="
                f"{render_process_gl_backend()!r} in its render process). Headless rendering "
                "needs EGL (e.g. apt install libegl1) or OSMesa (apt install libosmesa6), or "
                "set MUJOCO_GL; or drop vision=True. The render process said:\n" + result
            )
        raise RuntimeError(f"{self.env_id!r} raised in its render process:\n{result}")

    def reset(self, *, seed=None, options=None):
        return self._call("reset", seed=seed, options=options)

    def step(self, action):
        return self._call("step", action)

    def render(self):
        return self._call("render")

    def close(self):
        if self._closed:
            return
        self._closed = True
        try:
            self._send.send(("close", (), {}))
        except OSError:  # the process is gone already
            pass
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._send.close()
        self._receive.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.close()


def _serve(child_in, child_out):
    """The render process's loop (see :class:`RenderProcessEnv`). Every reply is
    `(status, stage, result)`: `("ok", None, value)` or `("error", stage, traceback)`, where the
    stage of a failed start says what failed: loading OpenGL, building the env, or rendering."""
    receive = Connection(child_in, writable=False)
    send = Connection(child_out, readable=False)
    env = None
    while True:
        try:
            method, args, kwargs = receive.recv()
        except EOFError:  # the parent is gone
            break
        if method == "close":
            break
        stage = method
        try:
            if method == "start":
                stage = "opengl"
                import dm_control._render  # noqa: F401  (loads the MUJOCO_GL backend)

                stage = "build"
                env_id, settings = args
                match = _DMC_ID.fullmatch(env_id)
                domain = DOMAIN_ALIASES.get(match["domain"], match["domain"])
                env = _local_env(domain, match["task"], settings)
                stage = "render"
                frame = np.asarray(env.unwrapped.render())
                if frame.shape != (IMAGE_SIZE, IMAGE_SIZE, 3):
                    raise RuntimeError(f"rendered a frame of shape {frame.shape}")
                result = (env.observation_space, env.action_space)
            else:
                result = getattr(env, method)(*args, **kwargs)
        except Exception:
            send.send(("error", stage, traceback.format_exc()))
        else:
            send.send(("ok", None, result))
    if env is not None:
        env.close()


# The render process's entry point: this file run by path (`python -c _CHILD_MAIN path fd fd`).
_CHILD_MAIN = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"

if __name__ == "__main__":
    _serve(int(sys.argv[-2]), int(sys.argv[-1]))
