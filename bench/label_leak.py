"""What secure aggregation leaks across rounds (issue 58): a device's weights are constant, so unmasked sums over
different survivor sets give its per-class weights by subtraction (docs/privacy.md, "What masking does not hide
across rounds").

    python -m bench.label_leak            # both parts, printed; --trials, --seed

1. `subtraction`: protofl/secagg.py's devices and server, in one process, run two phases over 6 devices with
   fedproto's weighted tables ([row * n_kc, n_kc] per class; the rows change between the phases as training would),
   once with every device and once without device-6: the two unmasked weight sums differ by exactly device-6's
   per-class counts, while the row sums give its rows only up to the others' drift.
2. `exposure`: without any protocol (the unmasking is exact), the fraction of devices whose weight vector is
   determined by the unmasked weight sums of R rounds, when each device drops out of each round independently with
   probability p: device u is exposed when its indicator lies in the row space of the rounds' survivor matrix.
"""

from __future__ import annotations

import argparse

import numpy as np

from protofl import secagg
from protofl.secagg import Device, FixedPoint, Server

CLASSES, WIDTH = 10, 8


def unmasked_sum(tables: dict[str, np.ndarray], round_: int, bound: float) -> np.ndarray:
    """One masked phase over the devices of `tables` (all survive): the decoded sum the server unmasks."""
    ctx = secagg.context("leak", round_, "train")
    ring = FixedPoint.for_sum(bound, len(tables))
    server = Server(ctx, seed=b"leak")
    devices = {i: Device(i, ctx) for i in sorted(tables)}
    for i, d in devices.items():
        server.advertised(i, d.advertise())
    keys_for = server.close_advertise()
    sent = {i: devices[i].share_keys(keys_for[i], server.threshold()) for i in devices}
    for v, boxes in server.route_shares(sent).items():
        devices[v].receive_shares(boxes)
    for i in sorted(tables):
        server.received(i, devices[i].masked_input(ring.encode(tables[i]), server.shared))
    survivors = set(server.masked)
    answers = {i: devices[i].unmask(survivors) for i in sorted(survivors)}
    return np.asarray(ring.decode(server.unmask(answers)), dtype=np.float64)


def weighted_table(rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """fedproto's masked vector: per class [row * n_kc, n_kc] (zeros for a class the device lacks)."""
    return np.concatenate([rows * counts[:, None], counts[:, None]], axis=1).reshape(-1)


def subtraction(rng: np.random.Generator) -> dict[str, float]:
    ids = [f"device-{i}" for i in range(1, 7)]
    counts = {i: rng.integers(0, 60, CLASSES) * (rng.random(CLASSES) < 0.6) for i in ids}  # label skew: zeros
    rows = {i: rng.normal(0, 0.3, (CLASSES, WIDTH)) for i in ids}
    drift = {i: rows[i] + rng.normal(0, 0.05, (CLASSES, WIDTH)) for i in ids}  # the next round's rows
    bound = 60 * 2.0
    everyone = unmasked_sum({i: weighted_table(rows[i], counts[i]) for i in ids}, 1, bound)
    without = unmasked_sum({i: weighted_table(drift[i], counts[i]) for i in ids[:-1]}, 2, bound)
    grid = (everyone - without).reshape(CLASSES, WIDTH + 1)
    u = ids[-1]
    got = np.rint(grid[:, WIDTH]).astype(np.int64)
    exact = bool(np.array_equal(got, counts[u]))
    present = counts[u] > 0
    row_err = np.abs(grid[present, :WIDTH] / counts[u][present, None] - rows[u][present]).max()
    print(f"counts of {u}:      {counts[u].tolist()}")
    weight_err = np.abs(grid[:, WIDTH] - counts[u]).max()
    print(f"round 1 - round 2:  {got.tolist()}  (exact: {exact}; max |weight error| {weight_err:.2g})")
    print(f"its rows from the same subtraction: max |error| {row_err:.3g} (the others' drift between the rounds)")
    return {"exact": float(exact), "row_error": float(row_err)}


def exposed_fraction(n: int, p: float, rounds: int, rng: np.random.Generator) -> float:
    """The fraction of n devices whose weights R unmasked sums determine (dropout p a device and round)."""
    survived = (rng.random((rounds, n)) >= p).astype(np.float64)
    # u is determined iff e_u is in the row space: iff the null space's basis is zero in coordinate u
    _, s, vt = np.linalg.svd(survived, full_matrices=True)
    rank = int((s > 1e-9).sum())
    null = vt[rank:]
    return float((np.abs(null).max(axis=0) < 1e-9).mean()) if null.size else 1.0


def exposure(trials: int, rng: np.random.Generator) -> None:
    print("\nfraction of devices whose per-class weights R rounds' unmasked sums determine (mean of trials)")
    print("devices  dropout   " + "  ".join(f"R={r:<4d}" for r in (2, 5, 10, 20, 50, 100)))
    for n in (10, 100):
        for p in (0.01, 0.05, 0.1, 0.2):
            cells = []
            for r in (2, 5, 10, 20, 50, 100):
                cells.append(np.mean([exposed_fraction(n, p, r, rng) for _ in range(trials)]))
            print(f"{n:>7d}  {p:>7.2f}   " + "  ".join(f"{c:6.2f}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    subtraction(rng)
    exposure(args.trials, rng)


if __name__ == "__main__":
    main()
