"""One KV transfer's state, held in one place, with its allowed transitions written down.

    decode, read:   HANDSHAKING -> READY -> TRANSFERRING -> DONE
    decode, write:  HANDSHAKING -> READY -> TRANSFERRING -> DONE   (READY: blocks announced)
    prefill, write: WAITING_FOR_BLOCKS -> TRANSFERRING -> DONE     (computing all along: see below)
    prefill, read:  HELD -> DONE                                   (decode read and said so)

Every live state may also end FAILED, TIMED_OUT (its deadline passed) or ABORTED. Besides its
state a transfer knows which rank pairs still move data (`pending`): its blocks may be freed
once it is terminal and no rank still touches them (`settled`), or once its deadline passes.
A transfer with `drain_s` (decode, write mode, a transport whose peer writes our memory) that
ends early with ranks still pending waits up to drain_s more for them: a late push into freed
blocks would land in another request's KV.
A write-mode prefill computes its prompt from the start, whether decode's block ids have come or
not (WAITING_FOR_BLOCKS does not hold the request back, within a share of the KV cache, see
connector.py): `pushed_tokens` is how far its prompt KV has been pushed; once the ids are in, the
connector pushes what is computed but not yet pushed (from the request's own blocks, held until
the transfer settles), then each chunk as it is computed (push_plan.py).
"""
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.connectors.layout import RankPair
from tandem.connectors.params import KVTransferParams

if TYPE_CHECKING:
    from tandem.engine.request import Request


class TransferState(enum.Enum):
    HANDSHAKING = "handshaking"  # decode: exchanging layouts with the prefill instance
    READY = "ready"  # decode: layouts mapped; read: the next step starts the ranks' reads
    WAITING_FOR_BLOCKS = "waiting_for_blocks"  # prefill, write: decode has not said where to write (yet computing)
    TRANSFERRING = "transferring"  # ranks move data
    HELD = "held"  # prefill, read: blocks kept until decode has read them
    DONE = "done"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


S = TransferState
_TERMINAL = {S.DONE, S.FAILED, S.TIMED_OUT, S.ABORTED}
_ENDS = {S.FAILED, S.TIMED_OUT, S.ABORTED}
ALLOWED: dict[TransferState, set[TransferState]] = {
    S.HANDSHAKING: {S.READY} | _ENDS,
    S.READY: {S.TRANSFERRING} | _ENDS,
    S.WAITING_FOR_BLOCKS: {S.TRANSFERRING, S.DONE} | _ENDS,  # (DONE: decode needs no block)
    S.TRANSFERRING: {S.DONE} | _ENDS,
    S.HELD: {S.DONE} | _ENDS,
    S.DONE: set(), S.FAILED: set(), S.TIMED_OUT: set(), S.ABORTED: set(),
}


_TIMEOUT_ERRORS = {
    S.HANDSHAKING: "no KV handshake with the peer instance within the transfer timeout",
    S.READY: "the KV transfer did not start within the transfer timeout",
    S.WAITING_FOR_BLOCKS: "the decode instance did not send its KV block ids within the transfer timeout",
    S.TRANSFERRING: "KV transfer timed out",
    S.HELD: "no decode instance read the held KV blocks within the hold timeout",
}


class InvalidTransition(RuntimeError):
    pass


@dataclass
class Transfer:
    """request_id: the local request; side: "prefill" | "decode"; peer: the other instance's
    connector (host:port); deadline: monotonic time at which the current state times out."""

    request_id: str
    side: str
    params: KVTransferParams
    state: TransferState
    deadline: float
    peer: str | None = None
    pending: set[RankPair] = field(default_factory=set)
    error: str | None = None
    request_done: bool = False  # the local request finished; its blocks wait for `settled`
    pairs: list[RankPair] = field(default_factory=list)
    peer_ranks: list[str] = field(default_factory=list)  # the peer's rank (data agent) addresses
    local_blocks: list[int] = field(default_factory=list)
    remote_blocks: list[int] = field(default_factory=list)
    request: "Request | None" = None  # prefill, write: the local request (its blocks and computed tokens)
    pushed_tokens: int = 0  # prefill, write: prompt tokens whose KV pushes have been issued
    told_peer: bool = False  # decode, read: the prefill was told to free its blocks
    # the first output token (and logprobs): decode: arrived from the prefill; prefill, write:
    # sampled before decode's block ids came, sent once they do (decode knows the transfer then)
    first_token: tuple[int, list | None] | None = None
    drain_s: float = 0.0  # ended early with ranks pending: wait this much longer for them (see module doc)

    @property
    def transfer_id(self) -> str | None:
        return self.params.transfer_id

    @property
    def mode(self) -> str:
        return self.params.mode

    @property
    def settled(self) -> bool:
        return self.state.terminal and not self.pending


class TransferTable:
    """Every transfer of one instance, by local request id (and by transfer id in write mode)."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.transfers: dict[str, Transfer] = {}
        self.by_transfer_id: dict[str, Transfer] = {}

    def add(self, t: Transfer) -> Transfer:
        self.transfers[t.request_id] = t
        if t.transfer_id:
            self.by_transfer_id[t.transfer_id] = t
        return t

    def get(self, request_id: str) -> Transfer | None:
        return self.transfers.get(request_id)

    def find(self, request_id: str | None = None, transfer_id: str | None = None) -> Transfer | None:
        return self.transfers.get(request_id) if request_id else self.by_transfer_id.get(transfer_id or "")

    def remove(self, t: Transfer) -> None:
        if self.transfers.get(t.request_id) is t:
            del self.transfers[t.request_id]
        if t.transfer_id and self.by_transfer_id.get(t.transfer_id) is t:
            del self.by_transfer_id[t.transfer_id]

    def move(self, t: Transfer, state: TransferState, error: str | None = None,
             timeout_s: float | None = None) -> None:
        """Change t's state (ValueError-free: an illegal move is a bug, InvalidTransition)."""
        if state not in ALLOWED[t.state]:
            raise InvalidTransition(f"transfer of {t.request_id}: {t.state.value} -> {state.value} is not allowed")
        t.state = state
        if error is not None and t.error is None:
            t.error = error
        if timeout_s is not None:
            t.deadline = self.clock() + timeout_s

    def start_moving(self, t: Transfer, pairs: list[RankPair], timeout_s: float) -> None:
        """-> TRANSFERRING, waiting for each of pairs to report."""
        self.move(t, S.TRANSFERRING, timeout_s=timeout_s)
        t.pending = set(pairs)

    def pair_done(self, t: Transfer, pair: RankPair, error: str | None) -> None:
        """A rank pair finished its part; the last one ends a TRANSFERRING transfer."""
        t.pending.discard(pair)
        if error and t.error is None:
            t.error = error
        if t.state == S.TRANSFERRING and not t.pending:
            self.move(t, S.FAILED if t.error else S.DONE)

    def end(self, t: Transfer, state: TransferState, error: str | None = None, quiet: bool = False) -> None:
        """Fail, time out or abort t unless it already ended; quiet: no rank will touch its
        blocks any more (the peer is gone, or nothing was ever moved)."""
        if not t.state.terminal:
            self.move(t, state, error)
            if t.drain_s and t.pending and not quiet:
                t.deadline = max(t.deadline, self.clock() + t.drain_s)
                t.drain_s = 0.0
        if quiet:
            t.pending.clear()

    def expire(self) -> list[Transfer]:
        """Time out transfers past their deadline (terminal ones stop waiting for their ranks)."""
        now, out = self.clock(), []
        for t in list(self.transfers.values()):
            if now <= t.deadline:
                continue
            if not t.state.terminal:
                self.move(t, S.TIMED_OUT, _TIMEOUT_ERRORS[t.state])
                out.append(t)
                if t.drain_s and t.pending:
                    t.deadline, t.drain_s = now + t.drain_s, 0.0
                    continue
            t.pending.clear()
        return out
