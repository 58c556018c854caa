"""The per-release env cache: an env is reused only once its install finished; a failed or interrupted
install leaves nothing that is taken for an env. Fast tests fake the install; slow ones use pip."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from emulator.releases.envs import (
    CACHE_ENV_VAR,
    FIRST_MINOR,
    KNOWN_RELEASES,
    LAST_MINOR,
    RuntimeEnv,
    RuntimeEnvError,
    available_releases,
    cache_root,
    latest_patch_per_minor,
    requirements_for,
)


def fake_env(root: Path, version: str, *, marker: dict | None = None) -> RuntimeEnv:
    """An env dir whose python is this interpreter: what a finished install looks like, minus pip."""
    env = RuntimeEnv(version, root / f"onnxruntime-{version}")
    env.python.parent.mkdir(parents=True)
    env.python.symlink_to(sys.executable)
    if marker is not None:
        env.marker.write_text(json.dumps(marker))
    return env


def finished_marker(version: str) -> dict:
    return {"onnxruntime": version, "requirements": requirements_for(version)}


def test_requirements_pin_the_release_and_numpy_1_up_to_1_18():
    assert requirements_for("1.18.1") == ["onnxruntime==1.18.1", "numpy<2"]
    assert requirements_for("1.19.2") == ["onnxruntime==1.19.2"]
    for bad in ("1.18", "2.0.0", "1.18.1rc1", "../1.18.1"):
        with pytest.raises(ValueError):
            requirements_for(bad)


@given(st.lists(st.tuples(st.integers(10, 40), st.integers(0, 5), st.sampled_from(["", "rc1", ".dev0"]))))
def test_latest_patch_per_minor_keeps_the_highest_final_patch_in_range(versions):
    strings = [f"1.{minor}.{patch}{tag}" for minor, patch, tag in versions]
    picked = latest_patch_per_minor(strings)
    finals = [(minor, patch) for minor, patch, tag in versions if not tag and FIRST_MINOR <= minor <= LAST_MINOR]
    expected = {minor: max(p for m, p in finals if m == minor) for minor, _ in finals}
    assert picked == [f"1.{minor}.{expected[minor]}" for minor in sorted(expected)]


def test_known_releases_are_one_per_minor_15_to_32():
    assert available_releases() == latest_patch_per_minor(KNOWN_RELEASES) == list(KNOWN_RELEASES)
    assert [int(v.split(".")[1]) for v in KNOWN_RELEASES] == list(range(15, 33))


def test_cache_root_follows_the_environment_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "envs"))
    assert cache_root() == tmp_path / "envs"
    monkeypatch.delenv(CACHE_ENV_VAR)
    assert cache_root() == Path.home() / ".cache" / "fedfleet" / "runtimes"


def test_a_finished_env_is_reused_without_installing(tmp_path):
    env = fake_env(tmp_path, "1.17.3", marker=finished_marker("1.17.3"))
    stamp = env.marker.stat().st_mtime_ns
    # base_python would fail at once if anything were (re)installed
    assert RuntimeEnv.for_release("1.17.3", cache=tmp_path, base_python="/bin/false") == env
    assert env.marker.stat().st_mtime_ns == stamp


@pytest.mark.parametrize(
    "marker",
    [None, {"onnxruntime": "1.17.1", "requirements": ["onnxruntime==1.17.1"]}, {"onnxruntime": "1.17.3"}],
    ids=["interrupted", "other-release", "other-requirements"],
)
def test_an_env_without_a_matching_marker_is_never_reused(tmp_path, marker):
    env = fake_env(tmp_path, "1.17.3", marker=marker)
    assert not env.is_valid()
    with pytest.raises(RuntimeEnvError, match="no valid env"):
        RuntimeEnv.for_release("1.17.3", cache=tmp_path, create=False)
    with pytest.raises(RuntimeEnvError, match="python -m venv"):  # a rebuild starts from scratch...
        RuntimeEnv.for_release("1.17.3", cache=tmp_path, base_python="/bin/false")
    assert not env.path.exists()  # ...and a failed one leaves nothing behind


def test_run_json_binds_payload_and_returns_result(tmp_path):
    env = fake_env(tmp_path, "1.17.3", marker=finished_marker("1.17.3"))
    code = "import sys\nprint('noise on stdout')\nresult = {'sum': sum(payload['xs']), 'isolated': sys.flags.isolated}"
    assert env.run_json(code, {"xs": [1, 2, 3]}) == {"sum": 6, "isolated": 1}


def test_run_json_does_not_see_the_callers_packages(tmp_path, monkeypatch):
    env = fake_env(tmp_path, "1.17.3", marker=finished_marker("1.17.3"))
    shadow = tmp_path / "shadow"
    (shadow / "onnxruntime").mkdir(parents=True)
    (shadow / "onnxruntime" / "__init__.py").write_text("__version__ = 'shadowed'\n")
    monkeypatch.setenv("PYTHONPATH", str(shadow))
    monkeypatch.chdir(shadow)
    code = "import importlib.util\nspec = importlib.util.find_spec('onnxruntime')\nresult = spec and spec.origin"
    origin = env.run_json(code)
    assert origin is None or not origin.startswith(str(shadow))


def test_a_failing_snippet_raises_with_its_error(tmp_path):
    env = fake_env(tmp_path, "1.17.3", marker=finished_marker("1.17.3"))
    with pytest.raises(RuntimeEnvError, match="ZeroDivisionError"):
        env.run_json("result = 1 / 0")
    with pytest.raises(RuntimeEnvError, match="timed out"):
        env.run_json("import time\ntime.sleep(5)", timeout=0.5)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_real_release_installs_once_and_is_reused(tmp_path):
    env = RuntimeEnv.for_release("1.17.3", cache=tmp_path)
    assert env.is_valid() and json.loads(env.marker.read_text())["requirements"] == ["onnxruntime==1.17.3", "numpy<2"]
    ort_version, numpy_version = env.run_json(
        "import numpy, onnxruntime\nresult = [onnxruntime.__version__, numpy.__version__]"
    )
    assert ort_version == "1.17.3" and int(numpy_version.split(".")[0]) < 2  # its wheels need numpy 1.x
    stamp = env.marker.stat().st_mtime_ns
    assert RuntimeEnv.for_release("1.17.3", cache=tmp_path) == env
    assert env.marker.stat().st_mtime_ns == stamp


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_release_that_does_not_exist_leaves_no_env(tmp_path):
    with pytest.raises(RuntimeEnvError, match="pip install onnxruntime==1.15.99"):
        RuntimeEnv.for_release("1.15.99", cache=tmp_path)
    env = RuntimeEnv("1.15.99", tmp_path / "onnxruntime-1.15.99")
    assert not env.path.exists() and not env.is_valid()
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_index_lists_every_known_minor():
    releases = available_releases(query_index=True)
    assert [int(v.split(".")[1]) for v in releases] == list(range(FIRST_MINOR, LAST_MINOR + 1))
    patch = [int(v.split(".")[2]) for v in releases]
    assert all(p >= int(k.split(".")[2]) for p, k in zip(patch, KNOWN_RELEASES))  # the index never goes back
