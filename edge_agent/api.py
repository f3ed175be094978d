"""The device side as a Python API: run a device of a federation from a script of one's own.

`join(...)` is `protofl-edge join` as a call (the CLI is built on `resolve_identity` and `make_runner`
below): own data as a dataset spec or `module:function` loader (`__main__:load` names a function of the
running script), own model as a built-in name or `module:factory` (docs/design.md). It blocks until the
federation finishes and returns the agent (its `stats`, its `model`).

    from edge_agent.api import join
    agent = join("__main__:load", broker="mqtt://server:1883", credentials="device-1.json",
                 arch="__main__:backbone")
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protofl.errors import ConfigError
from protofl.names import check_extractor, check_name
from protofl.schedule import check_cadence
from protofl.traits import check_tags

if TYPE_CHECKING:
    from edge_agent.core.agent import EdgeAgent
    from edge_agent.core.emulation import Emulation
    from edge_agent.ops.lite import LiteRunner
    from edge_agent.ops.runner import DeviceRunner
    from protofl.transport.broker_url import BrokerOptions

__all__ = ["join", "make_lite_runner", "make_runner", "resolve_identity"]


def join(
    data: str,
    *,
    broker: str = "mqtt://127.0.0.1:1883",
    credentials: str | Path | None = None,
    client_id: str | None = None,
    fed: str | None = None,
    arch: str | None = None,
    device: str = "auto",
    state_dir: str | Path | None = None,
    timeout: float | None = None,
    **options: Any,
) -> EdgeAgent | None:
    """Take part in a federation until it finishes (or `timeout` seconds); the agent, or None if it never
    got a config. `options` are `make_runner`'s other parameters (data_dir, partition, eval_every, ...)."""
    cid, username, password, fed_name = resolve_identity(
        client_id,
        options.pop("username", None),
        options.pop("password", None),
        Path(credentials) if credentials else None,
        fed,
    )
    defaults: dict[str, Any] = dict(
        data_dir=None,
        partition=None,
        alpha=0.5,
        seed=None,
        test_limit=None,
        train_limit=None,
        profile="",
        eval_every=1,
        threads=None,
        tls_ca=None,
        tls_cert=None,
        tls_key=None,
        mqtt="auto",
        connect_timeout=30.0,
    )
    unknown = sorted(set(options) - set(defaults) - {"extractor", "emulation", "keepalive", "test_every", "artifacts"})
    if unknown:
        raise ConfigError(f"join() got unknown option(s) {unknown}; known: {sorted(defaults)}")
    runner = make_runner(
        broker=broker,
        fed=fed_name,
        client_id=cid,
        data=data,
        arch=arch,
        device=device,
        username=username,
        password=password,
        state_dir=Path(state_dir) if state_dir is not None else None,
        credentials=Path(credentials) if credentials else None,
        **{**defaults, **options},
    )
    return runner.run(timeout=timeout)


def resolve_identity(
    client_id: str | None, username: str | None, password: str | None, credentials: Path | None, fed: str | None
) -> tuple[str, str | None, str | None, str]:
    """(client id, user name, password, federation) from the flags and a credentials file. The generated
    broker ACL lets user X publish only on up/X, so a client id other than the user name could never upload."""
    if credentials is not None:
        from protofl.transport.credentials import read_device_credentials

        cred, cred_fed = read_device_credentials(credentials)
        fed = fed or cred_fed
        if cred_fed is not None and cred_fed != fed:
            raise ConfigError(
                f"--credentials {credentials} is for federation '{cred_fed}', not '{fed}'; pass --fed {cred_fed}"
            )
        username = username or cred.username
        password = password if password is not None else cred.password
    client_id = client_id or username
    if client_id is None:
        raise ConfigError(
            "no device id: pass --client-id ID (and --username/--password or --credentials FILE "
            "when the broker checks credentials)"
        )
    if credentials is not None and username != client_id:
        raise ConfigError(
            f"--client-id '{client_id}' differs from the user name '{username}' of {credentials}: "
            f"the federation's broker lets each device publish only under its own id; use "
            f"--client-id {username}"
        )
    return client_id, username, password, fed or "default"


def make_runner(
    broker: str,
    fed: str,
    client_id: str,
    data: str,
    data_dir: str | None,
    partition: str | None,
    alpha: float,
    seed: int | None,
    test_limit: int | None,
    train_limit: int | None,
    arch: str | None,
    device: str,
    profile: str,
    eval_every: int,
    threads: int | None,
    username: str | None,
    password: str | None,
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    mqtt: str,
    connect_timeout: float,
    extractor: str = "torch",
    emulation: Emulation | None = None,
    keepalive: int = 30,
    test_every: int | None = None,
    state_dir: Path | None = None,
    credentials: Path | None = None,
    artifacts: Path | str | None = None,
    tags: Sequence[str] = (),
) -> DeviceRunner:
    """The device loop `protofl-edge join` runs, from its options (checked before anything connects). A
    credentials file that carries the federation CA makes the device speak TLS and accept only a broker
    whose certificate that CA signed (unless --tls-ca names another CA)."""
    from edge_agent.ops.local_data import DataSpec, dataset_spec, parse_partition

    dataset_spec(data)  # a --data that names nothing or a bad spec fails now, before torch is imported
    from edge_agent.core.memory import pin_allocator

    pin_allocator()  # before torch allocates: its freed buffers go back to the system (edge_agent/core/memory.py)
    import torch

    from edge_agent.ops.runner import DeviceRunner, RunnerOptions

    _check_identity(client_id, fed, mqtt)
    check_extractor(extractor)
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got '{device}'")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device; use --device cpu")
    if threads is not None:
        torch.set_num_threads(max(1, threads))
    options = _connection(broker, username, password, tls_ca, tls_cert, tls_key, keepalive, credentials)
    spec = DataSpec(
        data, data_dir, parse_partition(partition) if partition else None, alpha, seed, test_limit, train_limit
    )
    opts = RunnerOptions(
        arch=arch,
        device=device,
        profile=profile,
        eval_every=eval_every,
        test_every=check_cadence(eval_every, test_every),
        protocol=mqtt,  # type: ignore[arg-type]
        connect_timeout=connect_timeout,
        extractor=extractor,
        emulation=emulation,
        state_dir=str(state_dir) if state_dir is not None else None,
        artifacts=str(artifacts) if artifacts is not None else None,
        tags=check_tags(tags),
    )
    return DeviceRunner(options, fed, client_id, spec, opts)


def _check_identity(client_id: str, fed: str, mqtt: str) -> None:
    """The options every device checks before it connects, whatever kind it is."""
    check_name(client_id, "--client-id")
    check_name(fed, "--fed")
    if mqtt not in ("auto", "5", "3.1.1"):
        raise ConfigError(f"--mqtt must be auto, 5 or 3.1.1, got '{mqtt}'")


def _connection(
    broker: str,
    username: str | None,
    password: str | None,
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    keepalive: int,
    credentials: Path | None,
) -> BrokerOptions:
    """The broker connection's options from `join`'s: a credentials file that carries the federation CA makes the
    device speak TLS and accept only a broker whose certificate that CA signed (unless --tls-ca names another)."""
    from protofl.transport.broker_url import parse_broker_url

    options = replace(
        parse_broker_url(broker).with_auth(username, password, tls_ca, tls_cert, tls_key), keepalive=keepalive
    )
    if credentials is not None:
        from protofl.transport.credentials import read_device_file

        ca_pem = read_device_file(credentials).ca_pem
        if ca_pem is not None:
            options = options.with_federation_ca(ca_pem, f"--credentials {credentials}")
    return options


def make_lite_runner(
    broker: str,
    fed: str,
    client_id: str,
    data: str,
    data_dir: str | None,
    partition: str | None,
    alpha: float,
    seed: int | None,
    test_limit: int | None,
    train_limit: int | None,
    profile: str,
    threads: int | None,
    username: str | None,
    password: str | None,
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    mqtt: str,
    connect_timeout: float,
    keepalive: int = 30,
    credentials: Path | None = None,
) -> LiteRunner:
    """A lite device's loop (no torch: onnxruntime and numpy; edge_agent/ops/lite.py), from `join`'s options."""
    from edge_agent.ops.lite import LiteOptions, LiteRunner
    from edge_agent.ops.local_data import DataSpec, dataset_spec, parse_partition

    dataset_spec(data)
    _check_identity(client_id, fed, mqtt)
    try:
        import onnxruntime  # noqa: F401 -- the one thing a lite device runs on
    except ImportError:
        raise ConfigError(
            "a device without torch joins as a lite device, which needs onnxruntime: pip install "
            "'protofl-edge[lite]' (or 'protofl-edge[device]' for a device that trains)"
        ) from None
    options = _connection(broker, username, password, tls_ca, tls_cert, tls_key, keepalive, credentials)
    spec = DataSpec(
        data, data_dir, parse_partition(partition) if partition else None, alpha, seed, test_limit, train_limit
    )
    opts = LiteOptions(profile=profile, protocol=mqtt, connect_timeout=connect_timeout, threads=threads)
    return LiteRunner(options, fed, client_id, spec, opts)
