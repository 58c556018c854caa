"""Every fenced code block of README.md and docs/**/*.md runs as written, so no example can drift
from the code. The rule a block follows (its info string, the ``docs-test`` comments, the scratch
folder and the ports) is written at the top of docs/contributing/index.md; this module is it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.docs.forkserver import ForkServer, write_shim

ROOT = Path(__file__).resolve().parents[2]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))
README_MAX_BYTES = 8000

#: Info strings and what is done with each block; anything else (an empty one included) is an error.
RUN = ("python", "bash", "sh")
CHECKED = ("toml", "json")
SHOWN = ("text", "csv")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<info>[^`]*)$")
MARKER = re.compile(r"^<!-- docs-test: (?P<mode>slow|skip: (?P<reason>.*\S)) -->$")
TITLE = re.compile(r'title="(?P<title>[^"]+)"')
#: A page's loopback ports 8000-8009, each given a free port of its own for the page's run.
PORT = re.compile(r"(?:(?<=127\.0\.0\.1:)|(?<=--port ))(800\d)\b")
SHELL_TIMEOUT_S = 900.0
#: The venv's commands a page runs through the fork server.
SHIMMED = ("fedfleet", "python")
#: How long what a page left running gets to end after SIGTERM before it is sent SIGKILL.
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    title: str | None
    code: str
    mode: str  # "run", "slow" or "skip"
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def parse_blocks(page: Path) -> list[Block]:
    """The page's fenced blocks, in order, each with the ``docs-test`` mode of the comment line
    just before its opening fence (blank lines between them allowed)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, info = opening["indent"], opening["info"].strip()
        start = i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = MARKER.match(lines[before].strip()) if before >= 0 else None
        mode, reason = (
            ("run", "")
            if marker is None
            else (("slow", "") if marker["mode"] == "slow" else ("skip", marker["reason"]))
        )
        title = TITLE.search(info)
        blocks.append(
            Block(
                page,
                start + 1,
                info.split()[0] if info else "",
                title["title"] if title else None,
                "\n".join(body) + "\n",
                mode,
                reason,
            )
        )
    return blocks


BLOCKS = {page: parse_blocks(page) for page in PAGES}


def _runnable(slow: bool) -> list:
    """Pages with a block to run or check: in the default set their blocks that are not slow; in
    the slow set, pages that have a slow block, run whole."""
    params = []
    for page, blocks in BLOCKS.items():
        kept = [b for b in blocks if b.mode != "skip" and b.lang in RUN + CHECKED]
        if slow and any(b.mode == "slow" for b in kept):
            params.append(pytest.param(page, kept, id=str(page.relative_to(ROOT))))
        elif not slow and any(b.mode == "run" for b in kept):
            params.append(pytest.param(page, [b for b in kept if b.mode == "run"], id=str(page.relative_to(ROOT))))
    return params


def test_every_block_says_what_it_is() -> None:
    unknown = [
        f"{b.where} ({b.lang or 'no info string'})"
        for blocks in BLOCKS.values()
        for b in blocks
        if b.lang not in RUN + CHECKED + SHOWN
    ]
    assert not unknown, f"blocks without a known info string ({', '.join(RUN + CHECKED + SHOWN)}): {unknown}"


def test_the_pages_have_blocks_to_run() -> None:
    assert sum(b.mode == "run" and b.lang in RUN for blocks in BLOCKS.values() for b in blocks) >= 30


def test_a_block_is_skipped_only_with_a_reason() -> None:
    assert all(b.reason for blocks in BLOCKS.values() for b in blocks if b.mode == "skip")


def test_the_readme_is_at_most_8000_bytes() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail to docs/ and link it"


def _refused_at_the_prompt(code: str) -> list[str]:
    """The lines of a block that Python's interactive prompt refuses when the block is pasted into
    it whole (``./dev shell``): the prompt runs a compound statement only at the blank line after
    it, so a line that goes on at the left margin right after an indented one is a SyntaxError, and
    so is an indented line after a blank one. Compiled the way ``code.InteractiveConsole`` reads
    lines, nothing run."""
    import codeop

    refused, pending = [], []
    for line in [*code.splitlines(), ""]:
        pending.append(line)
        try:
            compiled = codeop.compile_command("\n".join(pending), "<stdin>", "single")
        except SyntaxError:
            refused.append(line)
            pending = []
            continue
        if compiled is not None:
            pending = []
    return refused


def test_the_python_blocks_can_be_pasted_into_the_interactive_prompt() -> None:
    refused = [
        f"{b.where}: {lines[0]!r}"
        for blocks in BLOCKS.values()
        for b in blocks
        if b.lang == "python" and b.title is None and (lines := _refused_at_the_prompt(b.code))
    ]
    assert not refused, (
        f"a reader pasting these blocks gets a SyntaxError (leave a blank line after an indented block): {refused}"
    )


def test_the_prompt_check_refuses_what_the_prompt_refuses() -> None:
    assert _refused_at_the_prompt("for i in range(2):\n    print(i)\nprint('done')\n") == ["print('done')"]
    assert _refused_at_the_prompt("def f():\n    x = 1\n\n    return x\n") == ["    return x"]
    assert _refused_at_the_prompt("for i in range(2):\n    print(i)\n\nprint('done')\nx = (\n    1,\n)\n") == []


#: A command of the venv at a command's start in a shell line (after a pipe, ``;``, ``&&`` or ``$(``).
BARE_COMMAND = re.compile(r"(?:^|[;&|(]|\$\()\s*(?P<command>python3?|fedfleet|pip)\b")


def test_the_shell_blocks_run_the_venvs_commands_by_their_path() -> None:
    """A reader types a page's shell lines at the checkout's root, where ``.venv/bin`` is on no PATH
    (the tests put it there): ``python -c ...`` is the system's Python, or none, as on Debian
    without python-is-python3. Each command of the venv is written ``.venv/bin/COMMAND``."""
    bare = [
        f"{block.where}: {line.strip()}"
        for page in PAGES
        for block in parse_blocks(page)
        if block.lang in ("bash", "sh")
        for line in block.code.splitlines()
        if not line.lstrip().startswith("#") and BARE_COMMAND.search(line.split(" # ")[0])
    ]
    assert not bare, bare
    assert BARE_COMMAND.search("grep -q \"$(python -c 'print(1)')\" f")
    assert not BARE_COMMAND.search(".venv/bin/python x")


def test_a_marker_binds_the_block_after_it_only(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        '<!-- docs-test: slow -->\n\n```bash\ntrue\n```\n\n```python title="a.py"\n  x = 1\n```\n'
        "<!-- docs-test: skip: needs torch -->\n```python\nimport torch\n```\n",
        encoding="utf-8",
    )
    slow, written, skipped = parse_blocks(page)
    assert (slow.mode, slow.lang, slow.code) == ("slow", "bash", "true\n")
    assert (written.mode, written.title, written.code) == ("run", "a.py", "  x = 1\n")
    assert (skipped.mode, skipped.reason) == ("skip", "needs torch")


def test_ports_are_localized_consistently() -> None:
    ports: dict[str, str] = {}
    first = _localize("curl http://127.0.0.1:8000/x; server --port 8000; other 127.0.0.1:8001", ports)
    second = _localize("http://127.0.0.1:8000", ports)
    assert ports.keys() == {"8000", "8001"} and ports["8000"] != ports["8001"]
    assert f"127.0.0.1:{ports['8000']}/x" in first and f"--port {ports['8000']}" in first and ports["8000"] in second


def _localize(code: str, ports: dict[str, str]) -> str:
    from server_stub.serve import free_port

    def free(match: re.Match[str]) -> str:
        if match[1] not in ports:
            ports[match[1]] = str(free_port("127.0.0.1"))
        return ports[match[1]]

    return PORT.sub(free, code)


def _check_toml(block: Block, code: str, folder: Path) -> None:
    from emulator.fleet import FleetConfig

    data = tomllib.loads(code)
    first = code.splitlines()[0]
    if first.startswith("# examples/fleets/"):
        shipped = ROOT / first.removeprefix("# ").strip()
        assert data == tomllib.loads(shipped.read_text(encoding="utf-8")), f"{block.where} differs from {shipped}"
        FleetConfig.load(shipped)
    elif {"fleet", "task", "data"} & data.keys():
        config = folder / f"block-{block.line}.toml"
        config.write_text(code, encoding="utf-8")
        FleetConfig.load(config)


def _run_shell(block: Block, code: str, folder: Path, env: dict[str, str], groups: list[int]) -> None:
    log = folder / f".block-{block.line}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            ["bash", "-e", "-o", "pipefail", "-c", code],
            cwd=folder,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        groups.append(process.pid)
        try:
            status = process.wait(timeout=SHELL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            status = None
    if status != 0:
        tail = log.read_text(encoding="utf-8", errors="replace")[-4000:]
        pytest.fail(f"{block.where}: the shell block {'timed out' if status is None else f'exited {status}'}:\n{tail}")


def _stop(groups: list[int]) -> None:
    """End what the page's shell blocks left running (servers started with ``&``)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for group in groups:
            try:
                os.killpg(group, sig)
                alive.append(group)
            except ProcessLookupError:
                pass
        if not alive:
            return
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and alive:
            alive = [g for g in alive if _group_exists(g)]
            time.sleep(0.1)
        groups[:] = alive


def _group_exists(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def page_server(request: pytest.FixtureRequest) -> ForkServer | None:
    """The session's fork server (tests/docs/conftest.py) the pages' commands run in; none when
    FEDFLEET_DOCS_FORKSERVER=0, to run every command as a fresh process."""
    return None if os.environ.get("FEDFLEET_DOCS_FORKSERVER") == "0" else request.getfixturevalue("fork_server")


def _venv(folder: Path, server: ForkServer | None) -> Path:
    """The page's ``.venv``: the project's venv, whose ``fedfleet`` and ``python`` are the fork
    server's shims when there is a server; returns its ``bin`` folder."""
    real = Path(sys.prefix)
    if server is None:
        (folder / ".venv").symlink_to(real)
        return real / "bin"
    venv = folder / ".venv"
    (venv / "bin").mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name != "bin":
            (venv / entry.name).symlink_to(entry)
    for entry in (real / "bin").iterdir():
        if entry.name in SHIMMED:
            write_shim(venv / "bin" / entry.name, entry.name, server.socket, entry)
        else:
            (venv / "bin" / entry.name).symlink_to(entry)
    return venv / "bin"


def run_page(blocks: list[Block], folder: Path, server: ForkServer | None = None) -> None:
    """Run a page's blocks in order in ``folder``: Python in one namespace, shell in bash (its
    ``fedfleet`` and ``python script.py`` commands forked from ``server`` when given)."""
    (folder / "examples").symlink_to(ROOT / "examples")
    bin_folder = _venv(folder, server)
    env = dict(os.environ)
    env["PATH"] = f"{bin_folder}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    ports: dict[str, str] = {}
    namespace: dict[str, object] = {"__name__": "__docs__"}
    groups: list[int] = []
    cwd = Path.cwd()
    os.chdir(folder)
    try:
        for block in blocks:
            code = _localize(block.code, ports)
            if block.lang == "python" and block.title:
                (folder / block.title).write_text(code, encoding="utf-8")
            elif block.lang == "python":
                exec(compile(code, block.where, "exec"), namespace)  # noqa: S102 - the page's own example
            elif block.lang in ("bash", "sh"):
                _run_shell(block, code, folder, env, groups)
            elif block.lang == "toml":
                _check_toml(block, code, folder)
            elif block.lang == "json":
                json.loads(code)
    finally:
        os.chdir(cwd)
        _stop(groups)


#: The pages' runs and the fork server's own tests share one pytest-xdist worker: one fork server per
#: run (its imports cost seconds of CPU) instead of one on each worker.
on_the_fork_server = pytest.mark.xdist_group("fork_server")


@on_the_fork_server
@pytest.mark.parametrize(("page", "blocks"), _runnable(slow=False))
def test_the_blocks_of_each_page_run_as_written(
    page: Path, blocks: list[Block], tmp_path: Path, page_server: ForkServer | None
) -> None:
    run_page(blocks, tmp_path, page_server)


@pytest.mark.slow
@on_the_fork_server
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(("page", "blocks"), _runnable(slow=True))
def test_every_block_of_each_page_runs_as_written_with_the_slow_ones(
    page: Path, blocks: list[Block], tmp_path: Path, page_server: ForkServer | None
) -> None:
    run_page(blocks, tmp_path, page_server)
