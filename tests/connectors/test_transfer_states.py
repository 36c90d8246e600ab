"""The transfer state machine (connectors/transfer.py): every allowed transition, every illegal
one refused, abort and timeout from each live state, and when blocks may be freed.
Reference: the transition table written in the module (ALLOWED)."""
import pytest

from tandem.connectors.layout import RankPair
from tandem.connectors.params import KVTransferParams
from tandem.connectors.transfer import ALLOWED, InvalidTransition, Transfer, TransferState as S, TransferTable

LIVE = [s for s in S if not s.terminal]
PAIRS = [RankPair(0, 0, 0, 0, 1), RankPair(1, 0, 0, 1, 1)]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(state: S, timeout: float = 10.0) -> tuple[TransferTable, Transfer, Clock]:
    clock = Clock()
    table = TransferTable(clock)
    t = table.add(Transfer("r", "decode", KVTransferParams(transfer_id="t"), state, clock() + timeout))
    return table, t, clock


@pytest.mark.parametrize("src,dst", [(a, b) for a in S for b in S])
def test_every_transition_is_allowed_or_refused_as_written(src, dst):
    table, t, _ = make(src)
    if dst in ALLOWED[src]:
        table.move(t, dst)
        assert t.state == dst
    else:
        with pytest.raises(InvalidTransition):
            table.move(t, dst)
        assert t.state == src


@pytest.mark.parametrize("state", LIVE)
def test_abort_from_each_live_state(state):
    table, t, _ = make(state)
    table.end(t, S.ABORTED, "client went away")
    assert t.state == S.ABORTED and t.error == "client went away" and t.settled


@pytest.mark.parametrize("state", LIVE)
def test_timeout_from_each_live_state(state):
    table, t, clock = make(state, timeout=5)
    assert table.expire() == [] and t.state == state
    clock.now = 6
    assert table.expire() == [t]
    assert t.state == S.TIMED_OUT and "time" in t.error and t.settled


def test_transferring_waits_for_every_rank_pair():
    table, t, _ = make(S.READY)
    table.start_moving(t, PAIRS, 5)
    table.pair_done(t, PAIRS[0], None)
    assert t.state == S.TRANSFERRING and not t.settled
    table.pair_done(t, PAIRS[1], None)
    assert t.state == S.DONE and t.settled


def test_a_failed_pair_fails_the_transfer_once_all_pairs_are_quiet():
    table, t, _ = make(S.READY)
    table.start_moving(t, PAIRS, 5)
    table.pair_done(t, PAIRS[1], "rank 1 lost its peer")
    assert t.state == S.TRANSFERRING
    table.pair_done(t, PAIRS[0], None)
    assert t.state == S.FAILED and t.error == "rank 1 lost its peer"


def test_abort_while_transferring_keeps_blocks_until_ranks_are_quiet_or_deadline():
    table, t, clock = make(S.READY)
    table.start_moving(t, PAIRS, 5)
    table.end(t, S.ABORTED)
    assert t.state == S.ABORTED and not t.settled  # ranks may still write into its blocks
    table.pair_done(t, PAIRS[0], None)
    assert not t.settled
    clock.now = 6
    table.expire()
    assert t.state == S.ABORTED and t.settled  # the deadline frees them all the same


@pytest.mark.parametrize("end", ["abort", "timeout"])
def test_drain_keeps_blocks_past_an_early_end_while_the_peer_may_write(end):
    """drain_s (transports whose peer writes our memory): after an abort near the deadline, or a
    timeout, the blocks stay held drain_s longer unless every rank pair reports first."""
    table, t, clock = make(S.READY)
    t.drain_s = 10
    table.start_moving(t, PAIRS, 5)
    clock.now = 4.5 if end == "abort" else 6
    if end == "abort":
        table.end(t, S.ABORTED)
    else:
        assert table.expire() == [t] and t.state == S.TIMED_OUT
    assert not t.settled
    clock.now = 10
    table.expire()
    assert not t.settled  # past the transfer deadline, inside the drain window
    table.pair_done(t, PAIRS[0], None)
    table.pair_done(t, PAIRS[1], "aborted")
    assert t.settled and t.state != S.DONE
    table2, t2, clock2 = make(S.READY)
    t2.drain_s = 10
    table2.start_moving(t2, PAIRS, 5)
    clock2.now = 6
    table2.expire()
    clock2.now = 17
    table2.expire()
    assert t2.settled  # the drain window passed: freed all the same


def test_peer_gone_ends_quietly():
    table, t, _ = make(S.READY)
    table.start_moving(t, PAIRS, 5)
    table.end(t, S.FAILED, "peer gone", quiet=True)
    assert t.state == S.FAILED and t.settled


def test_ending_twice_keeps_the_first_end():
    table, t, _ = make(S.HELD)
    table.end(t, S.FAILED, "first")
    table.end(t, S.ABORTED, "second")
    assert t.state == S.FAILED and t.error == "first"


def test_lookup_by_request_and_transfer_id():
    table, t, _ = make(S.HANDSHAKING)
    assert table.find("r") is t and table.find(transfer_id="t") is t
    table.remove(t)
    assert table.find("r") is None and table.find(transfer_id="t") is None
