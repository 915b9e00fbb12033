"""The weight publisher's encoding buffers: host memory a version is encoded into and served from.

One :class:`EncodingBuffer` is a 1-D uint8 CPU tensor, pinned when the weights come from CUDA (so the
copy into it is asynchronous on the caller's stream), with a numpy view for the chunk checksums and
zero-copy frames. Its allocation (``storage``) can be larger than the version it holds, so a
buffer reserved at start (``WeightPublisher.reserve``) is reused by later versions whose encoding
grew a little (a longer header); ``touch`` faults the pages in at allocation, not in the first copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class EncodingBuffer:
    """One encoding buffer: a 1-D uint8 CPU tensor (pinned for copies from CUDA) and its numpy view;
    ``tensor`` is the first ``nbytes`` of ``storage``, the allocation (``sized`` reuses it)."""

    tensor: torch.Tensor
    pinned: bool
    storage: torch.Tensor

    @classmethod
    def alloc(cls, size: int, pinned: bool, capacity: int = 0, touch: bool = False) -> EncodingBuffer:
        storage = torch.empty(max(size, capacity), dtype=torch.uint8, pin_memory=pinned)
        if touch:  # fault the pages in now, not in the first copy into it
            storage.numpy().fill(0)
        return cls(storage[:size], pinned, storage)

    def fresh_like(self) -> EncodingBuffer:
        """A second buffer like this one, allocated and touched now rather than by the next hand-over
        (page faults on a fresh buffer cost as much as the copy itself)."""
        return EncodingBuffer.alloc(self.nbytes, self.pinned, self.capacity, touch=True)

    def sized(self, size: int) -> EncodingBuffer:
        return EncodingBuffer(self.storage[:size], self.pinned, self.storage)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    @property
    def capacity(self) -> int:
        return self.storage.numel()

    @property
    def arr(self) -> np.ndarray:
        return self.tensor.numpy()
