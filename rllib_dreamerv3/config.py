"""The names of DreamerV3's configuration, defined in :mod:`rllib_dreamerv3.algorithm`.

`DreamerV3Config` and `HYPERPARAMETERS` (name -> default and meaning of every DreamerV3
hyperparameter, with the paper's defaults) live next to `DreamerV3`, as in RLlib's own
algorithms, so that the config and the algorithm name each other without an import cycle. This
module keeps `from rllib_dreamerv3.config import ...` and configs pickled under this module's
name (older checkpoints) working; it imports from `rllib_dreamerv3.algorithm`, never the reverse.
"""

from rllib_dreamerv3.algorithm import (
    HYPERPARAMETERS,
    NONFINITE_ENV_DATA,
    PRECISIONS,
    DreamerV3Config,
)

__all__ = ["HYPERPARAMETERS", "NONFINITE_ENV_DATA", "PRECISIONS", "DreamerV3Config"]
