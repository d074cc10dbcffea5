"""Observation encoders and decoders (the paper's Appendix B): an MLP for vectors, a CNN for
64×64 images, and for Dict observations both (as the author's code: vector entries concatenated
through the MLP, images stacked along channels through the CNN).

Every encoder maps observations `[..., *obs_shape]` (a dict of such for Dict observations) to
embeddings `[..., out_units]`; every decoder maps features `[..., F]` to its prediction, and its
`loss` is `-ln p(x|s)` up to a constant, `[...]`. :func:`make_encoder_decoder` picks the pair
for an observation shape.
"""

import math
from itertools import pairwise

import tensorflow as tf

from rllib_dreamerv3 import math_ops
from rllib_dreamerv3.networks import MLP, Conv, ConvBlock, Dense

# The CNNs halve the resolution with every stride-2 layer until the image is this small.
CNN_MIN_RESOLUTION = 4


def flatten_leading(x, inner_rank):
    """`[..., *inner]` -> `[N, *inner]`, and the leading shape to restore it."""
    lead = tf.shape(x)[: x.shape.rank - inner_rank]
    return tf.reshape(x, [-1, *x.shape[x.shape.rank - inner_rank :]]), lead


def restore_leading(x, lead, inner_rank):
    """The inverse of :func:`flatten_leading`: `[N, *inner]` -> `[*lead, *inner]`."""
    inner = tf.shape(x)[x.shape.rank - inner_rank :] if inner_rank else []
    return tf.reshape(x, tf.concat([lead, inner], 0))


class VectorEncoder(tf.Module):
    """symlog(obs) -> MLP: `[..., obs_dim]` -> `[..., units]` (`size.vector_mlp`)."""

    def __init__(self, obs_dim, size, name=None):
        super().__init__(name=name)
        self.mlp = MLP(obs_dim, *size.vector_mlp)
        self.out_units = self.mlp.out_units

    def __call__(self, obs):
        x, lead = flatten_leading(tf.cast(obs, tf.float32), 1)
        return restore_leading(self.mlp(math_ops.symlog(x)), lead, 1)


class VectorDecoder(tf.Module):
    """Features -> MLP -> symlog(obs) prediction; its loss is the symlog squared error."""

    def __init__(self, feat_dim, obs_dim, size, name=None):
        super().__init__(name=name)
        self.mlp = MLP(feat_dim, *size.vector_mlp, out_units=obs_dim)

    def __call__(self, feat):
        x, lead = flatten_leading(feat, 1)
        return restore_leading(self.mlp(x), lead, 1)

    def loss(self, feat, obs):
        """Squared error in symlog space, summed over the observation's entries."""
        return self.loss_of(self(feat), obs)

    @staticmethod
    def loss_of(prediction, obs):
        """:meth:`loss` given the decoder's output `prediction`."""
        return tf.reduce_sum(tf.square(prediction - math_ops.symlog(tf.cast(obs, tf.float32))), -1)

    def predict(self, feat):
        """Observation prediction in real space."""
        return math_ops.symexp(self(feat))


def _cnn_channels(image_size, multiplier):
    """`d, 2d, 4d, ...`: one entry per stride-2 layer from `image_size` down to 4×4."""
    num_layers = int(math.log2(image_size // CNN_MIN_RESOLUTION))
    return [multiplier * 2**i for i in range(num_layers)]


class ImageEncoder(tf.Module):
    """CNN on uint8 images `[..., H, W, C]` (pixels centred: `x / 255 - 0.5`).

    Layers: :class:`~rllib_dreamerv3.networks.ConvBlock` with `d, 2d, 4d, 8d` channels for the
    size's multiplier `d`, kernel `kernel`, stride 2, "same" padding: 64×64 -> 4×4. The output,
    `[..., 4 * 4 * 8d]`, is the flattened last feature map.
    """

    def __init__(self, obs_shape, size, kernel=4, name=None):
        super().__init__(name=name)
        self.obs_shape = tuple(obs_shape)
        channels = [self.obs_shape[-1]] + _cnn_channels(self.obs_shape[0], size.cnn_multiplier)
        self.blocks = [ConvBlock(cin, cout, kernel, 2) for cin, cout in pairwise(channels)]
        self.out_units = CNN_MIN_RESOLUTION**2 * channels[-1]

    def __call__(self, obs):
        x, lead = flatten_leading(obs, 3)
        x = tf.cast(x, tf.float32) / 255.0 - 0.5
        for block in self.blocks:
            x = block(x)
        return restore_leading(tf.reshape(x, [-1, self.out_units]), lead, 1)


class ImageDecoder(tf.Module):
    """Transposed CNN mirroring :class:`ImageEncoder`: features -> centred pixels `[..., H, W, C]`.

    A dense layer maps the features to a 4×4×8d map; transposed ConvBlocks with `4d, 2d, d`
    channels upsample it, and a last transposed conv (with bias, no norm) outputs the image.
    The loss is the squared error on centred pixels `x / 255 - 0.5`, summed over pixels.
    """

    def __init__(self, feat_dim, obs_shape, size, kernel=4, name=None):
        super().__init__(name=name)
        self.obs_shape = tuple(obs_shape)
        channels = _cnn_channels(self.obs_shape[0], size.cnn_multiplier)[::-1]  # 8d ... d
        self.start_shape = (CNN_MIN_RESOLUTION, CNN_MIN_RESOLUTION, channels[0])
        self.dense = Dense(feat_dim, CNN_MIN_RESOLUTION**2 * channels[0])
        self.blocks = [
            ConvBlock(cin, cout, kernel, 2, transpose=True) for cin, cout in pairwise(channels)
        ]
        self.out = Conv(channels[-1], self.obs_shape[-1], kernel, 2, transpose=True)

    def __call__(self, feat):
        x, lead = flatten_leading(feat, 1)
        x = tf.reshape(self.dense(x), [-1, *self.start_shape])
        for block in self.blocks:
            x = block(x)
        return restore_leading(self.out(x), lead, 3)

    def loss(self, feat, obs):
        """Squared error on centred pixels, summed over the image."""
        return self.loss_of(self(feat), obs)

    @staticmethod
    def loss_of(prediction, obs):
        """:meth:`loss` given the decoder's output `prediction`."""
        target = tf.cast(obs, tf.float32) / 255.0 - 0.5
        return tf.reduce_sum(tf.square(prediction - target), [-3, -2, -1])

    def predict(self, feat):
        """Predicted image as uint8 pixels."""
        return self.pixels(self(feat))

    @staticmethod
    def pixels(prediction):
        """The decoder's output (centred pixels) as uint8 pixels."""
        pixels = tf.clip_by_value((prediction + 0.5) * 255.0, 0.0, 255.0)
        return tf.cast(tf.round(pixels), tf.uint8)


class DictEncoder(tf.Module):
    """Dict observations `{key: [..., *shape]}`: the vector entries (1-D), concatenated in key
    order, through a :class:`VectorEncoder`; the images (`(H, W, C)`), stacked along channels,
    through an :class:`ImageEncoder`; the two embeddings concatenated.

    Args:
        shapes: `{key: shape}` of the entries to encode (others in the observation are ignored).
    """

    def __init__(self, shapes, size, kernel=4, name=None):
        super().__init__(name=name)
        self.vector_keys, self.image_keys = _split_keys(shapes)
        self.vector = self.image = None
        if self.vector_keys:
            dims = sum(shapes[key][0] for key in self.vector_keys)
            self.vector = VectorEncoder(dims, size, name="vector")
        if self.image_keys:
            channels = sum(shapes[key][-1] for key in self.image_keys)
            image_shape = (*shapes[self.image_keys[0]][:2], channels)
            self.image = ImageEncoder(image_shape, size, kernel, name="image")
        self.out_units = sum(part.out_units for part in self.parts)

    @property
    def parts(self):
        """The vector and image encoders present, in that order."""
        return [part for part in (self.vector, self.image) if part is not None]

    def inputs(self, obs):
        """The parts' inputs: the concatenated vectors (float32), the stacked images."""
        out = []
        if self.vector is not None:
            out.append(tf.concat([tf.cast(obs[k], tf.float32) for k in self.vector_keys], -1))
        if self.image is not None:
            out.append(tf.concat([obs[k] for k in self.image_keys], -1))
        return out

    def __call__(self, obs):
        return tf.concat([part(x) for part, x in zip(self.parts, self.inputs(obs))], -1)


class DictDecoder(tf.Module):
    """Reconstructs the entries of Dict observations: one :class:`VectorDecoder` for all vector
    entries and one :class:`ImageDecoder` for all images (their outputs split back per key);
    the loss is the sum of every entry's loss (symlog squared error, pixel squared error).

    Args:
        shapes: `{key: shape}` of the entries to reconstruct.
    """

    def __init__(self, feat_dim, shapes, size, kernel=4, name=None):
        super().__init__(name=name)
        self.vector_keys, self.image_keys = _split_keys(shapes)
        self.shapes = dict(shapes)
        self.vector = self.image = None
        if self.vector_keys:
            dims = sum(shapes[key][0] for key in self.vector_keys)
            self.vector = VectorDecoder(feat_dim, dims, size, name="vector")
        if self.image_keys:
            channels = sum(shapes[key][-1] for key in self.image_keys)
            image_shape = (*shapes[self.image_keys[0]][:2], channels)
            self.image = ImageDecoder(feat_dim, image_shape, size, kernel, name="image")

    @property
    def parts(self):
        """The vector and image decoders present, in that order."""
        return [part for part in (self.vector, self.image) if part is not None]

    def split(self, outputs):
        """The parts' outputs (as :attr:`parts`) split into `{key: prediction}`."""
        out, outputs = {}, list(outputs)
        for keys, part in ((self.vector_keys, self.vector), (self.image_keys, self.image)):
            if part is not None:
                sizes = [self.shapes[key][-1] for key in keys]
                out.update(zip(keys, tf.split(outputs.pop(0), sizes, axis=-1)))
        return out

    def __call__(self, feat):
        return self.split([part(feat) for part in self.parts])

    def loss(self, feat, obs):
        """Sum of the entries' losses."""
        return self.loss_of(self(feat), obs)

    def loss_of(self, prediction, obs):
        """:meth:`loss` given the decoder's output `prediction`."""
        return tf.add_n(list(self.losses_of(prediction, obs).values()))

    def losses_of(self, prediction, obs):
        """`{key: loss [...]}` of every reconstructed entry."""
        losses = {}
        for key in self.vector_keys:
            losses[key] = VectorDecoder.loss_of(prediction[key], obs[key])
        for key in self.image_keys:
            losses[key] = ImageDecoder.loss_of(prediction[key], obs[key])
        return losses

    def predict(self, feat):
        """`{key: prediction}`: vectors in real space, images as uint8 pixels."""
        out = self(feat)
        for key in self.vector_keys:
            out[key] = math_ops.symexp(out[key])
        for key in self.image_keys:
            out[key] = ImageDecoder.pixels(out[key])
        return out


def _split_keys(shapes):
    """`(vector keys, image keys)` of `{key: shape}`, each in key order."""
    keys = sorted(shapes)
    return [k for k in keys if len(shapes[k]) == 1], [k for k in keys if len(shapes[k]) == 3]


def make_encoder_decoder(
    obs_shape, feat_dim, size, cnn_kernel=4, encoder_keys=None, decoder_keys=None
):
    """`(encoder, decoder)` for observations of `obs_shape`: 1-D vectors, `(H, W, C)` images, or
    a dict `{key: shape}` of both (Dict observations), of which the encoder reads the entries
    `encoder_keys` and the decoder reconstructs `decoder_keys` (None: all)."""
    if isinstance(obs_shape, dict):
        encoded = {k: obs_shape[k] for k in encoder_keys or obs_shape}
        decoded = {k: obs_shape[k] for k in decoder_keys or obs_shape}
        return (
            DictEncoder(encoded, size, cnn_kernel, name="encoder"),
            DictDecoder(feat_dim, decoded, size, cnn_kernel, name="decoder"),
        )
    if len(obs_shape) == 3:
        return (
            ImageEncoder(obs_shape, size, cnn_kernel, name="encoder"),
            ImageDecoder(feat_dim, obs_shape, size, cnn_kernel, name="decoder"),
        )
    return (
        VectorEncoder(obs_shape[0], size, name="encoder"),
        VectorDecoder(feat_dim, obs_shape[0], size, name="decoder"),
    )
