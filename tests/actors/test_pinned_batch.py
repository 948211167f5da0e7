"""PinnedBatch packs a step's arrays into one buffer and sends them in one copy: each comes back whole,
in its shape, as int64, however many there are and however large the buffer had to grow."""

import torch

from actors.worker.pinned_batch import PinnedBatch


def test_each_array_comes_back_in_its_shape_and_values():
    staging = PinnedBatch(torch.device("cpu"), pin=False)
    gen = torch.Generator().manual_seed(0)
    for rows in (3, 700, 1, 40):   # the buffer grows past 1024 values, then is reused smaller
        parts = [torch.randint(-1, 1 << 40, (rows,), generator=gen),
                 torch.randint(0, 1 << 30, (rows, 9), generator=gen).to(torch.int32),
                 torch.arange(rows + 1, dtype=torch.int32),
                 torch.empty(0, dtype=torch.int64)]
        sent = staging.send(parts)
        assert [t.shape for t in sent] == [p.shape for p in parts]
        assert all(t.dtype == torch.int64 for t in sent)
        assert all(torch.equal(t, p.long()) for t, p in zip(sent, parts))
