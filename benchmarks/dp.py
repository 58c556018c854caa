"""Distributed differential privacy's cost beside Secure Aggregation's, and DP's cost in accuracy.

Device: ``device_runtime.ddp.encode`` (clip, rotate, scale and round conditionally, add the
discrete Gaussian share, reduce mod 2^bitwidth) as a device runs it (``encoder``: the compiled
kernel, ``device_runtime.ddp_kernel``, where the install built it, else numpy), beside its numpy
path with each of that path's stages timed alone, and the compiled kernel's transform, uniforms and
normals alone, for 1e5 and 1e6 parameters, against the Secure Aggregation masking of the same encoded vector in the same run: a
real group of the smallest size a secure round forms (``secagg_group_size`` 5 plus the one spare the
server adds, so 6 clients on the complete graph: ``secagg_target_group_size`` 6; at the default of
100 each device expands some 100 masks, so 6 is the goal's hardest case) runs the whole protocol in process, and each client's
MaskedInput handler (its self-mask and one pairwise mask per peer, AES-CTR expansions of the
vector, plus the signature) is the masking time. Goal: encode <= 1.0x masking. The DDP parameters
are the task defaults (``DPConfig``: bitwidth 32, so the modulus 2^32 is the secure sum's too)
calibrated for noise multiplier 1 and clip 1, for sums of 5 to 11 devices (a group of 6 that may
lose its spare; ``assign_groups`` never makes one of 12 or more from groups of 6).

Server: ``ddp.decode`` of the group's modular sum (signed, divided by gamma, unrotated) against the
server's Unmasking round of the same group (rebuilding the self-masks and removing them).

Accuracy (not with ``--quick``; ``--accuracy`` runs only it): the built-in digits task's test
accuracy after a simulated day of 10,000 devices (``--devices``/``--hours`` for a smaller one) with
central DP at epsilon 1, 4 and 8 (delta 1e-5, no amplification by sampling), beside the same day
without DP. The day without DP says how many rounds commit; each target's noise multiplier is the
smallest whose epsilon after that many rounds stays within the target
(``server_stub.accounting.rounds_within``), and the target is also the task's ``max_epsilon``, so the
day ends at most at it.

Timings are the fastest of several repetitions (a shared machine's load only ever adds), with
BLAS held to one thread as on a phone's single training thread (env vars set before numpy loads).

    python -m benchmarks.dp [--quick | --accuracy [--devices N --hours H]] [--dims 100000,1000000]

Prints one JSON object per line; the last is the summary with the targets.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import numpy as np  # noqa: E402

from device_runtime import ddp, ddp_kernel  # noqa: E402
from secagg import Round, SecAggClient, SecAggConfig, SecAggServer  # noqa: E402
from secagg.graphs import complete_graph_threshold  # noqa: E402

#: The fleet's secure groups: ``TaskSection.secagg_group_size`` (5) and the server's one spare.
GROUP_MIN = 5
GROUP_SPARE = 1
GROUP = GROUP_MIN + GROUP_SPARE
#: The most devices one group's sum may hold: ``assign_groups`` splits n devices into n // 6
#: groups, so a group has at most 2 * 6 - 1 members.
GROUP_MAX = 2 * GROUP - 1
BITWIDTH = 32  # DPConfig's default
NOISE_MULTIPLIER = 1.0
CLIP = 1.0
DIMS = (100_000, 1_000_000)
GOAL_ENCODE_OVER_MASKING = 1.0


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _fastest(fn: Callable[[], object], reps: int, setup: Callable[[], object] | None = None) -> float:
    """The fastest of ``reps`` timed calls, after one untimed warm-up (``setup`` runs untimed before
    each call)."""
    if setup is not None:
        setup()
    fn()
    best = float("inf")
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def ddp_params(dim: int) -> ddp.DDPParams:
    return ddp.calibrate(
        noise_multiplier=NOISE_MULTIPLIER,
        clip=CLIP,
        dim=dim,
        bitwidth=BITWIDTH,
        min_devices=GROUP_MIN,
        max_devices=GROUP_MAX,
    )


def encode_costs(params: ddp.DDPParams, update: np.ndarray, reps: int, seed: int) -> dict:
    """The encode a device runs (``encode_s``), its numpy path whole (``numpy_encode_s``) and stage
    by stage (``stages_s``), and the compiled kernel's parts alone (``compiled_parts_s``), on the
    same update (seconds, fastest of ``reps``).

    The numpy stages are the numpy path's own steps (``ddp``'s private helpers, called as ``encode`` calls
    them), so that ``stages_sum_s`` (clip + rotate_and_round + noise_and_mod) is the encode: ``clip``
    the norm and the clip factor; ``rotate`` the padding, the signs (``signs`` alone) and the
    transform with clip, gamma and normalization in its scalar; ``rotate_and_round`` the same with
    the first rounding attempt done block by block in it (what ``encode`` runs; ``round`` is one
    attempt over the whole vector alone, for comparison); ``noise_and_mod`` the Gaussian draws
    (``normals`` alone), their rounding, the sum with the rounded vector, the int64 conversion and
    the modulus."""
    rng = np.random.default_rng(seed)
    gen = ddp._private_generator(rng)
    x = np.asarray(update, dtype=np.float64)
    scale = ddp._clip_factor(x, params.clip) * params.gamma
    y = ddp._rotate_vector(x, seed, scale)
    spare = np.empty_like(y)
    rounded = ddp._round_conditionally(y, params.sensitivity, gen, ddp.DEFAULT_MAX_ROUNDING_TRIES, spare).copy()
    std = float(np.sqrt(params.local_variance))
    scratch = np.empty_like(rounded)
    stages = {
        "clip": _fastest(lambda: ddp._clip_factor(x, params.clip), reps),
        "signs": _fastest(lambda: ddp._negated_signs(seed, params.padded_dim), reps),
        "rotate": _fastest(lambda: ddp._rotate_vector(x, seed, scale), reps),
        "round": _fastest(
            lambda: ddp._round_conditionally(y, params.sensitivity, gen, ddp.DEFAULT_MAX_ROUNDING_TRIES, spare), reps
        ),
        "rotate_and_round": _fastest(lambda: ddp._rotate_vector(x, seed, scale, ddp._BlockRounding(gen)), reps),
        "normals": _fastest(lambda: gen.standard_normal(out=scratch), reps),
        "noise_and_mod": _fastest(
            lambda: ddp._add_rounded_gaussian(scratch, std, gen, params.modulus - 1),
            reps,
            setup=lambda: np.copyto(scratch, rounded),
        ),
    }
    numpy_total = _fastest(lambda: ddp.encode(update, params, seed, rng, native=False), reps)
    kernel = ddp_kernel.available()
    compiled = kernel is not None and ddp.native_covers(params)
    total = _fastest(lambda: ddp.encode(update, params, seed, rng), reps) if compiled else numpy_total
    parts = ("clip", "rotate_and_round", "noise_and_mod")
    out = {
        "encoder": "compiled" if compiled else "numpy",
        "encode_s": total,
        "numpy_encode_s": numpy_total,
        "stages_s": stages,
        "stages_sum_s": sum(stages[k] for k in parts),
    }
    if kernel is not None:
        state = ddp_kernel.new_state(rng)
        pd = params.padded_dim
        out["compiled_parts_s"] = {
            "transform": _fastest(lambda: kernel.fwht(x, pd, scale), reps),
            "uniforms": _fastest(lambda: kernel.uniforms(state, pd), reps),
            "normals": _fastest(lambda: kernel.normals(state, pd), reps),
        }
    return out


def secure_group(params: ddp.DDPParams, updates: list[np.ndarray], seed: int) -> dict:
    """One Secure Aggregation group of ``len(updates)`` clients summing the updates' encodings,
    complete graph, modulus 2^bitwidth: each client's MaskedInput handler time, the server's
    Unmasking time, the decode time and whether the decoded sum is the clipped updates' sum
    within the noise."""
    n = len(updates)
    config = SecAggConfig(
        params.padded_dim,
        params.modulus,
        complete_graph_threshold(n),
        session_label=b"benchmarks.dp",
        min_summed=GROUP_MIN,
    )
    rng = np.random.default_rng(seed)
    encodings = [ddp.encode(u, params, seed, rng) for u in updates]
    ids = list(range(1, n + 1))
    server = SecAggServer(config, ids)
    clients = {u: SecAggClient(u, config) for u in ids}
    outbox = {u: c.start() for u, c in clients.items()}
    masking: list[float] = []
    unmasking = 0.0
    while not server.round.terminal:
        closing = server.round
        t0 = time.perf_counter()
        for u, data in outbox.items():
            server.receive(u, data)
        incoming = server.close_round()
        if closing is Round.UNMASKING:
            unmasking = time.perf_counter() - t0
        outbox = {}
        for u, data in incoming.items():
            if server.round is Round.MASKED_INPUT_COLLECTION:
                clients[u].set_input(encodings[u - 1])
                t0 = time.perf_counter()
                reply = clients[u].handle(data)
                masking.append(time.perf_counter() - t0)
            else:
                reply = clients[u].handle(data)
            if reply is not None:
                outbox[u] = reply
    if server.round is not Round.COMPLETED:
        raise RuntimeError(f"the secure group aborted: {server.abort_reason}")
    total = np.asarray(server.result(), dtype=np.int64)
    decode_s = _fastest(lambda: ddp.decode(total, params, seed, n), 3)
    decoded = ddp.decode(total, params, seed, n)
    expected = np.sum([ddp.clip_l2(u, params.clip) for u in updates], axis=0)
    # the noise on each coordinate has std central_std(n): the error's norm is about sqrt(dim) of it
    error = float(np.linalg.norm(decoded - expected))
    bound = 2.0 * params.central_std(n) * np.sqrt(params.padded_dim) + n * np.sqrt(params.padded_dim) / params.gamma
    return {
        "client_masked_input_s": min(masking),
        "client_masked_input_s_mean": float(np.mean(masking)),
        "server_unmasking_s": unmasking,
        "server_decode_s": decode_s,
        "correct": error <= bound,
    }


def device_and_server(dim: int, reps: int, groups: int, seed: int) -> dict:
    params = ddp_params(dim)
    rng = np.random.default_rng([seed, dim])
    updates = [rng.normal(0.0, 1.0, dim) * (0.5 + i / GROUP) / np.sqrt(dim) for i in range(GROUP)]
    enc = encode_costs(params, updates[0], reps, seed)
    runs = [secure_group(params, updates, seed + g) for g in range(groups)]
    masking = min(r["client_masked_input_s"] for r in runs)
    unmasking = min(r["server_unmasking_s"] for r in runs)
    decode_s = min(r["server_decode_s"] for r in runs)
    return {
        "case": f"dim_{dim}",
        "dim": dim,
        "padded_dim": params.padded_dim,
        "group": GROUP,
        "bitwidth": params.bitwidth,
        "gamma": params.gamma,
        "inflation": params.inflation,
        "mechanism": params.mechanism,
        **enc,
        "client_masked_input_s": masking,
        "encode_over_masking": enc["encode_s"] / masking,
        "server_unmasking_s": unmasking,
        "server_decode_s": decode_s,
        "decode_over_unmasking": decode_s / unmasking,
        "correct": all(r["correct"] for r in runs),
    }


ACCURACY_EPSILONS = (1.0, 4.0, 8.0)
ACCURACY_DELTA = 1e-5
#: The clip of the digits MLP's updates (weights after minus before): below the median update norm of
#: the default task's devices at the initial model (measured 2.0; p10-p90 1.4-2.8), so clipping binds
#: from the start and every device moves the sum by the same 1.0 at most.
ACCURACY_CLIP = 1.0


def noise_for(target: float, rounds: int, delta: float) -> float:
    """The smallest noise multiplier whose epsilon after ``rounds`` rounds stays within ``target``
    (bisection on ``rounds_within``, to 0.1%)."""
    from server_stub.accounting import rounds_within

    lo, hi = 1e-3, 1.0
    while rounds_within(target, hi, delta) < rounds:
        lo, hi = hi, hi * 2.0
    while hi / lo > 1.001:
        mid = (lo * hi) ** 0.5
        if rounds_within(target, mid, delta) >= rounds:
            hi = mid
        else:
            lo = mid
    return hi


def day(devices: int, hours: float, seed: int, dp: dict | None) -> dict:
    """One simulated day of the built-in digits task (with ``dp``: the ``[dp]`` keys)."""
    from emulator.fleet import FleetConfig, simulate

    config = FleetConfig.default().replace(devices=devices, hours=hours, seed=seed, dp=dp)
    started, cpu0 = time.perf_counter(), time.process_time()
    summary = simulate(config, progress=False).summary()
    return {
        "devices": devices,
        "hours": hours,
        "wall_s": round(time.perf_counter() - started, 1),
        "cpu_s": round(time.process_time() - cpu0, 1),
        **{
            k: summary[k]
            for k in ("rounds", "rounds_committed", "accuracy", "epsilon", "delta", "dp_rounds", "noise_multiplier")
        },
    }


def accuracy_at_epsilons(devices: int, hours: float, seed: int) -> list[dict]:
    """The day without DP, then one day per target epsilon (see the module docstring)."""
    base = {"case": "accuracy_no_dp", **day(devices, hours, seed, None)}
    rows = [base]
    rounds = max(1, int(base["rounds_committed"]))
    for target in ACCURACY_EPSILONS:
        z = noise_for(target, rounds, ACCURACY_DELTA)
        dp = {
            "mode": "central",
            "noise_multiplier": z,
            "clip": ACCURACY_CLIP,
            "delta": ACCURACY_DELTA,
            "max_epsilon": target,
        }
        rows.append({"case": f"accuracy_epsilon_{target:g}", "target_epsilon": target, **day(devices, hours, seed, dp)})
    return rows


def _dims(text: str) -> tuple[int, ...]:
    """``--dims``: positive parameter counts, comma-separated."""
    try:
        dims = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--dims takes comma-separated whole numbers, got {text!r}") from None
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"--dims takes one or more positive counts, got {text!r}")
    return dims


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="costs only: fewer repetitions, one secure group per size")
    mode.add_argument("--accuracy", action="store_true", help="only the accuracy at epsilon 1, 4 and 8")
    parser.add_argument("--devices", type=int, default=10_000, help="the accuracy days' devices (default 10,000)")
    parser.add_argument("--hours", type=float, default=24.0, help="the accuracy days' length (default 24)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dims",
        type=_dims,
        default=DIMS,
        help="comma-separated parameter counts of the cost part (default 100000,1000000; fewer are quicker, for tests)",
    )
    args = parser.parse_args(argv)
    machine = {"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count()}
    _emit({"machine": machine, "python": platform.python_version(), "numpy": np.__version__})
    rows: dict[str, dict] = {}
    if not args.accuracy:
        for dim in args.dims:
            row = device_and_server(dim, reps=3 if args.quick else 9, groups=1 if args.quick else 3, seed=args.seed)
            rows[row["case"]] = row
            _emit(row)
    accuracy: dict[str, dict] = {}
    if not args.quick:
        for row in accuracy_at_epsilons(args.devices, args.hours, args.seed):
            accuracy[row["case"]] = row
            _emit(row)
    targets = {
        f"{case}_encode_over_masking": {
            "value": row["encode_over_masking"],
            "goal": GOAL_ENCODE_OVER_MASKING,
            "met": row["correct"] and row["encode_over_masking"] <= GOAL_ENCODE_OVER_MASKING,
        }
        for case, row in rows.items()
    }
    _emit(
        {
            "summary": True,
            "quick": args.quick,
            "targets": targets,
            "server_decode_over_unmasking": {case: row["decode_over_unmasking"] for case, row in rows.items()},
            "all_correct": all(row["correct"] for row in rows.values()),
            "encoder": sorted({row["encoder"] for row in rows.values()}),
            "accuracy": {
                case: {k: row[k] for k in ("accuracy", "epsilon", "noise_multiplier", "rounds_committed")}
                for case, row in accuracy.items()
            },
        }
    )


if __name__ == "__main__":
    main()
