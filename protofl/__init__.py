"""protofl: the numpy-only core of protofl-edge (wire codec, config, algorithms, data)."""

__version__ = "0.1.0"
WIRE_VERSION = 1
