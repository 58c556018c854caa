"""How a device's examples become the plan's batches: chunks of examples (any size) are checked
for the tensors the plan feeds, shuffled through a bounded buffer, and cut into batches of the
plan's batch size. Memory stays bounded by the buffer plus one chunk, whatever the size of the
collection.

The buffer is the plan's ``shuffle_buffer``, but never more examples than fit in the device's
share of its memory for examples (``examples_share``: an eighth of its ``DeviceClass.memory_mb``,
``SHUFFLE_MAX_BYTES`` for a default device) at the largest size per example read so far: a hostile
plan's buffer of 10^9 examples would otherwise hold every example of the collection at once. The
bound depends only on the examples read and the device's memory, so the batches stay a function of
the plan's seed and the device's data; an honest plan's buffer (1,024 examples by default) is
below it and shuffles as it always did.

Examples are counted at the bytes they hold (``held_bytes``): an array of Python objects (strings,
bytes) holds its objects as well as the pointers its ``nbytes`` counts."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np

from .plan import DeviceConfig, PlanError

#: The part of a device's memory its examples may take at once, whatever the plan asks: its shuffle
#: buffer, and one batch (``examples_share``).
EXAMPLES_MEMORY_FRACTION = 8


def examples_share(memory_mb: float) -> int:
    """The most bytes of examples a device of ``memory_mb`` holds at once for a plan: in its shuffle
    buffer, and in one batch (an eighth of its memory)."""
    return int(memory_mb * (1 << 20)) // EXAMPLES_MEMORY_FRACTION


#: The most bytes of examples a plan's shuffle buffer holds on a default ``DeviceClass`` (2,048
#: MB), whatever the plan asks: 1,024 images of 224 x 224 x 3 bytes take 147 MiB. Counted from
#: the largest size per example of the chunks read so far.
SHUFFLE_MAX_BYTES = examples_share(2048)


def held_bytes(value: np.ndarray) -> int:
    """The bytes ``value`` holds: its ``nbytes``, and for an array of Python objects (strings,
    bytes, arrays) each object's own size too, which ``nbytes`` (a pointer each) leaves out."""
    if value.dtype.kind != "O":
        return int(value.nbytes)
    return int(value.nbytes) + sum(map(sys.getsizeof, value.flat))


def chunk_bytes(chunk: Mapping[str, np.ndarray]) -> int:
    """The bytes a chunk of examples holds (``held_bytes`` of each of its arrays)."""
    return sum(held_bytes(v) for v in chunk.values())


def batches_from_examples(
    device: DeviceConfig,
    open_examples: Callable[[], Iterable[Mapping[str, np.ndarray]]],
    *,
    batched: bool = True,
    max_held_bytes: int = SHUFFLE_MAX_BYTES,
) -> Callable[[], Iterator[dict[str, np.ndarray]]]:
    """The ``open_batches`` callable ``PlanExecutor.run_device`` takes, over a source of examples
    (see ``PlanExecutor.batches_from_examples``); the shuffle holds at most ``max_held_bytes`` of
    examples, whatever the plan's ``shuffle_buffer``."""
    keys = list(dict.fromkeys(device.inputs.values()))
    epoch = [0]
    seed = device.shuffle_seed

    def open_batches() -> Iterator[dict[str, np.ndarray]]:
        if seed is None:
            rng = np.random.default_rng()
        else:
            rng = np.random.Generator(np.random.PCG64(_epoch_seeds(seed, epoch[0])))
        epoch[0] += 1
        chunks = _chunks(open_examples(), keys, batched)
        if device.shuffle_buffer > 1:
            chunks = _shuffle(chunks, rng, device.shuffle_buffer, max_held_bytes)
        return _rebatch(chunks, keys, device.batch_size)

    return open_batches


@functools.lru_cache(maxsize=256)
def _epoch_seeds(seed: int, epoch: int) -> np.random.SeedSequence:
    """The seed sequence ``default_rng([seed, epoch])`` would hash, so shuffles stay those of
    earlier runtimes: the same for every device of a plan, so hashed once (hashing it took a
    quarter of the data pipeline's time in a simulated day of 10,000 devices)."""
    return np.random.SeedSequence([seed, epoch])


def _chunks(
    source: Iterable[Mapping[str, np.ndarray]], keys: list[str], batched: bool
) -> Iterator[dict[str, np.ndarray]]:
    for item in source:
        missing = [k for k in keys if k not in item]
        if missing:
            raise PlanError(f"examples have no tensor(s) {missing} (keys {sorted(item)})")
        chunk = {k: np.asarray(item[k]) for k in keys}
        if not batched:
            chunk = {k: v[None, ...] for k, v in chunk.items()}
        sizes = {v.shape[0] if v.ndim else -1 for v in chunk.values()}
        if len(sizes) != 1 or -1 in sizes:
            raise PlanError(
                f"example tensors disagree on the number of examples in a chunk: { {k: v.shape for k, v in chunk.items()} }"
            )
        if sizes.pop() > 0:
            yield chunk


def _take(chunk: dict[str, np.ndarray], idx: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v[idx] for k, v in chunk.items()}


def _size(chunk: dict[str, np.ndarray]) -> int:
    return next(iter(chunk.values())).shape[0]


def _shuffle(
    chunks: Iterator[dict], rng: np.random.Generator, capacity: int, max_bytes: int = SHUFFLE_MAX_BYTES
) -> Iterator[dict[str, np.ndarray]]:
    # The pool is the chunks read since it last overflowed, joined only when it does (or at the
    # end): joining each small chunk as it came copied the pool once per chunk.
    parts: list[dict[str, np.ndarray]] = []
    size = 0
    widest = 0  # the most bytes per example of any chunk read
    for chunk in chunks:
        parts.append(chunk)
        n = _size(chunk)
        size += n
        per_example = -(-chunk_bytes(chunk) // n)
        if per_example > widest:
            widest = per_example
            capacity = min(capacity, max(1, max_bytes // widest))
        if size > capacity:
            pool = join_chunks(parts)
            perm = rng.permutation(size)
            yield _take(pool, perm[: size - capacity])
            parts, size = [_take(pool, perm[size - capacity :])], capacity
    if size:
        yield _take(join_chunks(parts), rng.permutation(size))


def join_chunks(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The examples of ``parts`` (chunks of the same tensors) in one chunk, in order."""
    if len(parts) == 1:
        return parts[0]
    joined = {}
    for k in parts[0]:
        try:
            joined[k] = np.concatenate([p[k] for p in parts])
        except ValueError:  # numpy's words name no tensor: sequences of varied length in one store, say
            seen = list(dict.fromkeys(p[k].shape[1:] for p in parts))
            shapes = " and ".join(str(s) for s in seen[:3]) + (f" and {len(seen) - 3} more" if len(seen) > 3 else "")
            raise PlanError(
                f"example tensor {k!r} holds examples of shape {shapes}, which no batch stacks; store its examples "
                "at one shape (pad sequences to one length)"
            ) from None
    return joined


def _rebatch(chunks: Iterator[dict], keys: list[str], batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    pending: dict[str, np.ndarray] | None = None
    for chunk in chunks:
        pending = chunk if pending is None else join_chunks([pending, chunk])
        size = _size(pending)
        if size < batch_size:
            continue
        full = size - size % batch_size
        for start in range(0, full, batch_size):
            yield {k: v[start : start + batch_size] for k, v in pending.items()}
        pending = {k: v[full:] for k, v in pending.items()} if full < size else None
    if pending is not None and _size(pending):
        yield pending
