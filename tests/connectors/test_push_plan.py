"""connectors/push_plan.py: which prompt blocks a write-mode prefill step pushes, and how.
Reference: block ranges worked out by hand for a 4-token block size."""
from types import SimpleNamespace

from tandem.connectors.params import KVTransferParams
from tandem.connectors.push_plan import plan_pushes
from tandem.connectors.transfer import Transfer, TransferState as S

BS = 4


def _transfer(prompt: int, remote: list[int]) -> Transfer:
    req = SimpleNamespace(num_prompt_tokens=prompt, num_computed_tokens=0,
                          block_ids=[100 + i for i in range(-(-prompt // BS))])
    t = Transfer("r", "prefill", KVTransferParams(transfer_id="t"), S.TRANSFERRING, 0.0, request=req)
    t.remote_blocks = remote
    return t


def _plan(t: Transfer, n: int) -> list[tuple[list[int], list[int], bool, bool]]:
    ops = plan_pushes(t, n, BS)
    t.request.num_computed_tokens += n  # the step ran
    return [(op.local_blocks, op.remote_blocks, op.layerwise, op.final) for op in ops]


def test_ids_before_the_prompt_push_each_chunk_layer_by_layer():
    t = _transfer(10, [0, 1, 2])
    assert _plan(t, 6) == [([100, 101], [0, 1], True, False)]
    assert _plan(t, 4) == [([101, 102], [1, 2], True, True)]  # block 1 is completed: pushed again, whole
    assert _plan(t, 1) == []  # (a decode step after the prompt pushes nothing)


def test_ids_between_chunks_push_the_computed_blocks_at_once_then_the_chunk():
    t = _transfer(14, [0, 1, 2, 3])
    t.request.num_computed_tokens = 6  # computed before the ids came
    assert _plan(t, 8) == [([100], [0], False, False), ([101, 102, 103], [1, 2, 3], True, True)]


def test_ids_after_the_prompt_push_everything_at_once_and_finish():
    t = _transfer(10, [0, 1, 2])
    t.request.num_computed_tokens = 10
    assert _plan(t, 0) == [([100, 101, 102], [0, 1, 2], False, True)]
    assert _plan(t, 0) == []


def test_blocks_decode_has_cached_are_skipped_and_a_partial_block_waits():
    t = _transfer(12, [-1, 5, 6])
    t.request.num_computed_tokens = 6  # not scheduled this step: blocks 0-1 (block 1 in part) go now
    assert _plan(t, 0) == [([101], [5], False, False)]
    assert _plan(t, 6) == [([101, 102], [5, 6], True, True)]


def test_everything_cached_on_decode_still_reports_the_end():
    t = _transfer(8, [-1, -1])
    assert _plan(t, 8) == [([], [], True, True)]
