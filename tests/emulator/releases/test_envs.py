"""The per-release env cache: an env is reused only once its install finished; a failed or interrupted
install leaves nothing that is taken for an env. Fast tests fake the install; slow ones use pip."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from emulator.releases.cache import main as cache_main
from emulator.releases.envs import (
    CACHE_ENV_VAR,
    FIRST_MINOR,
    KNOWN_RELEASES,
    LAST_MINOR,
    WHEEL_PYTHONS,
    RuntimeEnv,
    RuntimeEnvError,
    available_releases,
    cache_root,
    cached_envs,
    install_failure,
    latest_patch_per_minor,
    measured_release,
    python_for_release,
    remove_envs,
    requirements_for,
)
from server_stub.release_gate import known_release


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


def test_an_earlier_patch_of_a_measured_minor_is_measured_as_its_latest_patch():
    assert measured_release("1.24.1") == measured_release("1.24.0") == measured_release("1.24.4") == "1.24.4"
    assert [measured_release(r) for r in KNOWN_RELEASES] == list(KNOWN_RELEASES)
    for release, says in [
        ("1.33.0", "onnxruntime minor 1.33 was not measured"),
        ("1.14.2", "onnxruntime minor 1.14 was not measured"),
        ("1.24.5", "1.24.5 is newer than 1.24.4, the patch of 1.24 measured (measure it: python -m "),
        ("9.9.9", "'9.9.9' is not a release 1.X.Y"),
        ("1.24.1rc1", "is not a release 1.X.Y"),
    ]:
        with pytest.raises(ValueError) as refused:
            measured_release(release)
        message = str(refused.value)
        assert len(message.splitlines()) == 1 and says in message and ", ".join(KNOWN_RELEASES) in message


@given(st.integers(0, 40), st.integers(0, 12))
def test_the_release_tests_know_a_release_exactly_when_the_servers_gate_does(minor, patch):
    """A claim the toolchain builds and tests is one the deploy gate lets through, and the other way round."""
    release = f"1.{minor}.{patch}"
    try:
        measured_release(release)
        known = True
    except ValueError:
        known = False
    assert known == known_release(release)


def test_cache_root_follows_the_environment_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "envs"))
    assert cache_root() == tmp_path / "envs"
    monkeypatch.delenv(CACHE_ENV_VAR)
    assert cache_root() == Path.home() / ".cache" / "fedfleet" / "runtimes"


def test_the_cache_commands_help_names_the_folder_it_uses_without_the_variable(monkeypatch, capsys):
    """``--cache``'s help said ``~/.cache``, where the envs are kept under ``~/.cache/fedfleet/runtimes``."""
    monkeypatch.delenv(CACHE_ENV_VAR, raising=False)
    with pytest.raises(SystemExit):
        cache_main(["--help"])
    assert f"~/{cache_root().relative_to(Path.home())})" in " ".join(capsys.readouterr().out.split())


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
    with pytest.raises(RuntimeEnvError, match="not a Python with venv"):  # a rebuild starts from scratch...
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


# What pip printed, word for word, when each install failed (the addresses of objects shortened).
PIP_UNREACHABLE = """\
Looking in indexes: http://127.0.0.1:9/simple
WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) after connection broken by \
'NewConnectionError('<pip._vendor.urllib3.connection.HTTPConnection object at 0x7f>: Failed to establish a new \
connection: [Errno 111] Connection refused')': /simple/onnxruntime/
ERROR: Could not find a version that satisfies the requirement onnxruntime==1.17.3 (from versions: none)
ERROR: No matching distribution found for onnxruntime==1.17.3
"""
PIP_NO_RETRIES = """\
Looking in indexes: http://127.0.0.1:9/simple
ERROR: Could not find a version that satisfies the requirement onnxruntime==1.17.3 (from versions: none)
ERROR: No matching distribution found for onnxruntime==1.17.3
"""
PIP_DISK_FULL = """\
Collecting onnxruntime==1.24.4
ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device
"""
PIP_NO_WHEEL = """\
ERROR: Could not find a version that satisfies the requirement onnxruntime==1.15.1 (from versions: 1.17.0, 1.17.1, \
1.17.3, 1.18.0, 1.32.0)
ERROR: No matching distribution found for onnxruntime==1.15.1
"""
PIP_NO_PATCH = PIP_NO_WHEEL.replace("1.15.1", "1.17.9")
PIP_OTHER = (
    "Collecting onnxruntime==1.17.3\nERROR: THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE.\n"
)


@pytest.mark.parametrize(
    ("output", "version", "says"),
    [
        (PIP_UNREACHABLE, "1.17.3", "could not be reached (Connection refused): connect to it, or point pip at"),
        (PIP_NO_RETRIES, "1.17.3", "listed no onnxruntime at all (unreachable, or an index without it)"),
        (
            PIP_DISK_FULL,
            "1.24.4",
            "is full (an env takes 150-250 MB): free space there, or set $FEDFLEET_RUNTIME_CACHE",
        ),
        (PIP_NO_WHEEL, "1.15.1", "no onnxruntime 1.15.1 for Python 3.12 on this platform (it has no 1.15 release"),
        (
            PIP_NO_PATCH,
            "1.17.9",
            "no onnxruntime 1.17.9 for Python 3.12 on this platform (of 1.17 it has 1.17.0, 1.17.1",
        ),
        (PIP_OTHER, "1.17.3", "THESE PACKAGES DO NOT MATCH THE HASHES"),
    ],
    ids=["unreachable", "unreachable-without-retries", "disk-full", "no-wheel-for-python", "no-such-patch", "other"],
)
def test_an_install_failure_is_one_line_saying_what_to_do(tmp_path, output, version, says):
    line = install_failure(output, version, python="3.12", cache=tmp_path)
    assert says in line and "\n" not in line


def test_an_env_that_cannot_be_made_says_so_in_one_line_and_leaves_nothing_that_counts(tmp_path):
    with pytest.raises(RuntimeEnvError) as failed:
        RuntimeEnv.for_release("1.17.3", cache=tmp_path, base_python=tmp_path / "no-python")
    assert "\n" not in str(failed.value) and "is not a Python with venv that runs" in str(failed.value)
    assert [e["release"] for e in cached_envs(tmp_path)] == []
    in_a_file = tmp_path / "a-file"
    in_a_file.write_text("")
    with pytest.raises(RuntimeEnvError, match=r"cannot use the runtime env cache .* set \$FEDFLEET_RUNTIME_CACHE"):
        RuntimeEnv.for_release("1.17.3", cache=in_a_file / "runtimes")


def _python_named(folder: Path, name: str, runs: bool = True) -> None:
    """``folder/name``: this interpreter under another name, or (``runs=False``) a pyenv shim of a
    version not selected, which exits 127."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / name
    script.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n' if runs else "#!/bin/sh\nexit 127\n")
    script.chmod(0o755)


def test_a_release_without_a_wheel_for_this_python_is_made_with_one_it_has_a_wheel_for(tmp_path):
    here = (sys.version_info[0], sys.version_info[1])
    assert python_for_release("1.17.3", current=(3, 12)) == sys.executable  # 1.17 has a 3.12 wheel
    assert python_for_release("1.15.1", current=here) == sys.executable
    older = [py for py, (first, _last) in WHEEL_PYTHONS.items() if first <= 15]  # 1.15 has wheels for these only
    assert 12 not in older and here[1] in older
    _python_named(tmp_path / "bin", f"python3.{here[1]}")
    chosen = python_for_release("1.15.1", current=(3, 12), search_path=str(tmp_path / "bin"))
    assert chosen == str(tmp_path / "bin" / f"python3.{here[1]}")
    for name in [f"python3.{py}" for py in older]:  # none of them runs (pyenv shims of versions not selected)
        _python_named(tmp_path / "shims", name, runs=False)
    with pytest.raises(RuntimeEnvError) as missing:
        python_for_release("1.15.1", current=(3, 12), search_path=str(tmp_path / "shims"))
    assert f"has wheels for Python 3.{min(older)}-3.{max(older)} only, not for this interpreter's 3.12" in str(
        missing.value
    )


def test_an_env_whose_onnxruntime_no_longer_imports_is_found_and_made_again(tmp_path):
    import onnxruntime

    here = onnxruntime.__version__
    sound = RuntimeEnv(here, tmp_path / f"onnxruntime-{here}")  # this interpreter, with its packages
    _python_named(sound.python.parent, sound.python.name)
    sound.marker.write_text(json.dumps(finished_marker(here)))
    assert sound.problem() is None
    assert sound.repaired(base_python="/bin/false") == sound  # sound: kept as it is
    other = RuntimeEnv("1.17.3", tmp_path / "onnxruntime-1.17.3")  # its files now hold another release
    shutil.copytree(sound.path, other.path)
    other.marker.write_text(json.dumps(finished_marker("1.17.3")))
    assert other.is_valid() and other.problem() == f"it imports onnxruntime {here!r}"
    gone = fake_env(tmp_path, "1.16.3", marker=finished_marker("1.16.3"))  # the interpreter without its packages
    assert gone.is_valid() and "No module named" in (gone.problem() or "")
    with pytest.raises(RuntimeEnvError, match="not a Python with venv"):  # made again: with a base that fails here
        gone.repaired(base_python=tmp_path / "no-python")
    assert not gone.path.exists() and sound.is_valid()


def test_the_cache_lists_each_env_with_its_state_and_size_and_removes_them(tmp_path, capsys):
    fake_env(tmp_path, "1.17.3", marker=finished_marker("1.17.3"))
    fake_env(tmp_path, "1.15.1")  # an install that never finished
    (tmp_path / "onnxruntime-1.15.1" / "blob").write_bytes(b"x" * 100_000)
    envs = cached_envs(tmp_path)
    assert [(e["release"], e["valid"]) for e in envs] == [("1.15.1", False), ("1.17.3", True)]
    assert envs[0]["bytes"] >= 100_000
    lines: list[str] = []
    assert cache_main(["--cache", str(tmp_path), "list"], out=lines.append) == 0
    assert "incomplete (made again on next use)" in lines[0] and "ready" in lines[1] and lines[2].startswith("2 envs")
    assert cache_main(["--cache", str(tmp_path), "remove", "../x"]) == 2  # a release string, never a path
    assert "is not an onnxruntime release" in capsys.readouterr().err
    assert remove_envs(["1.15.1", "1.16.3"], cache=tmp_path) == ["1.15.1"]
    assert cache_main(["--cache", str(tmp_path), "remove", "--all"], out=lines.append) == 0
    assert lines[-1] == f"removed 1 envs from {tmp_path}: 1.17.3" and cached_envs(tmp_path) == []


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_an_unreachable_index_fails_the_install_in_one_line_and_leaves_no_env(tmp_path, monkeypatch):
    with socket.socket() as closed:  # a loopback port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{port}/simple")
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.setenv(name, "")
    with pytest.raises(RuntimeEnvError) as failed:
        RuntimeEnv.for_release("1.17.3", cache=tmp_path)
    message = str(failed.value)
    assert "\n" not in message and "the package index could not be reached (Connection refused)" in message
    assert message.endswith(str(tmp_path / "onnxruntime-1.17.3.failed.log"))
    assert cached_envs(tmp_path) == [] and not RuntimeEnv("1.17.3", tmp_path / "onnxruntime-1.17.3").is_valid()
