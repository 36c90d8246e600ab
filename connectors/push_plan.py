"""What of a write-mode prefill's prompt KV one step pushes (the scheduler side decides it once
decode's block ids are in; every rank does its own heads of it).

The prefill computes its prompt whether decode's ids have come or not. A step pushes:
- blocks computed by earlier steps and not pushed yet (the ids came late, or the blocks were
  found in the prefix cache): every layer at once when the step starts;
- the blocks of the chunk the step computes: each layer right after the forward pass stored it.
A block that a chunk completes is pushed again, whole. The push that reaches the prompt's end is
`final`: the rank pairs report once it has landed.
"""
import logging

from tandem.connectors.protocol import PushOp
from tandem.connectors.stages import stamp
from tandem.connectors.transfer import Transfer

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_pushes(t: Transfer, n: int, block_size: int) -> list[PushOp]:
    """t: a prefill write transfer with decode's ids (t.remote_blocks) and its request; n: the
    tokens of that request this step computes (0: not scheduled). Advances t.pushed_tokens."""
    req, bs = t.request, block_size
    end = min(req.num_prompt_tokens, len(t.remote_blocks) * bs)
    if t.pushed_tokens >= end:
        return []
    done = min(req.num_computed_tokens, end)  # in req's blocks once the steps before this one ran
    upto = min(req.num_computed_tokens + n, end)  # and once this one ran
    chunk_lo = done // bs if upto > done else cdiv(done, bs)
    ops = [_op(t, t.pushed_tokens // bs, chunk_lo, final=upto == done == end, layerwise=False)]
    if upto > done:
        ops.append(_op(t, chunk_lo, cdiv(upto, bs), final=upto == end, layerwise=True))
    t.pushed_tokens = max(t.pushed_tokens, upto)
    ops = [op for op in ops if op.local_blocks or op.final]
    for op in ops:
        stamp(logger, "prefill", "conn.push_chunk" if op.layerwise else "conn.push_computed", t.request_id)
    return ops


def _op(t: Transfer, lo: int, hi: int, final: bool, layerwise: bool) -> PushOp:
    """A push of t's prompt blocks [lo, hi) (those decode has not cached: id -1)."""
    idx = [i for i in range(lo, hi) if t.remote_blocks[i] >= 0]
    return PushOp(t.request_id, t.transfer_id, [t.request.block_ids[i] for i in idx],
                  [t.remote_blocks[i] for i in idx], t.pairs, t.peer_ranks, final, layerwise)
