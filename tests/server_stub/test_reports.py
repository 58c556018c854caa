"""How the server checks plain reports: at most ``CHECKED_AT_ONCE`` at a time, since each check
holds several copies of the update (its digest, its norm and bounding in float64), so that the
reports of a large model arriving together do not take the server's memory at once."""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import os
import tempfile
import threading
import time
import tracemalloc

import httpx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from device_runtime import PlanExecutor, encode_checkpoint
from device_runtime.influence import bound_update
from server_stub import metrics, reports
from tests.support import deploy, digits_plan


def _update(plan) -> bytes:
    spec = PlanExecutor(plan).client_update_spec()
    update = {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in spec.items()}
    update["num_examples"] = np.array(4, dtype=update["num_examples"].dtype)
    return encode_checkpoint(update)


def test_reports_arriving_together_are_checked_one_at_a_time_at_a_limit_of_one(server, admin, monkeypatch):
    """Five DistilBERT reports (268 MB each) checked at once took a server past 7 GB; here, with
    the limit at one, three reports sent at once are checked one after another, and all taken."""
    plan, _ = deploy(admin, goal_count=3, over_selection=1.0, min_fraction=1.0, selection_timeout_s=60)
    monkeypatch.setattr(reports, "_checking", threading.BoundedSemaphore(1), raising=False)
    decode = reports.decode_checkpoint
    active, most, guard = [0], [0], threading.Lock()

    def slow_decode(*args, **kwargs):
        with guard:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.1)
        try:
            return decode(*args, **kwargs)
        finally:
            with guard:
                active[0] -= 1

    monkeypatch.setattr(reports, "decode_checkpoint", slow_decode)
    body = _update(plan)
    with httpx.Client(base_url=server.url, timeout=10) as http:
        sessions = [
            http.post("/v1/populations/digits/checkin", json={"runtime_version": "1.31.1"}).json() for _ in range(3)
        ]
    assert all(s["status"] == "accepted" for s in sessions), sessions
    answers: list[int] = []

    def send(session: dict) -> None:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            r = http.post(
                f"/v1/sessions/{session['session_id']}/report",
                content=body,
                headers={"Authorization": f"Bearer {session['token']}"},
            )
            answers.append(r.status_code)

    threads = [threading.Thread(target=send, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(answers) == [200, 200, 200]
    assert most[0] == 1


# ----------------------------------------------------------------- bounding in place, bit for bit


def _random_update(rng: np.random.Generator, shapes: dict[str, tuple[int, ...]], n: float, spread: float) -> dict:
    update = {name: (rng.standard_normal(shape) * spread).astype(np.float32) for name, shape in shapes.items()}
    update["loss_sum"] = np.array(rng.uniform(0, 5), dtype=np.float32)
    update["num_examples"] = update["count"] = np.array(n, dtype=np.float32)
    return update


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.sampled_from([0.0, 1.0, 3.0, 999.0, 1000.0, 1001.0, 1e6, 3e38]),
    spread=st.sampled_from([0.0, 1e-3, 1.0, 1e3, 1e30]),
    clip_norm=st.sampled_from([None, 1e-6, 1.0, 10.0, 1e40]),
    chunk=st.sampled_from([1, 7, 128, 200, 1 << 20]),
)
def test_bounding_by_pieces_is_bound_update_to_the_last_bit(seed, n, spread, clip_norm, chunk, monkeypatch):
    """The server bounds a report by pieces of its tensors (``bound_report``); every value it sums,
    and what it counts (capped, clipped, the norm), is ``bound_update``'s, bit for bit, whatever the
    count, the size of the delta, the clip and the size of the pieces; and so is the norm of the
    round's per-device summaries (``device_metrics``), taken by pieces too."""
    monkeypatch.setattr(reports, "_CHUNK", chunk)
    monkeypatch.setattr(metrics, "SQUARES_AT_ONCE", chunk)
    rng = np.random.default_rng(seed)
    update = _random_update(rng, {"w": (37, 29), "b": (301,), "frozen": (3,)}, n, spread)
    options = {"max_examples": 1000, "clip_norm": clip_norm}
    before = bound_update(update, ["w", "b", "absent"], **options)
    after = reports.bound_report(update, ["w", "b", "absent"], **options)
    assert (after.capped, after.clipped) == (before.capped, before.clipped)
    if clip_norm is not None:
        assert after.mean_delta_norm == before.mean_delta_norm or (
            math.isnan(after.mean_delta_norm) and math.isnan(before.mean_delta_norm)
        )
    assert after.update.keys() == before.update.keys()
    for name, value in before.update.items():
        assert after.update[name].dtype == value.dtype == np.float32
        assert after.update[name].tobytes() == value.tobytes(), name
    for name in ("w", "b"):  # device_metrics' norm, as it was taken whole
        whole = float(np.square(np.asarray(after.update[name], dtype=np.float64)).sum())
        assert metrics.sum_of_squares(after.update[name]) == whole


def test_bounding_a_float64_or_integer_tensor_rounds_it_as_bound_update_does():
    """A tensor that is not float32 (a plan's integer count, say) goes through float64 to float32
    there, rounded once from the float64 value: the same here, and its input is left as it was."""
    update = {
        "w": np.array([0.1, 1e-40, 3.0000001], dtype=np.float64),
        "count": np.array(2**53 + 1, dtype=np.int64),
        "num_examples": np.array(5.0, dtype=np.float32),
    }
    kept = {k: v.copy() for k, v in update.items()}
    before = bound_update(update, ["w"], max_examples=1000, clip_norm=10.0)
    after = reports.bound_report(update, ["w"], max_examples=1000, clip_norm=10.0)
    for name, value in before.update.items():
        assert after.update[name].tobytes() == value.tobytes(), name
    assert all(update[k].tobytes() == kept[k].tobytes() for k in kept)


def _committed_model(server, admin, population: str, updates: list[bytes]) -> bytes:
    deploy(admin, population, goal_count=len(updates), over_selection=1.0, min_fraction=1.0, selection_timeout_s=60)
    with httpx.Client(base_url=server.url, timeout=10) as http:
        for body in updates:
            session = http.post(f"/v1/populations/{population}/checkin", json={"runtime_version": "1.31.1"}).json()
            answer = http.post(
                f"/v1/sessions/{session['session_id']}/report",
                content=body,
                headers={"Authorization": f"Bearer {session['token']}"},
            )
            assert answer.status_code == 200, answer.text
    assert answer.json()["round_status"] == "committed"
    data, number, _ = admin.model_bytes(population)
    assert number == 1
    return data


def test_the_committed_model_is_the_same_bit_for_bit_as_bounded_in_float64_copies(server, admin, monkeypatch):
    """A round of a capped report (1e6 examples), a clipped one (a delta of norm 1e4) and one left
    as it came, sent over HTTP and spooled to files (``SPOOL_IN_MEMORY_BYTES`` at 256 bytes), commits
    the model that the same round, held in memory and bounded by ``bound_update`` (whole float64
    copies, as before), committed, to the last bit."""
    plan = digits_plan()
    spec = PlanExecutor(plan).client_update_spec()
    shapes = {name: shape for name, (shape, _) in spec.items() if name in plan.weight_names}
    rng = np.random.default_rng(7)
    updates = []
    for n, spread in ((1e6, 1e-2), (20.0, 1e3), (8.0, 1e-3)):
        update = {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in spec.items()}
        update.update({k: v for k, v in _random_update(rng, shapes, n, spread).items() if k in spec})
        updates.append(encode_checkpoint(update))
    monkeypatch.setattr(reports, "SPOOL_IN_MEMORY_BYTES", 256)
    spooled = _committed_model(server, admin, "spooled", updates)
    monkeypatch.setattr(reports, "SPOOL_IN_MEMORY_BYTES", 1 << 20)
    monkeypatch.setattr(reports, "bound_report", bound_update)
    before = _committed_model(server, admin, "float64", updates)
    assert spooled == before


# ----------------------------------------------------------------- bodies spooled, not held


@settings(max_examples=25, deadline=None)
@given(
    body=st.binary(max_size=600),
    cuts=st.lists(st.integers(0, 600), max_size=8),
    in_memory=st.sampled_from([0, 1, 100, 1000]),
)
def test_a_spooled_body_reads_back_as_it_was_sent_in_memory_or_from_its_file(body, cuts, in_memory):
    """However the body came in pieces and whatever its size against the spool's bound, ``view()``
    is the body, from memory up to the bound and from a file beyond."""
    edges = sorted({0, len(body), *(c for c in cuts if c < len(body))})
    with reports.BodySpool(in_memory_bytes=in_memory) as spool:
        for start, end in itertools.pairwise(edges):
            spool.write(body[start:end])
        assert spool.on_disk == (len(body) > in_memory)
        view = spool.view()
        assert bytes(view) == body and view.readonly


def test_a_body_in_its_file_is_not_in_memory_and_read_body_holds_one_copy(tmp_path):
    """A 4 MB body over a 64 KB spool bound costs the process little more than the bound while it
    arrives (tracemalloc's peak); kept in memory, it costs one copy of itself, where its pieces
    joined at the end cost two."""
    from server_stub.app import read_body, spool_body

    size, piece = 4 << 20, 64 << 10
    data = bytes(range(256)) * (size // 256)

    def request() -> Request:
        pieces = [memoryview(data)[i : i + piece] for i in range(0, size, piece)]

        async def receive() -> dict:
            chunk = bytes(pieces.pop(0)) if pieces else b""  # new bytes, as each read from a socket is
            return {"type": "http.request", "body": chunk, "more_body": bool(pieces)}

        headers = [(b"content-length", str(size).encode())]
        return Request({"type": "http", "method": "POST", "headers": headers}, receive)

    def peak(work) -> tuple[int, bytes]:
        async def measured(arriving: Request) -> tuple[int, bytes]:
            tracemalloc.start()  # in the loop: not its own start and end
            try:
                result = await work(arriving)
                return tracemalloc.get_traced_memory()[1], result
            finally:
                tracemalloc.stop()

        return asyncio.run(measured(request()))

    async def spooled(req: Request) -> bytes:
        with await spool_body(req, size) as spool:
            assert spool.on_disk
            return bytes(spool.view()[:16])

    original = reports.SPOOL_IN_MEMORY_BYTES
    reports.SPOOL_IN_MEMORY_BYTES = 64 << 10
    try:
        spooled_peak, head = peak(spooled)
    finally:
        reports.SPOOL_IN_MEMORY_BYTES = original
    assert head == data[:16]
    assert spooled_peak < 4 * piece, spooled_peak
    read_peak, body = peak(lambda req: read_body(req, size))
    assert body == data
    assert read_peak < 1.25 * size, read_peak


# ----------------------------------------------------------------- waiting holds no thread


def test_a_checkin_is_answered_while_more_reports_than_worker_threads_wait_their_turn(server, admin, monkeypatch):
    """Reports wait for their check in the event loop, not in the thread pool: with every checking
    slot busy (held here, as long checks would hold it) and 41 reports waiting, more than anyio's 40
    worker threads, a check-in is answered at once; then every report is taken. Before, each waiting
    report held a worker thread, and the check-in waited for the reports."""
    waiting = 41
    deploy(admin, goal_count=50, over_selection=1.0, min_fraction=1.0, selection_timeout_s=60, report_timeout_s=60)
    body = _update(digits_plan())
    with httpx.Client(base_url=server.url, timeout=10) as http:
        sessions = [
            http.post("/v1/populations/digits/checkin", json={"runtime_version": "1.31.1"}).json()
            for _ in range(waiting)
        ]
    assert all(s["status"] == "accepted" for s in sessions), sessions[-1]
    authorized = threading.Semaphore(0)
    report_limit = server.service.report_limit

    def counted_report_limit(*args):
        try:
            return report_limit(*args)
        finally:
            authorized.release()

    monkeypatch.setattr(server.service, "report_limit", counted_report_limit)
    slots = [reports._checking.acquire(blocking=False) for _ in range(reports.CHECKED_AT_ONCE)]
    assert all(slots)

    async def run() -> tuple[float, list[int]]:
        limits = httpx.Limits(max_connections=waiting + 1)
        async with httpx.AsyncClient(base_url=server.url, timeout=10, limits=limits) as http:
            sent = [
                asyncio.ensure_future(
                    http.post(
                        f"/v1/sessions/{s['session_id']}/report",
                        content=body,
                        headers={"Authorization": f"Bearer {s['token']}"},
                    )
                )
                for s in sessions
            ]
            await asyncio.to_thread(lambda: [authorized.acquire(timeout=5) for _ in sessions])
            await asyncio.sleep(0.1)  # the bodies (1 KB) are in: every report waits for its check
            started = time.monotonic()
            try:
                checkin = await http.post(
                    "/v1/populations/digits/checkin", json={"runtime_version": "1.31.1"}, timeout=2
                )
                answered = time.monotonic() - started
                assert checkin.status_code == 200
                assert not any(r.done() for r in sent)
            finally:
                for _ in slots:
                    reports._checking.release()
            answers = await asyncio.gather(*sent)
            return answered, [a.status_code for a in answers]

    answered, statuses = asyncio.run(run())
    assert answered < 1.0
    assert statuses == [200] * waiting


# ----------------------------------------------------------------- the cores a container allows


def _cgroup(tmp_path, membership: str, files: dict[str, str]) -> tuple:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    (tmp_path / "self-cgroup").write_text(membership)
    return root, tmp_path / "self-cgroup"


def test_the_checks_at_once_follow_the_cgroups_cpu_quota_not_the_hosts_cores(tmp_path):
    """A container given 1.5 CPUs (cgroup v2 ``cpu.max``, here its parent's) checks two reports at
    once, however many cores its host has; v1's ``cpu.cfs_quota_us`` counts as well, and no quota
    (``max``, -1, no file) leaves the CPU affinity alone."""
    v2 = _cgroup(
        tmp_path / "v2",
        "0::/pod/app\n",
        {"pod/cpu.max": "150000 100000\n", "pod/app/cpu.max": "max 100000\n", "cpu.max": "max 100000\n"},
    )
    assert reports.cgroup_cpu_quota(*v2) == 1.5
    v1 = _cgroup(
        tmp_path / "v1",
        "4:memory:/x\n2:cpu,cpuacct:/\n",
        {"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"},
    )
    assert reports.cgroup_cpu_quota(*v1) == 3.0
    unlimited = _cgroup(
        tmp_path / "none",
        "2:cpu,cpuacct:/\n0::/\n",
        {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n", "cpu.max": "max 100000\n"},
    )
    assert reports.cgroup_cpu_quota(*unlimited) is None
    assert reports.cgroup_cpu_quota(tmp_path / "absent", tmp_path / "absent-cgroup") is None
    assert 1 <= reports.CHECKED_AT_ONCE <= len(os.sched_getaffinity(0))


def test_a_report_the_server_cannot_spool_is_answered_503_and_can_be_sent_again(server, admin, monkeypatch, tmp_path):
    """A spool folder that cannot take a body (here ``TMPDIR`` names a folder that is gone) is a 503
    ``SERVER_BUSY`` the device retries, not a 500; the same report is taken once the folder is back."""
    deploy(admin, goal_count=2, over_selection=1.0, min_fraction=1.0, selection_timeout_s=60)
    body = _update(digits_plan())
    monkeypatch.setattr(reports, "SPOOL_IN_MEMORY_BYTES", 256)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
    with httpx.Client(base_url=server.url, timeout=10) as http:
        session = http.post("/v1/populations/digits/checkin", json={"runtime_version": "1.31.1"}).json()
        send = functools.partial(
            http.post,
            f"/v1/sessions/{session['session_id']}/report",
            content=body,
            headers={"Authorization": f"Bearer {session['token']}"},
        )
        refused = send()
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "SERVER_BUSY"
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        taken = send()
    assert taken.status_code == 200 and taken.json()["status"] == "accepted"
