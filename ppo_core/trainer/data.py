"""A small stateful prompt loader whose position (epoch, batch) is checkpointable.

The order of an epoch depends only on ``(seed, epoch)``, so the state is two integers. A state taken right after
the last batch of an epoch is stored as "start of the next epoch": restoring it can never yield an exhausted
iterator that trains zero steps (in verl, a dataloader state saved at an epoch boundary resumes with zero
steps).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict

__all__ = ["PromptDataLoader", "collate_prompts"]


def collate_prompts(items: Sequence[Mapping[str, Any]], pad_token_id: int = 0) -> TensorDict:
    """Left-pad the ``input_ids`` of ``items`` into a batch; other fields ride along as non-tensor fields.

    Args:
        items: mappings with ``input_ids`` (a 1-D int sequence or tensor, at least one token) and optionally
            ``ground_truth``, ``data_source`` (default ``"unknown"``) and any other per-prompt values.
        pad_token_id: id written into the left padding.

    Returns:
        TensorDict with ``batch_size=[B]``: ``input_ids`` [B, P] and ``attention_mask`` [B, P] (int64, 0 on the
        left padding), plus one non-tensor field per other key.

    Example:
        >>> td = collate_prompts([{"input_ids": [5, 6]}, {"input_ids": [7]}])
        >>> td["input_ids"].tolist(), td["attention_mask"].tolist(), td.get("data_source").tolist()
        ([[5, 6], [0, 7]], [[1, 1], [0, 1]], ['unknown', 'unknown'])
    """
    if not items:
        raise ValueError("items must hold at least one prompt")
    ids = []
    for i, item in enumerate(items):
        if "input_ids" not in item:
            raise KeyError(f"item {i} has no 'input_ids'")
        row = torch.as_tensor(item["input_ids"], dtype=torch.long).reshape(-1)
        if row.numel() == 0:
            raise ValueError(f"item {i} has an empty 'input_ids'")
        ids.append(row)
    width = max(r.numel() for r in ids)
    input_ids = torch.full((len(ids), width), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, width - row.numel() :] = row
        attention_mask[i, width - row.numel() :] = 1
    td = TensorDict({"input_ids": input_ids, "attention_mask": attention_mask}, batch_size=[len(ids)])
    keys = {k for item in items for k in item if k != "input_ids"} | {"data_source"}
    for key in sorted(keys):
        default = "unknown" if key == "data_source" else None
        td.set(key, NonTensorStack.from_list([item.get(key, default) for item in items]))
    return td


class PromptDataLoader:
    """Batches of prompts, reshuffled each epoch; ``state_dict()`` captures the position exactly.

    Args:
        dataset: a sequence of prompt mappings (see :func:`collate_prompts`).
        batch_size: prompts per batch.
        drop_last: drop the incomplete last batch of an epoch (training); False keeps it (validation).
        shuffle: draw a new permutation per epoch from ``numpy.random.default_rng((seed, epoch))``.
        seed: the shuffling seed.
        collate_fn: turns a list of items into a batch (default :func:`collate_prompts` with ``pad_token_id``).

    Example:
        >>> loader = PromptDataLoader([{"input_ids": [i + 1]} for i in range(5)], batch_size=2, shuffle=False)
        >>> len(loader), [b["input_ids"].flatten().tolist() for b in loader]
        (2, [[1, 2], [3, 4]])
        >>> loader.state_dict()
        {'epoch': 1, 'position': 0}
    """

    def __init__(
        self,
        dataset: Sequence[Mapping[str, Any]],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        pad_token_id: int = 0,
        collate_fn: Callable[[Sequence[Mapping[str, Any]]], TensorDict] | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.collate_fn = collate_fn or (lambda items: collate_prompts(items, pad_token_id))
        self.epoch = 0
        self.position = 0
        self.last_indices: np.ndarray | None = None
        """The dataset indices of the batch yielded last (:attr:`last_batch`), in its row order (a resident step
        sends these instead of the prompts)."""
        self.last_batch: TensorDict | None = None
        """The batch yielded last."""

    def __len__(self) -> int:
        """Batches per epoch."""
        if self.drop_last:
            return len(self.dataset) // self.batch_size
        return -(-len(self.dataset) // self.batch_size)

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def __iter__(self) -> Iterator[TensorDict]:
        """The remaining batches of the current epoch; afterwards the loader points at the next epoch."""
        epoch = self.epoch
        order = self._order(epoch)
        while self.epoch == epoch and self.position < len(self):
            start = self.position * self.batch_size
            indices = order[start : start + self.batch_size]
            batch = self.collate_fn([self.dataset[int(i)] for i in indices])
            self.last_indices, self.last_batch = np.asarray(indices), batch
            self.position += 1
            self._normalize()
            yield batch

    def _normalize(self) -> None:
        if len(self) > 0 and self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position"}``: the next batch to yield (an epoch's end reads as the next epoch's start)."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Continue from a :meth:`state_dict`."""
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or position < 0:
            raise ValueError(f"state must have epoch >= 0 and position >= 0, got {dict(state)}")
        self.epoch, self.position = epoch, position
        self._normalize()
