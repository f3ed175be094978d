"""Record the wire fixtures: `python tests/protofl/wire_fixtures/record.py [NAME ...]` from the repository root.

Writes `<name>.msgpack`, the exact bytes `encode_message` gives for each case in `cases.py`, which
`tests/protofl/test_wire_fixtures.py` compares against. Those bytes are what devices in the field
speak, so:

- a new case (a new kind or variant) may be recorded at any time: name it to record only it;
- re-record existing fixtures ONLY for an intended wire change, which goes with a bump of
  `protofl.WIRE_VERSION` (devices speaking the old bytes are then refused with a clear error rather
  than misread). Say so in the commit message. A refactor that changes any fixture is a bug.

Without names every case is recorded and fixtures without a case are deleted. Each case is reported
as new, changed or unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if __package__ in (None, ""):  # run as a script: make `tests.` importable from the repository root
    sys.path.insert(0, str(HERE.parents[2]))

from tests.protofl.wire_fixtures.cases import CASES  # noqa: E402 - after the sys.path line above


def fixture_path(name: str) -> Path:
    return HERE / f"{name}.msgpack"


def main(only: list[str]) -> None:
    unknown = [n for n in only if n not in CASES]
    if unknown:
        sys.exit(f"unknown case(s): {', '.join(unknown)}; known: {', '.join(CASES)}")
    for name, case in CASES.items():
        if only and name not in only:
            continue
        path = fixture_path(name)
        data = case.encode()
        old = path.read_bytes() if path.exists() else None
        state = "new" if old is None else "unchanged" if old == data else "CHANGED"
        path.write_bytes(data)
        print(f"{state:9} {name} ({len(data)} bytes)")
    if not only:
        for path in sorted(HERE.glob("*.msgpack")):
            if path.stem not in CASES:
                path.unlink()
                print(f"deleted   {path.name} (no such case)")


if __name__ == "__main__":
    main(sys.argv[1:])
