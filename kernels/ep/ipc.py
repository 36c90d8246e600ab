"""ipc dispatch/combine: Triton kernels that write tokens straight into the peers' receive
buffers through GPU peer memory (CUDA IPC over NVLink; HIP IPC over XGMI), one node.

Each rank allocates one buffer and shares it with its peers at construction (CUDA IPC
handles, exchanged with all_gather_object over the group); a device table holds every rank's
buffer address as seen from this process. Regions, W ranks, M = max_tokens_per_rank:

  x       [W, M, H]     dtype    row [s, t]: token t of source rank s
  ids     [W, M, k]     int32    its experts' local indices here, -1 where held elsewhere
  weights [W, M, k]     float32  its top-k weights
  comb    [W, M, H]     dtype    row [s, t]: rank s's expert output for our token t
  flags   [W]           int32    barrier slot per peer (0 = empty)
  counts  [W]           int32    tokens each source sent in the last dispatch (local)

dispatch: one program per (token, hidden chunk) copies the chunk once to each rank holding >= 1
of the token's experts (dedup per rank) with the token's ids and weights; then a barrier that
also carries each source's token count. The experts run over all W * M rows: rows not sent
here hold ids -1 (the resting state of the ids region) and are skipped.
combine: each rank writes the y rows it received back into the home rank's comb slot, barrier,
then the home rank sums, per token, its own y row and the comb rows of the ranks it sent the
token to, and resets the ids slots it wrote on those ranks back to -1.

Barrier: program d of a one-program-per-rank kernel waits until rank d has emptied our slot in
its flags (it consumed our previous arrival), sets it (release, system scope), then waits for
rank d's arrival on its own slot and empties it (acquire). Slots return to 0 after every
barrier, so the state is the same at every CUDA-graph replay and no epoch counter is needed.
The copy kernels' plain stores reach the barrier's release through the kernel boundary (same
stream), as in PyTorch's symmetric-memory barriers.

Why two barriers per layer suffice (each rank's stream orders its own kernels):
- x/ids/weights of rank r are rewritten by a source only after it passed the previous combine
  barrier, which r signals after its experts and combine-send kernels read them;
- ids slots are reset by the home rank after the combine barrier (the receiver's experts and
  combine-send are done) and before the home rank's next dispatch signal;
- comb of rank r is written by peers after the next dispatch barrier, which r signals only after
  its combine-sum read comb;
- counts and flags are covered by the same two orders.
Everything is stream-ordered with no host sync: dispatch -> experts -> combine can be captured
in a CUDA graph. The returned x'/weights'/ids' are views of the receive buffers, valid until
combine; topk_ids must stay unchanged between dispatch and combine (combine reads it).

All ranks' GPUs must be visible to every process (pick each rank's GPU with torch.cuda.set_device,
not CUDA_VISIBLE_DEVICES). On ROCm this has not been run: flag polling may need uncached
(fine-grained) memory there.
"""
import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from tandem.kernels.ep.placement import ExpertMap

_MAX_TOP_K = 32  # id/weight slots per token
_ALIGN = 256


@triton.jit
def _peer(bases_ptr, rank, offset, ty: tl.constexpr):
    """Pointer to region `offset` (bytes) of rank's buffer, as ty elements (16-byte aligned)."""
    base = tl.multiple_of(tl.load(bases_ptr + rank), 16)
    return (base + offset).to(tl.pointer_type(ty))


@triton.jit
def _only_if(cond, mask):
    """mask where the scalar cond holds, else all false."""
    return tl.where(cond, mask, False)


@triton.jit
def _token_experts(ids_ptr, owner_ptr, t, num_experts, TOP_K: tl.constexpr, K_PAD: tl.constexpr):
    """Token t's top-k slots: (slot, slot < TOP_K, expert id, valid expert, its owner rank or -1)."""
    slot = tl.arange(0, K_PAD)
    in_k = slot < TOP_K
    e = tl.load(ids_ptr + t * TOP_K + slot, mask=in_k, other=-1)
    valid = in_k & (e >= 0) & (e < num_experts)
    owner = tl.load(owner_ptr + e, mask=valid, other=-1)
    return slot, in_k, e, valid, owner


@triton.jit
def _owns_any(owner, d):
    """Whether rank d holds at least one of the token's experts."""
    return tl.max((owner == d).to(tl.int32), axis=0) > 0


@triton.jit
def _dispatch_kernel(x_ptr, stride_x, ids_ptr, w_ptr, owner_ptr, local_ptr, bases_ptr,
                     x_off, ids_off, w_off, me, hidden, num_experts, rows_per_src,
                     TOP_K: tl.constexpr, K_PAD: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """Program (t, c): columns [c * BLOCK, (c + 1) * BLOCK) of token t to slot [me, t] of each
    rank that holds one of its experts; chunk 0 also writes the token's local ids and weights."""
    t = tl.program_id(0)
    c = tl.program_id(1)
    slot, in_k, e, valid, owner = _token_experts(ids_ptr, owner_ptr, t, num_experts, TOP_K, K_PAD)
    local = tl.load(local_ptr + e, mask=valid, other=-1)
    weight = tl.load(w_ptr + t * TOP_K + slot, mask=in_k, other=0.0)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    in_h = cols < hidden
    row = tl.load(x_ptr + t.to(tl.int64) * stride_x + cols, mask=in_h)
    dst = (me * rows_per_src + t).to(tl.int64)
    for d in tl.static_range(WORLD):
        hit = owner == d
        sends = _owns_any(owner, d)
        x_dst = _peer(bases_ptr, d, x_off, x_ptr.dtype.element_ty)
        tl.store(x_dst + dst * hidden + cols, row, mask=_only_if(sends, in_h))
        meta = _only_if(sends, _only_if(c == 0, in_k))
        ids_dst = _peer(bases_ptr, d, ids_off, tl.int32)
        tl.store(ids_dst + dst * TOP_K + slot, tl.where(hit, local, -1), mask=meta)
        w_dst = _peer(bases_ptr, d, w_off, tl.float32)
        tl.store(w_dst + dst * TOP_K + slot, weight, mask=meta)


@triton.jit
def _barrier_kernel(bases_ptr, flags_off, counts_ptr, me, signal, STORE_COUNTS: tl.constexpr):
    """Program d: arrive at rank d (its slot [me]: 0 -> signal, once it consumed our last
    arrival), then take rank d's arrival from our slot [d] (-> 0); its value - 1 is rank d's
    token count when STORE_COUNTS."""
    d = tl.program_id(0)
    peer_flags = _peer(bases_ptr, d, flags_off, tl.int32)
    while tl.atomic_cas(peer_flags + me, 0, signal, sem="release", scope="sys") != 0:
        pass
    my_flags = _peer(bases_ptr, me, flags_off, tl.int32)
    got = tl.atomic_xchg(my_flags + d, 0, sem="acquire", scope="sys")
    while got == 0:
        got = tl.atomic_xchg(my_flags + d, 0, sem="acquire", scope="sys")
    if STORE_COUNTS:
        tl.store(counts_ptr + d, got - 1)


@triton.jit
def _combine_send_kernel(y_ptr, stride_y, recv_ids_ptr, counts_ptr, bases_ptr, comb_off, me, hidden,
                         max_tokens, rows_per_src, TOP_K: tl.constexpr, K_PAD: tl.constexpr, WORLD: tl.constexpr,
                         BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr):
    """Persistent programs over (source rank s != me, token t < counts[s], chunk): the y row of
    each received token -> slot [me, t] of rank s's comb."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    slot = tl.arange(0, K_PAD)
    for s in tl.static_range(WORLD):
        work = tl.where(s == me, 0, tl.load(counts_ptr + s) * NUM_CHUNKS)
        comb = _peer(bases_ptr, s, comb_off, y_ptr.dtype.element_ty)
        for i in range(pid, work, num_programs):
            t = i // NUM_CHUNKS
            src = (s * rows_per_src + t).to(tl.int64)
            e = tl.load(recv_ids_ptr + src * TOP_K + slot, mask=slot < TOP_K, other=-1)
            cols = (i % NUM_CHUNKS) * BLOCK + tl.arange(0, BLOCK)
            m = _only_if(tl.max(e, axis=0) >= 0, cols < hidden)
            v = tl.load(y_ptr + src * stride_y + cols, mask=m)
            tl.store(comb + (me * max_tokens + t).to(tl.int64) * hidden + cols, v, mask=m)


@triton.jit
def _combine_sum_kernel(out_ptr, y_ptr, stride_y, comb_ptr, ids_ptr, owner_ptr, bases_ptr, ids_off, me,
                        hidden, num_experts, max_tokens, rows_per_src, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                        WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """Program (t, c): out[t] = sum over the ranks token t was sent to of their expert output
    (ours from y, the peers' from comb). Chunk 0 resets the ids slots [me, t] on those ranks."""
    t = tl.program_id(0)
    c = tl.program_id(1)
    slot, in_k, e, valid, owner = _token_experts(ids_ptr, owner_ptr, t, num_experts, TOP_K, K_PAD)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    in_h = cols < hidden
    row = (me * rows_per_src + t).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for d in tl.static_range(WORLD):
        sent = _owns_any(owner, d)
        own = tl.load(y_ptr + row * stride_y + cols, mask=_only_if(sent, _only_if(d == me, in_h)), other=0.0)
        peer = tl.load(comb_ptr + (d * max_tokens + t).to(tl.int64) * hidden + cols,
                       mask=_only_if(sent, _only_if(d != me, in_h)), other=0.0)
        acc += own.to(tl.float32) + peer.to(tl.float32)
        ids_dst = _peer(bases_ptr, d, ids_off, tl.int32)
        tl.store(ids_dst + row * TOP_K + slot, tl.full([K_PAD], -1, tl.int32), mask=_only_if(sent, _only_if(c == 0, in_k)))
    tl.store(out_ptr + t.to(tl.int64) * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=in_h)


def _layout(world: int, max_tokens: int, hidden: int, dtype: torch.dtype) -> tuple[dict[str, int], dict[str, int], int]:
    """Byte offset and size of each region in the one shared buffer, and the buffer's size."""
    rows, es = world * max_tokens, dtype.itemsize
    sizes = {"x": rows * hidden * es, "ids": rows * _MAX_TOP_K * 4, "weights": rows * _MAX_TOP_K * 4,
             "comb": rows * hidden * es, "flags": world * 4, "counts": world * 4}
    offsets, end = {}, 0
    for name, size in sizes.items():
        offsets[name] = end
        end += -(-size // _ALIGN) * _ALIGN
    return offsets, sizes, end


def _enable_peer_access(device: torch.device, peer: torch.device) -> None:
    """Let kernels on `device` reach `peer`'s memory (torch enables it on a cross-device copy)."""
    if not torch.cuda.can_device_access_peer(device, peer):
        raise ValueError(f"{device} cannot access {peer}'s memory (no GPU peer-to-peer path between them); "
                         "the ipc all2all backend needs one: use a2a or naive")
    a, b = torch.zeros(1, device=device), torch.zeros(1, device=peer)
    b.copy_(a)
    a.copy_(b)


def _open_peer_buffers(buffer: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int) -> list[torch.Tensor]:
    """Every rank's buffer, mapped into this process (ours as is). The caller synchronized the
    buffer's initialization before sharing it."""
    _, args = reduce_tensor(buffer)
    gathered: list = [None] * size
    dist.all_gather_object(gathered, args, group=group)
    peers = []
    for r, peer_args in enumerate(gathered):
        if r == rank:
            peers.append(buffer)
            continue
        # reduce_tensor's args: [6] the storage's device, [14] whether to wait on its IPC event.
        # The handle is opened in OUR device's context (torch would open it in the owner's):
        # only then may our kernels address it. The returned tensor's device label is ours,
        # its memory the peer's: it is used for its address only.
        peer_args = list(peer_args)
        _enable_peer_access(buffer.device, torch.device("cuda", peer_args[6]))
        peer_args[6], peer_args[14] = buffer.device.index, False
        peers.append(rebuild_cuda_tensor(*peer_args))
    torch.cuda.synchronize(buffer.device)
    return peers


class IpcDispatch:
    graph_safe = True

    def __init__(self, group: dist.ProcessGroup | None, experts: ExpertMap, max_tokens_per_rank: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device | None = None,
                 uniform_tokens: bool = False):
        """group None leaves the peers unattached (`_attach`): single-process emulation in tests.
        uniform_tokens: every rank dispatches the same T (the engine's lockstep DP ranks pad to
        it), so source s's rows start at s * T rather than s * M and the experts run over W * T
        rows instead of W * M (decode: a few rows, not the whole buffer)."""
        self.group, self.experts, self.uniform = group, experts, uniform_tokens
        self.rank, self.size = experts.rank, experts.size
        self.max_tokens, self.hidden, self.dtype = max_tokens_per_rank, hidden_size, dtype
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.offsets, self.sizes, nbytes = _layout(self.size, self.max_tokens, hidden_size, dtype)
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self._region("ids", torch.int32).fill_(-1)  # resting state: no row holds an expert
        self.counts = self._region("counts", torch.int32)
        self.block = min(1024, triton.next_power_of_2(hidden_size))
        self.num_chunks = triton.cdiv(hidden_size, self.block)
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 2
        self.send_programs = max(1, min((self.size - 1) * self.max_tokens * self.num_chunks, 4 * sms))
        self.owner, self.local = experts.get("owner", self.device), experts.get("local", self.device)
        self.peers: list[torch.Tensor] = []
        if group is not None:
            torch.cuda.synchronize(self.device)  # the resting state is in place before peers can write
            self._attach(_open_peer_buffers(self.buffer, group, self.rank, self.size))

    def _region(self, name: str, dtype: torch.dtype, numel: int | None = None) -> torch.Tensor:
        start = self.offsets[name]
        numel = self.sizes[name] // dtype.itemsize if numel is None else numel
        return self.buffer[start:start + numel * dtype.itemsize].view(dtype)

    def _attach(self, peers: list[torch.Tensor]) -> None:
        self.peers = peers
        self.bases = torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64, device=self.device)

    def _barrier(self, signal: int, store_counts: bool) -> None:
        _barrier_kernel[(self.size,)](self.bases, self.offsets["flags"], self.counts, self.rank, signal,
                                      STORE_COUNTS=store_counts, num_warps=1)

    def _meta(self, top_k: int) -> dict:
        return dict(TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), WORLD=self.size, BLOCK=self.block,
                    num_warps=4)

    def _dispatch_send(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
        num_tokens, top_k = topk_ids.shape
        if num_tokens > self.max_tokens:
            raise ValueError(f"ipc dispatch got {num_tokens} tokens but its buffers hold max_tokens_per_rank="
                             f"{self.max_tokens}; raise max_tokens_per_rank")
        if top_k > _MAX_TOP_K:
            raise ValueError(f"ipc dispatch supports top-k up to {_MAX_TOP_K}, got {top_k}")
        if x.shape != (num_tokens, self.hidden) or x.dtype != self.dtype:
            raise ValueError(f"ipc dispatch was built for [T, {self.hidden}] {self.dtype} tokens, "
                             f"got {tuple(x.shape)} {x.dtype}")
        if num_tokens == 0:
            return
        x = x if x.stride(-1) == 1 else x.contiguous()
        _dispatch_kernel[(num_tokens, self.num_chunks)](
            x, x.stride(0), topk_ids.contiguous(), topk_weights.contiguous(), self.owner, self.local, self.bases,
            self.offsets["x"], self.offsets["ids"], self.offsets["weights"], self.rank, self.hidden,
            self.experts.num_experts, self._rows_per_src(num_tokens), **self._meta(top_k))

    def _rows_per_src(self, num_tokens: int) -> int:
        return num_tokens if self.uniform else self.max_tokens

    def _received(self, top_k: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = self.size * self._rows_per_src(num_tokens)
        return (self._region("x", self.dtype, rows * self.hidden).view(rows, self.hidden),
                self._region("weights", torch.float32, rows * top_k).view(rows, top_k),
                self._region("ids", torch.int32, rows * top_k).view(rows, top_k))

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor):
        """-> x' [W * R, H], weights' [W * R, k], ids' [W * R, k] (views of the receive buffers;
        R = M, or T with uniform_tokens)."""
        self._dispatch_send(x, topk_weights, topk_ids)
        self._barrier(x.shape[0] + 1, store_counts=True)
        return *self._received(topk_ids.shape[1], x.shape[0]), (topk_ids, x.shape[0])

    def _combine_send(self, y: torch.Tensor, top_k: int, num_tokens: int) -> None:
        rows = self.size * self._rows_per_src(num_tokens)
        if y.shape != (rows, self.hidden) or y.dtype != self.dtype:
            raise ValueError(f"ipc combine expects the experts' output for dispatch's rows, "
                             f"[{rows}, {self.hidden}] {self.dtype}; got {tuple(y.shape)} {y.dtype}")
        _, _, recv_ids = self._received(top_k, num_tokens)
        _combine_send_kernel[(self.send_programs,)](
            y, y.stride(0), recv_ids, self.counts, self.bases, self.offsets["comb"], self.rank, self.hidden,
            self.max_tokens, self._rows_per_src(num_tokens), NUM_CHUNKS=self.num_chunks, **self._meta(top_k))

    def _combine_sum(self, y: torch.Tensor, handle) -> torch.Tensor:
        topk_ids, num_tokens = handle
        out = torch.empty((num_tokens, self.hidden), dtype=y.dtype, device=y.device)
        if num_tokens:
            _combine_sum_kernel[(num_tokens, self.num_chunks)](
                out, y, y.stride(0), self._region("comb", self.dtype), topk_ids.contiguous(), self.owner, self.bases,
                self.offsets["ids"], self.rank, self.hidden, self.experts.num_experts, self.max_tokens,
                self._rows_per_src(num_tokens), **self._meta(topk_ids.shape[1]))
        return out

    def combine(self, y: torch.Tensor, handle) -> torch.Tensor:
        y = y if y.stride(-1) == 1 else y.contiguous()
        self._combine_send(y, handle[0].shape[1], handle[1])
        self._barrier(1, store_counts=False)
        return self._combine_sum(y, handle)

    def close(self) -> None:
        """Collective: unmaps the peers' buffers once no rank can still write into ours."""
        if self.group is not None and self.peers:
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.group)
        self.peers = []
