"""How fast the decode attention's K/V reads can go: the same tiles gathered through the block table
with no math, in the cache's layout (NHD: [blocks, page, Hk, D], as the engine keeps it) and
head-major (HND: [blocks, Hk, page, D], where a head's page is one contiguous run), against the
attention itself on the NHD cache and the copy ceiling, all in one run.

The Llama-3-8B b=64 attention over an fp8 cache runs at about 1.75x its K/V bytes at the copy rate
(benchmarks/RESULTS.md). If the NHD gather alone is near the copy rate, that gap is the attention's
own work; if NHD is slow and HND fast, it is the layout.

Each program reads one (sequence, KV head) of K and V, or with SPLIT > 1 a 1 / SPLIT share of its
keys, BLOCK_N keys a turn, as 32-bit words (an fp8 head of 128 values is 32 words) and XORs them
together: one integer op a word, no conversion. The result is checked against a torch reference
before anything is timed. Two rows read the same bytes with the pages in order, no shuffle; one
pair reads them with no block table (each program one contiguous run, the same tiles); on Hopper
and newer, TMA rows copy each page's rows of the head by a tensor descriptor, several pages in flight
without the program's registers (what a TMA-fed attention's reads could do); one
row times a torch copy of K (the same bytes moved: K read, written back): the copy rate at this
size, against the 4 GiB copy the ceiling is measured on. The attention rows (attention_rows) time the Triton
decode attention and, on Hopper, the wgmma one (kernels/triton/attention_wgmma.py) over the same cache, alone and
as the engine's decode step takes them (rope fused, fp8 output); --attention-only runs just those.

  python -m benchmarks.kv_gather --batch 64 --context 1024
  python -m benchmarks.kv_gather --batch 64 --context 1024 --attention-only
"""
import argparse
import json

import torch
import triton
import triton.language as tl

HK, D, PAGE = 8, 128, 16  # Llama-3-8B's KV heads and head dim; the engine's page
# (BLOCK_N, num_warps, num_stages, SPLIT): the attention's b=64 plan first, then its neighbours, then
# more loads in flight: more warps a program, or each sequence's keys split over SPLIT programs
PLANS = [(64, 4, 2, 1), (64, 4, 3, 1), (32, 4, 3, 1), (128, 4, 3, 1), (64, 8, 3, 1), (128, 8, 3, 1),
         (64, 16, 3, 1), (64, 4, 2, 2), (64, 8, 3, 2), (64, 4, 2, 4), (64, 8, 3, 4)]
TMA_PLANS = [(4, 2), (4, 4), (4, 6), (4, 8), (1, 8)]  # (num_warps, stages) of the TMA gather (Hopper and newer)


@triton.jit
def _gather_kernel(k_ptr, v_ptr, bt_ptr, out_ptr, ctx, stride_bt, stride_kb, stride_ko, stride_kh,
                   PAGE: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """out[split, seq, head] = XOR of every word of the K and V rows of this head in the split's
    share of the sequence's ctx keys (ctx / SPLIT, a multiple of BLOCK_N), read BLOCK_N keys at a
    time through the block table. Strides in words."""
    head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    n = tl.arange(0, BLOCK_N)
    w = tl.arange(0, WORDS)
    acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.int32)
    share = ctx // tl.num_programs(2)
    for start in range(split * share, (split + 1) * share, BLOCK_N):
        keys = start + n
        block = tl.load(bt_ptr + seq * stride_bt + keys // PAGE).to(tl.int64)
        rows = block * stride_kb + (keys % PAGE) * stride_ko + head * stride_kh
        ptrs = rows[:, None] + w[None, :]
        acc ^= tl.load(k_ptr + ptrs) ^ tl.load(v_ptr + ptrs)
    slot = (split * tl.num_programs(1) + seq) * tl.num_programs(0) + head
    tl.store(out_ptr + slot * WORDS + w, tl.xor_sum(acc, axis=0))


@triton.jit
def _flat_read_kernel(x_ptr, y_ptr, out_ptr, words, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """The gather's reads without the block table: program p XORs its contiguous 1 / programs share of
    the words of x and of y (words of each, a multiple of BLOCK_N * WORDS * programs), one
    [BLOCK_N, WORDS] tile of each a turn."""
    share = words // tl.num_programs(0)
    tile = tl.arange(0, BLOCK_N)[:, None] * WORDS + tl.arange(0, WORDS)[None, :]
    offs = tl.program_id(0).to(tl.int64) * share + tile
    acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.int32)
    for start in range(0, share, BLOCK_N * WORDS):
        acc ^= tl.load(x_ptr + offs + start) ^ tl.load(y_ptr + offs + start)
    tl.store(out_ptr + tl.program_id(0) * WORDS + tl.arange(0, WORDS), tl.xor_sum(acc, axis=0))


def flat_read(k: torch.Tensor, v: torch.Tensor, programs: int, plan: tuple[int, int, int, int]) -> torch.Tensor:
    """_flat_read_kernel over the caches' bytes in `programs` programs: [programs, D / 4] int32."""
    block_n, warps, stages, _ = plan
    kw, vw = (c.view(torch.int32).flatten() for c in (k, v))
    words = k.shape[3] // 4
    out = torch.empty(programs, words, dtype=torch.int32, device=k.device)
    _flat_read_kernel[(programs,)](kw, vw, out, kw.numel(), BLOCK_N=block_n, WORDS=words, num_warps=warps,
                                   num_stages=stages)
    return out


def flat_read_ref(k: torch.Tensor, v: torch.Tensor, programs: int) -> torch.Tensor:
    """flat_read's result in torch."""
    words = (k.view(torch.int32).flatten() ^ v.view(torch.int32).flatten()).view(programs, -1, k.shape[3] // 4)
    return xor_reduce(words, 1)


@triton.jit
def _tma_gather_kernel(k_desc, v_desc, bt_ptr, out_ptr, pages, stride_bt, PAGE: tl.constexpr, WORDS: tl.constexpr,
                       STAGES: tl.constexpr):
    """_gather_kernel's result (one split) with each page's K and V rows of this head copied by TMA
    (descriptors over the caches as [blocks * PAGE, Hk * WORDS] words), a page a turn, STAGES - 1
    pages in flight: the copies take no registers or warps of the program while they fly."""
    head = tl.program_id(0)
    seq = tl.program_id(1)
    acc = tl.zeros([PAGE, WORDS], dtype=tl.int32)
    for p in tl.range(0, pages, num_stages=STAGES):  # (the loads feed no dot: the loop's own stage count)
        row = tl.load(bt_ptr + seq * stride_bt + p) * PAGE
        acc ^= k_desc.load([row, head * WORDS]) ^ v_desc.load([row, head * WORDS])
    tl.store(out_ptr + (seq * tl.num_programs(0) + head) * WORDS + tl.arange(0, WORDS), tl.xor_sum(acc, axis=0))


def tma_gather(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, ctx: int, warps: int,
               stages: int) -> torch.Tensor:
    """_tma_gather_kernel over NHD caches of one-byte values: [seqs, Hk, D / 4] int32 (gather_ref's)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    blocks, page, heads, d = k.shape
    words = d // 4
    kd, vd = (TensorDescriptor.from_tensor(c.view(torch.int32).reshape(blocks * page, heads * words), [page, words])
              for c in (k, v))
    out = torch.empty(table.shape[0], heads, words, dtype=torch.int32, device=k.device)
    _tma_gather_kernel[(heads, table.shape[0])](kd, vd, table, out, ctx // page, table.stride(0), PAGE=page,
                                                WORDS=words, STAGES=stages, num_warps=warps)
    return out


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """An NHD cache [blocks, page, Hk, D] copied into HND [blocks, Hk, page, D]."""
    return cache.transpose(1, 2).contiguous()


def gather(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, ctx: int, hnd: bool,
           plan: tuple[int, int, int, int]) -> torch.Tensor:
    """The kernel over caches of one-byte values (NHD, or HND when hnd): [SPLIT, seqs, Hk, D / 4]
    int32, one XOR per split (gather_ref's result is their XOR)."""
    block_n, warps, stages, split = plan
    kw, vw = (c.view(torch.int32) for c in (k, v))  # [blocks, a, b, D / 4]
    seqs, heads, words = table.shape[0], k.shape[1 if hnd else 2], k.shape[3] // 4
    out = torch.empty(split, seqs, heads, words, dtype=torch.int32, device=k.device)
    stride_ko, stride_kh = (kw.stride(2), kw.stride(1)) if hnd else (kw.stride(1), kw.stride(2))
    _gather_kernel[(heads, seqs, split)](kw, vw, table, out, ctx, table.stride(0), kw.stride(0), stride_ko,
                                         stride_kh, PAGE=k.shape[2 if hnd else 1], BLOCK_N=block_n, WORDS=words,
                                         num_warps=warps, num_stages=stages)
    return out


def xor_reduce(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The XOR of t's slices along dim (torch has no XOR reduction)."""
    t = t.movedim(dim, 0)
    acc = t[0].clone()
    for part in t[1:]:
        acc ^= part
    return acc


def gather_ref(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, ctx: int) -> torch.Tensor:
    """gather's result from an NHD cache in torch: [seqs, Hk, D / 4] int32."""
    blocks = table[:, :-(-ctx // k.shape[1])].long()  # [seqs, pages]
    keys = (k[blocks] ^ v[blocks]).flatten(1, 2)[:, :ctx]  # [seqs, ctx, Hk, D] bytes
    return xor_reduce(keys.view(torch.int32), 1)


def caches(seqs: int, ctx: int, device: str, seed: int = 0):
    """Random one-byte K and V caches (NHD) of seqs sequences of ctx keys, their pages shuffled."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages = -(-ctx // PAGE)
    k, v = (torch.randint(0, 256, (seqs * pages, PAGE, HK, D), generator=g, dtype=torch.uint8).to(device)
            for _ in range(2))
    table = torch.randperm(seqs * pages, generator=g).to(torch.int32).view(seqs, pages).to(device)
    return k, v, table


def gather_rows(rows: list, floor_us: float, k, v, table, ctx: int) -> None:
    """The gathers (module docstring) over the one-byte caches, each checked against its torch reference, then
    timed: rows and lines as main's."""
    from benchmarks.kernels import bench
    seqs = table.shape[0]
    ref = gather_ref(k, v, table, ctx)
    hnd = (head_major(k), head_major(v))
    in_order = torch.arange(table.numel(), dtype=torch.int32, device="cuda").view_as(table)

    def run(what, plan, fn, want, combine=lambda out: out):
        """combine(fn()) checked against want, then fn alone timed; a row and a line for it."""
        if not torch.equal(combine(fn()), want):
            raise SystemExit(f"{what} {plan}: the result differs from the reference")
        us = bench(fn) * 1e3
        rows.append(dict(what=what, plan=plan, us=us, of_copy=floor_us / us))
        print(f"{what} BLOCK_N {plan[0]:3d} warps {plan[1]:2d} stages {plan[2]} split {plan[3]}: {us:7.1f} us "
              f"({floor_us / us:.0%} of the copy rate)", flush=True)

    def gathered(kc, vc, tab, hnd_layout, plan):
        return lambda: gather(kc, vc, tab, ctx, hnd_layout, plan)

    for plan in PLANS:
        run("gather NHD", plan, gathered(k, v, table, False, plan), ref, xor_reduce)
        run("gather HND", plan, gathered(*hnd, table, True, plan), ref, xor_reduce)
    in_order_ref = gather_ref(k, v, in_order, ctx)
    programs = seqs * HK
    flat_ref = flat_read_ref(k, v, programs)
    for plan in (PLANS[0], PLANS[4]):
        # the same reads with each sequence's pages in order (no shuffle); the same bytes and tiles with no
        # block table, each program one contiguous run
        run("gather NHD, pages in order", plan, gathered(k, v, in_order, False, plan), in_order_ref, xor_reduce)
        run(f"flat read (no block table, {programs} programs)", plan, lambda: flat_read(k, v, programs, plan),
            flat_ref)
    if torch.cuda.get_device_capability() >= (9, 0):  # TMA: the reads in flight without the program's registers
        for warps, stages in TMA_PLANS:
            run(f"TMA gather NHD, a page a turn, {stages - 1} pages in flight", (PAGE, warps, stages, 1),
                lambda: tma_gather(k, v, table, ctx, warps, stages), ref)


def attention_rows(rows: list, floor_us: float, q, k8, v8, table, seq_lens, qsl, context: int) -> None:
    """The decode attention over the same cache (one query a sequence): the Triton kernel's rule plan and, on
    Hopper, kernels/triton/attention_wgmma.py at 1-3 stages; then each as the engine's decode step takes it, rope
    fused (raw q and new keys: q and the new key rotated, the key and value stored) and the output quantized for
    the o projection. Rows and lines as main's."""
    from benchmarks.kernels import bench
    from tandem.kernels.attention import NewTokens
    from tandem.kernels.rotary import build_cos_sin_cache
    from tandem.kernels.triton.attention import paged_attention_triton
    scale, seqs, hq = D ** -0.5, q.shape[0], q.shape[1]
    fns = {"attention NHD (the rule's plan)": lambda: paged_attention_triton(q, k8, v8, table, seq_lens, qsl, scale,
                                                                             1, context)}
    qkv = torch.randn(seqs, hq + 2 * HK, D, device=q.device).to(torch.bfloat16)
    pos = seq_lens.long() - 1
    slots = table[torch.arange(seqs, device=q.device), pos // PAGE].long() * PAGE + pos % PAGE
    cos_sin = build_cos_sin_cache(1.0 / (5e5 ** (torch.arange(0, D, 2, device=q.device).float() / D)), context + 1)
    rope = NewTokens(pos, qkv[:, hq:hq + HK], qkv[:, hq + HK:], cos_sin, slots)
    quant = (k8.dtype, D)
    fns["attention NHD, rope fused, fp8 out"] = lambda: paged_attention_triton(
        qkv[:, :hq], k8, v8, table, seq_lens, qsl, scale, 1, context, rope=rope, quant=quant)
    if torch.cuda.get_device_capability() == (9, 0):
        from tandem.kernels.triton.attention_wgmma import decode_attention_wgmma
        for stages in (1, 2, 3):
            fns[f"attention wgmma, {stages} stages"] = (
                lambda st=stages: decode_attention_wgmma(q, k8, v8, table, seq_lens, qsl, scale, stages=st))
        fns["attention wgmma, rope fused, fp8 out"] = lambda: decode_attention_wgmma(
            qkv[:, :hq], k8, v8, table, seq_lens, qsl, scale, quant, rope=rope)
    for what, fn in fns.items():
        us = bench(fn) * 1e3
        rows.append(dict(what=what, us=us, of_copy=floor_us / us))
        print(f"{what}: {us:.1f} us ({floor_us / us:.0%} of the copy rate)", flush=True)


def main() -> None:
    from benchmarks.kernels import bench
    from benchmarks.roofline import copy_bandwidth
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024, help="keys a sequence (a multiple of 128)")
    ap.add_argument("--attention-only", action="store_true",
                    help="only the attention rows (the Triton kernel's and, on Hopper, the wgmma one's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    k, v, table = caches(args.batch, args.context, "cuda")
    kv_bytes = 2 * k.numel()
    floor_us = kv_bytes / bw * 1e6
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s; {args.batch} sequences x {args.context} keys, "
          f"K+V {kv_bytes / 1e6:.1f} MB: floor {floor_us:.1f} us", flush=True)
    rows = []
    if not args.attention_only:
        gather_rows(rows, floor_us, k, v, table, args.context)
    # the copy rate at this size: a torch copy of K (its bytes read and written: the gather's bytes)
    dst = torch.empty_like(k)
    us = bench(lambda: dst.copy_(k)) * 1e3
    del dst
    rows.append(dict(what="torch copy of K (the same bytes moved)", us=us, of_copy=floor_us / us))
    print(f"torch copy of K, {kv_bytes / 2e6:.1f} MB read and written: {us:.1f} us ({floor_us / us:.0%} of the copy "
          "rate)", flush=True)
    q = torch.randn(args.batch, 4 * HK, D, device="cuda", dtype=torch.bfloat16)
    for c in (k, v):
        c.bitwise_and_(0xF7)  # no NaN bytes for the attention (e4m3's 0x7F / 0xFF): one exponent bit cleared
    k8, v8 = (c.view(torch.float8_e4m3fn) for c in (k, v))
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(args.batch + 1, dtype=torch.int32, device="cuda")
    attention_rows(rows, floor_us, q, k8, v8, table, seq_lens, qsl, args.context)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_gbs=bw / 1e9, batch=args.batch,
                           context=args.context, floor_us=floor_us, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
