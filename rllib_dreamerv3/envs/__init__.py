"""The environments of the paper's benchmarks, made as DreamerV3 expects them: Atari
(`atari.py`, ALE with the paper's settings) and DeepMind Control (`dmc.py`, `"DMC/<domain>-<task>"`
ids), with their shared settings handling (`settings.py`)."""
