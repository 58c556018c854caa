"""How the suite itself runs."""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def test_property_tests_run_without_a_deadline_or_the_too_slow_check():
    """A loaded machine must not fail a property (tests/conftest.py's ``suite`` profile)."""
    assert settings().deadline is None
    assert HealthCheck.too_slow in settings().suppress_health_check


def test_a_mistyped_dev_subcommand_is_answered_with_the_one_meant_and_nothing_installed(tmp_path):
    """``./dev demoo`` names ``demo`` above the usage and exits 2, before and without a venv or pip
    (its Python is a stand-in that says each call); an unknown word close to none is named alone."""
    import subprocess

    from tests.support import checkout_with_stand_in_python

    work, env = checkout_with_stand_in_python(tmp_path)
    for typed, said in (("demoo", "demoo is not a command (did you mean demo?)"), ("x", "x is not a command")):
        done = subprocess.run(["./dev", typed], cwd=work, env=env, capture_output=True, text=True, timeout=60)
        first, usage = done.stderr.splitlines()
        assert (done.returncode, done.stdout, first) == (2, "", f"./dev: {said}")
        assert usage.startswith("usage: ./dev demo")
    assert not (work / ".venv").exists() and not (tmp_path / "calls.log").exists()


def test_the_dev_usage_names_every_subcommand_the_script_takes(tmp_path):
    """``./dev help`` lists each command ``./dev`` runs (the words its did-you-mean matches), on one line."""
    import re
    import subprocess

    from tests.support import checkout_with_stand_in_python

    work, env = checkout_with_stand_in_python(tmp_path)
    names = re.search(r"for name in ([a-z ]+); do", (work / "dev").read_text()).group(1).split()
    assert "shell" in names
    done = subprocess.run(["./dev", "help"], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    (usage,) = done.stderr.splitlines()
    assert [name for name in names if f"./dev {name}" not in usage] == [], usage
