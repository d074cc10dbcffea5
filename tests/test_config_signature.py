"""`DreamerV3Config.training`: one typed keyword per hyperparameter, documented from the table."""

import inspect
import pydoc
import types
import typing

import pytest
from ray.rllib.utils.from_config import NotProvided

from rllib_dreamerv3 import DreamerV3Config
from rllib_dreamerv3.config import HYPERPARAMETERS


def _explicit_keywords(function):
    """The keyword-only parameters written in `function`'s `def` (not its `__signature__`)."""
    code = function.__code__
    return list(code.co_varnames[code.co_argcount : code.co_argcount + code.co_kwonlyargcount])


def test_training_has_one_keyword_per_hyperparameter_in_table_order():
    assert _explicit_keywords(DreamerV3Config.training) == list(HYPERPARAMETERS)


def test_explicit_defaults_are_not_provided():
    defaults = DreamerV3Config.training.__kwdefaults__
    assert set(defaults) == set(HYPERPARAMETERS)
    assert all(value is NotProvided for value in defaults.values())


def test_signature_shows_the_table_defaults_and_types():
    params = inspect.signature(DreamerV3Config.training).parameters
    for name, (default, _) in HYPERPARAMETERS.items():
        param = params[name]
        assert param.kind is inspect.Parameter.KEYWORD_ONLY, name
        assert param.default == default, name
        assert param.annotation is not inspect.Parameter.empty, name
        allowed = (
            typing.get_args(param.annotation)
            if isinstance(param.annotation, types.UnionType)
            else (param.annotation,)
        )
        allowed = tuple(type(None) if t is None else t for t in allowed)
        assert isinstance(default, allowed), (name, default, param.annotation)
    assert params["model_size"].annotation is str and params["model_size"].default == "XS"
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def test_help_shows_defaults_and_meanings_from_the_table():
    text = pydoc.render_doc(DreamerV3Config.training, renderer=pydoc.plaintext)
    assert "model_size: str = 'XS'" in text
    assert "fast_kernels: bool = True" in text
    for name in HYPERPARAMETERS:
        assert f"    {name}: " in text, name
    assert "Default: 1024." in text  # training_ratio


def test_only_given_values_are_set():
    config = DreamerV3Config().training(model_size="nano", batch_size_B=4)
    config.training(horizon_H=7)  # leaves the earlier values as they are
    assert (config.model_size, config.batch_size_B, config.horizon_H) == ("nano", 4, 7)
    assert config.training_ratio == HYPERPARAMETERS["training_ratio"][0]
    config.training(model_size=NotProvided)
    assert config.model_size == "nano"


class _Chosen(Exception):
    pass


@pytest.mark.parametrize("fast, chosen", [(True, "kernels"), (False, "losses")])
def test_fast_kernels_selects_the_update_implementation(fast, chosen, monkeypatch):
    """`make_update_fn` traces the world-model loss of the implementation the switch names."""
    import tensorflow as tf

    from rllib_dreamerv3 import update
    from rllib_dreamerv3.model import DreamerV3Model
    from rllib_dreamerv3.model_sizes import MODEL_SIZES

    for name in ("kernels", "losses"):

        def world_model_loss(*args, name=name):
            raise _Chosen(name)

        monkeypatch.setattr(getattr(update, name), "world_model_loss", world_model_loss)
    config = DreamerV3Config().training(fast_kernels=fast)
    model = DreamerV3Model((3,), 2, True, MODEL_SIZES["nano"])
    signature = update.batch_signature((3,), tf.float32, 2, 2, 4)
    update_fn = update.make_update_fn(model, {}, config, signature, jit_compile=False)
    with pytest.raises(_Chosen, match=f"^{chosen}$"):
        update_fn.get_concrete_function()
