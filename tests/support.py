"""Helpers shared by tests: plans over the digits data and deploying them to a server, attested
devices running secure rounds against it, and the benchmarks run as documented."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeVar

import httpx
import numpy as np
import onnxruntime
import pytest
import uvicorn

from device_runtime import (
    FLRuntime,
    OpStatsStore,
    SessionResult,
    build_mlp_plan,
    build_softmax_regression_plan,
    encode_checkpoint,
    initial_weights,
)
from device_runtime.attestation import DeviceAttestor, PeerCertificateVerifier
from device_runtime.conditions import DeviceState, StaticConditions
from device_runtime.protocol import ProtocolClient
from device_runtime.secure_client import SecureResult, run_secure_aggregation
from device_runtime.wire import CheckinAccepted
from emulator import AttestationAuthority
from example_store import ExampleSelector, SQLiteExampleStore
from secagg import parse_message
from secagg.messages import AdvertiseKeys
from server_stub import (
    AdminClient,
    AttestationVerifier,
    DPConfig,
    NonceRegistry,
    RateLimiter,
    RoundConfig,
    ServerThread,
)
from server_stub.dp_rounds import ledger as empty_ledger
from server_stub.secure_rounds import SecureRound
from server_stub.serve import free_port

T = TypeVar("T")
COLLECTION = "app:/digits"
ROOT = Path(__file__).resolve().parents[1]  # the checkout


def digits_plan(kind: str = "softmax", **kwargs):
    args = dict(
        learning_rate=0.2, batch_size=8, epochs=2, selector=ExampleSelector(COLLECTION), inputs={"x": "x", "y": "y"}
    )
    args.update(kwargs)
    if kind == "softmax":
        return build_softmax_regression_plan(64, 10, **args)
    return build_mlp_plan(64, (16,), 10, **args)


def deploy(admin: AdminClient, population: str = "digits", *, plan=None, **config) -> tuple:
    plan = plan or digits_plan()
    weights = initial_weights(plan, seed=0)
    admin.create_population(population)
    config.setdefault("min_reports", 1)  # these tests run rounds of a few devices knowingly
    admin.deploy_task(population, "train", plan, encode_checkpoint(weights), RoundConfig(**config))
    return plan, weights


def as_float32(d: dict) -> dict:
    return {k: np.asarray(v, dtype=np.float32) for k, v in d.items()}


def checkout_with_stand_in_python(tmp_path, *, checks_fail: bool = False) -> tuple:
    """A copy of the checkout's ``dev`` with a stand-in Python (``$PYTHON``) that logs each call
    to stderr and does nothing else, so a test sees what ``./dev`` says and installs, in order,
    without installing anything; with ``checks_fail`` its ``python -c`` (``./dev``'s import
    checks) fails, as where a tool is missing. Returns (the checkout, the environment to run in)."""
    import os
    import stat

    work = tmp_path / "checkout"
    work.mkdir()
    (work / "dev").write_bytes((ROOT / "dev").read_bytes())
    (work / "dev").chmod(0o755)
    (work / "pyproject.toml").write_text("[project]\nname = 'x'\n", encoding="utf-8")
    log = tmp_path / "calls.log"
    fake = tmp_path / "python3"
    fail = 'if [ "$1" = "-c" ]; then exit 1; fi\n' if checks_fail else ""
    fake.write_text(
        f"""#!/usr/bin/env bash
echo "python $*" >> {log}
if [ "$1 $2" = "-m venv" ]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; fi
{fail}echo "python $*" >&2
""",
        encoding="utf-8",
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return work, {**os.environ, "PYTHON": str(fake)}


# ------------------------------------------------------------------ attested secure rounds over HTTP


def attested_server_thread(db_path: Path, authority: AttestationAuthority) -> ServerThread:
    """A server that admits devices the authority certified (the trust anchor devices also hold),
    with a rate limit no test fleet reaches: the limit has tests of its own."""
    verifier = AttestationVerifier(
        authority.trust_anchor(), NonceRegistry(ttl_s=60), RateLimiter(burst=40, rate_per_s=10)
    )
    return ServerThread(db_path, verifier=verifier)


#: ``deploy_secure``'s round unless a test says otherwise: its selection and report window, then its groups.
SECURE_ROUND = {"over_selection": 1.0, "min_fraction": 0.2, "selection_timeout_s": 60, "report_timeout_s": 60.0}
# groups of k + 1 = 6 (not the default 100), so that a test's few dozen devices make several groups;
# rounds of 10 s: a group forms at its last check-in, and a runtime downloads the plan and builds its
# training session before it advertises its keys. With rounds of 3 s, a device held up that long (its
# thread starved on a machine at load 6-8) was left out of its group, and a test expecting all six
# failed. Where no device drops, no round waits its timeout out, so a long one costs nothing; a test
# whose devices drop sets a short one (and a report window just over three of them).
SECURE_ROUND |= {"secagg_min_group_size": 5, "secagg_target_group_size": 6, "secagg_round_timeout_s": 10.0}


def deploy_secure(admin: AdminClient, population: str = "digits", *, plan=None, **config) -> tuple:
    """``deploy`` of a secure softmax task as these tests run it: every device checked in is selected,
    selection waits long enough for a test's check-ins, and groups of six (at least five summed)
    run rounds of 10 s; ``config`` overrides any of it (and must name ``goal_count``)."""
    plan = plan or digits_plan("softmax", secure_aggregation=True)
    return deploy(admin, population, plan=plan, **{**SECURE_ROUND, **config})


def on_secure_rounds(monkeypatch, server: ServerThread, population: str, change: Callable[[SecureRound], None]) -> None:
    """Hand each secure round the real service opens for ``population`` to ``change`` before any
    device sees it (a malicious server's edit); ``monkeypatch`` gives the service back at the test's end."""
    service = server.service
    real_start = service._start_next

    def start_next(pop, now):  # noqa: ANN001, ANN202 - the service's own
        real_start(pop, now)
        run = pop.current
        if pop.name == population and run is not None and run.secure is not None:
            change(run.secure)

    monkeypatch.setattr(service, "_start_next", start_next)


def sessions_in_background(fleet: Any, count: int) -> tuple[threading.Thread, list]:
    """The first ``count`` of ``fleet``'s devices run a session each, in a thread of their own
    (joined through the thread returned); what each ended with, its result or what it raised."""

    def session(i: int) -> Any:
        try:
            return fleet.runtimes[i].run_session()
        except Exception as exc:  # noqa: BLE001 - what a device raised is the test's to judge
            return exc

    ended: list = []
    devices = threading.Thread(target=lambda: ended.extend(in_threads(count, session, 120)))
    devices.start()
    return devices, ended


def in_threads(count: int, work: Callable[[int], T], timeout_s: float) -> list[T | None]:
    """``work(i)`` for every i below ``count``, all at once in threads of their own (devices of one
    round); waits up to ``timeout_s`` for each and returns what each gave (None where one had not ended)."""
    results: list[T | None] = [None] * count

    def go(i: int) -> None:
        results[i] = work(i)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return results


class TrainingSeen(StaticConditions):
    """Conditions that always hold in ``state`` and tell (``training``) once they are read between
    training steps, which only a session in its training phase does so often."""

    def __init__(self, state: DeviceState) -> None:
        super().__init__(state)
        self.reads = 0
        self.training = threading.Event()

    def current(self) -> DeviceState:
        self.reads += 1
        if self.reads >= 20:
            self.training.set()
        return self.state


@dataclass
class AttestedClient:
    """A protocol-level device: its client, its attested key and the session its check-in opened."""

    client: ProtocolClient
    attestor: DeviceAttestor
    session: CheckinAccepted


def attested_checkins(
    clients: Sequence[ProtocolClient], authority: AttestationAuthority, population: str
) -> list[AttestedClient]:
    """Each client checks in with a fresh device key the authority certified, attesting the server's nonce."""
    out = []
    for client in clients:
        attestor = authority.new_device_attestor("emulated-phone", time.time())
        session = client.checkin(
            population,
            onnxruntime.__version__,
            None,
            lambda c=client, a=attestor: a.attest(c.attestation_nonce(), population, onnxruntime.__version__),
        )
        assert isinstance(session, CheckinAccepted), session
        out.append(AttestedClient(client, attestor, session))
    return out


def run_secure_aggregations(
    devices: Sequence[AttestedClient],
    vectors: Sequence[np.ndarray] | Mapping[int, np.ndarray],
    authority: AttestationAuthority,
    *,
    deadline_s: float = 60.0,
    hooks: Callable[[int], dict] = lambda i: {},
) -> dict[int, SecureResult]:
    """Every device runs its group's SecAgg rounds on ``vectors[i]`` in a thread of its own, signing
    with its attested key and checking its peers' certificates; ``hooks(i)`` adds device i's
    ``on_round``/``should_abort``. The clients are closed; returns each device's result (none for
    one still running at its deadline and 30 s more)."""
    verify_peer = PeerCertificateVerifier(authority.trust_anchor(), time.time)

    def device(i: int) -> SecureResult:
        return run_secure_aggregation(
            devices[i].client,
            devices[i].session,
            vectors[i],
            deadline=time.monotonic() + deadline_s,
            signer=devices[i].attestor.secagg_signer(),
            verify_peer=verify_peer,
            **hooks(i),
        )

    results = in_threads(len(devices), device, deadline_s + 30)
    for d in devices:
        d.client.close()
    return {i: r for i, r in enumerate(results) if r is not None}


class AttestedRuntimes:
    """``count`` real ``FLRuntime``s (or ``runtime``s) of ``population``, each with twelve digits of
    its own, its opstats, an attested key and the authority's trust anchor, as the SDK's default
    policy wants for secure rounds; ``options`` go to every runtime (e.g. a ``dp_policy``)."""

    def __init__(
        self,
        folder: Path,
        digits,  # the digits fixture's dataset
        authority: AttestationAuthority,
        url: str,
        population: str,
        count: int,
        *,
        runtime: type[FLRuntime] = FLRuntime,
        transport: Callable[[int], httpx.BaseTransport] | None = None,
        **options,
    ) -> None:
        """``transport(i)``: device i's transport (real HTTP when not given)."""
        folder.mkdir(parents=True, exist_ok=True)
        self.opstats = [OpStatsStore(folder / f"opstats{i}.db") for i in range(count)]
        self.stores = []
        self.runtimes = []
        for i in range(count):
            store = SQLiteExampleStore(folder / f"app{i}.db")
            part = slice(12 * i, 12 * i + 12)
            store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[part], digits.y_train[part])))
            self.stores.append(store)
            self.runtimes.append(
                runtime(
                    population,
                    url,
                    store,
                    cache_dir=folder / f"cache{i}",
                    opstats=self.opstats[i],
                    attestor=authority.new_device_attestor("emulated-phone", time.time()),
                    trust_anchor=authority.trust_anchor(),
                    transport=transport(i) if transport is not None else None,
                    **options,
                )
            )

    def run(self, drop: frozenset[int] = frozenset()) -> list:
        """Every device runs one session at once; those in ``drop`` stop once trained, before their masked input."""

        def session(i: int) -> SessionResult:
            trained = threading.Event()
            return self.runtimes[i].run_session(
                before_report=trained.set, should_abort=lambda: i in drop and trained.is_set()
            )

        return in_threads(len(self.runtimes), session, 120)

    def close(self) -> None:
        for c in (*self.runtimes, *self.stores, *self.opstats):
            c.close()


# ------------------------------------------------------------------ devices and servers killed mid-round

#: Where a device is killed in a Secure Aggregation session: once its check-in was accepted (it waits
#: for selection's end, and its group is formed with it), once the server took its message
#: (``sent:<message>``: its keys, its shares, its share check, its masked input, its signature), or
#: once it holds the server's request of a round and before it answers (``received:<round>``).
SECAGG_KILL_POINTS = (
    "checked_in",
    "sent:AdvertiseKeys",
    "sent:EncryptedShares",
    "sent:ShareCheck",
    "sent:MaskedInput",
    "received:ConsistencyCheck",
    "sent:ConsistencySignature",
    "received:Unmasking",
)
#: The kill points after which the device's masked input is with the server (its group's sum holds it).
AFTER_MASKED_INPUT = frozenset(SECAGG_KILL_POINTS[SECAGG_KILL_POINTS.index("sent:MaskedInput") :])


def secagg_point(request: httpx.Request, response: httpx.Response) -> str | None:
    """The point of ``SECAGG_KILL_POINTS`` a device reaches with this exchange, if any."""
    if response.status_code != 200:
        return None
    if request.url.path.endswith("/checkin"):
        return "checked_in" if json.loads(response.read()).get("status") == "accepted" else None
    if not request.url.path.endswith("/secagg"):
        return None
    if request.method == "POST":
        return f"sent:{type(parse_message(request.content)).__name__}"
    state = json.loads(response.read())
    return f"received:{state.get('round')}" if isinstance(state, dict) and state.get("message") else None


class KillSwitch(httpx.HTTPTransport):
    """A device's transport that acts once the device reaches ``point`` (of ``SECAGG_KILL_POINTS``;
    None: never): it sets ``reached`` and calls ``then`` (a process's SIGKILL of itself, a test's
    signal, a dropped connection raised), and, when the device ``dies`` (the default), every
    request from then on fails as a dead device's would, so the server hears nothing more from it.
    ``statuses``: the HTTP status of every answer the device got; ``advertised``: the public keys
    (encryption and masking) of every AdvertiseKeys it sent."""

    def __init__(self, point: str | None = None, then: Callable[[], None] | None = None, *, dies: bool = True) -> None:
        super().__init__()
        self.point, self.then, self.dies = point, then, dies
        self.reached = threading.Event()
        self.statuses: list[int] = []
        self.advertised: list[bytes] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.dies and self.reached.is_set():
            raise httpx.ConnectError("this device was killed")
        response = super().handle_request(request)
        self.statuses.append(response.status_code)
        point = secagg_point(request, response)
        if point == "sent:AdvertiseKeys":
            keys = parse_message(request.content)
            assert isinstance(keys, AdvertiseKeys)
            self.advertised += [keys.c_pk, keys.s_pk]
        if point is not None and point == self.point and not self.reached.is_set():
            self.reached.set()
            if self.then is not None:
                self.then()
            if self.dies:
                raise httpx.ConnectError("this device was killed")
        return response


KILLED_APP = """
import json, os, signal, sys
sys.path.insert(0, sys.argv[5])  # the checkout
from pathlib import Path
from device_runtime import FLRuntime, OpStatsStore
from device_runtime.attestation import DeviceAttestor
from example_store import SQLiteExampleStore
from server_stub.trust_anchor import read_trust_anchor
from tests.support import KillSwitch

folder, url, population, point = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]


def kill():
    seen = {"statuses": switch.statuses, "advertised": [key.hex() for key in switch.advertised]}
    (folder / "seen.json").write_text(json.dumps(seen))
    os.kill(os.getpid(), signal.SIGKILL)


switch = KillSwitch(point, kill)
FLRuntime(
    population, url, SQLiteExampleStore(folder / "app.db"), opstats=OpStatsStore(folder / "app.db"),
    cache_dir=folder / "cache", attestor=DeviceAttestor.load(folder / "device.key"),
    trust_anchor=read_trust_anchor(folder / "trust.json"), transport=switch,
).run_session()
"""


class KilledApp:
    """A device app whose files are in ``folder`` (examples and opstats in ``app.db``, plans in
    ``cache/``, its attested key in ``device.key``, the authority's trust anchor): ``start(point)``
    runs a session in a process of its own that kills itself (SIGKILL) at ``point``, and
    ``restarted()`` is the same app started again on the same files, in this process."""

    def __init__(self, folder: Path, digits, authority: AttestationAuthority, url: str, population: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.url, self.population = folder, url, population
        self.trust_anchor = authority.trust_anchor()
        store = SQLiteExampleStore(folder / "app.db")
        part = slice(-12, None)  # digits no runtime of ``AttestedRuntimes`` holds
        store.add(COLLECTION, ({"x": x, "y": y} for x, y in zip(digits.x_train[part], digits.y_train[part])))
        store.close()
        authority.new_device_attestor("emulated-phone", time.time()).save(folder / "device.key")
        authority.save_trust_anchor(folder / "trust.json")

    def start(self, point: str) -> subprocess.Popen:
        script = self.folder / "app.py"
        script.write_text(KILLED_APP)
        args = [str(self.folder), self.url, self.population, point, str(ROOT)]
        return subprocess.Popen([sys.executable, str(script), *args])

    def seen(self) -> tuple[list[int], list[bytes]]:
        """The killed session's ``KillSwitch.statuses`` and ``advertised``, up to its death."""
        seen = json.loads((self.folder / "seen.json").read_text())
        return seen["statuses"], [bytes.fromhex(key) for key in seen["advertised"]]

    def restarted(self, **options) -> FLRuntime:
        db = self.folder / "app.db"
        return FLRuntime(
            self.population,
            self.url,
            SQLiteExampleStore(db),
            opstats=OpStatsStore(db),
            cache_dir=self.folder / "cache",
            attestor=DeviceAttestor.load(self.folder / "device.key"),
            trust_anchor=self.trust_anchor,
            **options,
        )


class ThroughRestart(KillSwitch):
    """A device's transport whose requests wait while the server is down (``up`` cleared): the
    device meets the restarted server, whatever the time the restart takes on a loaded machine,
    instead of giving up on a dead one (``ServerUnreachable``). A request in flight at the kill
    fails and the device sends it again, as after any connection error."""

    def __init__(self, point: str | None, up: threading.Event) -> None:
        super().__init__(point, dies=False)
        self.up = up

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        assert self.up.wait(120)
        return super().handle_request(request)


class LoopbackApp:
    """An ASGI app served by uvicorn in a thread on a loopback port, held from its pick so that no
    other server takes it; ``url`` reaches it between ``__enter__`` and ``__exit__``. With ``cert``
    (certificate and key files) it is served over TLS, its ``url`` https."""

    def __init__(self, app: Any, *, cert: tuple[Path, Path] | None = None, lifespan: str = "auto") -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"{'https' if cert else 'http'}://127.0.0.1:{self.port}"
        tls = {"ssl_certfile": cert[0], "ssl_keyfile": cert[1]} if cert else {}
        config = uvicorn.Config(app, log_level="warning", log_config=None, lifespan=lifespan, **tls)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.listener]}, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        while not self.server.started:
            threading.Event().wait(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.listener.close()


#: The admin key of a ``ServerProcess``.
PROCESS_ADMIN_KEY = "secagg-crash-test-admin-key-0123456789abcdef"


class ServerProcess:
    """``python -m server_stub`` on one port and database, attested devices only; ``kill`` is a
    SIGKILL. ``start(dies_in_commit=point)`` starts one that kills itself at ``point`` of its first
    round commit instead (``tests.dying_server``); ``died()`` waits for that."""

    def __init__(self, folder: Path, authority: AttestationAuthority) -> None:
        self.folder, self.port = folder, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        authority.save_trust_anchor(folder / "trust.json")
        admin_key_file(folder / "admin.key", PROCESS_ADMIN_KEY)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0, *, dies_in_commit: str | None = None) -> None:
        log = (self.folder / "server.log").open("a")
        command = ["tests.dying_server", dies_in_commit] if dies_in_commit is not None else ["server_stub"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *command, "--db", str(self.folder / "server.db"), "--port", str(self.port)]
            + [
                "--admin-key-file",
                str(self.folder / "admin.key"),
                "--attestation-trust",
                str(self.folder / "trust.json"),
            ]
            + ["--rate-burst", "40", "--allow-untested-plans", "--log-level", "warning"],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=1) as http:
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, (self.folder / "server.log").read_text()[-2000:]
                try:
                    if http.get(self.url + "/v1/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        raise AssertionError(f"the server did not start on {self.url}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(30) == -signal.SIGKILL

    def died(self, timeout_s: float = 120.0) -> None:
        """Wait for a server started with ``dies_in_commit`` to have killed itself."""
        assert self.proc is not None
        assert self.proc.wait(timeout_s) == -signal.SIGKILL, (self.folder / "server.log").read_text()[-2000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


#: A distributed-DP task's privacy settings that the digits devices of these tests run with.
DDP = DPConfig(mode="distributed", noise_multiplier=1.0, clip=0.05, bitwidth=32, delta=1e-6)


def check_ddp_accounting(rounds: list[dict], dp: DPConfig) -> None:
    """Each committed round of a distributed-DP task on record (``AdminClient.rounds``, all
    committed) counts the privacy of the rounds on record up to it, and of no other."""
    ledger = empty_ledger(dp)
    for n, record in enumerate(rounds, start=1):
        ledger = ledger.add_round(dp.noise_multiplier)
        assert (record["status"], record["metrics"]["dp_rounds"]) == ("committed", n)
        assert record["metrics"]["epsilon"] == pytest.approx(ledger.epsilon, rel=1e-9)


# ------------------------------------------------------------------ benchmarks run as documented


def run_benchmark(name: str, *args: str, timeout_s: float = 280) -> list[dict]:
    """``python -m benchmarks.<name> *args`` from the checkout's root with this interpreter (the
    venv's); fails showing the benchmark's stderr when it exits non-zero, and returns its JSON lines,
    checked to be objects and to end in the summary."""
    try:
        out = subprocess.run(
            [sys.executable, "-m", f"benchmarks.{name}", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as late:
        pytest.fail(f"benchmarks.{name} ran past {timeout_s} s:\n{str(late.stderr or '')[-4000:]}")
    assert out.returncode == 0, f"benchmarks.{name} exited {out.returncode}:\n{out.stderr[-4000:]}"
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    assert lines and all(isinstance(line, dict) for line in lines), out.stdout[-2000:]
    assert lines[-1].get("summary") is True, lines[-1]
    return lines


def admin_key_file(path: Path, key: str) -> Path:
    """``key`` in a file as an operator keeps it: readable by its owner only (a file others can
    read is warned of)."""
    path.write_text(key + "\n", encoding="utf-8")
    path.chmod(0o600)
    return path


def server_command_exit(args: Sequence[str], timeout_s: float = 30.0) -> int:
    """The exit status of the server command's ``main`` run in-process with ``args`` (argparse's
    refusals included), in a thread of its own: a command that serves instead of refusing fails
    the test after ``timeout_s`` instead of hanging it."""
    from server_stub.cli import main

    codes: queue.Queue[int] = queue.Queue()

    def run() -> None:
        try:
            codes.put(main(list(args)))
        except SystemExit as exit_:
            codes.put(int(exit_.code or 0))

    threading.Thread(target=run, daemon=True).start()
    try:
        return codes.get(timeout=timeout_s)
    except queue.Empty:
        pytest.fail(f"the server command started serving instead of refusing {list(args)}")


@contextlib.contextmanager
def read_only_folder(folder: Path) -> Iterator[Path]:
    """``folder`` made, then refusing files as a read-only file system's does (immutable with
    ``chattr +i``: root writes past modes; else mode 0555), for the body of the ``with``; the test
    is skipped where this process can write to it all the same."""
    folder.mkdir()
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        os.chmod(folder, 0o555)
    try:
        try:
            (folder / "probe").write_text("")
        except OSError:
            pass
        else:
            (folder / "probe").unlink()
            pytest.skip("this process writes to read-only folders, and chattr cannot make one immutable here")
        yield folder
    finally:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
        os.chmod(folder, 0o755)
