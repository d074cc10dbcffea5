"""Observation encoders and decoders: CNN shapes and parameter counts for every size."""

import numpy as np
import pytest
import tensorflow as tf

from rllib_dreamerv3.encoders import (
    ImageDecoder,
    ImageEncoder,
    VectorDecoder,
    VectorEncoder,
    make_encoder_decoder,
)
from rllib_dreamerv3.model_sizes import MODEL_SIZES, get_model_size

KERNEL = 4


def num_params(module):
    return sum(int(np.prod(v.shape)) for v in module.trainable_variables)


def conv_block_params(cin, cout):
    return KERNEL * KERNEL * cin * cout + 2 * cout  # kernel (no bias) + LayerNorm scale/offset


@pytest.mark.parametrize("size", list(MODEL_SIZES))
@pytest.mark.parametrize("channels", [3, 1])
def test_cnn_shapes_and_parameter_counts(size, channels):
    dims = get_model_size(size)
    d = dims.cnn_multiplier
    feat_dim = 7
    encoder = ImageEncoder((64, 64, channels), dims, KERNEL)
    decoder = ImageDecoder(feat_dim, (64, 64, channels), dims, KERNEL)

    # d, 2d, 4d, 8d channels, each layer halving the resolution: 64 -> 32 -> 16 -> 8 -> 4.
    x = tf.zeros([2, 64, 64, channels], tf.uint8)
    x = tf.cast(x, tf.float32)
    for block, (res, ch) in zip(encoder.blocks, [(32, d), (16, 2 * d), (8, 4 * d), (4, 8 * d)]):
        x = block(x)
        assert x.shape == (2, res, res, ch)
    assert len(encoder.blocks) == 4
    assert encoder.out_units == 4 * 4 * 8 * d
    assert encoder(tf.zeros([3, 5, 64, 64, channels], tf.uint8)).shape == (3, 5, 4 * 4 * 8 * d)
    assert decoder(tf.zeros([3, 5, feat_dim])).shape == (3, 5, 64, 64, channels)

    expected_encoder = sum(
        conv_block_params(a, b)
        for a, b in [(channels, d), (d, 2 * d), (2 * d, 4 * d), (4 * d, 8 * d)]
    )
    expected_decoder = (
        feat_dim * 16 * 8 * d
        + 16 * 8 * d  # dense with bias to 4x4x8d
        + sum(conv_block_params(a, b) for a, b in [(8 * d, 4 * d), (4 * d, 2 * d), (2 * d, d)])
        + KERNEL * KERNEL * d * channels
        + channels
    )  # output conv with bias
    assert num_params(encoder) == expected_encoder
    assert num_params(decoder) == expected_decoder


def test_xs_encoder_parameter_count_by_hand():
    # XS, d = 24, RGB: 4*4*(3*24 + 24*48 + 48*96 + 96*192) kernels + 2*(24+48+96+192) norms.
    encoder = ImageEncoder((64, 64, 3), get_model_size("XS"), KERNEL)
    assert num_params(encoder) == 388_224 + 720


def test_encoder_centres_pixels_and_decoder_loss_is_pixel_squared_error():
    dims = get_model_size("nano")
    decoder = ImageDecoder(3, (64, 64, 1), dims, KERNEL)
    for v in decoder.variables:  # a decoder that predicts 0 everywhere (centred grey 127.5)
        v.assign(tf.zeros_like(v))
    obs = np.zeros((2, 64, 64, 1), np.uint8)
    obs[1] = 255
    loss = decoder.loss(tf.zeros([2, 3]), obs).numpy()
    # 4096 squared errors of 0.25 each: their sum is exact in any order.
    np.testing.assert_allclose(loss, [64 * 64 * 0.25, 64 * 64 * 0.25], rtol=1e-6)
    assert decoder.predict(tf.zeros([1, 3])).dtype == tf.uint8
    assert int(decoder.predict(tf.zeros([1, 3]))[0, 0, 0, 0]) == 128  # round(127.5)


def test_make_encoder_decoder_picks_by_observation_rank():
    dims = get_model_size("nano")
    enc, dec = make_encoder_decoder((5,), 9, dims)
    assert isinstance(enc, VectorEncoder) and isinstance(dec, VectorDecoder)
    assert dec(tf.zeros([2, 9])).shape == (2, 5)
    enc, dec = make_encoder_decoder((64, 64, 3), 9, dims)
    assert isinstance(enc, ImageEncoder) and isinstance(dec, ImageDecoder)


def test_vector_encoder_and_decoder_width_and_depth_are_configurable():
    # The author's runs on vector observations used 5 x 1024 MLPs at every size; the default
    # is the size table's (nano: 1 x 16).
    default = get_model_size("nano")
    assert default.vector_mlp == (16, 1)
    size = get_model_size("nano", vector_mlp_units=24, vector_mlp_layers=3)
    assert size.vector_mlp == (24, 3) and size.dense_units == 16 and size.mlp_layers == 1
    obs_dim, feat_dim = 5, 7
    encoder, decoder = VectorEncoder(obs_dim, size), VectorDecoder(feat_dim, obs_dim, size)
    dense = lambda a, b: a * b + 2 * b  # noqa: E731 - kernel (no bias), LayerNorm scale/offset
    assert num_params(encoder) == dense(5, 24) + 2 * dense(24, 24)
    assert num_params(decoder) == dense(7, 24) + 2 * dense(24, 24) + 24 * 5 + 5
    assert encoder.out_units == 24
    assert encoder(tf.zeros([2, 3, obs_dim])).shape == (2, 3, 24)
    assert decoder(tf.zeros([2, 3, feat_dim])).shape == (2, 3, obs_dim)


def test_the_config_sets_the_modules_vector_mlp():
    import gymnasium as gym

    from rllib_dreamerv3 import DreamerV3Config

    config = (
        DreamerV3Config()
        .environment("CartPole-v1")
        .training(model_size="nano", vector_mlp_units=24, vector_mlp_layers=2)
    )
    module = config.get_rl_module_spec(env=gym.make("CartPole-v1")).build()
    world_model = module.model.world_model
    assert [b.dense.w.shape[1] for b in world_model.encoder.mlp.blocks] == [24, 24]
    assert [b.dense.w.shape[1] for b in world_model.decoder.mlp.blocks] == [24, 24]
    assert world_model.gru.units == 16  # the rest keeps the size table's
