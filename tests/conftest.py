import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("RAY_DEDUP_LOGS", "1")

import pytest  # noqa: E402

# Modules that compile many XLA programs. Every compiled program stays mapped in the process that
# compiled it (TF keeps its compilation cache for the life of the process), and Linux caps a
# process at `vm.max_map_count` (65,530 by default) mappings; past it TF dies with SIGSEGV and no
# traceback. When a run also selects `test_isolated_modules.py`, each of these modules runs in its
# own interpreter there instead; otherwise (`pytest tests/test_model.py`, `-k`, `-m slow`) they run
# here as usual.
ISOLATED_MODULES = (
    "test_algorithm.py",
    "test_kernels.py",
    "test_model.py",
    "test_dict_training.py",
    "test_multi_learner.py",
)
ISOLATED_CHILD_ENV = "RLLIB_DREAMERV3_ISOLATED_CHILD"


@pytest.hookimpl(trylast=True)  # after `-m` / `-k` have deselected
def pytest_collection_modifyitems(config, items):
    if os.environ.get(ISOLATED_CHILD_ENV):
        return
    if not any(item.path.name == "test_isolated_modules.py" for item in items):
        return
    moved = [item for item in items if item.path.name in ISOLATED_MODULES]
    if moved:
        items[:] = [item for item in items if item.path.name not in ISOLATED_MODULES]
        config.hook.pytest_deselected(items=moved)


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
