"""MoE router top-k in one Triton launch: scores (softmax or sigmoid), top-k, renormalisation.

Same contract as `kernels.moe.topk_routing_ref`. A program takes ROWS tokens, holds their
[ROWS, E] scores in registers and picks the k largest by k rounds of one max over 64-bit keys
(score bits above, E_PAD - 1 - id below: ties go to the lower expert id), scores in float32.
It replaces the float cast, softmax, topk, sum, divide and int cast that torch launches one by
one (six launches at decode).
"""
import torch
import triton
import triton.language as tl

from tandem.kernels.triton.device import tickets
from tandem.kernels.triton.fp8_skinny import _quant_tile
from tandem.kernels.triton.pdl import launch_args, wait_previous


@triton.jit
def _take_best(keys, top_w, top_id, k, i, E_PAD: tl.constexpr):
    """Round i of the top-k: the largest key goes to slot i. A key holds the score's float bits
    above and E_PAD - 1 - id below (scores are >= 0, so their bits order like the scores), so one
    max finds the best score and, among equal ones, the lowest id."""
    best = tl.max(keys, axis=1)
    top_w = tl.where(k[None, :] == i, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)[:, None], top_w)
    top_id = tl.where(k[None, :] == i, (E_PAD - 1 - (best & 0xFFFFFFFF)).to(tl.int32)[:, None], top_id)
    return tl.where(keys == best[:, None], -1, keys), top_w, top_id


@triton.jit
def topk_of_rows(x, ex, ex_ok, TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                  SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr, rounds=None):
    """x: [R, E_PAD] float32 logits (-inf past the experts) -> (weights, ids), [R, K_PAD] each
    (slots past TOP_K hold zeros). rounds (runtime, <= TOP_K): fill only the first `rounds` slots
    (their ids are final; the weights are renormalized over those slots only)."""
    if SOFTMAX:
        m = tl.max(x, axis=1)
        m = tl.where(m == float("-inf"), 0.0, m)  # rows past the batch
        p = tl.exp(x - m[:, None])
        scores = p / tl.sum(p, axis=1)[:, None]
    else:
        scores = tl.sigmoid(x)
    k = tl.arange(0, K_PAD)
    top_w = tl.zeros([x.shape[0], K_PAD], dtype=tl.float32)
    top_id = tl.zeros([x.shape[0], K_PAD], dtype=tl.int32)
    keys = (scores.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (E_PAD - 1 - ex)[None, :]
    keys = tl.where(ex_ok[None, :], keys, -1)  # padding experts are never chosen
    if rounds is None:
        for i in tl.static_range(TOP_K):
            keys, top_w, top_id = _take_best(keys, top_w, top_id, k, i, E_PAD)
    else:
        for i in range(rounds):
            keys, top_w, top_id = _take_best(keys, top_w, top_id, k, i, E_PAD)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    return top_w, top_id


@triton.jit
def _topk_routing_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_t,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, ROWS: tl.constexpr,
    SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_tokens
    ex = tl.arange(0, E_PAD)
    ex_ok = ex < num_experts
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_t + ex[None, :],
                mask=row_ok[:, None] & ex_ok[None, :], other=float("-inf")).to(tl.float32)
    top_w, top_id = topk_of_rows(x, ex, ex_ok, TOP_K, K_PAD, E_PAD, SOFTMAX, RENORMALIZE)
    k = tl.arange(0, K_PAD)
    out = rows.to(tl.int64)[:, None] * TOP_K + k[None, :]
    mask = row_ok[:, None] & (k < TOP_K)[None, :]
    tl.store(weights_ptr + out, top_w, mask=mask)
    tl.store(ids_ptr + out, top_id, mask=mask)


def check_routing(router_logits: torch.Tensor, top_k: int, scoring: str) -> None:
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown MoE scoring function {scoring!r}; expected 'softmax' or 'sigmoid'")
    if top_k > router_logits.shape[-1]:
        raise ValueError(f"top_k {top_k} is larger than the number of experts {router_logits.shape[-1]}")


def topk_routing_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str = "softmax", pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int32)."""
    check_routing(router_logits, top_k, scoring)
    num_tokens, num_experts = router_logits.shape
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty(num_tokens, top_k, device=logits.device, dtype=torch.float32)
    ids = torch.empty(num_tokens, top_k, device=logits.device, dtype=torch.int32)
    if num_tokens:
        e_pad = triton.next_power_of_2(num_experts)
        rows = max(1, min(triton.next_power_of_2(num_tokens), 4096 // e_pad, 16))
        _topk_routing_kernel[(triton.cdiv(num_tokens, rows),)](
            logits, weights, ids, num_tokens, num_experts, logits.stride(0),
            TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), E_PAD=e_pad, ROWS=rows,
            SOFTMAX=scoring == "softmax", RENORMALIZE=renormalize, num_warps=4, **launch_args(logits, pdl),
        )
    return weights, ids


@triton.jit
def _route_token_kernel(x_ptr, gate_ptr, ss_in_ptr, in_strips, eps, logits_ptr, ticket_ptr, weights_ptr, ids_ptr,
                        q_ptr, qs_ptr, num_experts, K, G, fp8_max, router_programs,
                        EB: tl.constexpr, K_BLOCK: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                        E_PAD: tl.constexpr, SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr,
                        NORM_IN: tl.constexpr, S_PAD: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
                        PDL: tl.constexpr, RANK: tl.constexpr = True):
    """One token's router GEMM, top-k and quantized row in one launch (route_token_triton). Programs below
    router_programs: EB experts' logits each (their router weight rows loaded before the wait), rounded to the
    logits' dtype (the router GEMM's output), then (RANK) a ticket: the last of them ranks all the logits as
    _topk_routing_kernel does; without RANK the logits are the launch's answer (the experts' kernels rank them).
    The others: GROUPS groups of GROUP columns of x quantized (_quant_tile)."""
    pid = tl.program_id(0)
    kk = tl.arange(0, K_BLOCK)
    if pid < router_programs:
        e = pid * EB + tl.arange(0, EB)
        w = tl.load(gate_ptr + e[:, None].to(tl.int64) * K + kk[None, :],
                    mask=(e < num_experts)[:, None] & (kk < K)[None, :], other=0.0)
        wait_previous(PDL)
        x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if NORM_IN:  # x is a pending norm's s * weight: its 1/rms (kernels/triton/linear.py pending_rstd)
            sp = tl.arange(0, S_PAD)
            acc *= tl.rsqrt(tl.sum(tl.load(ss_in_ptr + sp, mask=sp < in_strips, other=0.0), axis=0) / K + eps)
        tl.store(logits_ptr + e, acc.to(x_ptr.dtype.element_ty).to(tl.float32), mask=e < num_experts)
        if RANK:
            tl.debug_barrier()  # every thread's logits are written before the ticket is taken
            if tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu") == router_programs - 1:
                ex = tl.arange(0, E_PAD)
                lg = tl.load(logits_ptr + ex[None, :], mask=(ex < num_experts)[None, :], other=float("-inf"),
                             cache_modifier=".cg")
                top_w, top_id = topk_of_rows(lg, ex, ex < num_experts, TOP_K, K_PAD, E_PAD, SOFTMAX, RENORMALIZE)
                k = tl.arange(0, K_PAD)[None, :]
                tl.store(weights_ptr + k, top_w, mask=k < TOP_K)
                tl.store(ids_ptr + k, top_id, mask=k < TOP_K)
                tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")
    else:
        wait_previous(PDL)
        gi = (pid - router_programs) * GROUPS + tl.arange(0, GROUPS)
        cols = gi[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        mask = (cols < K) & (gi < G)[:, None]
        q, s = _quant_tile(tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32), fp8_max, q_ptr.dtype.element_ty)
        tl.store(qs_ptr + gi, s, mask=gi < G)
        tl.store(q_ptr + cols, q, mask=mask)


ROUTE_TOKEN_ELEMENTS = 16384  # router weight elements a program holds (EB rows of the padded K)
ROUTE_TOKEN_QUANT_COLUMNS = 1024  # columns of x a quantizing program takes (groups of 128)
# Measured plans: (experts, K) -> {"ELEMENTS": router weight elements a program, "num_warps": w}, where one beat
# (ROUTE_TOKEN_ELEMENTS, 4 warps) in a decode step (benchmarks.ab_decode plans=F, F a walk {"what": "route (E, K)"}).
ROUTE_PLANS: dict[tuple[int, int], dict] = {
    (128, 2048): {"ELEMENTS": 4096, "num_warps": 1},  # Qwen3-30B-A3B: 2.022 -> 1.995 ms at b=1 (H200)
}


def route_token_supports(x: torch.Tensor, gate: torch.Tensor) -> bool:
    """Whether route_token_triton takes x [1, K] against the router weight gate [E, K]: bf16/fp16 both, K within
    ROUTE_TOKEN_ELEMENTS, K a multiple of 128."""
    return (x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16) and gate.dtype == x.dtype
            and gate.shape[1] == x.shape[1] and x.shape[1] % 128 == 0
            and triton.next_power_of_2(x.shape[1]) <= ROUTE_TOKEN_ELEMENTS)


def route_token_triton(x: torch.Tensor, gate: torch.Tensor, top_k: int, renormalize: bool, scoring: str,
                       q_dtype: torch.dtype, norm_in: tuple[torch.Tensor, float] | None = None, pdl: bool = True,
                       rank: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token's x [1, K] (route_token_supports) -> (topk_weights [1, k] float32, topk_ids [1, k] int32, q [1,
    K] q_dtype, s [1, K / 128] float32): the router GEMM x @ gate.T (norm_in = (ss, eps): x is a pending norm's
    s * weight, the logits scaled by its 1/rms), ranked as topk_routing_triton ranks them, and x quantized in
    groups of 128 as quantize_rows_triton does, in one launch. rank False: no ranking here, (logits [E] float32,
    the router GEMM's output rounded to x's dtype, None, q, s) for kernels that rank them themselves
    (fp8_tma.fp8_tma_ring_experts' logits)."""
    num_experts, k = gate.shape
    check_routing(gate.t(), top_k, scoring)
    k_block = triton.next_power_of_2(k)
    plan = ROUTE_PLANS.get((num_experts, k), {})
    eb = max(1, min(plan.get("ELEMENTS", ROUTE_TOKEN_ELEMENTS) // k_block, triton.next_power_of_2(num_experts)))
    programs = triton.cdiv(num_experts, eb)
    groups, g = ROUTE_TOKEN_QUANT_COLUMNS // 128, k // 128
    dev = x.device
    logits = torch.empty(num_experts, device=dev, dtype=torch.float32)
    weights = torch.empty(1, top_k, device=dev, dtype=torch.float32)
    ids = torch.empty(1, top_k, device=dev, dtype=torch.int32)
    q = torch.empty(1, k, device=dev, dtype=q_dtype)
    qs = torch.empty(1, g, device=dev, dtype=torch.float32)
    ss_in, eps = norm_in if norm_in is not None else (logits, 0.0)
    in_strips = ss_in.shape[1] if norm_in is not None else 1
    x = x if x.stride(-1) == 1 else x.contiguous()
    _route_token_kernel[(programs + triton.cdiv(g, groups),)](
        x, gate, ss_in, in_strips, eps, logits, tickets(dev), weights, ids, q, qs, num_experts, k, g,
        float(torch.finfo(q_dtype).max), programs, EB=eb, K_BLOCK=k_block, TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(num_experts), SOFTMAX=scoring == "softmax",
        RENORMALIZE=renormalize, NORM_IN=norm_in is not None, S_PAD=triton.next_power_of_2(in_strips), GROUP=128,
        GROUPS=groups, RANK=rank, num_warps=plan.get("num_warps", 4), **launch_args(x, pdl))
    return (weights, ids, q, qs) if rank else (logits, None, q, qs)
