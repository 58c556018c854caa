"""The FL server under many concurrent devices: check-in and report latency, time-outs, 5xx.

One uvicorn worker runs the server in its own process on a loopback port (a fresh server and
database per load level); this process is the load generator: N emulated devices in one asyncio
loop over one ``httpx.AsyncClient`` whose pool admits every device's request at once. A device
checks in; when turned away it sleeps for a time drawn uniformly from the window the server named
(``retry_after_s``); when selected it fetches the plan and checkpoint by id (cached for the whole
process, as a device caches by id, so each id crosses the wire once), "trains", posts a
precomputed valid update with its session token, and comes back after a pause drawn from the
task's retry window. Every wait is drawn from the device's own seeded ``random.Random``.

Training is not run per device: the update is computed once with ``PlanExecutor.run_device`` and
a device only sleeps for a training time drawn from [0.5, 2] s. Without that sleep the first 50
devices of a round report before the 51st checks in: every check-in is selected and the rejection
path (``ROUND_FULL`` and its retry window) never runs. Rounds need 50 reports (65 selected), so
they turn over every couple of seconds. The devices' first check-ins are spread over the retry
window's upper bound (15 s; 5 s with ``--quick``), as their later check-ins are.

A request that takes longer than 10 s is a time-out; its latency is kept (censored at 10 s) so
that percentiles do not hide it.

Baseline in the same run: ``GET /v1/health``, measured on the idle server before the load and
sampled every 50 ms by its own coroutine during the load; the summary gives p99 ratios against
both. The load generator is not free: a device's request costs this process about 1 ms of CPU
(httpx and the device loop), twice what the server spends on it, and more when thousands are in
flight at once; with all 2,000 devices starting together the generator saturates a core and its
own queue shows up as seconds of "latency". The health samples under load carry that delay too,
and each level reports the cores used by the server, by the generator and by everything else on
the (shared, 2-core) machine, also per 5 s of load in ``timeline``: read a tail against those
before blaming the server.

    cd /work/main && .venv/bin/python -m benchmarks.server_load [--quick]

Prints one JSON object per load level; the last line is the summary with the targets (reported,
not asserted): report p99 <= 1 s at 1,000 devices, no time-out at 2,000 devices.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import hashlib
import inspect
import json
import math
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import onnxruntime

from device_runtime import PlanExecutor, build_softmax_regression_plan, encode_checkpoint, initial_weights
from example_store import ExampleSelector
from server_stub import AdminClient, RoundConfig, free_port

POPULATION = "load"
TASK = "train"
#: Rounds that turn over quickly: 65 devices selected, committed at the 50th report.
ROUND_CONFIG = RoundConfig(goal_count=50, report_timeout_s=10.0, selection_timeout_s=2.0)
REQUEST_TIMEOUT_S = 10.0
#: How long an emulated device "trains" (it only sleeps) between its downloads and its report.
TRAIN_TIME_S = (0.5, 2.0)
HEALTH_PERIOD_S = 0.05
LAG_PERIOD_S = 0.01
TIMELINE_S = 5.0
REPORT_P99_GOAL_S = 1.0
LEVELS = (1000, 2000)
QUICK_LEVELS = (200, 400)


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


# ---------------------------------------------------------------------------- server process


@functools.cache
def _server_help() -> str:
    out = subprocess.run([sys.executable, "-m", "server_stub", "--help"], capture_output=True, text=True, timeout=60)
    return out.stdout + out.stderr


def _takes_admin_key() -> bool:
    """Operator authentication is being added; use it only where this tree already has it."""
    return "admin_key" in inspect.signature(AdminClient).parameters


def admin_client(url: str, admin_key: str) -> AdminClient:
    return AdminClient(url, admin_key=admin_key) if _takes_admin_key() else AdminClient(url)


def start_server(db_path: Path, port: int, admin_key_file: Path) -> subprocess.Popen:
    """``python -m server_stub`` (one uvicorn worker) on 127.0.0.1:port; its output goes to
    ``server.log`` next to the database. The caller terminates it."""
    cmd = [sys.executable, "-m", "server_stub", "--db", str(db_path), "--port", str(port)]
    if "--admin-key-file" in _server_help():
        cmd += ["--admin-key-file", str(admin_key_file)]
    if "--allow-untested-plans" in _server_help():
        cmd += ["--allow-untested-plans"]  # the load's plan is built here, not release-tested
    log = open(Path(db_path).parent / "server.log", "wb")
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()  # the child holds its own descriptor


def write_admin_key(folder: Path) -> tuple[str, Path]:
    """A fresh operator key, and the owner-only file a server reads it from (``--admin-key-file``)."""
    key = secrets.token_urlsafe(32)
    key_file = Path(folder) / "admin.key"
    key_file.write_text(key + "\n", encoding="utf-8")
    key_file.chmod(0o600)
    return key, key_file


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Until the server ``proc`` answers its health check (one client for every poll: each new
    one costs ~60 ms of CPU, which the benchmarks' figures would carry)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=1) as http:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode} before answering")
            try:
                http.get(url + "/v1/health").raise_for_status()
                return
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not answer on {url} within {timeout_s} s") from None
                time.sleep(0.05)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def cpu_reading(server_pid: int) -> tuple[float, float, float, float] | None:
    """Cumulative CPU seconds (server process, this process, whole machine busy, stolen by the
    hypervisor) from /proc; None where there is no /proc. The machine is shared: what neither
    process used is other people's work competing for the same 2 cores."""
    try:
        fields = Path(f"/proc/{server_pid}/stat").read_text().rsplit(")", 1)[1].split()
        machine = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, IndexError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    own = os.times()
    user, nice, system, _idle, _iowait, irq, softirq, steal = (machine + [0] * 8)[:8]
    return (
        (int(fields[11]) + int(fields[12])) / tick,
        own.user + own.system,
        (user + nice + system + irq + softirq) / tick,
        steal / tick,
    )


def _cores(a: tuple, b: tuple, seconds: float) -> dict:
    server, own, busy, steal = ((y - x) / seconds for x, y in zip(a, b))
    return {
        "server": round(server, 2),
        "generator": round(own, 2),
        "others": round(max(0.0, busy - server - own), 2),
        "steal": round(steal, 2),
    }


# ---------------------------------------------------------------------------- task and update


@functools.cache
def bench_plan():
    """The digits softmax plan of ``tests/support.py``."""
    return build_softmax_regression_plan(
        64,
        10,
        learning_rate=0.2,
        batch_size=8,
        epochs=2,
        selector=ExampleSelector("app:/digits"),
        inputs={"x": "x", "y": "y"},
    )


def setup(url: str, admin_key: str) -> None:
    plan = bench_plan()
    with admin_client(url, admin_key) as admin:
        admin.create_population(POPULATION)
        admin.deploy_task(POPULATION, TASK, plan, encode_checkpoint(initial_weights(plan)), ROUND_CONFIG)


def precomputed_update(seed: int = 0) -> bytes:
    """One valid update (16 random examples, the plan's own training); every device sends it."""
    plan = bench_plan()
    rng = np.random.default_rng(seed)
    batch = {"x": rng.standard_normal((16, 64), dtype=np.float32), "y": rng.integers(0, 10, 16).astype(np.int64)}
    result = PlanExecutor(plan).run_device(initial_weights(plan), lambda: [batch])
    return encode_checkpoint(result.update)


# ---------------------------------------------------------------------------- measurements


@dataclass
class Tally:
    """Latencies (seconds) per request kind and event counts; no I/O."""

    latencies: dict[str, list[float]] = field(default_factory=dict)
    #: When each request started (same clock, same order as ``latencies``), for the timeline.
    starts: dict[str, list[float]] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)
    #: The clock when the devices started; wall-clock time of the same moment, to tell the load's
    #: rounds from those the idle server abandoned before it.
    load_started: float = 0.0
    load_started_wall: float = 0.0
    #: (clock, cumulative ``cpu_reading``) about once a second during the load.
    cpu: list[tuple[float, tuple]] = field(default_factory=list)

    def latency(self, kind: str, started: float, seconds: float) -> None:
        self.latencies.setdefault(kind, []).append(seconds)
        self.starts.setdefault(kind, []).append(started)

    def timeline(self, window_s: float, duration_s: float) -> list[dict]:
        """Per window of the load (by request start): check-ins sent and the tail latencies, to
        tell the ramp-up from the steady state."""
        out = []
        for k in range(math.ceil(duration_s / window_s)):
            lo, hi = self.load_started + k * window_s, self.load_started + (k + 1) * window_s

            def inside(kind: str, lo: float = lo, hi: float = hi) -> np.ndarray:  # this window's, bound now
                t = np.asarray(self.starts.get(kind, []))
                return np.asarray(self.latencies.get(kind, []))[(t >= lo) & (t < hi)] * 1000.0

            checkin, report, health, lag = (
                inside("checkin"),
                inside("report"),
                inside("health_load"),
                inside("loop_lag"),
            )
            cpu = [(t, r) for t, r in self.cpu if lo <= t <= hi + 0.5]
            out.append(
                {
                    "t_s": round(k * window_s, 1),
                    "checkins": len(checkin),
                    "checkin_p99_ms": round(float(np.percentile(checkin, 99)), 1) if len(checkin) else None,
                    "report_p99_ms": round(float(np.percentile(report, 99)), 1) if len(report) else None,
                    "health_max_ms": round(float(health.max()), 1) if len(health) else None,
                    "loop_lag_max_ms": round(float(lag.max()), 1) if len(lag) else None,
                    "cpu_cores": _cores(cpu[0][1], cpu[-1][1], cpu[-1][0] - cpu[0][0]) if len(cpu) > 1 else None,
                }
            )
        return out

    def cpu_cores(self) -> dict | None:
        """Mean cores used over the whole load by the server, this generator, and everyone else."""
        if len(self.cpu) < 2:
            return None
        (t0, a), (t1, b) = self.cpu[0], self.cpu[-1]
        return _cores(a, b, t1 - t0)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    a = np.asarray(values) * 1000.0
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {
        "n": len(values),
        "p50_ms": round(float(p50), 2),
        "p95_ms": round(float(p95), 2),
        "p99_ms": round(float(p99), 2),
        "max_ms": round(float(a.max()), 2),
    }


def _ratio(a: dict, b: dict, key: str = "p99_ms") -> float | None:
    return round(a[key] / b[key], 2) if key in a and key in b and b[key] > 0 else None


# ---------------------------------------------------------------------------- load generator


class Load:
    """The I/O shell shared by the emulated devices: one HTTP client, the tally, the end of the
    run and the process-wide resource cache (id -> download in progress or done)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        tally: Tally,
        update: bytes,
        clock: Callable[[], float],
        deadline: float = math.inf,
    ) -> None:
        self.client = client
        self.tally = tally
        self.update = update
        self.clock = clock
        self.deadline = deadline
        self._resources: dict[str, asyncio.Future] = {}
        self._extensions = {"trace": self._trace}

    async def _trace(self, event: str, info: dict) -> None:
        # httpcore's trace hook: count the TCP connections the pool had to open.
        if event == "connection.connect_tcp.complete":
            self.tally.counts["connections_opened"] += 1

    @property
    def over(self) -> bool:
        return self.clock() >= self.deadline

    async def pause(self, seconds: float) -> bool:
        """Sleep; False (at the deadline) if the run ends first. A plain sleep: the generator's CPU
        is the scarce resource here (see the module doc), and this runs once per request."""
        remaining = self.deadline - self.clock()
        if seconds >= remaining:
            await asyncio.sleep(max(0.0, remaining))
            return False
        await asyncio.sleep(max(0.0, seconds))
        return True

    async def request(self, kind: str, method: str, path: str, **kwargs) -> httpx.Response | None:
        """One timed request; None (and counted) on a time-out, a transport error or a 5xx."""
        t0 = self.clock()
        try:
            response = await self.client.request(method, path, extensions=self._extensions, **kwargs)
        except httpx.TimeoutException as exc:
            self.tally.latency(kind, t0, self.clock() - t0)
            self.tally.counts[f"timeout:{kind}:{type(exc).__name__}"] += 1
            return None
        except httpx.TransportError as exc:
            self.tally.counts[f"transport_error:{kind}:{type(exc).__name__}"] += 1
            return None
        self.tally.latency(kind, t0, self.clock() - t0)
        if response.status_code >= 500:
            self.tally.counts[f"5xx:{kind}:{response.status_code}"] += 1
            return None
        return response

    async def resource(self, rid: str, token: str) -> bool:
        future = self._resources.get(rid)
        if future is None:
            future = self._resources[rid] = asyncio.ensure_future(self._download(rid, token))
        return await asyncio.shield(future)

    async def _download(self, rid: str, token: str) -> bool:
        response = await self.request(
            "resource", "GET", f"/v1/resources/{rid}", headers={"Authorization": f"Bearer {token}"}
        )
        ok = (
            response is not None and response.status_code == 200 and hashlib.sha256(response.content).hexdigest() == rid
        )
        if not ok:
            self.tally.counts["resource_failed"] += 1
            del self._resources[rid]  # the next device tries again
        return ok


def _error_code(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"


async def device(load: Load, rng: random.Random, ramp_s: float, train_s: tuple[float, float]) -> None:
    """One emulated device until the run stops; every wait draws from the device's own ``rng``."""
    counts = load.tally.counts
    idle_window = ROUND_CONFIG.retry_window_s
    body = {"runtime_version": onnxruntime.__version__}
    if not await load.pause(rng.uniform(0.0, ramp_s)):
        return
    while not load.over:
        response = await load.request("checkin", "POST", f"/v1/populations/{POPULATION}/checkin", json=body)
        if response is None or response.status_code != 200:
            if response is not None:
                counts[f"checkin_http:{response.status_code}:{_error_code(response)}"] += 1
            if not await load.pause(rng.uniform(*idle_window)):
                return
            continue
        answer = response.json()
        if answer["status"] != "accepted":
            counts["checkin_rejected"] += 1
            counts[f"reject_reason:{answer.get('reason')}"] += 1
            lo, hi = answer["retry_after_s"]
            if not await load.pause(rng.uniform(lo, hi)):
                return
            continue
        counts["checkin_accepted"] += 1
        token, sid = answer["token"], answer["session_id"]
        if await load.resource(answer["plan_id"], token) and await load.resource(answer["checkpoint_id"], token):
            if not await load.pause(rng.uniform(*train_s)):
                return
            response = await load.request(
                "report",
                "POST",
                f"/v1/sessions/{sid}/report",
                content=load.update,
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"},
            )
            if response is not None and response.status_code == 200:
                counts["report_accepted"] += 1
            elif response is not None and _error_code(response) == "REPORT_LATE":
                counts["report_late"] += 1  # the round had its 50 reports already: over-selection at work
            elif response is not None:
                counts[f"report_http:{response.status_code}:{_error_code(response)}"] += 1
        else:
            counts["session_without_report"] += 1
        if not await load.pause(rng.uniform(*idle_window)):
            return


async def sample_health(load: Load, kind: str, period_s: float, samples: int | None = None) -> None:
    """``GET /v1/health`` every ``period_s`` until the run stops (or ``samples`` are taken)."""
    taken = 0
    while not load.over and (samples is None or taken < samples):
        t0 = load.clock()
        await load.request(kind, "GET", "/v1/health")
        taken += 1
        if not await load.pause(period_s - (load.clock() - t0)):
            return


async def watch_lag(load: Load, kind: str) -> None:
    """How late this process's event loop wakes a sleeper: the generator's own share of latency."""
    while not load.over:
        t0 = load.clock()
        await asyncio.sleep(LAG_PERIOD_S)
        load.tally.latency(kind, t0, max(0.0, load.clock() - t0 - LAG_PERIOD_S))


async def watch_cpu(load: Load, server_pid: int) -> None:
    while True:
        reading = cpu_reading(server_pid)
        if reading is None:
            return
        load.tally.cpu.append((load.clock(), reading))
        if not await load.pause(1.0):
            reading = cpu_reading(server_pid)
            if reading is not None:
                load.tally.cpu.append((load.clock(), reading))
            return


@contextlib.contextmanager
def no_full_collections():
    """No full garbage collections during the load: one over everything imported (numpy, onnx,
    httpx...) and the devices' state stalled the generator's loop for 50-110 ms, which showed up in
    every kind's p99. Young objects are still collected; a minute of the rest is a few MB."""
    gc.collect()
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], 1_000_000)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


async def run_load(
    url: str,
    devices: int,
    duration_s: float,
    ramp_s: float,
    train_s: tuple[float, float],
    idle_samples: int,
    seed: int,
    update: bytes,
    server_pid: int,
    clock: Callable[[], float] = time.perf_counter,
    wall_clock: Callable[[], float] = time.time,
) -> Tally:
    tally = Tally()
    limits = httpx.Limits(max_connections=devices + 16, max_keepalive_connections=devices + 16)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(REQUEST_TIMEOUT_S), limits=limits) as client:
        idle = Load(client, tally, update, clock)
        await sample_health(idle, "health_idle", 0.01, idle_samples)
        tally.load_started, tally.load_started_wall = clock(), wall_clock()
        load = Load(client, tally, update, clock, deadline=tally.load_started + duration_s)
        tasks = [
            asyncio.create_task(sample_health(load, "health_load", HEALTH_PERIOD_S)),
            asyncio.create_task(watch_lag(load, "loop_lag")),
            asyncio.create_task(watch_cpu(load, server_pid)),
        ]
        tasks += [
            asyncio.create_task(device(load, random.Random(f"server_load/{seed}/{devices}/{i}"), ramp_s, train_s))
            for i in range(devices)
        ]
        await asyncio.gather(*tasks)
        tally.counts["drain_ms"] = round((clock() - load.deadline) * 1000)
    return tally


# ---------------------------------------------------------------------------- one load level


def run_level(
    devices: int,
    duration_s: float,
    ramp_s: float,
    train_s: tuple[float, float],
    idle_samples: int,
    seed: int,
    update: bytes,
) -> dict:
    with tempfile.TemporaryDirectory(prefix="server_load_") as tmp:
        key, key_file = write_admin_key(Path(tmp))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_server(Path(tmp) / "server.db", port, key_file)
        try:
            wait_ready(url, proc)
            setup(url, key)
            with no_full_collections():
                tally = asyncio.run(
                    run_load(url, devices, duration_s, ramp_s, train_s, idle_samples, seed, update, proc.pid)
                )
            with admin_client(url, key) as admin:
                rounds = admin.rounds(POPULATION)
        finally:
            stop_server(proc)
        log = (Path(tmp) / "server.log").read_text(errors="replace")
    if "Traceback" in log or "ERROR" in log:
        print(
            f"--- server log ({devices} devices), last lines ---\n" + "\n".join(log.splitlines()[-30:]), file=sys.stderr
        )
    return _level_result(devices, duration_s, ramp_s, train_s, tally, rounds, log)


def _level_result(devices, duration_s, ramp_s, train_s, tally: Tally, rounds, log: str) -> dict:
    lat = {kind: percentiles(values) for kind, values in tally.latencies.items()}
    for kind in ("checkin", "report", "resource", "health_idle", "health_load", "loop_lag"):
        lat.setdefault(kind, {"n": 0})
    c = tally.counts

    def grouped(prefix: str) -> dict:
        return {k[len(prefix) :]: v for k, v in sorted(c.items()) if k.startswith(prefix)}

    timeouts = grouped("timeout:")
    device_timeouts = sum(v for k, v in timeouts.items() if not k.startswith("health"))
    # Rounds of the idle server before the load (abandoned: no device came) are left out.
    by_status = Counter(r["status"] for r in rounds if r.get("ended_at", float("inf")) >= tally.load_started_wall)
    return {
        "benchmark": "server_load",
        "case": f"devices_{devices}",
        "devices": devices,
        "duration_s": duration_s,
        "ramp_s": ramp_s,
        "train_s": list(train_s),
        "round_config": ROUND_CONFIG.to_dict(),
        "latency": lat,
        "checkins_accepted": c["checkin_accepted"],
        "checkins_rejected": c["checkin_rejected"],
        "reject_reasons": grouped("reject_reason:"),
        "checkins_per_s": round(len(tally.latencies.get("checkin", [])) / duration_s, 1),
        "reports_accepted": c["report_accepted"],
        "reports_late": c["report_late"],
        "sessions_without_report": c["session_without_report"],
        "other_http": {**grouped("checkin_http:"), **grouped("report_http:")},
        "timeouts": device_timeouts,
        "timeouts_by_kind": timeouts,
        "http_5xx": sum(grouped("5xx:").values()),
        "http_5xx_by_kind": grouped("5xx:"),
        "transport_errors": grouped("transport_error:"),
        "rounds_committed": by_status["committed"],
        "rounds_abandoned": by_status["abandoned"],
        "cpu_cores": tally.cpu_cores(),
        "drain_ms": c["drain_ms"],
        "server_log_errors": log.count("Traceback"),
        "connections_opened": c["connections_opened"],
        "timeline": tally.timeline(TIMELINE_S if duration_s > 2 * TIMELINE_S else duration_s / 4, duration_s),
        "ratios": {
            "checkin_p99_vs_idle_health_p99": _ratio(lat["checkin"], lat["health_idle"]),
            "report_p99_vs_idle_health_p99": _ratio(lat["report"], lat["health_idle"]),
            "health_p99_under_load_vs_idle": _ratio(lat["health_load"], lat["health_idle"]),
            "report_p99_vs_health_p99_under_load": _ratio(lat["report"], lat["health_load"]),
            "checkin_p99_vs_health_p99_under_load": _ratio(lat["checkin"], lat["health_load"]),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_LEVELS} devices, 10 s each (about 30 s in all)")
    parser.add_argument("--devices", type=int, nargs="+", help=f"load levels (default {LEVELS})")
    parser.add_argument("--duration", type=float, help="seconds of load per level (default 60, quick 10)")
    parser.add_argument("--ramp", type=float, help="devices start spread over this many seconds (default 15, quick 5)")
    parser.add_argument(
        "--train",
        type=float,
        nargs=2,
        default=TRAIN_TIME_S,
        metavar=("MIN", "MAX"),
        help=f"a selected device waits this long before it reports (default {TRAIN_TIME_S})",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    levels = tuple(args.devices or (QUICK_LEVELS if args.quick else LEVELS))
    duration = args.duration or (10.0 if args.quick else 60.0)
    ramp = args.ramp if args.ramp is not None else (5.0 if args.quick else ROUND_CONFIG.retry_window_s[1])
    idle_samples = 100 if args.quick else 300
    update = precomputed_update(args.seed)
    results = []
    for n in levels:
        result = run_level(n, duration, ramp, tuple(args.train), idle_samples, args.seed, update)
        results.append(result)
        _emit(result)

    low, high = results[0], results[-1]
    report_p99_s = low["latency"]["report"].get("p99_ms", float("inf")) / 1000.0
    _emit(
        {
            "benchmark": "server_load",
            "summary": True,
            "quick": args.quick,
            "admin_key_file_flag": "--admin-key-file" in _server_help(),
            "admin_client_key": _takes_admin_key(),
            "levels": {
                r["devices"]: {
                    "checkin_p99_ms": r["latency"]["checkin"].get("p99_ms"),
                    "report_p99_ms": r["latency"]["report"].get("p99_ms"),
                    "idle_health_p99_ms": r["latency"]["health_idle"].get("p99_ms"),
                    "load_health_p99_ms": r["latency"]["health_load"].get("p99_ms"),
                    "timeouts": r["timeouts"],
                    "http_5xx": r["http_5xx"],
                    "rounds_committed": r["rounds_committed"],
                    "cpu_cores": r["cpu_cores"],
                    **r["ratios"],
                }
                for r in results
            },
            "targets": {
                "report_p99_s": {
                    "devices": low["devices"],
                    "value": round(report_p99_s, 3),
                    "goal": REPORT_P99_GOAL_S,
                    "met": bool(report_p99_s <= REPORT_P99_GOAL_S),
                },
                "timeouts": {
                    "devices": high["devices"],
                    "value": high["timeouts"],
                    "goal": 0,
                    "met": high["timeouts"] == 0,
                },
            },
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
