"""Fixed-byte fixtures of wire protocol v1: `cases.py` builds the messages, `record.py` writes their bytes."""
