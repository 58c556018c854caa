"""The README's promise for plain rounds, over real HTTP: the server adds each report to the
round's running sum and keeps no single device's update, in memory or on disk.

Each device sends an update whose every weight entry is its own constant, so any copy of it (the
report as sent, the bounded update, its per-example delta, as float32 or float64, raw, hex,
base64 or JSON numbers) is a run of one recognisable value. After the round commits, no such run is anywhere in
the server's SQLite files or in any row of any table, while the committed model is."""

from __future__ import annotations

import base64
import sqlite3
from pathlib import Path

import httpx
import numpy as np

from device_runtime import encode_checkpoint
from tests.support import deploy

EXAMPLES = 4.0  # every device's num_examples; no device is capped (max_examples_per_report)
CONSTANTS = (0.371293, 0.529347, 0.814761)  # device i's weight sums; their mean is none of them


def _update(constant: float) -> dict[str, np.ndarray]:
    return {
        "w0": np.full((64, 10), constant, np.float32),
        "b0": np.full((10,), constant, np.float32),
        "loss_sum": np.array(EXAMPLES * 0.5, np.float32),
        "correct": np.array(EXAMPLES / 2, np.float32),
        "count": np.array(EXAMPLES, np.float32),
        "num_examples": np.array(EXAMPLES, np.float32),
    }


def _forms(run: bytes) -> list[bytes]:
    """``run`` (a 4- or 8-byte value repeated) as raw bytes, and as hex and base64 text at every
    byte phase, so that an encoded copy is found wherever it starts."""
    period = 8
    forms = [run[:64]]
    for phase in range(period):
        chunk = run[phase : phase + 48]
        forms.append(chunk.hex().encode())
        forms.append(base64.b64encode(chunk).rstrip(b"="))
    return forms


def _needles(constant: float) -> list[bytes]:
    """Every form of one device's update the server could have kept."""
    sent = float(np.float32(constant))  # what the server receives; it computes from this
    out = []
    for value in (sent, sent / EXAMPLES):  # the weight sums, and the mean delta
        for dtype in ("<f4", "<f8"):
            out += _forms(np.full(32, value, dtype).tobytes())
        # As JSON or text numbers; the leading delimiter keeps a timestamp's digits from matching.
        for text in (repr(value), repr(float(np.float32(value)))[:10]):
            out += [sep + text.encode() for sep in (b"[", b",", b" ", b":")]
    return out


def _holds_tensor(haystack: bytes, tensor: np.ndarray) -> bool:
    """Whether some 64-byte window of the tensor's float32 bytes is in ``haystack`` (a window, not
    the whole tensor: SQLite may split a large blob across pages)."""
    data = np.ascontiguousarray(tensor, "<f4").tobytes()
    return any(data[i : i + 64] in haystack for i in range(0, len(data) - 63, 64))


def _files(db: Path) -> bytes:
    """Every byte of the database and its companions (-wal, -shm, -journal)."""
    files = sorted(db.parent.glob(db.name + "*"))
    assert db in files
    return b"".join(p.read_bytes() for p in files)


def _rows(db: Path) -> list[bytes]:
    """Every value of every row of every table, as bytes."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        tables = [name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        assert {"resources", "rounds", "tasks"} <= set(tables)
        values = []
        for table in tables:
            for row in conn.execute(f'SELECT * FROM "{table}"'):
                values += [v if isinstance(v, bytes) else str(v).encode() for v in row]
    return values


def test_a_plain_round_writes_no_device_update_to_disk(server, admin):
    plan, w0 = deploy(
        admin,
        goal_count=len(CONSTANTS),
        over_selection=1.0,
        min_fraction=1.0,
        report_timeout_s=60,
        selection_timeout_s=60,
        clip_update_norm=None,
    )
    with httpx.Client(base_url=server.url, timeout=10) as http:
        sessions = [
            http.post("/v1/populations/digits/checkin", json={"runtime_version": "1.31.1"}).json() for _ in CONSTANTS
        ]
        for session, constant in zip(sessions, CONSTANTS):
            assert session["status"] == "accepted", session
            r = http.post(
                f"/v1/sessions/{session['session_id']}/report",
                content=encode_checkpoint(_update(constant)),
                headers={"Authorization": f"Bearer {session['token']}"},
            )
            assert r.status_code == 200, r.text
    (record,) = admin.rounds("digits")
    assert record["status"] == "committed" and record["metrics"]["reported"] == len(CONSTANTS)
    model, _ = admin.model("digits")
    mean_delta = np.float32(sum(CONSTANTS) / (len(CONSTANTS) * EXAMPLES))
    for name in plan.weight_names:
        np.testing.assert_allclose(model[name], w0[name] + mean_delta, rtol=1e-6, atol=1e-6)

    disk, rows = _files(server.db_path), _rows(server.db_path)
    # The scans see tensors: the committed model is both in the files and in a row.
    assert _holds_tensor(disk, model["w0"])
    assert any(_holds_tensor(value, model["w0"]) for value in rows)
    in_files = [i for i, c in enumerate(CONSTANTS) if any(needle in disk for needle in _needles(c))]
    in_rows = [i for i, c in enumerate(CONSTANTS) if any(needle in value for needle in _needles(c) for value in rows)]
    assert in_files == [], f"the updates of devices {in_files} are in the server's database files"
    assert in_rows == [], f"the updates of devices {in_rows} are in rows of the server's database"
