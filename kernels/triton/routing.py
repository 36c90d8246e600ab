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
