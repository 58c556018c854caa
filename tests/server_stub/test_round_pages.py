"""``GET /v1/populations/{p}/rounds`` answers a page of the newest rounds (100 by default, at most
1,000) and pages back through the older ones with ``before``: the pages of a history, followed by
their cursors, hold every round once, in the order they ran across the tasks; and no query string,
however odd, gets anything but a stable 4xx."""

from __future__ import annotations

import itertools

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from device_runtime import encode_checkpoint, initial_weights, serialize_plan
from server_stub import AdminError, RoundConfig, ServerStore, ServerThread
from server_stub.persistence import NewTask
from server_stub.schemas import MAX_ROUNDS_PAGE, ROUNDS_PAGE
from tests.server_stub.test_round_history import ONE_DEVICE
from tests.support import admin_key_file, digits_plan

_populations = itertools.count()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = ServerStore(tmp_path_factory.mktemp("pages") / "fl.db")
    yield store
    store.close()


@settings(max_examples=30, deadline=None)
@given(
    starts=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 5)), min_size=0, max_size=12),
    per_page=st.integers(1, 5),
)
def test_pages_followed_by_their_cursors_hold_every_round_once_in_the_order_they_ran(store, starts, per_page):
    """Two tasks' rounds, some starting at the same instant (the cursor orders ties by task, round, attempt)."""
    population = f"p{next(_populations)}"
    store.create_population(population)
    plan = digits_plan()
    tasks = store.add_tasks(
        population,
        [NewTask(name, serialize_plan(plan), encode_checkpoint(initial_weights(plan, seed=0)), {}) for name in "ab"],
    )
    ids = [t.id for t in tasks]
    numbers = [0, 0]
    for which, start in starts:
        numbers[which] += 1
        store.record_round(ids[which], numbers[which], 1, "committed", {}, float(start), float(start) + 0.5)
    every, more = store.round_page(ids)
    assert not more and len(every) == len(starts)
    key = [(r.started_at, r.task_id, r.number, r.attempt) for r in every]
    assert key == sorted(key)
    pages, before = [], None
    while True:
        page = store.round_page(ids, per_page, before)
        assert page is not None
        found, more = page
        assert len(found) == min(per_page, len(every) - sum(len(p) for p in pages))
        pages.append(found)
        if not more:
            break
        before = found[0].id
    assert [r for p in reversed(pages) for r in p] == every


def test_an_answer_holds_the_newest_rounds_and_links_to_the_older_ones_and_odd_queries_get_a_4xx(tmp_path, capsys):
    from emulator.cli import commands as cli

    plan = digits_plan()
    with ServerThread(tmp_path / "fl.db") as server, server.admin() as admin:
        for population in ("p", "q"):
            admin.create_population(population)
            admin.deploy_task(
                population, "t", plan, encode_checkpoint(initial_weights(plan, seed=0)), RoundConfig(**ONE_DEVICE)
            )
        store = server.service.store
        task = {t.population: t.id for t in store.tasks()}
        for number in range(1, ROUNDS_PAGE + 6):  # a history longer than one answer
            store.record_round(task["p"], number, 1, "abandoned", {"selected": 0}, float(number), number + 0.5)
        other = store.record_round(task["q"], 1, 1, "abandoned", {"selected": 0}, 1.0, 1.5)
        headers = {"Authorization": f"Bearer {server.admin_key}"}
        with httpx.Client(base_url=server.url, headers=headers) as http:
            newest = http.get("/v1/populations/p/rounds")
            assert newest.status_code == 200
            assert [r["round"] for r in newest.json()["rounds"]] == list(range(6, ROUNDS_PAGE + 6))
            older = http.get(newest.url.join(newest.links["next"]["url"]))
            assert [r["round"] for r in older.json()["rounds"]] == list(range(1, 6)) and "next" not in older.links
            assert "next" not in http.get("/v1/populations/p/rounds", params={"last": MAX_ROUNDS_PAGE}).links
            for query, code in [
                ("last=0", "BAD_QUERY"),
                ("last=-1", "BAD_QUERY"),
                (f"last={MAX_ROUNDS_PAGE + 1}", "BAD_QUERY"),
                ("last=" + "9" * 400, "BAD_QUERY"),
                ("last=1e3", "BAD_QUERY"),
                ("last=", "BAD_QUERY"),
                ("last=%00", "BAD_QUERY"),
                ("before=0", "BAD_QUERY"),
                ("before=-5", "BAD_QUERY"),
                (f"before={2**63}", "BAD_QUERY"),
                ("before=0x10", "BAD_QUERY"),
                ("before=1.5", "BAD_QUERY"),
                (f"before={2**63 - 1}", "UNKNOWN_ROUND"),
                (f"before={other.id}", "UNKNOWN_ROUND"),  # a round of another population
                (f"task=t&before={other.id}", "UNKNOWN_ROUND"),
                ("task=" + "x" * 129, "BAD_QUERY"),
                ("task=%00%ff", "UNKNOWN_TASK"),
                ("task=nope&last=1", "UNKNOWN_TASK"),
            ]:
                answer = http.get(f"/v1/populations/p/rounds?{query}")
                status = 400 if code == "BAD_QUERY" else 404
                assert (answer.status_code, answer.json()["error"]["code"]) == (status, code), (query, answer.text)
            assert http.get("/v1/populations/p/rounds?last=2&last=3&before=5&zzz=1").status_code == 200
        every = admin.rounds("p")  # the client reads page after page
        assert [r["round"] for r in every] == list(range(1, ROUNDS_PAGE + 6))
        assert admin.rounds("p", last=3) == every[-3:]
        with pytest.raises(AdminError) as refused:
            admin.round_page("p", before=other.id)
        assert refused.value.code == "UNKNOWN_ROUND"
        key = admin_key_file(tmp_path / "admin.key", server.admin_key)
        common = ["--server", server.url, "--population", "p", "--admin-key-file", str(key)]
        assert cli.main(["rounds", *common, "--last", "2"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert [line.split()[1] for line in lines[1:3]] == [str(ROUNDS_PAGE + 4), str(ROUNDS_PAGE + 5)]
        hint = lines[-1]
        assert "--before" in hint
        before = hint.split("--before ")[1].split()[0]
        assert cli.main(["rounds", *common, "--last", "2", "--before", before]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert [line.split()[1] for line in lines[1:3]] == [str(ROUNDS_PAGE + 2), str(ROUNDS_PAGE + 3)]
        with pytest.raises(SystemExit) as exit_:
            cli.main(["rounds", *common, "--before", "-1"])
        assert exit_.value.code == 2 and "give the --before a rounds listing named" in capsys.readouterr().err


def test_a_cursor_whose_round_retention_removed_between_two_pages_pages_on_from_where_it_was(tmp_path):
    """Retention removing the round a Link header's cursor names, before the operator asks for the
    page it links to, does not stop the paging: the next page holds the rounds still on record that
    ran before it. A removed round's place is kept a day; a cursor naming no round stays 404."""
    plan = digits_plan()
    with ServerThread(tmp_path / "fl.db") as server, server.admin() as admin:
        admin.create_population("p")
        admin.deploy_task("p", "t", plan, encode_checkpoint(initial_weights(plan, seed=0)), RoundConfig(**ONE_DEVICE))
        store = server.service.store
        [task] = store.tasks("p")
        made = [store.record_round(task.id, n, 1, "abandoned", {"selected": 0}, float(n), n + 0.5) for n in range(1, 9)]
        headers = {"Authorization": f"Bearer {server.admin_key}"}
        with httpx.Client(base_url=server.url, headers=headers) as http:
            newest = http.get("/v1/populations/p/rounds?last=2")
            assert [r["round"] for r in newest.json()["rounds"]] == [7, 8]
            kept = {made[0].id, made[2].id}  # rounds 1 and 3 stay, 2 and 4 to 7 (the cursor's) go
            done = store.prune_rounds(keep_rounds=1, ended_before=None, limit=100, keep_ids=kept, removed_at=1e9)
            assert done.rounds == 5 and [r.number for r in store.rounds(task.id)] == [1, 3, 8]
            older = http.get(newest.url.join(newest.links["next"]["url"]))
            assert older.status_code == 200, older.text
            assert [r["round"] for r in older.json()["rounds"]] == [1, 3] and "next" not in older.links
            one = http.get(newest.url.join(newest.links["next"]["url"].replace("last=2", "last=1")))
            assert [r["round"] for r in one.json()["rounds"]] == [3] and "next" in one.links
            never = http.get(f"/v1/populations/p/rounds?before={made[-1].id + 100}")
            assert (never.status_code, never.json()["error"]["code"]) == (404, "UNKNOWN_ROUND")
        # a day after its removal a removed round's place goes, at the next removal
        store.record_round(task.id, 9, 1, "abandoned", {"selected": 0}, 9.0, 9.5)
        store.prune_rounds(keep_rounds=1, ended_before=None, limit=100, removed_at=1e9 + 86_401)
        assert store.round_page([task.id], 2, made[6].id) is None
        assert [r.number for r in store.rounds(task.id)] == [9]
        assert store.round_page([task.id], 2, made[7].id) == ([], False)  # removed just now: nothing before it
