import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("RAY_DEDUP_LOGS", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def ray_session():
    """A 2-CPU local Ray for the tests of one module (`usefixtures("ray_session")`)."""
    import ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        ignore_reinit_error=True,
        runtime_env={"env_vars": {"TF_CPP_MIN_LOG_LEVEL": "3"}},
    )
    yield
    ray.shutdown()
