"""TandemConnector: the KV connector's scheduler side (engine core process).

It decides every transfer and holds its state (connectors/transfer.py); the ranks' worker sides
(connectors/worker.py) only do what each step's KVStepMeta lists and report back.

Prefill computes the whole prompt and samples the first output token exactly as a collocated
server would; decode receives the KV of every prompt token plus that token (read mode: in the
kv_transfer_params the router forwards; write mode: a FirstToken message), emits it as its first
output and starts with its decode step: the numbers of a collocated server's second step.

Read mode (decode pulls): prefill finishes the prompt and holds its blocks (HELD); decode
shakes hands with prefill (rank -> KV-head maps), its ranks read the heads they need from the
prefill ranks holding them, and decode tells prefill to free. Prefill frees at once when the
decode that was to read is gone (its connection fails, or the router dropped it and says so:
PeerGone), else after hold_timeout_s.
Write mode (prefill pushes): decode shakes hands and sends its block ids and layout. Prefill
computes the prompt as soon as it arrives, ids or not: once the ids are in, its ranks push what
is already computed (every layer, from the request's own blocks, which stay held until the
transfer settles) and then each later chunk layer by layer right after computing it; each rank
pair reports when its data has landed. The first output token goes to decode once the request
has sampled it and decode's ids have come (decode knows the transfer by then).
"""
import logging
import threading
import uuid

from tandem.connectors.agent import KVAgent, TransferError
from tandem.connectors.layout import KVLayout, plan_pairs
from tandem.connectors.params import KVTransferParams
from tandem.connectors.protocol import (AbortTransfer, DecodeBlocks, FinishOp, FirstToken, FreeBlocks, Hello,
                                        HelloReply, KVStepMeta, PeerGone, RankDone, ReadOp, TransferDone)
from tandem.connectors.push_plan import cdiv, plan_pushes
from tandem.connectors.stages import stamp
from tandem.connectors.transfer import Transfer, TransferState as S, TransferTable
from tandem.connectors.transport import peer_writes_memory
from tandem.engine.config import KVTransferConfig
from tandem.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)

PRODUCER, CONSUMER, BOTH = "kv_producer", "kv_consumer", "kv_both"
_MAX_INBOX = 4096  # early messages kept for requests not seen yet; the oldest go first
# Write-mode prefills start before decode's block ids only while such requests hold at most this share
# of the KV cache, else a prefill full of requests decode has not admitted and a decode full of requests
# prefill cannot compute would wait on each other until the transfer timeout.
_EARLY_SHARE = 0.5


def _remember(d: dict, key: str, value) -> None:
    """d[key] = value, the oldest entry dropped past _MAX_INBOX."""
    d[key] = value
    if len(d) > _MAX_INBOX:
        del d[next(iter(d))]


def _logprobs_list(req: Request) -> list | None:
    """req's first output token's logprobs as [token_ids, logprobs, rank] (None: not asked)."""
    lp = req.first_token_logprobs
    return None if lp is None else [lp.token_ids, lp.logprobs, lp.rank]


class TandemConnector:
    def __init__(self, config: KVTransferConfig, layout: KVLayout, transport: str = "tcp", num_blocks: int = 0):
        """num_blocks: the KV cache's blocks (0: a write-mode prefill never starts before the ids)."""
        if config.kv_role not in (PRODUCER, CONSUMER, BOTH):
            raise ValueError(f"kv_role must be one of {PRODUCER}, {CONSUMER}, {BOTH}; got {config.kv_role!r}")
        extra = config.kv_connector_extra_config
        self.role, self.layout, self.transport, self.num_blocks = config.kv_role, layout, transport, num_blocks
        self.block_size = layout.block_size
        self.transfer_timeout_s = float(extra.get("transfer_timeout_s", 30.0))
        self.hold_timeout_s = float(extra.get("hold_timeout_s", 60.0))
        self.recompute_on_failure = bool(extra.get("recompute_on_failure", False))
        first_token = extra.get("first_token", "step")
        if first_token not in ("step", "arrival"):
            raise ValueError(f"kv_connector_extra_config first_token must be 'step' or 'arrival', got {first_token!r}")
        self.first_token_at_step = first_token == "step"
        self.engine_id = extra.get("engine_id") or uuid.uuid4().hex[:12]
        self.agent = KVAgent(f"kv-control-{self.engine_id}", extra.get("kv_host", "127.0.0.1"),
                             int(extra.get("handshake_port", 0)), self.transfer_timeout_s, self._on_message)
        self.rank_addresses: list[str] = []  # each rank's data agent, set once the ranks have met
        self.lock = threading.Lock()  # guards table, inbox and the outboxes (engine + agent threads)
        self.table = TransferTable()
        # prefill, write: DecodeBlocks / AbortTransfer for a request not seen here, or that ended here
        # before decode's ids came (an AbortTransfer of our own); see _early
        self.inbox: dict[str, object] = {}
        self.finishes: list[FinishOp] = []
        self.closed: list[str] = []
        self.first_tokens: dict[str, tuple[int, list | None]] = {}  # decode: arrived, not yet taken
        self.news = threading.Event()  # set when a message or handshake changed a transfer (see wait)
        logger.info("KV connector %s (%s, TP %d) listening at %s", self.engine_id, self.role, layout.tp_size,
                    self.agent.address)

    @property
    def address(self) -> str:
        return self.agent.address

    def _hello(self) -> Hello:
        return Hello(self.engine_id, self.layout, self.transport)

    # ---- messages (agent server thread) ---------------------------------------------------

    def _on_message(self, msg, payload):
        try:
            return self._handle(msg)
        finally:
            self.news.set()

    def _handle(self, msg):
        if isinstance(msg, Hello):
            error = self.layout.mismatch(msg.layout)
            if msg.transport != self.transport:
                error = f"KV transports differ ({msg.transport} vs {self.transport})"
            if error:
                logger.error("refused KV handshake from %s: %s", msg.engine_id, error)
            return HelloReply(self.engine_id, self.layout, error, self.transport, list(self.rank_addresses)), None
        if isinstance(msg, PeerGone):  # the router dropped that instance (it stopped pinging)
            logger.warning("the router dropped the KV peer at %s; ending its transfers", msg.peer)
            self._peer_gone(msg.peer)
            return None
        with self.lock:
            if isinstance(msg, RankDone):
                t = self.table.find(msg.request_id, msg.transfer_id)
                if t is not None:
                    self.table.pair_done(t, msg.pair, msg.error)
                    if t.state == S.DONE:
                        stamp(logger, t.side, "conn.kv_done", t.request_id)
                    self._after_end(t)
            elif isinstance(msg, FreeBlocks):
                t = self.table.get(msg.request_id)
                if t is not None and t.state == S.HELD:
                    self.table.move(t, S.DONE)
            elif isinstance(msg, DecodeBlocks | AbortTransfer):
                stamp(logger, "prefill", f"conn.{type(msg).__name__}", msg.transfer_id)
                t = self.table.find(transfer_id=msg.transfer_id)
                if t is None:
                    self._early(msg)
                else:
                    self._prefill_message(t, msg)
            elif isinstance(msg, FirstToken):
                t = self.table.find(transfer_id=msg.transfer_id)
                if t is not None and t.side == "decode" and t.first_token is None:
                    stamp(logger, "decode", "conn.first_token_msg", t.request_id)
                    t.first_token = self.first_tokens[t.request_id] = (msg.token_id, msg.logprobs)
            elif isinstance(msg, TransferDone):
                t = self.table.find(transfer_id=msg.transfer_id)
                if t is not None:
                    self.table.end(t, S.FAILED, f"KV transfer failed on the prefill instance: {msg.error}", quiet=True)
        return None

    def _prefill_message(self, t: Transfer, msg) -> None:
        """Prefill, write mode: decode's block ids (or its abort) for transfer t (lock held). The
        next step's KVStepMeta pushes what the request has computed so far (build_meta)."""
        if isinstance(msg, AbortTransfer):
            self._end_push(t, S.ABORTED, "the decode request was aborted")
            return
        if t.state != S.WAITING_FOR_BLOCKS:
            return
        if not msg.block_ids:
            self.table.move(t, S.DONE)
            return
        try:
            t.pairs = plan_pairs(self.layout, msg.layout)
        except ValueError as e:
            self._end_push(t, S.FAILED, str(e))
            return
        t.peer_ranks, t.remote_blocks = list(msg.rank_addresses), list(msg.block_ids)
        self.table.start_moving(t, t.pairs, self.transfer_timeout_s)
        if t.first_token is not None:  # sampled while the ids were on their way
            self._send_first_token(t)

    def _early(self, msg: DecodeBlocks | AbortTransfer) -> None:
        """Prefill, write: a message for a request not seen here (yet), or that ended here before
        decode's ids came, kept for it (lock held). Decode's ids meeting a reason nothing will be
        pushed (decode's abort: the client hung up before the router's request reached us; or the
        request's end here, an AbortTransfer of our own) are answered at once with TransferDone,
        else decode keeps the blocks (and, if it still runs, the request) until its transfer
        timeout. The abort stays, for a request that still comes: it ends without pushing."""
        prior = self.inbox.get(msg.transfer_id)
        if {type(prior), type(msg)} == {DecodeBlocks, AbortTransfer}:
            ids = msg if isinstance(msg, DecodeBlocks) else prior
            if ids.block_ids and ids.reply_to:
                self._tell(ids.reply_to, TransferDone(msg.transfer_id, "the request ended before its KV transfer"))
            msg = AbortTransfer(msg.transfer_id)
        _remember(self.inbox, msg.transfer_id, msg)  # (bounded: the oldest are dropped)

    def _send_first_token(self, t: Transfer) -> None:
        """Prefill, write: tell decode the first output token (lock held; decode knows t)."""
        peer, first = t.peer, FirstToken(t.transfer_id, *t.first_token)
        stamp(logger, "prefill", "conn.first_token_sent", t.request_id)
        self._tell(peer, first)

    def _end_push(self, t: Transfer, state: S, error: str) -> None:
        """Prefill, write: stop t. Pushes may have started: the ranks end them and tell decode."""
        if t.state.terminal:
            return
        if t.state == S.TRANSFERRING:
            self.finishes.append(FinishOp(t.request_id, t.transfer_id, t.pairs, t.peer_ranks, error))
            self.table.move(t, state, error)
        else:
            self.table.end(t, state, error, quiet=True)
            if t.peer:
                self._tell(t.peer, TransferDone(t.transfer_id, error))

    def _after_end(self, t: Transfer) -> None:
        """Decode, read: once t's ranks are done (or it ended), tell prefill to free (lock held)."""
        if t.side == "decode" and t.mode == "read" and t.settled and t.peer and not t.told_peer:
            t.told_peer = True
            self._tell(t.peer, FreeBlocks(t.params.remote_request_id))

    def _tell(self, peer: str, msg) -> None:
        """Send msg to peer from the agent's client thread (never blocks the caller; a failure is logged)."""
        self.agent.submit(lambda: self._send_quietly(peer, msg))

    def _send_quietly(self, peer: str, msg) -> None:
        try:
            self.agent.send(peer, msg)
        except TransferError as e:
            logger.warning("could not tell %s %s: %s", peer, type(msg).__name__, e)

    def _peer_gone(self, peer: str) -> None:
        """The other instance at peer is gone (client thread): end its transfers now."""
        with self.lock:
            for t in list(self.table.transfers.values()):
                if t.peer == peer and not t.state.terminal:
                    self.table.end(t, S.FAILED, f"the KV peer instance at {peer} is gone", quiet=True)
        self.news.set()

    # ---- scheduler hooks (engine thread) ---------------------------------------------------

    def num_remote_tokens(self, req: Request, num_local_computed: int) -> int:
        p: KVTransferParams | None = req.kv_transfer_params
        if p is None or not p.do_remote_prefill:
            return 0
        n = max(0, req.num_prompt_tokens - num_local_computed)
        if n == 0:  # nothing to receive; release the prefill's blocks (read) or its wait (write)
            msg = (DecodeBlocks(p.transfer_id, self.engine_id, []) if p.mode == "write"
                   else FreeBlocks(p.remote_request_id))
            self._tell(p.peer, msg)
        return n

    def on_blocks_allocated(self, req: Request, num_remote_tokens: int) -> None:
        """Decode: req owns blocks for the remote tokens; shake hands, then read or announce."""
        p = req.kv_transfer_params
        first = (req.remote_computed_tokens - num_remote_tokens) // self.block_size
        last = cdiv(req.remote_computed_tokens, self.block_size)
        t = Transfer(req.request_id, "decode", p, S.HANDSHAKING, self.table.clock() + self.transfer_timeout_s,
                     peer=p.peer)
        if p.mode == "write":
            t.local_blocks = [-1] * first + req.block_ids[first:last]
            if peer_writes_memory(self.transport):  # ended early: keep the blocks until prefill's pushes end
                t.drain_s = self.transfer_timeout_s
        else:
            t.local_blocks, t.remote_blocks = req.block_ids[first:last], p.remote_block_ids[first:last]
        with self.lock:
            self.table.add(t)
            if p.first_token_id is not None:
                t.first_token = self.first_tokens[req.request_id] = (p.first_token_id, p.first_token_logprobs)
        self.agent.submit(lambda: self._connect(t))

    def _connect(self, t: Transfer) -> None:
        """Decode (client thread): handshake with the prefill, map the rank layouts."""
        try:
            reply, _ = self.agent.hello(t.peer, self._hello())
            pairs = plan_pairs(reply.layout, self.layout)
        except (TransferError, ValueError) as e:
            with self.lock:
                self.table.end(t, S.FAILED, str(e), quiet=True)
                self._after_end(t)
            self.news.set()
            return
        self.agent.watch(t.peer, self._peer_gone)
        stamp(logger, "decode", "conn.handshake_done", t.request_id)
        with self.lock:
            if t.state != S.HANDSHAKING:
                return
            t.pairs, t.peer_ranks = pairs, list(reply.rank_addresses)
            self.table.move(t, S.READY)
            if t.mode == "write":
                self.table.start_moving(t, pairs, self.transfer_timeout_s)
                msg = DecodeBlocks(t.transfer_id, self.engine_id, t.local_blocks, self.layout, self.rank_addresses,
                                   self.agent.address)
        if t.mode == "write":
            self.agent.send(t.peer, msg)
        self.news.set()  # read: the next step starts the ranks' reads

    def ready(self, req: Request) -> bool:
        """Prefill, write mode: register req's transfer; it may compute at once, whether decode's
        block ids have come or not (within _EARLY_SHARE of the cache), unless the transfer
        already ended (decode aborted: poll ends the request)."""
        p = req.kv_transfer_params
        if p is None or not (p.do_remote_decode and p.mode == "write"):
            return True
        with self.lock:
            t = self.table.get(req.request_id)
            if t is None:
                t = self.table.add(Transfer(req.request_id, "prefill", p, S.WAITING_FOR_BLOCKS,
                                            self.table.clock() + self.transfer_timeout_s, peer=p.peer, request=req))
                if t.peer:  # a decode that is or goes away: end at once, free the blocks (not after the timeout)
                    self.agent.submit(lambda: self.agent.watch(t.peer, self._peer_gone))
                early = self.inbox.pop(p.transfer_id, None)
                if early is not None:
                    self._prefill_message(t, early)
            if t.state == S.WAITING_FOR_BLOCKS:
                return self._room_before_ids(req)
            return not t.state.terminal or t.state == S.DONE

    def _room_before_ids(self, req: Request) -> bool:
        """May req start before decode's block ids came? (lock held; see _EARLY_SHARE)"""
        held = sum(len(t.request.block_ids) for t in self.table.transfers.values()
                   if t.state == S.WAITING_FOR_BLOCKS and t.request is not None)
        return held + cdiv(req.num_prompt_tokens, self.block_size) <= _EARLY_SHARE * self.num_blocks

    def wait(self, timeout_s: float) -> None:
        """Engine thread, idle with transfers in flight: sleep up to timeout_s, less when news came
        (a waiting write-mode prefill starts as soon as decode's block ids arrive, a decode emits
        the prefill's first token as soon as it arrives). News that lands after the clear sets the
        event again; news before it is already in the state the next step reads."""
        if self.news.wait(timeout_s):
            self.news.clear()

    def take_first_tokens(self) -> dict[str, tuple[int, list | None]]:
        """Decode: {request id: (first output token, its logprobs or None)} arrived from prefills
        since the last call."""
        with self.lock:
            out, self.first_tokens = self.first_tokens, {}
        return out

    def build_meta(self, scheduled: list[tuple[Request, int]]) -> KVStepMeta | None:
        """What this step transfers, for every rank: reads whose handshake is done, pushes of
        the scheduled prefill chunks, ended pushes, closed receives."""
        meta = KVStepMeta(self.agent.address)
        with self.lock:
            for t in self.table.transfers.values():
                if t.side == "decode" and t.mode == "read" and t.state == S.READY:
                    self.table.start_moving(t, t.pairs, self.transfer_timeout_s)
                    stamp(logger, "decode", "conn.read_start", t.request_id)
                    meta.reads.append(ReadOp(t.request_id, t.params.remote_request_id, t.remote_blocks,
                                             t.local_blocks, t.pairs, t.peer_ranks))
            chunks = {req.request_id: n for req, n in scheduled}
            for t in self.table.transfers.values():
                if t.side == "prefill" and t.state == S.TRANSFERRING and t.request is not None:
                    meta.pushes += plan_pushes(t, chunks.get(t.request_id, 0), self.block_size)
            meta.finishes, self.finishes = self.finishes, []
            meta.closed, self.closed = self.closed, []
        return meta if meta else None

    def poll(self) -> tuple[set[str], dict[str, str], set[str]]:
        """(decode ids whose KV landed, {id: error} of transfers that failed for a waiting or
        running request, ids whose blocks may be freed now)."""
        landed, failed, releasable = set(), {}, set()
        with self.lock:
            for t in self.table.expire():
                logger.warning("KV transfer of %s: %s", t.request_id, t.error)
                if t.side == "decode" and t.mode == "write" and t.peer and t.pending:
                    self._tell(t.peer, AbortTransfer(t.transfer_id))  # prefill's ranks end their pushes
                elif t.side == "prefill" and t.mode == "write" and t.peer and not t.remote_blocks:
                    self._tell(t.peer, TransferDone(t.transfer_id, t.error))  # nothing was pushed
            for t in list(self.table.transfers.values()):
                self._after_end(t)
                if not t.settled:
                    continue
                if t.request_done:
                    releasable.add(t.request_id)
                elif t.side == "decode":
                    if t.state == S.DONE and t.first_token is None:
                        if self.table.clock() <= t.deadline:
                            continue  # the KV landed; the prefill's first token is still on its way
                        failed[t.request_id] = "the prefill instance sent no first token within the transfer timeout"
                    elif t.state == S.DONE:
                        landed.add(t.request_id)
                    else:
                        failed[t.request_id] = t.error or f"KV transfer {t.state.value}"
                elif t.state == S.DONE:
                    continue  # prefill write: pushes landed while the request still runs
                else:
                    failed[t.request_id] = t.error or f"KV transfer {t.state.value}"
                self._remove(t)
        return landed, failed, releasable

    def _remove(self, t: Transfer) -> None:
        self.table.remove(t)
        if t.side == "decode" and t.mode == "write":
            self.closed.append(t.transfer_id)

    def on_request_finished(self, req: Request) -> tuple[bool, dict | None]:
        """(keep req's blocks until its transfer settles?, kv_transfer_params for the client)."""
        p = req.kv_transfer_params
        if p is None:
            return False, None
        ok = req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        with self.lock:
            t = self.table.get(req.request_id)
            if p.do_remote_decode and p.mode == "read":
                return self._hold_for_read(req, p) if ok else (False, None)
            if p.do_remote_decode and p.mode == "write" and p.peer and not ok and (t is None or not t.remote_blocks):
                self._early(AbortTransfer(p.transfer_id))  # (aborted while queued, or waiting for ids)
            if t is None:
                if p.do_remote_prefill and p.mode == "write" and p.peer and not ok and not req.num_output_tokens:
                    # decode ended before it asked for any KV (aborted while queued): the prefill,
                    # which may hold the prompt's blocks for our ids, would wait out its timeout
                    self._tell(p.peer, AbortTransfer(p.transfer_id))
                elif p.do_remote_prefill and p.mode == "read" and p.peer and not ok and not req.block_ids:
                    # read: the same, for the blocks the prefill holds for our read (hold_timeout_s)
                    self._tell(p.peer, FreeBlocks(p.remote_request_id))
                return False, None
            if t.side == "decode" and not t.state.terminal:
                self.table.end(t, S.ABORTED, "the request finished")
                if t.mode == "write" and t.peer:
                    self._tell(t.peer, AbortTransfer(t.transfer_id))
                if t.state == S.ABORTED and not t.pending:
                    self._after_end(t)
            elif t.side == "prefill" and not ok:
                self._end_push(t, S.ABORTED, req.error or "the prefill request was aborted")
            elif t.side == "prefill" and t.peer and req.num_output_tokens:
                t.first_token = (req.output_token_ids[0], _logprobs_list(req))
                if t.state != S.WAITING_FOR_BLOCKS:  # else once decode's ids come (_prefill_message)
                    self._send_first_token(t)
            t.request_done = True
            hold = not t.settled
            if not hold:
                self._remove(t)
        params = {"transfer_id": p.transfer_id} if (p.do_remote_decode and ok) else None
        return hold, params

    def _hold_for_read(self, req: Request, p: KVTransferParams) -> tuple[bool, dict]:
        """Prefill, read mode: keep the blocks for the decode (lock held)."""
        t = self.table.add(Transfer(req.request_id, "prefill", p, S.HELD, self.table.clock() + self.hold_timeout_s,
                                    peer=p.peer, request_done=True))
        if t.peer:  # the decode that will read: free at once if it goes away
            self.agent.submit(lambda: self.agent.watch(t.peer, self._peer_gone))
        host, port = self.agent.address.rsplit(":", 1)
        out = KVTransferParams(do_remote_prefill=True, remote_engine_id=self.engine_id,
                               remote_block_ids=list(req.block_ids), remote_host=host, remote_port=int(port),
                               remote_request_id=req.request_id, first_token_id=req.output_token_ids[0],
                               first_token_logprobs=_logprobs_list(req))
        return True, out.to_dict()

    def close(self) -> None:
        self.agent.close()
