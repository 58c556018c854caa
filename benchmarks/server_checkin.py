"""Check-ins per second that one uvicorn worker answers on loopback to concurrent clients.

The server runs in its own process; the load comes from this process over keep-alive
connections. Baseline in the same run: the same server's trivial health endpoint. Only the
operator setup (populations, deploys) needs the admin key; the measured requests are device
check-ins and the health check, which take none, and no device downloads a resource."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.server_load import wait_ready, write_admin_key
from device_runtime import build_softmax_regression_plan, encode_checkpoint, initial_weights
from example_store import ExampleSelector
from server_stub import AdminClient, RoundConfig, free_port

OPEN_GOAL = 1_000_000  # RoundConfig's largest goal_count; far more check-ins than a run makes
WARMUP_S = 0.5  # each case's load before its measured load


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


async def _load(port: int, method: str, path: str, body: bytes, connections: int, duration: float) -> tuple[int, int]:
    """Closed-loop load: each connection sends a request as soon as the previous answer is in."""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    done = 0
    errors = 0
    stop_at = time.perf_counter() + duration

    async def worker() -> None:
        nonlocal done, errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < stop_at:
                writer.write(head)
                status_line = await reader.readline()
                length = 0
                while True:
                    line = await reader.readline()
                    if line in (b"\r\n", b""):
                        break
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                if b" 200 " in status_line:
                    done += 1
                else:
                    errors += 1
        finally:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(connections)))
    return done, errors


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--duration takes seconds, got {text!r}") from None
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"--duration takes a positive number of seconds, got {text!r}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="3 s per case instead of 10")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument(
        "--duration",
        type=_seconds,
        help="seconds each case is measured (default 10; 3 with --quick); the warm-up runs at most as long",
    )
    args = parser.parse_args()
    duration = args.duration if args.duration is not None else (3.0 if args.quick else 10.0)
    warmup = min(WARMUP_S, duration)
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        admin_key, key_file = write_admin_key(Path(tmp))
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server_stub",
                "--db",
                str(Path(tmp) / "bench.db"),
                "--port",
                str(port),
                "--admin-key-file",
                str(key_file),
                "--log-level",
                "warning",
                "--allow-untested-plans",
            ],  # the benchmark's plan is built here, not release-tested
            stdout=subprocess.DEVNULL,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, proc, timeout_s=20)
            plan = build_softmax_regression_plan(64, 10, selector=ExampleSelector("app:/digits"))
            long = dict(over_selection=1.0, selection_timeout_s=3600, report_timeout_s=3600)
            with AdminClient(url, admin_key=admin_key) as admin:
                # "open": every check-in is selected; "full": the one seat is taken, so every check-in is turned away.
                # "full" lowers min_reports to its goal of 1: its round never commits, and the default (5) would
                # refuse the deploy.
                for population, goal in (("open", OPEN_GOAL), ("full", 1)):
                    admin.create_population(population)
                    admin.deploy_task(
                        population,
                        "t",
                        plan,
                        encode_checkpoint(initial_weights(plan)),
                        RoundConfig(goal_count=goal, min_reports=min(goal, 5), **long),
                    )
                httpx.post(url + "/v1/populations/full/checkin", json={"runtime_version": "1.31.1"}).raise_for_status()
            checkin_body = json.dumps({"runtime_version": "1.31.1", "eligibility": {}}).encode()
            results = {}
            for name, method, path, body in [
                ("health", "GET", "/v1/health", b""),
                ("checkin_selected", "POST", "/v1/populations/open/checkin", checkin_body),
                ("checkin_rejected", "POST", "/v1/populations/full/checkin", checkin_body),
            ]:
                asyncio.run(_load(port, method, path, body, args.connections, warmup))  # warm-up
                t0 = time.perf_counter()
                done, errors = asyncio.run(_load(port, method, path, body, args.connections, duration))
                elapsed = time.perf_counter() - t0
                results[name] = done / elapsed
                _emit(
                    {
                        "case": name,
                        "connections": args.connections,
                        "requests": done,
                        "errors": errors,
                        "per_s": round(done / elapsed, 1),
                    }
                )
        finally:
            proc.terminate()
            proc.wait(10)
    rate = min(results["checkin_selected"], results["checkin_rejected"])
    _emit(
        {
            "benchmark": "server_checkin",
            "summary": True,
            "checkins_selected_per_s": round(results["checkin_selected"], 1),
            "checkins_rejected_per_s": round(results["checkin_rejected"], 1),
            "health_per_s": round(results["health"], 1),
            "ratio_selected_vs_health": round(results["checkin_selected"] / results["health"], 3),
            "targets": {"checkins_per_s": {"value": round(rate, 1), "goal": 500, "met": rate >= 500}},
        }
    )


if __name__ == "__main__":
    main()
