"""Watching rank processes: a daemon thread notices a child rank that exits, or whose heartbeat
stops (a frozen or stuck process), and reports it once, naming the rank, within about a second.

Every rank process runs `start_heartbeat`, which stamps its slot of a shared array twice a
second; the process that spawned it holds the array and a `Supervisor`.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from multiprocessing.connection import wait

logger = logging.getLogger(__name__)

HEARTBEAT_PERIOD_S = 0.5


def start_heartbeat(beats=None, slot: int = 0) -> None:
    """From a daemon thread: stamp `beats[slot]` with the monotonic clock (when given), and exit
    this process when the process that spawned it is gone (nothing would stop it otherwise)."""
    parent = multiprocessing.parent_process()

    def beat():
        while True:
            if beats is not None:
                beats[slot] = time.monotonic()
            if parent is not None and not parent.is_alive():
                logger.warning("the process that started this rank is gone; exiting")
                os._exit(1)
            time.sleep(HEARTBEAT_PERIOD_S)

    threading.Thread(target=beat, name="m3serve-heartbeat", daemon=True).start()


class Supervisor:
    """Calls `on_failure(message)` once, from its thread, when a watched rank exits or misses
    heartbeats for `heartbeat_timeout_s` (`watch` adds processes; `stop` ends the watch)."""

    def __init__(self, on_failure, beats=None, heartbeat_timeout_s: float = 10.0, extra_check=None):
        self.on_failure = on_failure
        self.beats, self.timeout = beats, heartbeat_timeout_s
        self.extra_check = extra_check     # () -> failure message or None, polled with the watch
        self.procs: dict[int, tuple[multiprocessing.Process, int | None]] = {}  # rank -> (proc, slot)
        self.failure: str | None = None
        self.failure_exit_code: int | None = None   # set when the failure was an exit
        self._stopped = threading.Event()
        self._failed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="m3serve-supervisor", daemon=True)

    def watch(self, rank: int, proc: multiprocessing.Process, slot: int | None = None) -> None:
        self.procs[rank] = (proc, slot)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.is_set():
            sentinels = {p.sentinel: rank for rank, (p, _) in self.procs.items()}
            if sentinels:
                ready = wait(list(sentinels), timeout=HEARTBEAT_PERIOD_S)
            else:
                ready = []
                self._stopped.wait(HEARTBEAT_PERIOD_S)
            if self._stopped.is_set():
                return
            for s in ready:
                rank = sentinels[s]
                proc = self.procs[rank][0]
                proc.join(0.1)
                self.failure_exit_code = proc.exitcode
                return self._fail(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")
            if self.extra_check is not None and (message := self.extra_check()):
                return self._fail(message)
            if self.beats is None:
                continue
            now = time.monotonic()
            for rank, (proc, slot) in self.procs.items():
                last = self.beats[slot] if slot is not None else 0.0
                if slot is not None and last > 0 and now - last > self.timeout:
                    return self._fail(f"rank {rank} (pid {proc.pid}) stopped responding: no heartbeat "
                                      f"for {now - last:.0f} s")

    def _fail(self, message: str) -> None:
        self.failure = message
        self._failed.set()
        logger.error("%s", message)
        self.on_failure(message)

    def failure_within(self, seconds: float) -> str | None:
        """The failure, waiting up to `seconds` for one: a collective that failed because a
        peer died can raise before this thread has seen the exit (then the exit names it)."""
        self._failed.wait(seconds)
        return self.failure

    def terminate_all(self) -> None:
        """Kill every watched process (SIGKILL after a short grace), without raising."""
        for proc, _ in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 3.0
        for proc, _ in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
