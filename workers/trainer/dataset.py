"""`ExperienceDataset`: finalized groups as a torch `IterableDataset` of `TensorDict` batches.

Use it with `batch_size=None` (each item is a batch already), `num_workers=0` (the Kafka consumer
lives in the trainer's process) and `collate_fn=keep_batch` (torch's default would take a TensorDict
for a dict of fields and index it by its rows); `stateful_loader` builds exactly that.

A batch counts as trained when the next one is asked for or when `state_dict()` is taken, which is
when torchdata's `StatefulDataLoader` takes it (after the training step); so the state saved in a
checkpoint covers exactly the batches trained before it.

    loader = stateful_loader(dataset)  # StatefulDataLoader(dataset, batch_size=None, num_workers=0, ...)
    ...
    state = loader.state_dict()        # inside the model checkpoint
    save(model, optimizer, state)
    dataset.checkpoint_durable(state)  # rows it covers are cleared, offsets committed

Each batch carries its groups' ids, weight versions and staleness as non-tensor entries.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from tensordict import TensorDict
from torch.utils.data import IterableDataset

from schemas.errors import InvalidArgument
from workers.trainer.batch import BatchMeta, Layout
from workers.trainer.consumer import WITHDRAWN, ExperienceConsumer

# Where torchdata's StatefulDataLoader (num_workers=0) keeps its dataset's state.
_LOADER_DATASET_KEY = "dataset_state"


def keep_batch(batch: TensorDict) -> TensorDict:
    return batch


def stateful_loader(dataset: ExperienceDataset):
    """torchdata's `StatefulDataLoader` over `dataset`, set up as the dataset needs (torchdata installed)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(dataset, batch_size=None, num_workers=0, collate_fn=keep_batch)


class ExperienceDataset(IterableDataset):
    """Batches of `min_groups`..`max_groups` prompt groups usable at `version()`, as TensorDicts.

    `version` returns the trainer's current weight version; `stop` ends the iteration when it
    returns True while no batch is ready (default: never).
    """

    def __init__(
        self,
        consumer: ExperienceConsumer,
        version: Callable[[], int],
        *,
        min_groups: int,
        max_groups: int | None = None,
        fields: Sequence[str] | None = None,
        layout: Layout = "padded",
        poll_s: float = 1.0,
        stop: Callable[[], bool] = lambda: False,
    ):
        super().__init__()
        self.consumer = consumer
        self._version = version
        self._min, self._max = min_groups, max_groups or min_groups
        self._fields, self._layout = fields, layout
        self._poll_s, self._stop = poll_s, stop
        self._last: BatchMeta | None = None

    def __iter__(self) -> Iterator[TensorDict]:
        while True:
            self._settle()
            meta = self.consumer.select(self._version(), self._min, self._max, timeout_s=self._poll_s)
            if meta is None:
                if self._stop():
                    return
                continue
            try:
                batch = self.consumer.materialize(meta, self._fields, self._layout)
            except WITHDRAWN:  # the consumer took the batch back: select again
                continue
            batch.set_non_tensor("group_ids", [g.group_id for g in meta.groups])
            batch.set_non_tensor("weight_versions", list(meta.weight_versions))
            batch.set_non_tensor("staleness", meta.staleness)
            self._last = meta
            yield batch

    def _settle(self) -> None:
        if self._last is not None:
            meta, self._last = self._last, None
            self.consumer.ack(meta)

    def state_dict(self) -> dict[str, Any]:
        """The consumer's state with the last batch handed out counted as trained."""
        self._settle()
        return self.consumer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.consumer.load_state_dict(dict(state))

    def checkpoint_durable(self, state: Mapping[str, Any]) -> None:
        """`state` from `state_dict()`, or a StatefulDataLoader's state holding it, is safely stored."""
        inner = state.get(_LOADER_DATASET_KEY, state)
        if not isinstance(inner, Mapping):
            raise InvalidArgument(f"checkpoint_durable: {_LOADER_DATASET_KEY!r} of the loader state is no dict")
        self.consumer.checkpoint_durable(dict(inner))
