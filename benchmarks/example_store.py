"""Example-store throughput against raw sqlite3 doing the same work in the same run.

Insert: ``SQLiteExampleStore.add`` of N example dicts (64 float32 features + an int64 label)
versus stdlib sqlite3 ``executemany`` of the already-encoded payload rows into an equivalent
table (same DDL, WAL, synchronous=NORMAL), one transaction each. Read: streaming the whole
collection through ``query_batches`` and through the per-example ``query`` iterator, versus
raw sqlite3 fetching the same payload rows (no decoding) with ``fetchmany``. The sealed cases
do the same with the store opened with a key store (AES-256-GCM per payload, nonce and tag
stored with it), still against the same raw sqlite3 baseline.

Prints one JSON object per line; the last is the summary with the targets.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.schema import CreateIndex, CreateTable

from example_store import ExampleSelector, InMemoryKeyStore, SQLiteExampleStore
from example_store.sqlite_store import collections_table, examples_table

COLLECTION = "app:/bench"
FEATURES = 64
INSERT_GOAL = 0.5
READ_GOAL = 200_000
SEALED_READ_GOAL = 200_000


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _make_data(n: int, seed: int = 0) -> tuple[list[dict], list[float], list[bytes]]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, FEATURES), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int64)
    examples = [{"x": xi, "y": yi} for xi, yi in zip(x, y)]
    timestamps = (1_700_000_000.0 + np.arange(n, dtype=np.float64)).tolist()
    rec = np.empty(n, dtype=[("x", "<f4", (FEATURES,)), ("y", "<i8")])
    rec["x"], rec["y"] = x, y
    buf = rec.tobytes()
    size = rec.dtype.itemsize
    payloads = [buf[i : i + size] for i in range(0, len(buf), size)]
    return examples, timestamps, payloads


def _raw_connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=WAL").fetchall()
    conn.execute("PRAGMA synchronous=NORMAL")
    dialect = sqlite_dialect.dialect()
    for table in (collections_table, examples_table):
        conn.execute(str(CreateTable(table).compile(dialect=dialect)))
    for index in examples_table.indexes:
        conn.execute(str(CreateIndex(index).compile(dialect=dialect)))
    conn.execute("INSERT INTO collections VALUES (1, ?, '{}', ?, 0)", (COLLECTION, 0))
    conn.commit()
    return conn


def bench_raw_insert(path: Path, timestamps: list[float], payloads: list[bytes]) -> float:
    conn = _raw_connect(path)
    t0 = time.perf_counter()
    conn.executemany(
        "INSERT INTO examples (collection_id, timestamp, payload) VALUES (1, ?, ?)", zip(timestamps, payloads)
    )
    conn.commit()
    elapsed = time.perf_counter() - t0
    conn.close()
    return elapsed


def bench_raw_read(path: Path, n: int) -> float:
    conn = sqlite3.connect(path)
    t0 = time.perf_counter()
    cur = conn.execute("SELECT payload FROM examples WHERE collection_id = 1 ORDER BY timestamp ASC, id ASC")
    cur.arraysize = 1024
    rows = 0
    while chunk := cur.fetchmany():
        rows += len(chunk)
    elapsed = time.perf_counter() - t0
    conn.close()
    assert rows == n, (rows, n)
    return elapsed


def bench_insert(
    path: Path, examples: list[dict], timestamps: list[float], key_store: InMemoryKeyStore | None = None
) -> float:
    with SQLiteExampleStore(path, key_store=key_store) as store:
        t0 = time.perf_counter()
        store.add(COLLECTION, examples, timestamps=timestamps)
        return time.perf_counter() - t0


def bench_read_batches(path: Path, n: int, batch_size: int, key_store: InMemoryKeyStore | None = None) -> float:
    with SQLiteExampleStore(path, key_store=key_store) as store:
        t0 = time.perf_counter()
        rows = 0
        with store.query_batches(ExampleSelector(COLLECTION), batch_size) as batches:
            for batch in batches:
                rows += len(batch["y"])
        elapsed = time.perf_counter() - t0
    assert rows == n, (rows, n)
    return elapsed


def bench_read_examples(path: Path, n: int, key_store: InMemoryKeyStore | None = None) -> float:
    with SQLiteExampleStore(path, key_store=key_store) as store:
        t0 = time.perf_counter()
        rows = 0
        with store.query(ExampleSelector(COLLECTION)) as examples:
            for _ in examples:
                rows += 1
        elapsed = time.perf_counter() - t0
    assert rows == n, (rows, n)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small run (< ~15 s)")
    parser.add_argument("--examples", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    n = args.examples or (50_000 if args.quick else 200_000)
    repeats = args.repeats or (2 if args.quick else 3)
    examples, timestamps, payloads = _make_data(n)
    config = {
        "examples": n,
        "features": FEATURES,
        "payload_bytes": len(payloads[0]),
        "repeats": repeats,
        "batch_size": args.batch_size,
        "python": sys.version.split()[0],
        "sqlite": sqlite3.sqlite_version,
    }
    _emit({"benchmark": "example_store", "case": "config", **config})

    cases = (
        "insert_ours",
        "insert_raw",
        "read_query_batches",
        "read_query_iterator",
        "read_raw",
        "insert_sealed",
        "read_sealed_query_batches",
        "read_sealed_query_iterator",
    )
    results: dict[str, list[float]] = {k: [] for k in cases}
    key_store = InMemoryKeyStore()
    with tempfile.TemporaryDirectory(prefix="bench-example-store-") as tmp:
        for r in range(repeats):
            ours, raw = Path(tmp) / f"ours{r}.db", Path(tmp) / f"raw{r}.db"
            results["insert_raw"].append(n / bench_raw_insert(raw, timestamps, payloads))
            results["insert_ours"].append(n / bench_insert(ours, examples, timestamps))
            results["read_raw"].append(n / bench_raw_read(raw, n))
            results["read_query_batches"].append(n / bench_read_batches(ours, n, args.batch_size))
            results["read_query_iterator"].append(n / bench_read_examples(ours, n))
            sealed = Path(tmp) / f"sealed{r}.db"
            results["insert_sealed"].append(n / bench_insert(sealed, examples, timestamps, key_store))
            results["read_sealed_query_batches"].append(n / bench_read_batches(sealed, n, args.batch_size, key_store))
            results["read_sealed_query_iterator"].append(n / bench_read_examples(sealed, n, key_store))
            for case, values in results.items():
                _emit({"benchmark": "example_store", "case": case, "repeat": r, "examples_per_s": round(values[-1])})

    best = {k: max(v) for k, v in results.items()}
    median = {k: statistics.median(v) for k, v in results.items()}
    insert_ratio = best["insert_ours"] / best["insert_raw"]
    sealed_read = best["read_sealed_query_batches"]
    _emit(
        {
            "benchmark": "example_store",
            "summary": True,
            **config,
            "best_examples_per_s": {k: round(v) for k, v in best.items()},
            "median_examples_per_s": {k: round(v) for k, v in median.items()},
            "insert_ratio_vs_raw": round(insert_ratio, 3),
            "read_batches_ratio_vs_raw": round(best["read_query_batches"] / best["read_raw"], 3),
            "read_examples_ratio_vs_raw": round(best["read_query_iterator"] / best["read_raw"], 3),
            "sealed_insert_ratio_vs_raw": round(best["insert_sealed"] / best["insert_raw"], 3),
            "sealed_read_batches_ratio_vs_raw": round(sealed_read / best["read_raw"], 3),
            "sealed_read_examples_ratio_vs_raw": round(best["read_sealed_query_iterator"] / best["read_raw"], 3),
            "targets": {
                "insert_ratio_vs_raw": {
                    "value": round(insert_ratio, 3),
                    "goal": INSERT_GOAL,
                    "met": insert_ratio >= INSERT_GOAL,
                },
                "read_examples_per_s": {
                    "value": round(best["read_query_batches"]),
                    "goal": READ_GOAL,
                    "met": best["read_query_batches"] >= READ_GOAL,
                    "via": "query_batches",
                },
                "sealed_read_examples_per_s": {
                    "value": round(sealed_read),
                    "goal": SEALED_READ_GOAL,
                    "met": sealed_read >= SEALED_READ_GOAL,
                    "via": "query_batches, sealed",
                },
            },
        }
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
