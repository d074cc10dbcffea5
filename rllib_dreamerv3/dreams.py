"""Dream summaries: what the world model reconstructs and imagines, as TensorBoard media.

Every `dream_every_n_updates` updates the Learner runs :func:`make_dream_fn` on a replayed batch:
the posterior reconstructs every step, and an *open-loop dream* observes the first
`dream_burn_in` steps, then imagines the rest with the prior, fed the real actions. Then
:func:`dream_summaries` turns the result into arrays that Ray Tune's TensorBoard logger writes
as images (`[C, H, W]` uint8) and videos (`[1, T, C, H, W]` uint8), plus scalar errors.
:func:`save_dreams` writes the same media as PNG/MP4 files.
"""

import os

import cv2
import numpy as np
import tensorflow as tf

from rllib_dreamerv3 import random_ops
from rllib_dreamerv3.losses import time_major


class MediaArray(np.ndarray):
    """A numpy image/video in a result dict. TensorBoard sees an ndarray; Tune's JSON and CSV
    loggers, which would write every pixel as text, see a one-line description instead."""

    def __repr__(self):
        return f"<{self.dtype} media {self.shape}>"

    __str__ = __repr__


def _media(array):
    return np.ascontiguousarray(array, np.uint8).view(MediaArray)


def make_dream_fn(model, signature, burn_in, num_sequences, jit_compile=True):
    """A compiled `dream(batch, seed) -> dict` on the first `num_sequences` sequences of a batch.

    The dict holds, all batch-major `[n, T, ...]` (observations as dicts `{key: ...}` for Dict
    observations, of the decoded keys for `recon` and `dream`): `obs` (real), `recon` (decoded
    posterior),
    `dream` (decoded posterior for the first `burn_in` steps, then open-loop prior predictions
    with the real actions; an `is_first` inside the dream resets to the initial state), and
    real / open-loop `rewards` and continue probabilities. Traced once; only called when dream
    summaries are due, so it never slows the update.
    """
    wm = model.world_model
    length = signature["rewards"].shape[1]

    def dream(batch, seed):
        batch = tf.nest.map_structure(lambda value: value[:num_sequences], batch)
        seeds = random_ops.split(seed, 2 * length)
        obs = tf.nest.map_structure(time_major, batch["obs"])
        actions = time_major(batch["actions"])
        is_first = time_major(batch["is_first"])
        prev_actions = tf.concat([tf.zeros_like(actions[:1]), actions[:-1]], 0)
        h, z, _, _ = wm.observe(wm.encoder(obs), prev_actions, is_first, seeds[:length])
        posterior = tf.concat([h, z], -1)  # [T, n, F]
        feats = [posterior[t] for t in range(burn_in)]
        h_t, z_t = h[burn_in - 1], z[burn_in - 1]
        for t in range(burn_in, length):
            h_t, z_t, action = wm.reset(h_t, z_t, prev_actions[t], is_first[t])
            h_t, z_t = wm.imagine_step(h_t, z_t, action, seeds[length + t])
            feats.append(tf.concat([h_t, z_t], -1))
        dreamed = tf.stack(feats, 0)

        def batch_major(x):  # swapping the first two axes back: [T, n] -> [n, T]
            return tf.nest.map_structure(time_major, x)

        return {
            "obs": batch["obs"],
            "recon": batch_major(wm.decoder.predict(posterior)),
            "dream": batch_major(wm.decoder.predict(dreamed)),
            "reward_real": batch["rewards"],
            "reward_dream": batch_major(wm.reward(dreamed)),
            "continue_real": 1.0 - tf.cast(batch["is_terminal"], tf.float32),
            "continue_dream": batch_major(tf.sigmoid(wm.continue_logit(dreamed))),
        }

    return tf.function(
        dream,
        jit_compile=jit_compile,
        autograph=False,
        input_signature=[signature, tf.TensorSpec([2], tf.int32)],
    )


def dream_summaries(out, burn_in):
    """Media and scalars from :func:`make_dream_fn`'s numpy output.

    Returns a dict: `reconstruction` (image: real above decoded-posterior frames, for each
    sequence) and `video` (real | dream | error, one row per sequence) for image observations;
    `observations` (vector plot: real, posterior, dream for the first dims of sequence 0) for
    vectors; `rewards_and_continues` (plot: real vs dreamed); scalars `obs_mse_posterior`,
    `obs_mse_open_loop`, `reward_mae_open_loop`, `continue_mae_open_loop` (open loop: the
    imagined steps only). For Dict observations every decoded image entry gets its own
    `reconstruction/<key>`, `video/<key>` and every entry its own `obs_mse_*/<key>`; the vector
    entries share one `observations` plot.
    """
    recon, dream = out["recon"], out["dream"]
    dict_obs = isinstance(recon, dict)
    entries = recon.keys() if dict_obs else [None]
    summaries, panels = {}, []
    for key in entries:
        suffix, name = ("", "obs") if key is None else (f"/{key}", key)
        obs = out["obs"][key] if dict_obs else out["obs"]
        rec, dre = (recon[key], dream[key]) if dict_obs else (recon, dream)
        image = obs.ndim == 5
        scale = 255.0 if image else 1.0
        real = obs.astype(np.float32) / scale
        summaries[f"obs_mse_posterior{suffix}"] = float(np.mean((rec / scale - real) ** 2))
        summaries[f"obs_mse_open_loop{suffix}"] = float(
            np.mean((dre[:, burn_in:] / scale - real[:, burn_in:]) ** 2)
        )
        if image:
            summaries[f"reconstruction{suffix}"] = _media(_frame_grid(obs, rec).transpose(2, 0, 1))
            summaries[f"video{suffix}"] = _media(_video(obs, dre)[None].transpose(0, 1, 4, 2, 3))
        else:
            max_dims = 4 if dict_obs else 8
            panels += _vector_panels(obs[0], rec[0], dre[0], burn_in, name, max_dims)
    summaries["reward_mae_open_loop"] = float(
        np.mean(np.abs(out["reward_dream"][:, burn_in:] - out["reward_real"][:, burn_in:]))
    )
    summaries["continue_mae_open_loop"] = float(
        np.mean(np.abs(out["continue_dream"][:, burn_in:] - out["continue_real"][:, burn_in:]))
    )
    if panels:
        summaries["observations"] = _media(np.concatenate(panels, axis=0).transpose(2, 0, 1))
    summaries["rewards_and_continues"] = _media(_reward_plot(out, burn_in).transpose(2, 0, 1))
    return summaries


def save_dreams(summaries, directory, prefix="dreams"):
    """Write the media of :func:`dream_summaries` as PNG images and an MP4 video; return paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for key, value in summaries.items():
        if not isinstance(value, np.ndarray):
            continue
        path = os.path.join(directory, f"{prefix}_{key.replace('/', '_')}")
        if value.ndim == 3:  # [C, H, W]
            paths.append(path + ".png")
            cv2.imwrite(paths[-1], _bgr(np.asarray(value).transpose(1, 2, 0)))
        elif value.ndim == 5:  # [1, T, C, H, W]
            frames = np.asarray(value)[0].transpose(0, 2, 3, 1)
            paths.append(path + ".mp4")
            height, width = frames.shape[1:3]
            writer = cv2.VideoWriter(
                paths[-1], cv2.VideoWriter_fourcc(*"mp4v"), 10, (width, height)
            )
            for frame in frames:
                writer.write(_bgr(frame))
            writer.release()
    return paths


def _bgr(rgb):
    rgb = np.asarray(rgb)
    return np.repeat(rgb, 3, -1) if rgb.shape[-1] == 1 else rgb[..., ::-1]


# --- layout helpers (numpy, host side) ---------------------------------------------------------
def _frame_grid(obs, recon, columns=8):
    """`[n * 2 * H, columns * W, C]`: per sequence a row of real frames over a row of recons."""
    length = obs.shape[1]
    steps = np.linspace(0, length - 1, min(columns, length)).astype(int)
    rows = []
    for seq in range(obs.shape[0]):
        for frames in (obs[seq], recon[seq]):
            rows.append(np.concatenate(list(frames[steps]), axis=1))
    return np.concatenate(rows, axis=0)


def _video(obs, dream):
    """`[T, n * H, 3 * W, C]`: real | dream | absolute error, one row per sequence."""
    error = np.abs(obs.astype(np.int16) - dream.astype(np.int16)).astype(np.uint8)
    rows = np.concatenate([obs, dream, error], axis=3)  # [n, T, H, 3W, C]
    return np.concatenate(list(rows), axis=1)  # [T, nH, 3W, C]


_COLORS = {"real": (40, 40, 40), "posterior": (30, 120, 230), "dream": (220, 50, 50)}


def _panel(series, burn_in, title, height=90, width=320):
    """One line plot `[height, width, 3]` of `{name: values [T]}`, burn-in end marked."""
    canvas = np.full((height, width, 3), 255, np.uint8)
    values = np.concatenate([np.asarray(v, np.float64) for v in series.values()])
    low, high = float(np.min(values)), float(np.max(values))
    if high - low < 1e-6:
        low, high = low - 1.0, high + 1.0
    length = len(next(iter(series.values())))
    top, bottom, left, right = 14, height - 4, 4, width - 4

    def point(t, v):
        x = left + (right - left) * t / max(1, length - 1)
        y = bottom - (bottom - top) * (v - low) / (high - low)
        return round(x), round(y)

    boundary = point(burn_in - 0.5, low)[0]
    cv2.line(canvas, (boundary, top), (boundary, bottom), (170, 170, 170), 1)
    for name, v in series.items():
        pts = np.array([point(t, x) for t, x in enumerate(v)], np.int32)
        cv2.polylines(canvas, [pts], False, _COLORS[name], 1, cv2.LINE_AA)
    x = _text(canvas, f"{title} [{low:.3g}, {high:.3g}]", left, (0, 0, 0))
    for name in series:  # the legend: each name in its line's colour
        x = _text(canvas, name, x + 6, _COLORS[name])
    return canvas


def _text(canvas, text, x, color):
    """Draw small text at `(x, top)`; return where the next text may start."""
    font, scale = cv2.FONT_HERSHEY_SIMPLEX, 0.3
    cv2.putText(canvas, text, (x, 10), font, scale, color, 1, cv2.LINE_AA)
    return x + cv2.getTextSize(text, font, scale, 1)[0][0]


def _vector_panels(obs, recon, dream, burn_in, name="obs", max_dims=8):
    """Panels, one per observation dim: real, posterior reconstruction and dream over time."""
    return [
        _panel(
            {"real": obs[:, i], "posterior": recon[:, i], "dream": dream[:, i]},
            burn_in,
            f"{name}[{i}]",
        )
        for i in range(min(max_dims, obs.shape[-1]))
    ]


def _reward_plot(out, burn_in):
    """Panels per sequence: reward and continue probability, real vs dream."""
    panels = []
    for seq in range(out["reward_real"].shape[0]):
        panels.append(
            _panel(
                {"real": out["reward_real"][seq], "dream": out["reward_dream"][seq]},
                burn_in,
                f"reward seq {seq}",
            )
        )
        panels.append(
            _panel(
                {"real": out["continue_real"][seq], "dream": out["continue_dream"][seq]},
                burn_in,
                f"continue seq {seq}",
            )
        )
    return np.concatenate(panels, axis=0)
