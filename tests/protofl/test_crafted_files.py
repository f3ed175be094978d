"""Crafted files a user may be handed are refused from their declared sizes, before anything is allocated
(issue 43): an npz whose headers declare gigabytes, a checkpoint of millions of empty msgpack lists, a CSV of a
million columns, a PNG that claims 50000x50000 pixels. Each is refused in < 2 s and < 200 MB (tracemalloc
counts numpy's and msgpack's allocations as well as Python's)."""

from __future__ import annotations

import hashlib
import struct
import time
import tracemalloc
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from protofl.artifacts import read_model, read_predictor, read_prototypes, read_vector
from protofl.checkpoint import MAGIC, CheckpointError, read_checkpoint
from protofl.data import own
from protofl.errors import DataError

MB = 1 << 20
# The bound is 2 s, which every case meets on an idle box (the slowest, the nested checkpoint's 2M counted
# objects, ~1 s); the suite runs two test files at once on 2 cores, where that case took 3.3 s once: the time bound
# here is a hang detector (the files used to take 50 s and 3 GB; 13 s once beside a qemu emulation), the memory
# bound the real one.
SECONDS = 20.0


def refused(fn: Callable[[], object], exc: type[BaseException], match: str) -> None:
    """`fn` raises `exc` (matching `match`) within SECONDS, its allocations peaking under 200 MB (measured in a
    second call: tracing every allocation slows the first one's clock)."""
    t0 = time.perf_counter()
    with pytest.raises(exc, match=match):
        fn()
    seconds = time.perf_counter() - t0
    tracemalloc.start()
    try:
        with pytest.raises(exc, match=match):
            fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert seconds < SECONDS, f"refused after {seconds:.1f} s"
    assert peak < 200 * MB, f"peaked at {peak / MB:.0f} MB before refusing"


def npy_header(shape: tuple[int, ...], dtype: str = "<f4") -> bytes:
    """An npy 1.0 header declaring `shape` (the array data is the caller's)."""
    d = repr({"descr": dtype, "fortran_order": False, "shape": shape}).encode("latin1")
    pad = 64 - (10 + len(d) + 1) % 64
    d = d + b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(d)) + d


def bomb_npz(path: Path, members: dict[str, tuple[int, ...]], data_mb: int = 3) -> Path:
    """An npz whose members declare `shape`s, each followed by `data_mb` MB of real zeros (deflated to a few
    kilobytes): np.load allocates the declared array before it finds the data short."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, shape in members.items():
            with zf.open(f"{name}.npy", "w", force_zip64=True) as m:
                m.write(npy_header(shape))
                for _ in range(data_mb):
                    m.write(bytes(MB))
    return path


def test_an_npz_declaring_gigabytes_is_refused_from_its_headers(tmp_path: Path) -> None:
    # 3.2 GB declared: prototypes (100000, 8000) float32.
    protos = bomb_npz(tmp_path / "protos.npz", {"classes": (10,), "prototypes": (100_000, 8_000)})
    refused(
        lambda: read_prototypes(protos),
        DataError,
        r"protos\.npz: its arrays declare more than 256 MiB .*'prototypes\.npy'.*refused",
    )
    model = bomb_npz(tmp_path / "model.npz", {"state/w": (100_000, 8_000), "spec": ()})
    refused(lambda: read_model(model), DataError, r"declare more than 512 MiB")
    vec = bomb_npz(tmp_path / "vec.npz", {"vector": (800_000_000,), "kind": ()})
    refused(lambda: read_vector(vec), DataError, r"declare more than 512 MiB")
    refused(lambda: read_predictor(vec), DataError, r"declare more than 512 MiB")
    # A member that is not an array would be read whole as bytes: refused by name.
    with zipfile.ZipFile(tmp_path / "raw.npz", "w") as zf:
        zf.writestr("classes", b"x" * 100)
    refused(lambda: read_prototypes(tmp_path / "raw.npz"), DataError, r"member 'classes' is not an \.npy array")
    # What a run writes still reads.
    np.savez(tmp_path / "ok.npz", classes=np.arange(3), prototypes=np.ones((3, 4), np.float32))
    assert read_prototypes(tmp_path / "ok.npz").values.shape == (3, 4)


def test_export_refuses_an_npz_model_declaring_gigabytes(tmp_path: Path) -> None:
    from export.checkpoint import load_checkpoint
    from protofl.errors import ConfigError

    model = bomb_npz(tmp_path / "model.npz", {"state/w": (100_000, 8_000), "spec": ()})
    refused(lambda: load_checkpoint(model), ConfigError, r"declare more than 512 MiB")


def checkpoint_file(path: Path, body: bytes) -> Path:
    path.write_bytes(MAGIC + hashlib.sha256(body).digest() + body)  # a valid hash: only the decoder can refuse it
    return path


def test_a_checkpoint_of_millions_of_empty_lists_is_refused(tmp_path: Path) -> None:
    n = 20_000_000
    flat = checkpoint_file(tmp_path / "flat.bin", b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n)
    refused(lambda: read_checkpoint(flat), CheckpointError, r"does not decode")
    # Nested under the length limit (20 lists of 1e6 empty lists): the object count refuses it.
    inner = b"\xdd" + (1_000_000).to_bytes(4, "big") + b"\x90" * 1_000_000
    nested = checkpoint_file(tmp_path / "nested.bin", b"\xdc" + (20).to_bytes(2, "big") + inner * 20)
    refused(lambda: read_checkpoint(nested), CheckpointError, r"more than 2000000 msgpack objects")
    # A device checkpoint handed to `export --checkpoint` says so, as a ConfigError.
    from export.checkpoint import load_checkpoint  # torch imported before the clock starts
    from protofl.errors import ConfigError

    refused(lambda: load_checkpoint(flat), ConfigError, r"does not decode")


def test_a_csv_of_a_million_columns_is_refused_on_its_header_line(tmp_path: Path) -> None:
    n = 1_000_000
    path = tmp_path / "wide.csv"
    path.write_text(
        "label," + ",".join(f"c{i}" for i in range(n)) + "\n" + "0," + ",".join("12" for _ in range(n)) + "\n"
    )
    refused(
        lambda: own.read_csv(str(path), None),
        DataError,
        rf"the header line has more than {own.MAX_CSV_COLUMNS} columns",
    )
    # A narrow header and a wide row: the row is refused before it is parsed.
    path.write_text("label,a\n" + "0," + ",".join("12" for _ in range(n)) + "\n")
    refused(lambda: own.read_csv(str(path), None), DataError, r"a line has more than")


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb_png(path: Path, w: int = 50_000, h: int = 50_000) -> Path:
    """A 100-byte PNG that claims w x h RGB pixels."""
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 1000)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")
    )
    return path


def test_a_decompression_bomb_is_skipped_with_the_unreadable_files(tmp_path: Path) -> None:
    from PIL import Image

    good = []
    for i in range(3):
        good.append(tmp_path / f"{i}.png")
        Image.new("L", (16, 16), 40 * i).save(good[-1])
    bomb = bomb_png(tmp_path / "bomb.png")
    small_bomb = bomb_png(tmp_path / "big.png", 9_000, 9_000)  # under Pillow's own limit, over ours
    got = own.decode_images([*good, bomb, small_bomb], (1, 16, 16))
    assert got.kept == [0, 1, 2]
    reasons = dict(got.skipped)
    assert "50000x50000" in reasons[bomb] or "decompression bomb" in reasons[bomb], reasons
    assert "declares 9000x9000 pixels" in reasons[small_bomb], reasons
    refused(lambda: own.decode_images([bomb], (1, 16, 16), strict=True), DataError, r"bomb\.png: .*strict")
