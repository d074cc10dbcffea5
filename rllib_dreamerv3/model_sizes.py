"""The model-size table (the paper's Appendix B): the only place where network widths and depths
are set.

XS…XL follow the paper's table B. nano…XXS are debug sizes with fewer latent categoricals and
classes (the same numbers as RLlib's built-in DreamerV3, so that benchmarks compare like with like).
"""

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSize:
    """Widths and depths of every network for one model size."""

    gru_units: int  # size of the deterministic state h
    cnn_multiplier: int  # channels of the first conv layer (d, 2d, 4d, 8d)
    dense_units: int  # width of every MLP hidden layer
    mlp_layers: int  # hidden layers of encoder, decoder, heads, actor and critic
    num_categoricals: int  # z: this many independent categoricals ...
    num_classes: int  # ... of this many classes each
    # The vector-observation encoder and decoder MLPs (None: `dense_units`, `mlp_layers`).
    vector_mlp_units: int | None = None
    vector_mlp_layers: int | None = None

    @property
    def vector_mlp(self):
        """`(units, layers)` of the vector-observation encoder and decoder MLPs."""
        units = self.vector_mlp_units or self.dense_units
        return units, self.vector_mlp_layers or self.mlp_layers


MODEL_SIZES = {
    "nano": ModelSize(16, 2, 16, 1, 4, 4),
    "micro": ModelSize(32, 4, 32, 1, 8, 8),
    "mini": ModelSize(64, 8, 64, 1, 16, 16),
    "XXS": ModelSize(128, 16, 128, 1, 32, 32),
    "XS": ModelSize(256, 24, 256, 1, 32, 32),
    "S": ModelSize(512, 32, 512, 2, 32, 32),
    "M": ModelSize(1024, 48, 640, 3, 32, 32),
    "L": ModelSize(2048, 64, 768, 4, 32, 32),
    "XL": ModelSize(4096, 96, 1024, 5, 32, 32),
}


def get_model_size(name, vector_mlp_units=None, vector_mlp_layers=None):
    """The :class:`ModelSize` called `name`, with the vector encoder/decoder MLP's width and
    depth where given; a clear `ValueError` for unknown names."""
    if name not in MODEL_SIZES:
        raise ValueError(
            f"Unknown model_size={name!r}. Use one of {list(MODEL_SIZES)} "
            "(XS…XL are the paper's sizes, nano…XXS small sizes for debugging)."
        )
    return dataclasses.replace(
        MODEL_SIZES[name], vector_mlp_units=vector_mlp_units, vector_mlp_layers=vector_mlp_layers
    )
