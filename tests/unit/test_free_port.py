"""`free_port` hands out ports that no outgoing connection can take before their owner binds them:
outside the kernel's ephemeral range, each bindable, never the same twice in one process."""
import socket

from m3serve.engine import engine_group
from m3serve.engine.engine_group import free_port


def test_runs_are_bindable_distinct_and_outside_the_ephemeral_range():
    low, high = engine_group._ephemeral_ports()
    seen: set[int] = set()
    for _ in range(50):
        base = free_port(3)
        ports = set(range(base, base + 3))
        assert not ports & seen
        seen |= ports
        assert all(p < low or p > high for p in ports), (base, low, high)
        for p in ports:
            with socket.socket() as s:
                s.bind(("", p))


def test_a_busy_port_is_skipped(monkeypatch):
    busy = socket.socket()
    busy.bind(("", 0))
    taken = busy.getsockname()[1]

    class Scripted:          # proposes the busy port first, then the one after it
        def __init__(self):
            self.picks = iter([taken, taken + 1])

        def choice(self, firsts):
            pick = next(self.picks)
            assert pick in firsts
            return pick

    monkeypatch.setattr(engine_group, "_LOWEST_PORT", 10000)
    monkeypatch.setattr(engine_group, "_ephemeral_ports", lambda: (65000, 65100))   # taken lies below it
    monkeypatch.setattr(engine_group.random, "Random", Scripted)
    try:
        assert free_port() == taken + 1
    finally:
        busy.close()
