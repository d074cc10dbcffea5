"""`env_config` tables of the built-in envs (Atari, DeepMind Control): checked keys, defaults."""

import difflib


def settings_with_defaults(env_config, table, kind):
    """`env_config` completed with the defaults of `table` (`name -> (default, description)`);
    a `ValueError` naming an unknown key, the closest known one and every valid key. `kind`
    names the envs in the message, e.g. "Atari"."""
    env_config = dict(env_config or {})
    for key in env_config:
        if key not in table:
            close = difflib.get_close_matches(str(key), list(table), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            valid = "; ".join(
                f"{name!r} (default {default!r}): {doc}" for name, (default, doc) in table.items()
            )
            raise ValueError(f"Unknown {kind} env_config key {key!r}.{hint} Valid keys: {valid}.")
    return {name: env_config.get(name, default) for name, (default, _) in table.items()}
