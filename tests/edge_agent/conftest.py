"""Shared fixtures for the device-side tests."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # Small batches run fastest single-threaded, and on a shared 2-core box intra-op threads that spin
    # while another process holds the other core made single forwards 30x slower. Restored afterwards.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
