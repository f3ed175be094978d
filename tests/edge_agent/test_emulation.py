"""A device's profile at run time: the upload budget, the compute hold, messages kept in order."""

from __future__ import annotations

import time

import pytest

from edge_agent.core.emulation import Emulation, HeldSender, ReleaseOrder, RoundClock
from protofl.profiles import DeviceProfile, load_device, load_link


def test_budget_is_the_link_s_share_of_the_time_left() -> None:
    em = Emulation(device=load_device("x86-cpu"), link=load_link("nb-iot"), time_scale=10.0, emulate_compute=True)
    clock = RoundClock(em)
    now = time.time()
    clock.begin(now)
    # deadline 10 real s away = 100 simulated s; minus ~0 compute and the 1.6 s RTT -> 98.4 s;
    # 0.8 x 98.4 s x 7812.5 B/s = 615,000 B
    assert clock.budget(now + 10.0) == pytest.approx(615_000, rel=0.01)
    assert clock.budget(now - 1.0) == 0  # already late: nothing fits
    assert RoundClock(Emulation(device=None, link=None)).budget(now + 10) is None  # no link: no budget
    no = Emulation(link=load_link("nb-iot"), adaptive=False)
    assert RoundClock(no).budget(now + 10) is None


def test_uploads_wait_for_the_emulated_compute() -> None:
    # compute_factor 0.08 (rpi3): a round that costs 10 ms of CPU here is 125 ms on the Pi; at time
    # scale 1 its uploads leave 125 ms after the round message came.
    clock = RoundClock(Emulation(device=load_device("rpi3"), time_scale=1.0, emulate_compute=True))
    clock.begin(time.time())
    end = time.thread_time() + 0.01
    while time.thread_time() < end:
        pass
    release = clock.upload_release()
    cpu, compute = clock.extra["compute_cpu_s"], clock.extra["compute_s"]
    assert cpu >= 0.01 and compute == pytest.approx(cpu / 0.08)
    assert release == pytest.approx(clock.recv_t + compute, abs=0.01) and clock.extra["overrun_s"] == 0.0
    assert clock.upload_release() == release  # one release per round message
    # Asynchronous rounds: a newer version's message that came while the device still trained (before `release`)
    # is trained from that release on, as the composed clock says (timeline.py): its uploads leave compute later.
    clock.begin(release - 0.1)
    again = clock.upload_release()
    assert again == pytest.approx(release + clock.extra["compute_s"], abs=0.01)


def test_held_sender_keeps_order_and_holds() -> None:
    sent: list[tuple[str, float]] = []
    held = HeldSender(lambda topic, payload, qos: sent.append((topic, time.time())))
    t0 = time.time()
    held.submit("upload", b"", 1, not_before=t0 + 0.2)
    held.submit("metrics", b"", 1)  # after the upload, never before it
    held.close()
    assert [s[0] for s in sent] == ["upload", "metrics"]
    assert sent[0][1] >= t0 + 0.2 and sent[1][1] >= sent[0][1]


def test_release_order_sends_uploads_in_emulated_order_whatever_the_machine_s() -> None:
    """The simulator's thread agents: b's upload, due first but released by this machine while a still trains
    (a's round message came earlier), waits for a, and for d, whose round message waits unhandled; a's, due
    earlier still, goes first; c (round message after b's due) holds nobody. When b went is recorded (its link
    time is measured from then, not from its due), and b goes no sooner after a than its due came after a's (the
    virtual clock runs from a's release)."""
    order = ReleaseOrder()
    sent: list[str] = []
    went: dict[str, float] = {}

    def publish(name: str) -> None:
        went.setdefault(name, time.time())
        sent.append(name)

    def sender(name: str) -> HeldSender:
        return HeldSender(lambda topic, payload, qos: publish(name), order, name)

    t0 = time.time()
    a, b = sender("a"), sender("b")
    order.arrived("a", t0 - 2.0)  # a trains the round message that came 2 s ago
    order.arrived("c", t0 + 60.0)  # c's came after every due here: it cannot come first
    waits: list[float | None] = [t0 - 0.8]  # d's round message (after a's due, before b's) waits, unhandled
    order.watch("d", lambda: waits[0])
    due_b = t0 - 0.5
    b.submit("upload", b"", 1, not_before=due_b)  # overrun: due half a second ago
    a.submit("upload", b"", 1, not_before=t0 - 1.0)  # a was done training 1 s ago (this machine ran late)
    order.done("a")
    a.close()
    assert sent == ["a"]  # b still waits for d
    waits[0] = None  # d handled it: nothing of d's to wait for (it trained nothing here)
    b.close()
    assert sent == ["a", "b"]
    assert went["b"] - went["a"] >= 0.5 - 0.01  # let go late, they keep their dues' spacing (0.5 s)
    assert order.went[("b", due_b)] - due_b >= 0.5 and order.forced == 0


def test_virtual_clock_orders_across_versions_whatever_this_machine_s_lag() -> None:
    """Hand-computed: upload x, due at T + 0.45 on the virtual clock, goes 1.55 s late (this machine trained the
    devices one at a time): from then the virtual clock is T + 0.45 + (real - when x went). `slow` still holds an
    older version's upload due at T + 0.9. `fast` gets the next version's round message just after x went (virtual
    T + 0.45 + its lag) and, with the profile's compute (0.001 s x 50 samples / compute factor 0.5 = 0.1 s), is due
    at ~T + 0.55: before `slow`'s, though this machine takes 0.6 s of real time to train it, past `slow`'s due in
    real time too. It goes first (on real dues `slow` would, its due 1.1 s in the real past)."""
    order = ReleaseOrder()
    assert order.virtual(5.0) == 5.0  # no release yet: the identity
    went: dict[str, float] = {}

    def sender(name: str) -> HeldSender:
        def publish(topic: str, payload: bytes, qos: int) -> None:
            went.setdefault(name, time.time())

        return HeldSender(publish, order, name)

    T = time.time() - 2.0
    x = sender("x")
    x.submit("upload", b"", 1, not_before=T + 0.45)
    x.close()
    w1 = went["x"]
    assert order.virtual(w1 + 1.0) == pytest.approx(T + 1.45, abs=0.01)  # runs at the real rate from x's release
    assert order.virtual(w1 - 1.0) == pytest.approx(w1 - 1.0)  # before it: still the identity
    assert order.waited[("x", T + 0.45)] == pytest.approx(w1 - T - 0.45, abs=0.01)  # this machine's, not the link's

    slow = sender("slow")
    slow.submit("upload", b"", 1, not_before=T + 0.9)
    device = DeviceProfile("board", "a test board", compute_factor=0.5, memory_mb=512)
    clock = RoundClock(Emulation(device=device, emulate_compute=True, order=order, sample_cost_s=0.001))
    recv = time.time()
    order.arrived("fast", clock.start(recv))  # training: `slow` may not go while fast's upload can come first
    clock.begin(recv, 1_000, 50)
    time.sleep(0.6)  # this machine's lag: the real time of training, not the device's
    due = clock.upload_release()
    assert clock.extra["compute_s"] == pytest.approx(0.1) and clock.extra["recv_bytes"] == 1_000
    assert due == pytest.approx(T + 0.45 + (recv - w1) + 0.1, abs=0.01) and due < T + 0.9
    fast = sender("fast")
    fast.submit("upload", b"", 1, not_before=due)
    order.done("fast")
    fast.close()
    slow.close()
    assert sorted(went, key=went.__getitem__) == ["x", "fast", "slow"] and order.forced == 0
