"""A fleet past one process: the devices spread over shards (Ray actors), the server in one
process, and the run bit-identical to the single-process run of the same config and seed; and
independent runs (seeds, a grid of task parameters) fanned out as Ray tasks.

How a sharded run stays exact
-----------------------------
In one process every event runs in the order (time, order, key, sequence), the key naming the
device whose event it is (see ``events``). Devices touch one another only through the server,
and the server sees a device's request at the instant it arrives there: inside the device's
event at ``t1``, the key of that event ordering it among all requests. So a sharded run is exact
when (1) each shard runs its own devices' events in that same order, (2) the server handles
every request, and its own ticks and samples, in the global (time, order, key) order, and
(3) no device acts on an answer before the single-process device would have.

- A shard is a whole ``FleetSimulator`` that builds only its devices (``start_devices``), keyed
  by their position in the fleet. Its server is never called: a device's request goes into the
  shard's outbox with the key of its event, and the device's fiber waits (``Fibers.suspend``)
  with no timer of its own.
- Lookahead: the single-process device, having its answer at ``t1``, next acts no sooner than
  ``t1 + latency`` (the answer's trip back). So while a device waits, its shard may run every
  event before ``t1 + latency`` (its *bound*), except events of the waiting device itself (its
  timers: an app kill, say); it stops at the first event that is either. Conservative windows
  in virtual time, as wide as each device's own latency, never narrower than the fleet's least.
- The shard reports its requests and its *safe key*: the key below which it has run every event
  (the least bound and stopping event, or "done" when nothing waits). No request it sends later
  can sort before that key.
- The driver holds the one server (a ``FleetSimulator`` with no devices). It puts the requests
  on its own loop as events with their keys, next to the server's ticks and the timeline's
  samples, and runs every event below the least safe key of all shards: the server sees exactly
  the single-process order. The answers go back to the shards, which resume each waiting device
  as of its ``t1`` (the loop's clock and key set to the request's): what it does next (charge the
  answer's bytes, sleep their transfer time) lands after its bound, so never in the shard's past;
  a device whose next event would land there stops the run with a ``SimulationError``.
- Progress: the shard with the least safe key has all of its requests below it, so they are all
  answered, and its next bound lies beyond it.

The tables are rebuilt in single-process order: session rows carry the key of the event that
wrote them and are merged on it; the timeline's device counts come from each shard's log of
status changes (a sample at ``s`` counts every change before ``s``), the server's part from the
driver. The digest is the driver's server's, computed as in one process.

Cost: one exchange per window, and a busy fleet's windows are about one network latency wide
(tens of simulated ms), so a sharded run pays a round trip to every shard with news per window;
it pays off when the devices' own work (training) is what takes the time.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from server_stub.errors import did_you_mean, install_hint

from .config import FleetConfig, FleetConfigError
from .events import EventLoop, Fiber, Fibers, SimulationError
from .heap import long_lived_heap
from .sim_device import STATUS_CHECKING_IN, STATUS_IDLE, STATUS_PARTICIPATING
from .sim_transport import WireRequest
from .simulator import ORDER_SAMPLE, ORDER_SERVER, FleetSimulator, notify_before_run, progress_reporter
from .tables import FleetRun, SessionRow

#: A shard with nothing waiting: every request it will ever send is already reported (compare
#: with ``==``: it crosses process boundaries).
DONE: tuple = (math.inf,)

Key = tuple  # (time, order, key, sequence), compared as a tuple
Answer = Any  # (status, headers, body) or the exception the server's app raised
Request = tuple  # (key, request id, method, url, raw headers, body)


class RayBackendError(RuntimeError):
    """Ray is missing or cannot be reached; the message says how to get it."""


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayBackendError(
            f"Ray is not installed: install the optional extra with {install_hint('ray')}, or run without --ray"
        ) from None
    return ray


def ensure_ray(address: str | None = None, **init: Any) -> Any:
    """The ``ray`` module, connected: to ``address`` (a running cluster, e.g. ``ray://host:10001``
    or ``auto``), or to a new local cluster when None; an existing connection is reused."""
    ray = _ray()
    if not ray.is_initialized():
        init.setdefault("include_dashboard", False)
        init.setdefault("log_to_driver", False)
        main = threading.current_thread() is threading.main_thread()
        term = signal.getsignal(signal.SIGTERM) if main else None
        try:
            ray.init(address=address, **init)
        except (ConnectionError, ValueError, RuntimeError) as exc:  # what ray.init raises for a bad address
            raise RayBackendError(
                f"could not reach the Ray cluster at {address!r}: {exc}; start one with `ray start --head`"
            ) from exc
        finally:
            if callable(term):  # ray.init puts its core's crash handler (a stack dump) in place of the caller's
                signal.signal(signal.SIGTERM, term)
    return ray


# ===================================================================== the shard (one per actor)
class _KeyedFibers(Fibers):
    """Fibers keyed by their device's position in the whole fleet, so ties between devices
    break as they do in one process (there the key is the spawn order, which follows position)."""

    def __init__(self, loop: EventLoop, keys: Mapping[str, int]) -> None:
        super().__init__(loop)
        self._by_name = dict(keys)

    def spawn(
        self, run: Callable[[], None], *, at: float, name: str = "fiber", order: int = 1, key: int | None = None
    ) -> Fiber:
        return super().spawn(run, at=at, name=name, order=order, key=self._by_name[name] if key is None else key)

    def key_for(self, name: str) -> int:
        return self._by_name[name]


@dataclasses.dataclass
class _Waiting:
    fiber: Fiber
    key: Key
    bound: Key


class _ShardCaller:
    """The server as seen from a shard: the request goes to the outbox, the device waits."""

    def __init__(self, shard: FleetShard) -> None:
        self.shard = shard

    def call(self, request: WireRequest) -> Answer:
        result = self.shard._send(request)
        if isinstance(result, BaseException):
            raise result
        return result

    def close(self) -> None:
        pass


class _ShardSimulator(FleetSimulator):
    """A FleetSimulator whose rows carry the key of the event that wrote them and whose status
    changes are logged with their time, so the driver can merge shards in single-process order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.status_log: list[tuple[float, str, str]] = []
        self.tagged: list[tuple[Key, SessionRow]] = []
        self._rows = itertools.count()

    def set_status(self, device: Any, status: str) -> None:
        if device.status != status:
            self.status_log.append((self.loop.now, device.status, status))
        super().set_status(device, status)

    def add_session(self, row: SessionRow) -> None:
        loop = self.loop
        self.tagged.append(((loop.now, loop.order, loop.key, next(self._rows)), row))
        super().add_session(row)


class FleetShard:
    """Some of a fleet's devices (those at ``positions`` in the population), run in conservative
    windows (see the module's docstring). A plain object: the Ray backend wraps it in an actor;
    in one process it runs as it is, which is how the exchange is tested without a cluster."""

    def __init__(self, config: FleetConfig | Mapping[str, Any], positions: Iterable[int]) -> None:
        from .population import generate_population

        config = config if isinstance(config, FleetConfig) else FleetConfig.from_dict(config)
        specs = generate_population(config)
        self._tmp = tempfile.TemporaryDirectory(prefix="fedfleet-shard-")
        sim = _ShardSimulator(config, specs, workdir=self._tmp.name, serves=False)
        sim.caller.close()  # the shard's own server is never called: requests go to the driver
        sim.store.close()
        # simulator.py types its caller as the two it makes; a shard's has the same call() and close()
        sim.caller = _ShardCaller(self)  # type: ignore[assignment]
        sim.fibers = _KeyedFibers(sim.loop, {spec.device_id: i + 1 for i, spec in enumerate(specs)})
        owned = set(positions)
        sim.start_devices(owns=owned.__contains__)
        self.sim = sim
        self.horizon = sim.horizon_s
        self._devices = {
            d.key: d for d in sim.devices
        }  # by their fibers' keys (a fiber is spawned when its device is built)
        self._waiting: dict[int, _Waiting] = {}
        self._waiting_keys: set[int] = set()
        self._outbox: list[Request] = []
        self._ids = itertools.count()
        self._seq = itertools.count()
        self._log_sent = 0
        self._last: Key = (-math.inf,)
        self.held = 0  # windows that ended at an event of a waiting device (an app kill, say)

    @property
    def devices(self) -> int:
        return len(self._devices)

    def _send(self, request: WireRequest) -> Answer:
        sim = self.sim
        loop, fiber = sim.loop, sim.fibers.current
        if fiber is None:
            raise SimulationError("a request left a shard outside a device's fiber")
        device = self._devices[fiber.key]
        key = (loop.now, loop.order, loop.key, next(self._seq))
        rid = next(self._ids)
        bound = (loop.now + device.spec.network.latency_s, -math.inf)
        self._outbox.append((key, rid, request.method, request.target, request.headers, request.body))
        self._waiting[rid] = _Waiting(fiber, key, bound)
        self._waiting_keys.add(fiber.key)
        return sim.fibers.suspend()

    def _resume(self, rid: int, answer: Answer) -> None:
        waiting = self._waiting.pop(rid)
        self._waiting_keys.discard(waiting.fiber.key)
        loop = self.sim.loop
        saved = loop.now, loop.order, loop.key
        loop.now, loop.order, loop.key = waiting.key[0], waiting.key[1], waiting.key[2]
        try:
            waiting.fiber.send(answer)
        finally:
            loop.now, loop.order, loop.key = saved
        wakes = waiting.fiber.wakes_at
        if wakes is not None and (wakes, 1, waiting.fiber.key) <= self._last[:3]:
            raise SimulationError(
                f"device {waiting.fiber.name} acted on an answer sooner than its network latency allows "
                f"(at {wakes!r} s, the shard had run to {self._last[0]!r} s); a sharded run cannot stay exact: run it in one process"
            )

    def advance(self, answers: Sequence[tuple[int, Answer]] = ()) -> dict[str, Any]:
        """Deliver the driver's answers, run up to the next bound, report what was sent."""
        for rid, answer in answers:
            self._resume(rid, answer)
        loop, horizon = self.sim.loop, self.horizon
        safe: Key = DONE
        while True:
            nxt = loop.peek()
            if nxt is None or nxt[0] > horizon:
                break
            if self._waiting:
                bound = min(w.bound for w in self._waiting.values())
                if nxt >= bound or nxt[2] in self._waiting_keys:
                    safe = min(bound, nxt)
                    self.held += nxt < bound
                    break
            self._last = nxt
            loop.run_next()
        if self._waiting and safe == DONE:
            safe = min(w.bound for w in self._waiting.values())
        out, self._outbox = self._outbox, []
        log = self.sim.status_log[self._log_sent :]
        self._log_sent += len(log)
        return {"requests": out, "safe": safe, "status": log}

    def close(self) -> None:
        """End every fiber where it waits and remove the shard's files (idempotent)."""
        self.sim.fibers.close()
        self._tmp.cleanup()

    def finish(self) -> dict[str, Any]:
        """End the run: the sessions it cuts get their rows, every fiber unwinds; the rows (with
        their keys) and errors go back."""
        self.sim.end_sessions()
        self.close()
        return {
            "sessions": self.sim.tagged,
            "errors": dict(self.sim.errors),
            "status": self.sim.status_log[self._log_sent :],
            "held": self.held,
        }


# ===================================================================== the driver (the server)
class _DriverSimulator(FleetSimulator):
    """The server's side: requests from the shards run as events on its loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.answers: dict[int, list[tuple[int, Answer]]] = {}

    def handle(self, shard: int, rid: int, method: str, target: str, headers: list, body: bytes) -> None:
        try:
            answer: Answer = self.caller.call(WireRequest(method, target, headers, body))
        except Exception as exc:  # raised where the device made the request, as in one process
            answer = exc
        self.answers.setdefault(shard, []).append((rid, answer))


class _LocalShards:
    """Shards as plain objects in this process (the exchange without a cluster)."""

    def __init__(self, config: FleetConfig, parts: list[list[int]]) -> None:
        self.shards = [FleetShard(config, part) for part in parts]

    def advance(self, calls: dict[int, list]) -> dict[int, dict]:
        return {i: self.shards[i].advance(answers) for i, answers in calls.items()}

    def finish(self) -> list[dict]:
        return [s.finish() for s in self.shards]

    def close(self) -> None:
        for shard in self.shards:
            shard.close()


class _RayShards:
    """Shards as Ray actors, one CPU each; the calls of one window run in parallel."""

    def __init__(self, config: FleetConfig, parts: list[list[int]], ray: Any, cpus: float) -> None:
        self.ray = ray
        actor = ray.remote(num_cpus=cpus, max_concurrency=1)(FleetShard)
        data = config.dump()  # only the keys that were set: a task file's RoundConfig depends on which
        self.shards = [actor.remote(data, part) for part in parts]

    def advance(self, calls: dict[int, list]) -> dict[int, dict]:
        refs = {i: self.shards[i].advance.remote(answers) for i, answers in calls.items()}
        got = self.ray.get(list(refs.values()))
        return dict(zip(refs, got))

    def finish(self) -> list[dict]:
        return self.ray.get([s.finish.remote() for s in self.shards])

    def close(self) -> None:
        for shard in self.shards:
            self.ray.kill(shard)


def split_positions(specs: Sequence[Any], shards: int) -> list[list[int]]:
    """The positions of the devices that take part, dealt round-robin to ``shards`` shards
    (neighbours in the population differ in time zone and class, so shards get alike loads)."""
    taking = [i for i, spec in enumerate(specs) if spec.takes_part]
    return [taking[k::shards] for k in range(shards)]


def simulate_sharded(
    config: FleetConfig | None = None,
    *,
    shards: int = 2,
    out_dir: str | Path | None = None,
    progress: bool | Callable = False,
    ray: bool = True,
    address: str | None = None,
    shard_cpus: float = 1.0,
    stats: dict[str, Any] | None = None,
    notice: Callable[[str], None] | None = None,
) -> FleetRun:
    """Run the fleet with its devices over ``shards`` shards and the server here; the run equals
    ``simulate(config)`` bit for bit (digest, rounds, sessions, timeline). ``ray``: the shards are
    Ray actors (on the cluster at ``address``, or a local one); False runs them in this process.
    ``stats``, if given, is filled with the exchange's figures: ``windows`` (exchanges),
    ``requests`` (that crossed to the server), ``held`` (windows cut short by an event of a
    device waiting for its answer) and ``shards``. ``notice`` is told what ``simulate``'s is, once the
    server has taken the tasks and before the run starts."""
    from .population import generate_population
    from .workload import load_workload

    if shards < 1:
        raise SimulationError(f"shards must be at least 1, got {shards}")
    config = config or FleetConfig.default()
    if shards > config.fleet.devices:  # every shard costs each exchange window: 100,000 for 50 devices ran for hours
        raise SimulationError(
            f"shards: {shards} for a fleet of {config.fleet.devices:,} devices leaves shards with no device; use at "
            f"most {config.fleet.devices:,}"
        )
    started = time.perf_counter()
    workload = load_workload(config)  # refuses a task file or data that cannot run before any shard starts
    specs = generate_population(config)
    parts = split_positions(specs, shards)
    bar, callback = progress_reporter(progress, config.horizon_s)
    backend: _LocalShards | _RayShards
    if ray:
        backend = _RayShards(config, parts, ensure_ray(address), shard_cpus)
    else:
        backend = _LocalShards(config, parts)
    from .report import clear_run, earlier_server

    left = earlier_server(out_dir)  # before the driver replaces it
    try:
        with tempfile.TemporaryDirectory(prefix="fedfleet-sim-") as tmp:
            workdir = Path(out_dir) / "server" if out_dir is not None else Path(tmp)
            driver = _DriverSimulator(config, [], workdir=workdir, progress=callback, workload=workload)
            try:
                if notice is not None:  # once the server took the tasks: a [task] it refuses is the one line
                    notify_before_run(config, workload, specs, notice)
                if out_dir is not None:  # the run replaces an earlier one's files (see simulate)
                    replaced = clear_run(out_dir, server_left=left)
                    if replaced is not None and notice is not None:
                        notice(replaced)
                run = _drive(driver, backend, len(parts), specs, started, stats if stats is not None else {})
            finally:  # also when the run is interrupted (Ctrl-C)
                driver.close()
    finally:
        backend.close()
        if bar is not None:
            bar.close()
    if out_dir is not None:
        from .report import write_report

        write_report(run, out_dir)
    return run


def _drive(
    driver: _DriverSimulator,
    backend: _LocalShards | _RayShards,
    n: int,
    specs: Sequence[Any],
    started: float,
    stats: dict[str, Any],
) -> FleetRun:
    loop, horizon = driver.loop, driver.horizon_s
    # for the timeline's availability, which reads a device's spec only
    driver.devices = [SimpleNamespace(spec=spec) for spec in specs if driver.takes_part(spec)]  # type: ignore[misc]
    driver.status_counts[STATUS_IDLE] += len(driver.devices)
    log: list[tuple[float, str, str]] = []
    loop.call_at(0.0, driver._tick, order=ORDER_SERVER)
    loop.call_at(0.0, driver._sample, order=ORDER_SAMPLE)
    safe: list[Key] = [(-math.inf,)] * n
    calls: dict[int, list] = {i: [] for i in range(n)}
    windows = requests = 0
    try:
        with long_lived_heap():
            while calls:
                windows += 1
                for i, got in backend.advance(calls).items():
                    safe[i] = got["safe"]
                    requests += len(got["requests"])
                    for key, rid, method, url, headers, body in got["requests"]:
                        loop.call_at(
                            key[0], driver.handle, i, rid, method, url, headers, body, order=key[1], key=key[2]
                        )
                    for _, old, new in got["status"]:
                        driver.status_counts[old] -= 1
                        driver.status_counts[new] += 1
                    log.extend(got["status"])
                limit = min(safe)
                while (nxt := loop.peek()) is not None and nxt[0] <= horizon and (limit == DONE or nxt < limit):
                    loop.run_next()
                calls, driver.answers = driver.answers, {}
                if any(s != DONE for s in safe) and not calls:
                    raise SimulationError(
                        "the sharded run stalled: no shard can advance, which the exchange should never allow; "
                        "run this config in one process (without --ray/--shards) and keep the config to reproduce it"
                    )
            loop.run_until(horizon)
            driver.service.tick()
        finished = backend.finish()
    finally:
        driver.fibers.close()
    wall = time.perf_counter() - started
    tagged = sorted((row for part in finished for row in part["sessions"]), key=lambda kr: kr[0])
    driver.sessions = [row for _, row in tagged]
    for part in finished:
        driver.errors.update(part["errors"])
        log.extend(part["status"])
    driver.timeline_rows = _recount(driver.timeline_rows, log)
    if driver.progress is not None:
        status = driver.service.population_status(driver.population)
        driver.progress(horizon, int(status.get("committed_rounds", 0) or 0), 0)
    rounds, digest = driver._rounds()
    stats.update(windows=windows, requests=requests, held=sum(p["held"] for p in finished), shards=n)
    return FleetRun(
        sessions=driver.sessions,
        rounds=rounds,
        timeline=driver._timeline(),
        digest=digest,
        config=driver.config,
        wall_s=wall,
        simulated_s=horizon,
        errors=dict(sorted(driver.errors.items())),
        extra=driver.extra,
        devices_short_of_memory=sum(1 for spec in specs if spec.takes_part and not driver.takes_part(spec)),
        plan_cost=driver.plan_summary(),
    )


def _recount(
    rows: list[tuple[float, int, int, int]], log: list[tuple[float, str, str]]
) -> list[tuple[float, int, int, int]]:
    """Each sample's device counts from every status change before it (a sample runs before
    the devices' events of its instant)."""
    changes = sorted(log, key=lambda c: c[0])
    counts: Counter[str] = Counter()
    out, j = [], 0
    for t, _, _, active in rows:
        while j < len(changes) and changes[j][0] < t:
            _, old, new = changes[j]
            counts[old] -= 1
            counts[new] += 1
            j += 1
        out.append((t, counts[STATUS_CHECKING_IN], counts[STATUS_PARTICIPATING], active))
    return out


# ===================================================================== independent runs
def parse_sweep(items: Sequence[str]) -> dict[str, list[Any]]:
    """``["goal_count=8,16", "fleet.devices=100,200"]`` -> ``{"task.goal_count": [8, 16], ...}``.
    A key without a section is the task's; each value is read as JSON, else kept as text."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        name = name.strip()
        if not sep or not name or not values.strip():
            raise FleetConfigError(f"--sweep {item!r}: write KEY=V1,V2 (e.g. goal_count=8,16 or fleet.devices=100,200)")
        key = name if "." in name else f"task.{name}"
        if key in grid:  # the later one replaced the earlier, its runs dropped unsaid
            raise FleetConfigError(
                f"--sweep {item!r}: {key} is swept twice; give its values in one --sweep, as {name}=V1,V2,V3"
            )
        grid[key] = _values(values)
        if "" in grid[key]:
            raise FleetConfigError(
                f"--sweep {item!r}: a value is empty; write KEY=V1,V2 with no empty value between commas"
            )
        seen = [json.dumps(v, sort_keys=True) for v in grid[key]]
        twice = [v for i, v in enumerate(seen) if v in seen[:i]]
        if twice:  # the same run twice, which --seeds refuses too
            raise FleetConfigError(f"--sweep {item!r}: {twice[0]} is given twice; name each value once")
    return grid


def _values(text: str) -> list[Any]:
    """``V1,V2,...``, each value JSON where it reads as JSON (so ``[64,32],[128]`` is two lists),
    else the text up to the next comma."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while True:
        while text[i : i + 1].isspace():
            i += 1
        try:
            value, end = decoder.raw_decode(text, i)
            if text[end:].lstrip()[:1] not in ("", ","):
                raise ValueError("more follows before the comma")
        except ValueError:
            end = text.find(",", i)
            end = len(text) if end < 0 else end
            value = text[i:end].strip()
        out.append(value)
        end = text.find(",", end)
        if end < 0:
            return out
        i = end + 1


def sweep_configs(
    base: FleetConfig, *, seeds: Sequence[int] | None = None, grid: Mapping[str, Sequence[Any]] | None = None
) -> list[tuple[dict[str, Any], FleetConfig]]:
    """Every combination of ``seeds`` and the ``grid``'s values (dotted config keys), each with
    the parameters that made it; an unknown key or a bad value is refused by name."""
    axes: dict[str, Sequence[Any]] = {}
    if seeds:
        axes["fleet.seed"] = list(seeds)
        if "fleet.seed" in (grid or {}):
            raise FleetConfigError("--sweep fleet.seed and --seeds both give the seeds; give them once, with --seeds")
    axes.update(grid or {})
    out = []
    for combo in itertools.product(*axes.values()):
        params = dict(zip(axes, combo))
        data = base.dump()  # only the keys that were set, so a swept [task] key is set and the others stay unset
        full = base.model_dump(mode="json")
        for key, value in params.items():
            *path, last = key.split(".")
            node, model = data, full
            for depth, part in enumerate(path):
                if not isinstance(model, dict) or part not in model or not isinstance(model[part], dict):
                    sections = [".".join([*path[:depth], k]) for k, v in model.items() if isinstance(v, dict)]
                    meant = did_you_mean(".".join(path[: depth + 1]), sections)
                    raise FleetConfigError(f"--sweep {key}: the config has no section {part!r}{meant}")
                node, model = node.setdefault(part, {}), model[part]
            if not isinstance(model, dict) or last not in model:
                fields = [".".join([*path, k]) for k, v in model.items() if not isinstance(v, dict | list)]
                elsewhere = [f for f in _fields(full) if f.rsplit(".", 1)[-1] == last]  # hours: fleet.hours
                meant = f" (did you mean {elsewhere[0]}?)" if len(elsewhere) == 1 else did_you_mean(key, fields)
                raise FleetConfigError(
                    f"--sweep {key}: the config has no such field{meant}; examples/fleets/default.toml lists the fields"
                )
            node[last] = value
        said = ", ".join(f"{key}={json.dumps(value)}" for key, value in params.items())
        out.append((params, FleetConfig.from_dict(data, source=f"--sweep {said}")))
    return out


def _fields(table: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted key of every field of ``table`` that holds a value (not a table nor a list)."""
    out = []
    for key, value in table.items():
        if isinstance(value, Mapping):
            out.extend(_fields(value, f"{prefix}{key}."))
        elif not isinstance(value, list):
            out.append(f"{prefix}{key}")
    return out


def _run_one(data: dict[str, Any], out_dir: str | None) -> dict[str, Any]:
    from .simulator import simulate

    run = simulate(FleetConfig.from_dict(data), out_dir=out_dir, progress=False)
    return run.summary()


def run_many(
    configs: Sequence[FleetConfig],
    *,
    ray: bool = True,
    address: str | None = None,
    out_dirs: Sequence[str | Path | None] | None = None,
    task_cpus: float = 1.0,
) -> list[dict[str, Any]]:
    """Independent runs, one Ray task each (or one after another here with ``ray=False``); their
    summaries in the order of ``configs``. Each equals the same config run alone."""
    dirs = [None if d is None else str(d) for d in (out_dirs or [None] * len(configs))]
    payload = [c.dump() for c in configs]
    if not ray:
        return [_run_one(data, d) for data, d in zip(payload, dirs)]
    module = ensure_ray(address)
    task = module.remote(num_cpus=task_cpus)(_run_one)
    return module.get([task.remote(data, d) for data, d in zip(payload, dirs)])
