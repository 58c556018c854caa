"""A pytest plugin for mutation runs (``./dev mutate``), loaded with ``-p tests.mutation_profile``
from ``[tool.mutmut] pytest_add_cli_args``; an ordinary ``./dev test`` never loads it.

- Hypothesis runs under the ``mutation`` profile: few examples, derandomized (a mutant is killed
  or not the same way on every run), no example database (a failure found for one mutant is not
  replayed against the next) and no shrinking (a mutant only has to fail; shrinking a failing
  protocol run took longer than mutmut's time limit and turned kills into timeouts).
  ``FEDFLEET_HYPOTHESIS_PROFILE`` picks another registered profile. A test with its own
  ``@settings(max_examples=...)`` keeps that count.
- ``FEDFLEET_MUTATION_TESTS`` (paths or node-id prefixes separated by spaces) deselects every
  other test: mutmut collects which tests reach which function over the whole selection, so
  each module's run names only its own unit and property tests, not the HTTP or end-to-end ones.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

settings.register_profile(
    "mutation",
    max_examples=20,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=(Phase.explicit, Phase.generate),
    report_multiple_bugs=False,
)
settings.load_profile(os.environ.get("FEDFLEET_HYPOTHESIS_PROFILE", "mutation"))


def _selected_prefixes() -> tuple[str, ...]:
    return tuple(os.environ.get("FEDFLEET_MUTATION_TESTS", "").split())


def pytest_ignore_collect(collection_path, config):
    """Test files outside the selection are not even imported."""
    prefixes = _selected_prefixes()
    if not prefixes or not collection_path.is_file():
        return None
    try:
        rel = collection_path.relative_to(config.rootpath).as_posix()
    except ValueError:
        return None
    if any(rel.startswith(p.split("::")[0]) for p in prefixes):
        return None
    return True


def pytest_collection_modifyitems(config, items):
    prefixes = _selected_prefixes()
    if not prefixes:
        return
    keep, drop = [], []
    for item in items:
        (keep if item.nodeid.startswith(prefixes) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
