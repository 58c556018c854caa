"""An asyncio app, as the app developer's tutorial says to write one: sessions run in worker
threads (``asyncio.to_thread``) while the event loop goes on logging examples into the same sealed
store, and two populations' runtimes train at once on it."""

from __future__ import annotations

import asyncio

from device_runtime import FLRuntime, OpStatsStore, Outcome
from example_store import ExampleSelector, InMemoryKeyStore, SQLiteExampleStore
from tests.support import COLLECTION, deploy


def test_an_asyncio_app_trains_in_threads_while_its_loop_logs_examples(tmp_path, server, admin, digits):
    for population in ("digits", "keyboard"):
        deploy(admin, population=population, goal_count=5)
    db = tmp_path / "app.db"
    examples = [{"x": x, "y": y} for x, y in zip(digits.x_train[:200], digits.y_train[:200])]
    store = SQLiteExampleStore(db, key_store=InMemoryKeyStore())
    store.add(COLLECTION, examples[:100])
    opstats = OpStatsStore(db)
    runtimes = [FLRuntime(population, server.url, store, opstats=opstats) for population in ("digits", "keyboard")]

    async def app() -> list:
        sessions = asyncio.gather(*(asyncio.to_thread(runtime.run_session) for runtime in runtimes))
        for example in examples[100:]:  # what the app's users write meanwhile, one at a time
            store.add(COLLECTION, [example])
            await asyncio.sleep(0)
        return await sessions

    results = asyncio.run(app())
    assert [result.outcome for result in results] == [Outcome.COMPLETED, Outcome.COMPLETED]
    assert all(100 <= result.num_examples <= 200 for result in results), [r.num_examples for r in results]
    assert store.count(ExampleSelector(COLLECTION)) == 200
    assert opstats.shape_counts() == {"-v[]+^": 2}
    for runtime in runtimes:
        runtime.close()
    opstats.close()
    store.close()
