"""Each package's ``__all__`` holds what its users call (the rule and each package's users are in
docs/contributing/index.md): every name in it is there to import, every package a user meets has
its reference page, which mkdocstrings builds from ``__all__``, and the parts a package is made of
stay out of it."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The packages a user of the project imports, each with its reference page.
PUBLIC = (
    "device_runtime",
    "example_store",
    "secagg",
    "server_stub",
    "emulator",
    "emulator.fleet",
    "emulator.toolchain",
    "emulator.fleet.federated_data",
)
#: What each package is made of, which its users do not call: imported from its module.
INTERNAL = {
    "example_store": {"sqlite_engine"},
    "secagg": {"MaskAccumulator", "expand", "keyed_ring"},
    "server_stub": {
        "RoundCore",
        "Phase",
        "ReportVerdict",
        "SessionState",
        "SecureRound",
        "SecureGroup",
        "SecureSettings",
        "choose_task",
        "bound_update",
        "check_release_report",
        "write_trust_anchor",
        "resource_id",
    },
    "emulator": {"WorkerPool", "RuntimeWorker", "WorkerExecutor", "assign_releases"},
    "emulator.fleet": {"EventLoop", "Fibers", "AppKilled", "SimTransport", "AsgiCaller", "FleetShard"},
    "device_runtime": {"ProtocolClient", "SecureAggregation", "AttestationError"},
}


@pytest.mark.parametrize("name", PUBLIC)
def test_every_exported_name_imports_and_the_package_has_its_reference_page(name):
    package = importlib.import_module(name)
    exported = package.__all__
    assert len(exported) == len(set(exported)), f"{name}.__all__ repeats a name"
    assert [n for n in exported if not hasattr(package, n)] == []
    pages = [p for p in (ROOT / "docs" / "reference" / "python").glob("*.md") if f"::: {name}\n" in p.read_text()]
    assert len(pages) == 1, f"no reference page builds {name}"


@pytest.mark.parametrize("name", sorted(INTERNAL))
def test_the_parts_a_package_is_made_of_stay_out_of_its_all(name):
    package = importlib.import_module(name)
    assert INTERNAL[name].isdisjoint(package.__all__), INTERNAL[name] & set(package.__all__)
