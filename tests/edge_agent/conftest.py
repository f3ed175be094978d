"""Shared fixtures for the device-side tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread: None) -> None:
    """Every device-side test module runs torch single-threaded (tests/conftest.py says why)."""
