"""How fast the decode attention's K/V reads can go: the same tiles gathered through the block table
with no math, in the cache's layout (NHD: [blocks, page, Hk, D], as the engine keeps it) and
head-major (HND: [blocks, Hk, page, D], where a head's page is one contiguous run), against the
attention itself on the NHD cache and the copy ceiling, all in one run.

The Llama-3-8B b=64 attention over an fp8 cache runs at about 1.75x its K/V bytes at the copy rate
(benchmarks/RESULTS.md). If the NHD gather alone is near the copy rate, that gap is the attention's
own work; if NHD is slow and HND fast, it is the layout.

Each program reads one (sequence, KV head) of K and V, BLOCK_N keys a turn, as 32-bit words (an fp8
head of 128 values is 32 words) and XORs them together: one integer op a word, no conversion. The
result is checked against a torch reference before anything is timed.

  python -m benchmarks.kv_gather --batch 64 --context 1024
"""
import argparse
import json

import torch
import triton
import triton.language as tl

HK, D, PAGE = 8, 128, 16  # Llama-3-8B's KV heads and head dim; the engine's page
# (BLOCK_N, num_warps, num_stages): the attention's b=64 plan first, then its neighbours
PLANS = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (32, 4, 3), (128, 4, 3), (64, 8, 3), (128, 8, 3)]


@triton.jit
def _gather_kernel(k_ptr, v_ptr, bt_ptr, out_ptr, ctx, stride_bt, stride_kb, stride_ko, stride_kh,
                   PAGE: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    """out[seq, head] = XOR of every word of the sequence's K and V rows of this head (ctx keys, a
    multiple of BLOCK_N), read BLOCK_N keys at a time through the block table. Strides in words."""
    head = tl.program_id(0)
    seq = tl.program_id(1)
    n = tl.arange(0, BLOCK_N)
    w = tl.arange(0, WORDS)
    acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.int32)
    for start in range(0, ctx, BLOCK_N):
        keys = start + n
        block = tl.load(bt_ptr + seq * stride_bt + keys // PAGE).to(tl.int64)
        rows = block * stride_kb + (keys % PAGE) * stride_ko + head * stride_kh
        ptrs = rows[:, None] + w[None, :]
        acc ^= tl.load(k_ptr + ptrs) ^ tl.load(v_ptr + ptrs)
    tl.store(out_ptr + (seq * tl.num_programs(0) + head) * WORDS + w, tl.xor_sum(acc, axis=0))


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """An NHD cache [blocks, page, Hk, D] copied into HND [blocks, Hk, page, D]."""
    return cache.transpose(1, 2).contiguous()


def gather(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, ctx: int, hnd: bool,
           plan: tuple[int, int, int]) -> torch.Tensor:
    """The kernel over caches of one-byte values (NHD, or HND when hnd): [seqs, Hk, D / 4] int32."""
    block_n, warps, stages = plan
    kw, vw = (c.view(torch.int32) for c in (k, v))  # [blocks, a, b, D / 4]
    seqs, heads, words = table.shape[0], k.shape[1 if hnd else 2], k.shape[3] // 4
    out = torch.empty(seqs, heads, words, dtype=torch.int32, device=k.device)
    stride_ko, stride_kh = (kw.stride(2), kw.stride(1)) if hnd else (kw.stride(1), kw.stride(2))
    _gather_kernel[(heads, seqs)](kw, vw, table, out, ctx, table.stride(0), kw.stride(0), stride_ko, stride_kh,
                                  PAGE=k.shape[2 if hnd else 1], BLOCK_N=block_n, WORDS=words, num_warps=warps,
                                  num_stages=stages)
    return out


def gather_ref(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, ctx: int) -> torch.Tensor:
    """gather's result from an NHD cache in torch: [seqs, Hk, D / 4] int32."""
    page = k.shape[1]
    rows = []
    for seq in range(table.shape[0]):
        blocks = table[seq, :-(-ctx // page)].long()
        words = (k[blocks].flatten(0, 1)[:ctx].view(torch.int32) ^ v[blocks].flatten(0, 1)[:ctx].view(torch.int32))
        acc = torch.zeros_like(words[0])
        for row in words:  # (no XOR reduction in torch)
            acc ^= row
        rows.append(acc)
    return torch.stack(rows)


def caches(seqs: int, ctx: int, device: str, seed: int = 0):
    """Random one-byte K and V caches (NHD) of seqs sequences of ctx keys, their pages shuffled."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages = -(-ctx // PAGE)
    k, v = (torch.randint(0, 256, (seqs * pages, PAGE, HK, D), generator=g, dtype=torch.uint8).to(device)
            for _ in range(2))
    table = torch.randperm(seqs * pages, generator=g).to(torch.int32).view(seqs, pages).to(device)
    return k, v, table


def main() -> None:
    from benchmarks.kernels import bench
    from benchmarks.roofline import copy_bandwidth
    from tandem.kernels.triton.attention import paged_attention_triton
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024, help="keys a sequence (a multiple of 128)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    k, v, table = caches(args.batch, args.context, "cuda")
    kv_bytes = 2 * k.numel()
    floor_us = kv_bytes / bw * 1e6
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:.0f} GB/s; {args.batch} sequences x {args.context} keys, "
          f"K+V {kv_bytes / 1e6:.1f} MB: floor {floor_us:.1f} us", flush=True)
    ref = gather_ref(k, v, table, args.context)
    hnd = (head_major(k), head_major(v))
    rows = []
    for plan in PLANS:
        for layout, (kc, vc) in (("NHD", (k, v)), ("HND", hnd)):
            if not torch.equal(gather(kc, vc, table, args.context, layout == "HND", plan), ref):
                raise SystemExit(f"{layout} {plan}: the gather's result differs from the reference")
            us = bench(lambda: gather(kc, vc, table, args.context, layout == "HND", plan)) * 1e3
            rows.append(dict(what=f"gather {layout}", plan=plan, us=us, of_copy=floor_us / us))
            print(f"gather {layout} BLOCK_N {plan[0]:3d} warps {plan[1]} stages {plan[2]}: {us:7.1f} us "
                  f"({floor_us / us:.0%} of the copy rate)", flush=True)
    q = torch.randn(args.batch, 4 * HK, D, device="cuda", dtype=torch.bfloat16)
    for c in (k, v):
        c.bitwise_and_(0xF7)  # no NaN bytes for the attention (e4m3's 0x7F / 0xFF): one exponent bit cleared
    k8, v8 = (c.view(torch.float8_e4m3fn) for c in (k, v))
    seq_lens = torch.full((args.batch,), args.context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(args.batch + 1, dtype=torch.int32, device="cuda")
    us = bench(lambda: paged_attention_triton(q, k8, v8, table, seq_lens, qsl, D ** -0.5, 1, args.context)) * 1e3
    rows.append(dict(what="attention NHD (the rule's plan)", us=us, of_copy=floor_us / us))
    print(f"attention over the NHD cache, the rule's plan: {us:.1f} us ({floor_us / us:.0%} of the copy rate)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_gbs=bw / 1e9, batch=args.batch,
                           context=args.context, floor_us=floor_us, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
