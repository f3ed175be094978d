"""Secure aggregation, SecAgg+ style (Bell et al., CCS 2020, after Bonawitz et al., CCS 2017): the server learns
the sum of the surviving devices' vectors and nothing else of any one of them. Pure: no transport, no clock; the
messages are bytes and numpy arrays that a round machine carries (issue 46; docs/privacy.md).

The protocol, for one phase, over devices with ids that sort:

0. **advertise**: each device makes two X25519 key pairs, `c` (to encrypt the shares it sends) and `s` (to agree
   the pairwise masks), and sends both public keys (`Device.advertise`).
1. **share keys**: the server publishes the keys; `neighbours` draws a sparse graph from the published ids and a
   public seed (every device a ring neighbour of k others after a keyed shuffle, SecAgg+: a device's cost grows
   with log n, not n; k = 2 ceil(log2 n) and t = k/2 + 1, or both derived from a stated threat model:
   protofl/secagg_params.py). A device refuses a roster whose t is not a strict majority of its neighbours or that
   names fewer than MIN_NEIGHBOURS (`roster_problem`). Each device draws its self-mask seed b_u and Shamir-splits
   b_u and its secret key s_u among its neighbours with threshold t (`Device.share_keys`), each share encrypted
   (AES-GCM) to the neighbour under a key agreed from the `c` keys, and sent through the server. Shares are elements of
   GF(2^256 - 189), 32 bytes; neighbour v's point is its rank in u's neighbours (`share_point`) and the box's nonce
   is derived (`Device._nonce`): neither travels.
2. **masked input**: each device that received its neighbours' shares sends y_u = x_u + PRG(b_u)
   + sum over its neighbours v that shared keys of (+PRG(s_uv) if u < v else -PRG(s_uv)), all mod 2^32
   (`Device.masked_input`); s_uv is HKDF of the X25519 agreement of s_u and s_v with the phase's context,
   PRG is AES-256-CTR of zeros under that key.
3. **unmask**: the server says who sent a masked input (the survivors); each responding device sends, for every
   neighbour, its share of b_u where u survived, of s_u where u dropped after sharing its keys (`Device.unmask`;
   never both for one u: it refuses a server that asks). The server rebuilds each survivor's b_u and each dropped
   device's s_u from t shares (`Server.unmask`), removes the self masks, and cancels the dropped devices' pairwise
   masks against their surviving neighbours: what is left is the plain sum.

The ring: values mod 2^32 after a fixed-point encoding (`FixedPoint`): x -> round(x * 2^f) as a signed 32-bit
integer. A sum of n values each within +-bound decodes exactly when n * bound * 2^f < 2^31, which `FixedPoint.for_sum`
picks f for; each value is off by at most 2^-(f+1), a sum of n by n 2^-(f+1). Clipping (protofl/privacy.py) is what
bounds the values. A prototype upload in f4, f2 or q8 is decoded to floats on the device before it is encoded: the
masked vector travels as u4 (4 bytes a value) whatever the plan's dtype, and the fixed point's resolution (2^-f) is
finer than f2's or q8's step for the bounds that clipping gives, so masking adds no error of its own beyond it.

Threats (SECURITY.md): an honest-but-curious server learns only the sum over the survivors (needs t or more
colluding neighbours of a device to unmask it alone); a malicious server that lies about who dropped gets t shares
of both of a device's secrets only with 2t - k corrupt neighbours of it (each honest one gives one kind per device:
`Device.unmask`), which a strict majority t, checked by the device (`roster_problem`), keeps at 1 or more; the
consistency round of the malicious variant is not implemented.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

RING_BITS = 32
PRIME = 2**256 - 189  # the largest prime below 2^256: a share is 32 bytes, and so is a secret (drawn below PRIME)
SECRET_BYTES = 32
SHARE_BYTES = 32  # a share: an element of GF(PRIME)
BOX_BYTES = 2 * SHARE_BYTES + 16  # AES-GCM of (share of b_u, share of s_u) with its tag; nonce and x not sent


class SecAggError(ValueError):
    """A step that cannot go on: too few shares, a share that does not decrypt, a server asking for both shares."""


# -- the ring ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FixedPoint:
    """x -> round(x * 2^frac_bits) mod 2^32; every value within +-bound; sums of up to `devices` decode exactly."""

    frac_bits: int
    bound: float
    devices: int

    @classmethod
    def for_sum(cls, bound: float, devices: int) -> FixedPoint:
        """The finest scale at which `devices` values of magnitude <= `bound` sum without wrapping."""
        if not (bound > 0 and devices >= 1):
            raise ValueError(f"bound must be > 0 and devices >= 1, got {bound}, {devices}")
        f = math.floor(math.log2((2**31 - 1) / (devices * bound)))
        if f < 0:
            raise ValueError(f"{devices} values within +-{bound:g} do not fit a 32-bit ring")
        return cls(min(f, 30), float(bound), devices)

    @property
    def resolution(self) -> float:
        return float(2.0**-self.frac_bits)

    def encode(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        if not np.all(np.isfinite(x)) or (x.size and np.abs(x).max() > self.bound):
            raise ValueError(f"values must be finite and within +-{self.bound:g} (clip them first)")
        return np.rint(x * 2.0**self.frac_bits).astype(np.int64).astype(np.uint32)

    def decode(self, total: np.ndarray) -> np.ndarray:
        """A ring sum back to floats (its signed 32-bit reading over 2^frac_bits)."""
        return np.asarray(total, dtype=np.uint32).view(np.int32).astype(np.float64) / 2.0**self.frac_bits


def prg(key: bytes, n: int) -> np.ndarray:
    """n values of the ring from a 32-byte key: AES-256-CTR of zeros (the same on every machine)."""
    enc = Cipher(algorithms.AES(key), modes.CTR(b"\0" * 16)).encryptor()
    return np.frombuffer(enc.update(b"\0" * (4 * n)) + enc.finalize(), dtype="<u4").astype(np.uint32)


# -- the neighbour graph ----------------------------------------------------------------------------------------
def degree(n: int) -> int:
    """Neighbours per device: 2 ceil(log2 n) (SecAgg+'s O(log n)), at most n - 1."""
    return min(n - 1, 2 * math.ceil(math.log2(max(n, 2))))


def neighbours(ids: Iterable[str], seed: bytes, k: int | None = None) -> dict[str, frozenset[str]]:
    """A symmetric graph over `ids`: after a shuffle keyed by `seed` (public: the server's for the phase), each id
    on a ring is joined to the k/2 before and the k/2 after it; everybody to everybody when n <= k + 1."""
    order = sorted(set(ids), key=lambda i: hmac.new(seed, i.encode(), hashlib.sha256).digest())
    n = len(order)
    k = degree(n) if k is None else min(k, n - 1)
    half = max(1, (k + 1) // 2)
    out: dict[str, set[str]] = {i: set() for i in order}
    if n <= 1:
        return {i: frozenset() for i in order}
    for pos, i in enumerate(order):
        for step in range(1, half + 1):
            j = order[(pos + step) % n]
            if j != i:
                out[i].add(j)
                out[j].add(i)
    return {i: frozenset(v) for i, v in out.items()}


def share_point(neighbours: Iterable[str], v: str) -> int:
    """Where neighbour v's shares of a device's secrets are taken: its rank among that device's neighbours, from 1
    (the device, v and the server each know the neighbours: the roster; so x never travels)."""
    return sorted(neighbours).index(v) + 1


def threshold(k: int) -> int:
    """Shares needed to rebuild a device's secrets: a strict majority of its neighbours (at least 1)."""
    return max(1, k // 2 + 1)


# -- what a device accepts of a roster --------------------------------------------------------------------------
# The smallest roster a device takes part with. With one neighbour the only strict majority is t = 1, and a Shamir
# share of threshold 1 is the secret itself: that one neighbour would hold this device's self-mask seed b_u and its
# mask key s_u in the clear, so the server and that single device together unmask it. From 2 neighbours on, t >= 2
# and no single other device holds either secret (Google's SecAgg also never shares with a threshold under 2). So
# secure aggregation needs at least 3 devices in a round.
MIN_NEIGHBOURS = 2


def roster_problem(k: int, t: int) -> str | None:
    """Why a device refuses a roster of k neighbours with threshold t (None: it takes part). The threshold must be
    a strict majority of the neighbours (2t > k): then t honest answers of one kind leave fewer than t for the other,
    so a server that tells some neighbours "u survived" and others "u dropped" cannot gather t shares of both b_u
    and s_u (each honest device gives one kind per neighbour: `Device.unmask`). With t = 1 and 4 neighbours it gets
    one of each and rebuilds u's input."""
    if k < MIN_NEIGHBOURS:
        return (
            f"the roster names {k} neighbour(s), under the floor of {MIN_NEIGHBOURS}: with one neighbour its share "
            "of this device's secrets would be the secrets themselves (secure aggregation needs 3 devices a round)"
        )
    if 2 * t <= k:
        return (
            f"the roster's threshold t={t} is not a strict majority of its {k} neighbours (at least {k // 2 + 1}): "
            "a server telling some neighbours that a device survived and others that it dropped could gather "
            "enough shares of both its secrets to unmask it"
        )
    if t > k:
        return f"the roster's threshold t={t} is more than its {k} neighbours: no secret could be rebuilt"
    return None


# -- Shamir over GF(2^256 - 189) ---------------------------------------------------------------------------------
def split(secret: bytes, xs: Iterable[int], t: int) -> dict[int, int]:
    """Shares of a SECRET_BYTES secret at the points `xs` (distinct, >= 1): any t rebuild it, fewer tell nothing."""
    coeffs = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(t - 1)]
    out = {}
    for x in xs:
        acc = 0
        for c in reversed(coeffs):
            acc = (acc * x + c) % PRIME
        out[x] = acc
    return out


def secret() -> bytes:
    """A uniform secret of SECRET_BYTES below PRIME (an element of the field: its shares rebuild it exactly). A draw
    at or above PRIME (probability 189 / 2^256) is drawn again."""
    while True:
        out = secrets.token_bytes(SECRET_BYTES)
        if int.from_bytes(out, "big") < PRIME:
            return out


def combine(shares: Mapping[int, int], t: int) -> bytes:
    """The secret from t or more shares (Lagrange at 0)."""
    if len(shares) < t:
        raise SecAggError(f"{len(shares)} shares, {t} needed")
    pts = list(shares.items())[:t]
    acc = 0
    for j, (xj, yj) in enumerate(pts):
        num, den = 1, 1
        for m, (xm, _) in enumerate(pts):
            if m != j:
                num = num * (-xm) % PRIME
                den = den * (xj - xm) % PRIME
        acc = (acc + yj * num * pow(den, -1, PRIME)) % PRIME
    return acc.to_bytes(SECRET_BYTES, "big")


# -- keys -------------------------------------------------------------------------------------------------------
def _raw(pub: X25519PublicKey) -> bytes:
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _kdf(secret: bytes, context: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=context, info=info).derive(secret)


def usable_key(public: bytes) -> bool:
    """Whether an advertised public key agrees a secret with a fresh key (X25519 refuses low-order points, which
    would make every agreement with it fail: a member's way to wreck its neighbours' steps)."""
    try:
        X25519PrivateKey.generate().exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:
        return False
    return True


def pair_key(own: X25519PrivateKey, other: bytes, context: bytes) -> bytes:
    """The pairwise mask key s_uv (symmetric in u and v) for one phase (`context` names it)."""
    return _kdf(own.exchange(X25519PublicKey.from_public_bytes(other)), context, b"protofl-secagg mask")


def pair_mask(me: str, other: str, key: bytes, n: int) -> np.ndarray:
    """+PRG(s_uv) for the smaller id, -PRG(s_uv) for the larger: the pair's masks cancel in the sum."""
    m = prg(key, n)
    return m if me < other else (np.uint32(0) - m).astype(np.uint32)


@dataclass(frozen=True)
class Keys:
    """A device's advertised public keys (32 bytes each)."""

    c: bytes  # encrypts the shares sent to it
    s: bytes  # agrees the pairwise masks


@dataclass
class Device:
    """One device's side of one phase. `context` binds every derived key to the phase (federation, round, phase)."""

    id: str
    context: bytes
    _c: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate, repr=False)
    # s_u is Shamir-split: its 32 raw bytes are drawn below PRIME (X25519 clamps any 32 bytes when it uses them)
    _s: X25519PrivateKey = field(default_factory=lambda: X25519PrivateKey.from_private_bytes(secret()), repr=False)
    _b: bytes = field(default_factory=secret, repr=False)
    keys_of: dict[str, Keys] = field(default_factory=dict)  # the neighbours' (share keys)
    held: dict[str, tuple[int, int]] = field(default_factory=dict)  # u -> (share of b_u, share of s_u)
    answered: dict[str, str] = field(default_factory=dict)  # u -> "b" | "s": what it gave the server of u

    def advertise(self) -> Keys:
        return Keys(_raw(self._c.public_key()), _raw(self._s.public_key()))

    def share_keys(self, keys_of: Mapping[str, Keys], t: int) -> dict[str, bytes]:
        """Encrypted shares of b_u and s_u for each neighbour (`keys_of`: the neighbours' advertised keys). Neighbour
        v's share is the polynomials' value at x = `share_point(keys_of, v)`, which v and the server know from the
        roster: x travels in no box and no answer."""
        self.keys_of = dict(keys_of)
        order = sorted(self.keys_of)
        xs = {v: share_point(order, v) for v in order}
        s_raw = self._s.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        b_sh, s_sh = split(self._b, xs.values(), t), split(s_raw, xs.values(), t)
        out = {}
        for v in order:
            x = xs[v]
            plain = b_sh[x].to_bytes(SHARE_BYTES, "big") + s_sh[x].to_bytes(SHARE_BYTES, "big")
            out[v] = self._box(v).encrypt(self._nonce(self.id, v), plain, self._ad(self.id, v))
        return out

    def receive_shares(self, sealed: Mapping[str, bytes]) -> None:
        """The shares the neighbours sent this device (u -> ciphertext). Its point x in u's sharing is its rank in
        u's neighbours, which the server names in the unmasking (`share_point`): the device needs none. Raises on
        the first box that does not decrypt (`open_shares` keeps the others and names it instead)."""
        bad = self.open_shares(sealed)
        if bad:
            raise SecAggError(f"{self.id}: the share from {bad[0]} does not decrypt")

    def open_shares(self, sealed: Mapping[str, bytes]) -> list[str]:
        """The shares of `sealed` that decrypt, kept; the senders of those that do not (forged or garbled: a member
        that sent right-sized boxes it did not seal to this device), sorted. A device names them to the server and
        goes on without them: its masked input carries no pair mask with them (`masked_input` over the others)."""
        bad = []
        for u, box in sealed.items():
            if u not in self.keys_of:
                raise SecAggError(f"{self.id}: a share from {u}, which is not a neighbour")
            try:
                plain = self._box(u).decrypt(self._nonce(u, self.id), box, self._ad(u, self.id))
            except Exception:  # cryptography's InvalidTag: forged or garbled
                bad.append(u)
                continue
            self.held[u] = (int.from_bytes(plain[:SHARE_BYTES], "big"), int.from_bytes(plain[SHARE_BYTES:], "big"))
        return sorted(bad)

    def masked_input(self, x: np.ndarray, shared: Iterable[str]) -> np.ndarray:
        """y_u: the encoded input (uint32) plus its self mask and a pairwise mask per neighbour in `shared` (those
        that shared keys, whose shares this device holds)."""
        x = np.asarray(x, dtype=np.uint32)
        n = x.shape[0]
        y = x + prg(self._b, n)
        for v in sorted(set(shared) & set(self.keys_of)):
            y = y + pair_mask(self.id, v, pair_key(self._s, self.keys_of[v].s, self.context), n)
        return y.astype(np.uint32)

    def unmask(self, survivors: Iterable[str]) -> dict[str, tuple[str, int]]:
        """For each neighbour whose shares it holds: ("b", share of b_u) if u survived, else ("s", share of s_u).
        A device never gives both kinds for one u (that would let the server unmask u's input)."""
        alive = set(survivors)
        out: dict[str, tuple[str, int]] = {}
        for u, (b, s) in sorted(self.held.items()):
            kind = "b" if u in alive else "s"
            if self.answered.setdefault(u, kind) != kind:
                raise SecAggError(f"{self.id}: the server asked for both secrets of {u}: refused")
            out[u] = (kind, b if kind == "b" else s)
        return out

    def _box(self, other: str) -> AESGCM:
        return AESGCM(
            _kdf(
                self._c.exchange(X25519PublicKey.from_public_bytes(self.keys_of[other].c)),
                self.context,
                b"protofl-secagg shares",
            )
        )

    def _nonce(self, sender: str, to: str) -> bytes:
        """The AES-GCM nonce of the box from `sender` to `to`, derived, never sent: SHA-256 of (the phase's context:
        federation, round, phase; the step; sender; receiver), 12 bytes. Safe because a (key, nonce) pair seals
        one box only: the box key is agreed from the two devices' `c` keys, fresh for this phase and bound to its
        context, so it serves this one pair in this one phase; a pair exchanges one box each way, and the two
        directions' nonces differ (sender and receiver are ordered in the hash). A box sent again (a restart) is
        the same box (the device keeps its answer), never a second plaintext under the same nonce."""
        return hashlib.sha256(self.context + f"\0shares\0{sender}\0{to}".encode()).digest()[:12]

    def _ad(self, sender: str, to: str) -> bytes:
        return self.context + f"\0{sender}\0{to}".encode()


@dataclass
class Server:
    """The server's side of one phase: the advertised keys, the graph, the masked inputs, the unmasking."""

    context: bytes
    seed: bytes = field(default_factory=lambda: secrets.token_bytes(16))
    keys: dict[str, Keys] = field(default_factory=dict)
    graph: dict[str, frozenset[str]] = field(default_factory=dict)
    shared: set[str] = field(default_factory=set)  # devices whose encrypted shares arrived (U1)
    masked: dict[str, np.ndarray] = field(default_factory=dict)  # (U2)
    k: int | None = None
    t: int | None = None  # the threshold (None: a strict majority of the graph's degree, `threshold`)
    answers: dict[str, dict[str, tuple[str, int]]] = field(default_factory=dict)  # unmasking, by responder
    # v -> the neighbours whose boxes v could not open (it named them): v's masked input carries no pair mask with
    # them and v holds none of their shares, so no mask between them is removed
    cut: dict[str, frozenset[str]] = field(default_factory=dict)

    def advertised(self, device: str, keys: Keys) -> None:
        self.keys[device] = keys

    def close_advertise(self) -> dict[str, dict[str, Keys]]:
        """The graph over the devices that advertised, and each one's neighbours' keys (what each receives)."""
        self.graph = neighbours(self.keys, self.seed, self.k)
        return {u: {v: self.keys[v] for v in self.graph[u]} for u in self.graph}

    def threshold(self) -> int:
        if self.t is not None:
            return self.t
        return threshold(max((len(v) for v in self.graph.values()), default=1))

    def route_shares(self, sent: Mapping[str, Mapping[str, bytes]]) -> dict[str, dict[str, bytes]]:
        """The encrypted shares by recipient (u -> {v: box} becomes v -> {u: box}); the senders make U1."""
        self.shared = set(sent)
        out: dict[str, dict[str, bytes]] = {}
        for u, boxes in sent.items():
            for v, box in boxes.items():
                if v not in self.graph.get(u, ()):
                    raise SecAggError(f"{u} sent a share to {v}, which is not its neighbour")
                if v in self.shared:
                    out.setdefault(v, {})[u] = box
        return out

    def received(self, device: str, y: np.ndarray) -> None:
        if device not in self.shared:
            raise SecAggError(f"a masked input from {device}, which shared no keys")
        self.masked[device] = np.asarray(y, dtype=np.uint32)

    def answered(self, device: str, given: Mapping[str, tuple[str, int]]) -> None:
        """One survivor's unmasking answer (its shares of its neighbours' secrets)."""
        if device not in self.masked:
            raise SecAggError(f"an unmasking answer from {device}, which sent no masked input")
        self.answers[device] = dict(given)

    def unmask(self, answers: Mapping[str, Mapping[str, tuple[str, int]]] | None = None) -> np.ndarray:
        """The sum over the survivors (uint32, the ring's), from the responding devices' shares (`answers`, or
        those `answered` so far)."""
        for device, given in (answers or {}).items():
            self.answered(device, given)
        answers = self.answers
        survivors = set(self.masked)
        if not survivors:
            raise SecAggError("no masked input arrived")
        n = next(iter(self.masked.values())).shape[0]
        t = self.threshold()
        b_shares: dict[str, dict[int, int]] = {}
        s_shares: dict[str, dict[int, int]] = {}
        for v, given in answers.items():
            for u, (kind, y) in given.items():
                if u not in self.graph.get(v, ()):
                    continue
                (b_shares if kind == "b" else s_shares).setdefault(u, {})[share_point(self.graph[u], v)] = y
        total = np.zeros(n, dtype=np.uint32)
        for masked in self.masked.values():
            total += masked
        for u in sorted(survivors):
            total -= prg(combine(b_shares.get(u, {}), t), n)
        for u in sorted(self.shared - survivors):  # dropped after sharing: their masks with survivors stay in
            masked_with = sorted(v for v in self.graph[u] & survivors if u not in self.cut.get(v, ()))
            if not masked_with:
                continue  # (every surviving neighbour named it: no mask with it to remove, no key to rebuild)
            s_u = X25519PrivateKey.from_private_bytes(combine(s_shares.get(u, {}), t))
            for v in masked_with:
                # v added pair_mask(v, u); remove it
                total -= pair_mask(v, u, pair_key(s_u, self.keys[v].s, self.context), n)
        return total.astype(np.uint32)

    # -- durability: what a journal or a checkpoint keeps of a phase in progress (plain values, no pickle) --------
    def state(self) -> dict[str, Any]:
        """The phase so far as plain values (bytes, ints, str, lists: msgpack takes it as it is); the graph is
        recomputed from the keys and the seed."""
        return {
            "context": self.context,
            "seed": self.seed,
            "k": self.k,
            **({} if self.t is None else {"t": self.t}),  # (a state without it, as before: the fixed threshold)
            "keys": {i: [k.c, k.s] for i, k in sorted(self.keys.items())},
            "graph": bool(self.graph),
            "shared": sorted(self.shared),
            "masked": {i: np.asarray(y, dtype="<u4").tobytes() for i, y in sorted(self.masked.items())},
            "answers": {
                v: {u: [kind, y.to_bytes(SHARE_BYTES, "big")] for u, (kind, y) in sorted(given.items())}
                for v, given in sorted(self.answers.items())
            },
            "cut": {v: sorted(us) for v, us in sorted(self.cut.items())},
        }

    @classmethod
    def restore(cls, saved: Mapping[str, Any]) -> Server:
        """A server from `state()`: it goes on where that one stopped (e.g. mid-unmask after a restart)."""
        out = cls(bytes(saved["context"]), seed=bytes(saved["seed"]), k=saved["k"], t=saved.get("t"))
        out.keys = {i: Keys(bytes(c), bytes(s)) for i, (c, s) in saved["keys"].items()}
        if saved["graph"]:
            out.graph = neighbours(out.keys, out.seed, out.k)
        out.shared = set(saved["shared"])
        out.masked = {i: np.frombuffer(bytes(y), dtype="<u4").astype(np.uint32) for i, y in saved["masked"].items()}
        out.answers = {
            v: {u: (str(kind), int.from_bytes(bytes(y), "big")) for u, (kind, y) in given.items()}
            for v, given in saved["answers"].items()
        }
        out.cut = {v: frozenset(us) for v, us in saved.get("cut", {}).items()}
        return out


# -- prototype tables on the ring -------------------------------------------------------------------------------
def table_vector(protos: Mapping[int, np.ndarray], num_classes: int, width: int) -> np.ndarray:
    """A device's prototype table as one dense vector to mask: per class its row (zeros for a class it lacks) and
    a presence value (1 or 0), so that the unmasked sum gives each class's row sum and its number of senders
    without telling which device sent which class. float64, num_classes * (width + 1)."""
    out = np.zeros((num_classes, width + 1), dtype=np.float64)
    for c, row in protos.items():
        out[c, :width] = row
        out[c, width] = 1.0
    return out.reshape(-1)


def table_of_sum(total: np.ndarray, num_classes: int, width: int) -> tuple[dict[int, np.ndarray], dict[int, int]]:
    """The decoded sum of `table_vector`s: ({class: row sum}, {class: senders}) for every class somebody sent."""
    grid = np.asarray(total, dtype=np.float64).reshape(num_classes, width + 1)
    senders = np.rint(grid[:, width]).astype(np.int64)
    present = [c for c in range(num_classes) if senders[c] > 0]
    return {c: grid[c, :width] for c in present}, {c: int(senders[c]) for c in present}


def context(fed: str, round_: int, phase: str) -> bytes:
    """What binds a phase's keys and masks to it (so that nothing of one phase serves another)."""
    return f"protofl-secagg\0{fed}\0{round_}\0{phase}".encode()
