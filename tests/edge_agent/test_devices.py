"""`--device cpu | cuda | auto`: resolved once, with an error that says what to do."""

from __future__ import annotations

import pytest
import torch

from edge_agent.core.devices import resolve_device
from protofl.errors import ConfigError


def test_resolve_device() -> None:
    has_cuda = torch.cuda.is_available()
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if has_cuda else "cpu")
    with pytest.raises(ConfigError, match="--device must be cpu, cuda or auto, got 'tpu'"):
        resolve_device("tpu")
    if has_cuda:
        assert resolve_device("cuda") == "cuda"
    else:
        with pytest.raises(ConfigError, match="torch sees no CUDA device.*use --device cpu"):
            resolve_device("cuda")
