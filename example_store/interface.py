"""The interface apps implement to hand training examples to the FL runtime.

The runtime only ever reads through a selector, streaming, so a store never has to hold a whole
collection in memory. Iterators are closable because a training session can be interrupted at
any time (the phone is unplugged) and must give its cursor back at once.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from types import TracebackType

import numpy as np

from .codec import Example
from .errors import InvalidArgumentError, ResumptionNotSupportedError
from .selector import ExampleSelector


class ExampleIterator(Iterator[Example], abc.ABC):
    """An iterator of examples (or of batches) that holds a resource until closed.

    ``close()`` is idempotent and also happens at exhaustion; use it as a context manager to close
    early. Implementations must not hold locks between ``__next__`` calls."""

    def __iter__(self) -> ExampleIterator:
        return self

    @abc.abstractmethod
    def __next__(self) -> Example: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def resumption_token(self) -> str:
        """An opaque token of the position after the last example (or batch) returned so far,
        valid during and after iteration (also after ``close()``). Pass it as
        ``ExampleSelector(..., resume_after=token)`` to continue strictly after that example, in the
        same order, in a later session. Before anything was returned it resumes where this
        iterator started. Stores that cannot resume raise :class:`ResumptionNotSupportedError`."""
        raise ResumptionNotSupportedError(
            f"{type(self).__name__} does not issue resumption tokens; implement resumption_token() in "
            f"the app's example store (example_store.ResumptionTokens helps) or read without resume_after"
        )

    def __enter__(self) -> ExampleIterator:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _BatchingIterator(ExampleIterator):
    """Stacks the examples of any ExampleIterator into batches: the generic query_batches."""

    def __init__(self, examples: ExampleIterator, batch_size: int) -> None:
        self._examples = examples
        self._batch_size = batch_size

    def __next__(self) -> dict[str, np.ndarray]:
        batch: list[Example] = []
        for example in self._examples:
            batch.append(example)
            if len(batch) == self._batch_size:
                break
        if not batch:
            self.close()
            raise StopIteration
        return {name: np.stack([ex[name] for ex in batch]) for name in batch[0]}

    def close(self) -> None:
        self._examples.close()

    def resumption_token(self) -> str:
        # Batches are built from exactly the examples pulled, so the inner position is the batch's.
        return self._examples.resumption_token()


def check_batch_size(batch_size: int) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be a positive int, got {batch_size!r}")
    return batch_size


class ExampleStore(abc.ABC):
    """What an app registers with the FL runtime: read access to its examples by selector."""

    @abc.abstractmethod
    def query(self, selector: ExampleSelector) -> ExampleIterator:
        """Streams the selected examples in the selector's order (strictly after
        ``selector.resume_after`` when it is set)."""

    @abc.abstractmethod
    def count(self, selector: ExampleSelector) -> int:
        """How many examples ``query(selector)`` would yield now (limit included)."""

    def query_batches(self, selector: ExampleSelector, batch_size: int) -> ExampleIterator:
        """Streams the selection as dicts of stacked arrays with a leading batch dimension of
        ``batch_size`` (the last batch may be smaller). Override it when the store can decode
        whole batches faster than example by example."""
        return _BatchingIterator(self.query(selector), check_batch_size(batch_size))

    def close(self) -> None:  # noqa: B027 - a no-op default, not abstract: most stores hold nothing to release
        """Releases the store's resources; the default has none."""

    def __enter__(self) -> ExampleStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
