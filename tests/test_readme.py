"""README's code blocks run as written."""

import pathlib
import re

import pytest
from helpers import tiny_config

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_block(containing):
    """The one ```python block of README.md that contains `containing`."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    found = [block for block in blocks if containing in block]
    assert len(found) == 1, f"{len(found)} README blocks contain {containing!r}"
    return found[0]


@pytest.mark.usefixtures("ray_session")
def test_the_module_action_snippet_plays_an_episode(capsys):
    algo = tiny_config().build_algo()  # CartPole-v1, as the snippet's env
    try:
        exec(python_block("module.act("), {"algo": algo})
    finally:
        algo.stop()
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"return \d+\.0", printed), printed
