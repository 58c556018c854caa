"""An app killed (SIGKILL, in a process of its own) at every phase of its work, then started again
on the same files: its sealed example store opens and holds exactly the examples it committed,
its opstats hold no session twice or in part, and its next session runs to the end."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from device_runtime import FLRuntime, OpStatsStore, Outcome
from example_store import ExampleSelector, FileKeyStore, SQLiteExampleStore
from tests.support import COLLECTION, ROOT, deploy, digits_plan

KILLED_APP = """
import os, signal, sys
sys.path.insert(0, sys.argv[4])  # the checkout
import httpx
import numpy as np
from sqlalchemy import event
import device_runtime.plan_cache
from device_runtime import FLRuntime, OpStatsStore
from example_store import FileKeyStore, SQLiteExampleStore

folder, url, phase = sys.argv[1], sys.argv[2], sys.argv[3]
db = os.path.join(folder, "app.db")


def die():
    os.kill(os.getpid(), signal.SIGKILL)


KILL_AT = {"checkin": "/checkin", "download": "/v1/resources/", "report": "/report"}


class Killer(httpx.HTTPTransport):  # dies as the request of its phase leaves
    def handle_request(self, request):
        if phase in KILL_AT and KILL_AT[phase] in request.url.path:
            die()
        return super().handle_request(request)


store = SQLiteExampleStore(db, key_store=FileKeyStore(os.path.join(folder, "keys.json")))
if phase == "add":
    rng = np.random.default_rng(0)
    store.add("app:/digits", [{"x": rng.random(64, dtype=np.float32), "y": np.int64(i % 10)} for i in range(50)])

    def written():
        for i in range(10**6):
            if i == 5000:  # two chunks of the transaction inserted, the third on its way
                die()
            yield {"x": rng.random(64, dtype=np.float32), "y": np.int64(i % 10)}

    store.add("app:/digits", written())
opstats = OpStatsStore(db)
inserts = {"opstats-before-upload": 1, "opstats-at-end": 2, "token": 1}
if phase in inserts:
    table = "fl_resumption_tokens" if phase == "token" else "fl_opstats_events"
    seen = []

    @event.listens_for(opstats.engine, "before_cursor_execute")
    def inside_the_transaction(conn, cursor, statement, *args):
        if statement.startswith("INSERT INTO " + table):
            seen.append(statement)
            if len(seen) == inserts[phase]:
                die()
if phase == "plan-cache":
    def replaced(source, target, *args, **kwargs):  # the plan written aside, not yet renamed into place
        die()

    device_runtime.plan_cache.os.replace = replaced
runtime = FLRuntime("digits", url, store, opstats=opstats, cache_dir=os.path.join(folder, "cache"), transport=Killer())
runtime.run_session(should_abort=lambda: phase == "training" and die())
"""

#: The sessions opstats keep of a session killed at each phase, before the restart.
KEPT = {
    "add": [],
    "checkin": [],
    "download": [],
    "plan-cache": [],
    "training": [],
    "opstats-before-upload": [],  # killed in the transaction that keeps the session before its upload
    "report": ["-v[]+"],  # the server may have the update: the session counts as taking part
    # the session's last record and its resumption token are one transaction: killed between the
    # two writes (its events written, its token not yet), it rolls back to the record before the
    # upload, its token not moved (the token moved with the record still at '+' before)
    "opstats-at-end": ["-v[]+"],
    "token": ["-v[]+"],
}
LIGHT = ("training", "report", "opstats-at-end", "token")


@pytest.fixture(scope="module")
def resuming_server(tmp_path_factory):
    from server_stub import ServerThread

    with ServerThread(tmp_path_factory.mktemp("server") / "server.db") as server, server.admin() as admin:
        plan = digits_plan(resume_examples=True, selector=ExampleSelector(COLLECTION, limit=40))
        deploy(admin, plan=plan, goal_count=1000)
        yield server


def _killed_then_restarted(tmp_path, server, digits, phase: str) -> None:
    keys = FileKeyStore(tmp_path / "keys.json")
    store = SQLiteExampleStore(tmp_path / "app.db", key_store=keys)
    store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[:100], digits.y_train[:100])))
    store.close()
    script = tmp_path / "app.py"
    script.write_text(KILLED_APP)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), server.url, phase, str(ROOT)], timeout=120, capture_output=True
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]

    store = SQLiteExampleStore(tmp_path / "app.db", key_store=keys)
    opstats = OpStatsStore(tmp_path / "app.db")
    try:
        committed = 150 if phase == "add" else 100  # the 50 added before, none of the add killed
        assert store.count(ExampleSelector(COLLECTION)) == committed
        assert sum(1 for _ in store.query(ExampleSelector(COLLECTION))) == committed  # every row opens
        assert [s.shape for s in opstats.sessions()] == KEPT[phase]
        # the token moves with the session's last record, which says it completed ('^') or took part
        # ('+': killed once its update had started to leave, the server may hold it), or not at all
        assert (opstats.resumption_token("digits", "train", COLLECTION) is None) == (KEPT[phase] == [])
        with FLRuntime("digits", server.url, store, opstats=opstats, cache_dir=tmp_path / "cache") as runtime:
            assert runtime.run_session().outcome is Outcome.COMPLETED
        sessions = opstats.sessions()
        assert [s.shape for s in sessions] == [*KEPT[phase], "-v[]+^"]
        assert len({s.session_id for s in sessions}) == len(sessions)
        token = opstats.resumption_token("digits", "train", COLLECTION)
        assert token is not None
        # 40 a session: the next reads on past a slice whose update may have reached the server, where
        # it trained and sent that slice again
        assert store.count(ExampleSelector(COLLECTION).resuming(token)) == committed - (80 if KEPT[phase] else 40)
        assert [p.name for p in (tmp_path / "cache" / "plans").iterdir() if p.name.endswith(".tmp")] == []
    finally:
        opstats.close()
        store.close()


@pytest.mark.parametrize("phase", LIGHT)
def test_an_app_killed_while_training_or_reporting_starts_again_cleanly(tmp_path, resuming_server, digits, phase):
    _killed_then_restarted(tmp_path, resuming_server, digits, phase)


@pytest.mark.slow
@pytest.mark.parametrize("phase", [phase for phase in KEPT if phase not in LIGHT])
def test_an_app_killed_at_any_phase_starts_again_cleanly(tmp_path, resuming_server, digits, phase):
    _killed_then_restarted(tmp_path, resuming_server, digits, phase)


KILLED_WITH_ITS_OWN_CACHE = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])  # the checkout
from device_runtime import FLRuntime
from example_store import InMemoryExampleStore

runtime = FLRuntime("digits", "http://127.0.0.1:9", InMemoryExampleStore())  # no cache_dir: one of its own
(runtime.cache_dir / "plans").mkdir()
(runtime.cache_dir / "plans" / ("0" * 64)).write_bytes(b"a plan")
print(runtime.cache_dir, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _own_caches(folder) -> list[str]:
    from device_runtime.plan_cache import OWN_CACHE_PREFIX

    return sorted(p.name for p in folder.iterdir() if p.name.startswith(OWN_CACHE_PREFIX))


def test_the_plan_cache_of_a_runtime_killed_is_removed_by_the_next_one(tmp_path, monkeypatch):
    """A runtime given no ``cache_dir`` keeps its plans in a folder of its own in the temp folder,
    removed when it is closed or collected: an app killed (no ``close`` ran) left the folder, plans
    and all, for good, one more at each kill. (The lighter twin of the SIGKILL test below: the
    folder as a killed process leaves it, its owner's lock free.)"""
    import fcntl
    import tempfile

    from device_runtime.plan_cache import OWN_CACHE_PREFIX
    from example_store import InMemoryExampleStore

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    alive, dead = (tmp_path / f"{OWN_CACHE_PREFIX}{name}" for name in ("alive", "dead"))
    for folder in (alive, dead):
        (folder / "plans").mkdir(parents=True)
        (folder / ".owner.lock").touch()
    with open(alive / ".owner.lock", "rb") as held:  # another process's runtime, living
        fcntl.flock(held, fcntl.LOCK_EX)
        with FLRuntime("digits", "http://127.0.0.1:9", InMemoryExampleStore()) as runtime:
            assert runtime.cache_dir is not None
            assert _own_caches(tmp_path) == sorted([alive.name, runtime.cache_dir.name])
    assert _own_caches(tmp_path) == [alive.name]


@pytest.mark.slow
def test_the_plan_cache_of_an_app_killed_with_sigkill_is_removed_by_its_next_start(tmp_path, monkeypatch):
    import os
    import tempfile

    from example_store import InMemoryExampleStore

    script = tmp_path / "app.py"
    script.write_text(KILLED_WITH_ITS_OWN_CACHE)
    temp = tmp_path / "temp"
    temp.mkdir()
    done = subprocess.run(
        [sys.executable, str(script), str(ROOT)],
        timeout=120,
        capture_output=True,
        text=True,
        env={**os.environ, "TMPDIR": str(temp)},
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    left = done.stdout.strip()
    assert _own_caches(temp) == [os.path.basename(left)]
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    with FLRuntime("digits", "http://127.0.0.1:9", InMemoryExampleStore()) as runtime:
        assert runtime.cache_dir is not None and _own_caches(temp) == [runtime.cache_dir.name]
    assert _own_caches(temp) == []
