"""Shared fixtures: a real uvicorn FL server on a loopback port, the digits data, small plans."""

from __future__ import annotations

import pytest

# The project's packages are imported by the fixtures that use them, not here: this file is also read by
# pytest-xdist's controller, which runs no test and would pay their import before starting the workers.


def pytest_configure(config: pytest.Config) -> None:
    _hypothesis_without_deadlines(config)
    _refuse_split_groups(config)


def _hypothesis_without_deadlines(config: pytest.Config) -> None:
    """Property tests judge what a protocol does, never how fast: Hypothesis's 200 ms deadline per
    example and its too-slow health check failed them on a loaded machine (timing belongs in
    benchmarks/). A mutation run's own profile (``-p tests.mutation_profile``) is left in place."""
    if config.pluginmanager.has_plugin("tests.mutation_profile"):
        return
    from hypothesis import HealthCheck, settings

    settings.register_profile("suite", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("suite")


def _refuse_split_groups(config: pytest.Config) -> None:
    """``--dist loadgroup`` (``./dev test``) keeps each xdist_group on one worker (a module's fleets
    built once, one Ray cluster) by extending the tests' node ids, which pytest 9.2 no longer reads:
    the groups would be split without a word (pytest-xdist #1386), so such a run stops and says why."""
    if getattr(config.option, "dist", None) == "loadgroup" and pytest.version_tuple[:2] >= (9, 2):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} splits the suite's xdist_group tests across workers under "
            "--dist loadgroup (pytest-xdist #1386): install the pytest that pyproject.toml [test] allows "
            "(./dev test does it on its next run)"
        )


@pytest.fixture(scope="session")
def digits():
    from emulator.datasets import load_digits_dataset

    return load_digits_dataset(seed=0)


@pytest.fixture
def server(tmp_path):
    from server_stub import ServerThread

    with ServerThread(tmp_path / "server.db") as srv:
        yield srv


@pytest.fixture
def admin(server):
    with server.admin() as client:
        yield client
