"""The rank supervisor names a rank that exits; `failure_within` lets a caller whose collective
failed first (the peer's death seen as a transport error) wait for that name."""
import multiprocessing
import os
import signal
import time

from m3serve.executor.supervisor import Supervisor


def _sleep():
    time.sleep(60)


def test_a_killed_rank_is_named_to_a_caller_that_asks_right_away():
    proc = multiprocessing.get_context("fork").Process(target=_sleep, daemon=True)
    proc.start()
    seen = []
    sup = Supervisor(seen.append)
    sup.watch(1, proc)
    sup.start()
    try:
        assert sup.failure_within(0.2) is None            # alive: nothing to report
        os.kill(proc.pid, signal.SIGKILL)
        message = sup.failure_within(2.0)                 # asked before the watch thread woke
        assert message == f"rank 1 (pid {proc.pid}) exited with code -9" and seen == [message]
        assert sup.failure_exit_code == -9
    finally:
        sup.stop()
        proc.join(1)
