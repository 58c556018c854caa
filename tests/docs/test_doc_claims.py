"""What the pages state besides their code blocks: the figures and names they give are the code's
(a default, a bound, an error code and its status, a dotted name), the benchmarks' index dates are
those of the pages it lists, and README's links, which MkDocs does not build, name files that exist."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

from tests.docs.test_reference_pages import HOOKS

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PACKAGES = ("device_runtime", "example_store", "secagg", "server_stub", "emulator")
#: Round metrics the pages name with a dot (``metrics.secagg.ddp``): keys of a JSON record, not Python.
METRIC_KEYS = {"secagg.ddp", "secagg.dropped"}


def _text(page: str) -> str:
    """The page's prose with every run of white space one space, as a reader sees it."""
    return " ".join((ROOT / page).read_text(encoding="utf-8").split())


def _table(page: str, heading: str) -> dict[str, list[str]]:
    """The rows of the first table under the line ``heading`` (a heading, or the table's header row)
    on ``page``: first cell -> the other cells."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    start = lines.index(heading)
    rows: dict[str, list[str]] = {}
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.setdefault(cells[0], cells[1:])
        elif rows and not line.startswith("|"):
            break
    return rows


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            if not hasattr(found, part):
                return False
            found = getattr(found, part)
        return True
    return False


def test_every_dotted_name_of_the_projects_packages_a_page_gives_is_one_the_code_has() -> None:
    """``device_runtime.ATTESTATION_ERROR_CODES`` was named where only ``device_runtime.attestation``
    has it: a reader's import failed."""
    named = re.compile(rf"`((?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+)")
    missing = sorted(
        f"{page.relative_to(ROOT)}: {name}"
        for page in PAGES
        for name in {m.group(1) for m in named.finditer(page.read_text(encoding="utf-8"))}
        if name not in METRIC_KEYS and not name.endswith((".py", ".json", ".toml", ".c")) and not _resolves(name)
    )
    assert not missing, missing


def test_every_attribute_of_an_exported_class_a_page_gives_is_one_the_class_has() -> None:
    """``SchedulerSettings.settle_s``, ``WorkerQueue.HISTORY``: the class a package exports has it, as a
    field, an attribute or one its ``__init__`` sets."""
    exports: dict[str, Any] = {}
    for package in (*PACKAGES, "emulator.fleet", "emulator.toolchain", "emulator.fleet.federated_data"):
        module = importlib.import_module(package)
        for name in module.__all__:
            exports.setdefault(name, getattr(module, name))
    attribute = re.compile(r"`([A-Z][A-Za-z0-9]+)\.([a-z_]\w*|[A-Z_]{2,})[`(]")
    missing = []
    for page in PAGES:
        for cls, name in set(attribute.findall(page.read_text(encoding="utf-8"))):
            owner = exports.get(cls)
            if owner is None or hasattr(owner, name):
                continue
            fields = {f.name for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else set()
            if name not in fields and f"self.{name} " not in inspect.getsource(owner):
                missing.append(f"{page.relative_to(ROOT)}: {cls}.{name}")
    assert not missing, sorted(missing)


def test_the_http_page_lists_every_error_code_the_server_sends_under_its_status() -> None:
    """Each code a route documents (``x-error-codes``) and each the HTTP server or router answers
    before a route (named in the document's description) is in the page's table of statuses."""
    document = HOOKS.openapi_document()
    sent: dict[str, set[str]] = {}
    for item in document["paths"].values():
        for operation in item.values():
            for status, answer in operation.get("responses", {}).items():
                sent.setdefault(status, set()).update(answer.get("x-error-codes", []))
    for status, code in re.findall(r"\b(\d{3}) ([A-Z][A-Z_]{3,})\b", document["info"]["description"]):
        sent.setdefault(status, set()).add(code)
    table = _table("docs/reference/http.md", "| status | codes |")
    listed = {status: set(re.findall(r"`([A-Z][A-Z_*]+)`", cells[0])) for status, cells in table.items()}
    prose = _text("docs/reference/http.md")
    missing = []
    for status, codes in sorted(sent.items()):
        for code in sorted(codes):
            wildcard = any(c.endswith("*") and code.startswith(c[:-1]) for c in listed.get(status, ()))
            if code not in listed.get(status, set()) and not wildcard and f"{status} `{code}`" not in prose:
                missing.append(f"{status} {code}")
    assert not missing, missing


def test_the_http_page_states_the_servers_body_and_paging_bounds() -> None:
    from server_stub import app
    from server_stub.schemas import MAX_ROUNDS_PAGE, ROUNDS_PAGE

    page = _text("docs/reference/http.md")
    assert f"JSON bodies are at most {app.MAX_JSON_BYTES >> 10} KiB, deploys {app.MAX_DEPLOY_BYTES >> 20} MiB" in page
    assert f"(1 to {MAX_ROUNDS_PAGE:,}, default {ROUNDS_PAGE})" in page
    assert f"(long poll, at most {app.MAX_SECAGG_WAIT_S:g} s)" in page


def test_the_benchmarks_index_gives_each_pages_dates() -> None:
    rows = _table("docs/benchmarks/index.md", "| benchmark | first figures | latest figures |")
    assert len(rows) == len(list((ROOT / "docs" / "benchmarks").glob("*.md"))) - 1
    for cell, (first, latest) in rows.items():
        name = re.fullmatch(r"\[`(\w+)`\]\((\w+)\.md\)", cell)
        assert name, cell
        head = _text(f"docs/benchmarks/{name.group(2)}.md")[:400]
        assert f"(figures of {latest})" in head, (name.group(1), latest)
        measured = re.search(r"Measured (?:from|on) (\d{4}-\d\d-\d\d)", head)
        assert measured and measured.group(1) == first, (name.group(1), first)


def test_the_server_options_table_has_every_option_of_the_server_with_its_default() -> None:
    """operate-server's table of ``fedfleet server`` options: none missing, none that no longer exists,
    each default as the parser has it."""
    from server_stub.cli import add_server_arguments

    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    options = {a.option_strings[-1]: a for a in parser._actions if a.option_strings and a.dest != "help"}
    rows = _table("docs/howto/operate-server.md", "| option | default | meaning |")
    documented: dict[str, str] = {}
    for cell, (default, _meaning) in rows.items():
        names = re.findall(r"`(--[\w-]+)`", cell)
        values = [v.strip("` ") for v in default.split(",")] if len(names) > 1 else [default.strip("`")]
        documented.update(zip(names, values, strict=True))
    assert sorted(documented) == sorted(options)
    for name, action in options.items():
        if action.default is None or action.nargs == 0:
            continue
        shown = type(action.default)(documented[name]) if isinstance(action.default, (int, float)) else documented[name]
        assert shown == action.default, (name, documented[name], action.default)


def test_the_roundconfig_table_gives_each_field_of_roundconfig_with_its_default() -> None:
    from server_stub import RoundConfig

    rows = _table("docs/howto/operate-server.md", "| field | default | meaning |")
    documented = {cell.strip("`"): cells[0].strip("`") for cell, cells in rows.items()}
    defaults = {f.name: getattr(RoundConfig(), f.name) for f in dataclasses.fields(RoundConfig)}
    assert sorted(documented) == sorted(defaults)
    for name, value in defaults.items():
        shown = documented[name]
        if value is None:
            assert shown == "null", name
        elif isinstance(value, bool):
            assert shown == str(value).lower(), name
        elif isinstance(value, tuple):
            assert [float(v) for v in re.findall(r"[\d.]+", shown)] == list(value), name
        else:
            assert float(shown) == value, (name, shown, value)


def test_the_figures_the_app_developers_tutorial_gives_are_the_sdks_constants() -> None:
    from device_runtime import DeviceClass, SchedulerSettings, WorkerQueue, plan_cache, protocol, runtime
    from device_runtime.batching import examples_share
    from device_runtime.opstats import OpStatsStore
    from device_runtime.plan import nodes_bound
    from device_runtime.scheduling import OTHER_PROCESS_POLL_S

    page = _text("docs/tutorials/app-developer.md")
    device, settings = DeviceClass(), SchedulerSettings()
    queue = inspect.signature(WorkerQueue).parameters
    opstats = inspect.signature(OpStatsStore).parameters
    stated = [
        f"at most the {plan_cache.MAX_CACHED_PLANS} used last (`device_runtime.plan_cache.MAX_CACHED_PLANS`)",
        f"at most {plan_cache.MAX_CACHED_PLAN_BYTES >> 30} GiB of them (`MAX_CACHED_PLAN_BYTES`",
        f"a plan or checkpoint past {protocol.MAX_RESOURCE_BYTES >> 30} GiB",
        f"any other answer past {protocol.MAX_ANSWER_BYTES >> 20} MiB",
        f"slower than {protocol.MIN_ANSWER_BYTES_PER_S >> 10} KiB/s",
        f"{runtime.CHECKIN_WINDOW_S / 60:g} minutes until the server accepts it (`device_runtime.runtime.CHECKIN_WINDOW_S`)",
        f"larger than an eighth of its `memory_mb` ({device.memory_mb / runtime.RESOURCE_SHARE['plan']:g} MiB on a default",
        {2: "checkpoint larger than half of it"}.get(runtime.RESOURCE_SHARE["checkpoint"], "(checkpoint's share)"),
        f"({nodes_bound(device.memory_mb, device.name)[0]:,} on a default device, `device_runtime.plan.nodes_bound`)",
        f"memory ({examples_share(device.memory_mb) >> 20} MiB on a default device) of your examples",
        f"`SchedulerSettings.min_retry_s` ({settings.min_retry_s:g} s)",
        f"`SchedulerSettings.settle_s` ({settings.settle_s:g} s)",
        f"`WorkerQueue.idle_poll_s` ({queue['idle_poll_s'].default:g} s)",
        f"the last {WorkerQueue.HISTORY:,} job runs (`WorkerQueue.HISTORY`)",
        f"ended more than {opstats['keep_s'].default / 86400:g} days before it and all but the newest "
        f"{opstats['keep_sessions'].default:,}",
    ]
    assert OTHER_PROCESS_POLL_S == 1.0 and "looks again a second later" in page
    missing = [claim for claim in stated if claim not in page]
    assert not missing, missing


def test_the_readmes_relative_links_name_files_that_exist() -> None:
    """README.md is read on the repository's web page, outside the site MkDocs builds and checks."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = {t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in t}
    assert targets
    missing = sorted(t for t in targets if not (ROOT / t).exists())
    assert not missing, missing


def test_the_architecture_pages_opsets_per_release_are_the_measured_records() -> None:
    """``device_runtime/ort_support.json``: each release's highest opset, said per run of minors
    (``26 (1.25-1.31)``); 1.32's 28 was left out where the record has it."""
    import json

    measured: dict[int, list[str]] = {}
    for entry in json.loads((ROOT / "device_runtime" / "ort_support.json").read_text()):
        measured.setdefault(entry["max_opset"], []).append(entry["release"].rsplit(".", 1)[0])
    stated = re.search(
        r"measured max opset (.*?)\. `device_runtime/ort_support.json`", _text("docs/explanation/architecture.md")
    )
    assert stated, "the architecture page no longer says the measured opsets"
    said = {
        int(opset): [first, last] if last else [first]
        for opset, first, last in re.findall(r"(\d+) \((1\.\d+)(?:-(1\.\d+))?[,;)]", stated.group(1))
    }
    assert said == {opset: [m[0]] if len(m) == 1 else [m[0], m[-1]] for opset, m in measured.items()}


def test_the_model_engineers_tutorial_names_every_option_of_the_bundle_commands() -> None:
    """Its list of the options of ``plan from-onnx`` and ``plan from-torch`` (``--frozen-rows`` was
    missing from it, and the page said to write ``frozen_rows`` into the task by hand)."""
    page = _text("docs/tutorials/model-engineer.md")
    (plan,) = [sub for name, _help, sub in HOOKS._subparsers(HOOKS.cli_parser()) if name == "plan"]
    missing = [
        f"{name} {action.option_strings[-1]}"
        for name, _help, command in HOOKS._subparsers(plan)
        if name in ("from-onnx", "from-torch")
        for action in command._actions
        if action.option_strings
        and action.dest != "help"
        and not any(re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", page) for o in action.option_strings)
    ]
    assert not missing, missing


def test_the_http_pages_table_of_callers_has_every_route_with_its_credential() -> None:
    """ "Who may call what": each route of /openapi.json once, its "who" the credential the route
    declares (operator: the admin key; session: the session token; device, anyone: none)."""
    document = HOOKS.openapi_document()

    def path(text: str) -> str:
        return re.sub(r"\{[^}]+\}", "{}", text.split("?")[0])

    declared = {
        (method.upper(), path(route)): {name for need in operation.get("security", []) for name in need}
        for route, item in document["paths"].items()
        for method, operation in item.items()
        if method in ("get", "post", "put", "patch", "delete")
    }
    page = (ROOT / "docs" / "reference" / "http.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(GET|POST|PUT|PATCH|DELETE) ([^` ]+)`[^|]*\| ([^|]+) \|", page, re.M)
    said = {(method, path(route)): who.strip() for method, route, who in rows if route != "/openapi.json"}
    assert sorted(said) == sorted(declared)
    credential = {"operator": {"adminKey"}, "session": {"sessionToken"}, "device": set(), "anyone": set()}
    for route, who in said.items():
        assert set().union(*(credential[w] for w in who.split(", "))) == declared[route], (route, who)


def test_every_file_of_the_repository_a_page_names_exists() -> None:
    """A path in backticks under one of the project's folders (``emulator/fleet/plan_cost.py``,
    ``tests/docs/forkserver.py``, ``examples/fleets/*.toml``) names a file or folder that is there."""
    folders = {*PACKAGES, "benchmarks", "docs", "examples", "tests"}
    named = re.compile(r"`([A-Za-z_][\w.-]*/[\w./*-]*)`")
    paths = [
        (page, path)
        for page in PAGES
        for path in {m.group(1) for m in named.finditer(page.read_text(encoding="utf-8"))}
        if path.split("/")[0] in folders and not path.endswith("...")
    ]
    assert len(paths) > 100, "the pages name the repository's files; none found means the pattern broke"
    missing = sorted(
        f"{page.relative_to(ROOT)}: {path}"
        for page, path in paths
        if not (any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists())
    )
    assert not missing, missing
