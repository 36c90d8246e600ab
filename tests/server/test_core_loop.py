"""The engine-core loop of a lockstep DP rank, over real ZMQ sockets and a fake engine core: an
idle rank keeps stepping (its peers' collectives need it) but naps between idle steps, and a
WAKE frame (sent by the API to every other rank with a new request) is taken."""
import os
import tempfile
import threading
import time

import zmq

from tandem.engine.core_proc import _LOCKSTEP_IDLE_POLL_MS, EngineCoreLoop


class _Stop(Exception):
    pass


class FakeLockstepCore:
    dp_lockstep, dp_rank = True, 0

    def __init__(self):
        self.steps, self.stop = 0, False

    def has_unfinished_requests(self) -> bool:
        return False  # no rank has work

    def step(self):
        if self.stop:
            raise _Stop()
        self.steps += 1
        return []

    def get_stats(self):
        from tandem.engine.protocol import SchedulerStats
        return SchedulerStats()


def test_idle_lockstep_rank_naps_and_takes_wake():
    d = tempfile.mkdtemp()
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(f"ipc://{d}/in")
    pull.bind(f"ipc://{d}/out")
    core = FakeLockstepCore()
    loop = EngineCoreLoop(core, f"ipc://{d}/in", f"ipc://{d}/out", parent_pid=os.getppid())

    def run():
        try:
            loop.run()
        except _Stop:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        time.sleep(0.5)
        idle_steps = core.steps
        # at most one step per nap (a slow machine only takes fewer): naps of 20 ms or more
        # (2 ms naps took ~250 steps here)
        assert _LOCKSTEP_IDLE_POLL_MS >= 20 and 1 <= idle_steps <= 0.5 / 0.020 + 2
        push.send_multipart([b"WAKE"])
        deadline = time.monotonic() + 10
        while core.steps == idle_steps and time.monotonic() < deadline:
            time.sleep(0.005)
        assert core.steps > idle_steps and thread.is_alive()
    finally:
        core.stop = True
        push.send_multipart([b"WAKE"])
        thread.join(5)
        loop.close()
        push.close(0)
        pull.close(0)
        ctx.term()
    assert not thread.is_alive()
