"""benchmarks.kv_gather's kernel on CPU under the Triton interpreter (a child process): the gather
of a shuffled paged cache, in the cache's layout and head-major, with each plan's key tile, and with
the keys split over 1 or 2 programs, gives the torch reference's result; so do the TMA gather (tensor
descriptors, a page a turn) and the flat read (no block table). No timing."""
import json

from tests.interpreter import run_under_interpreter


def _child() -> None:
    import torch

    from benchmarks import kv_gather
    k, v, table = kv_gather.caches(seqs=2, ctx=128, device="cpu")  # (two: the table's row stride counts)
    ref = kv_gather.gather_ref(k, v, table, 128)
    out = {}
    for block_n, split in ((32, 1), (64, 1), (128, 1), (32, 2), (64, 2)):
        for hnd, (kc, vc) in ((False, (k, v)), (True, (kv_gather.head_major(k), kv_gather.head_major(v)))):
            got = kv_gather.xor_reduce(kv_gather.gather(kc, vc, table, 128, hnd, (block_n, 4, 2, split)))
            out[f"{block_n}/{split} {'HND' if hnd else 'NHD'}"] = bool((got == ref).all())
    for stages in (2, 4):
        out[f"tma {stages}"] = bool(torch.equal(kv_gather.tma_gather(k, v, table, 128, 4, stages), ref))
    for block_n in (32, 64):
        got = kv_gather.flat_read(k, v, 4, (block_n, 4, 2, 1))
        out[f"flat {block_n}"] = bool(torch.equal(got, kv_gather.flat_read_ref(k, v, 4)))
    out["ref nonzero"] = bool(ref.ne(0).any())
    print(json.dumps(out))


def test_gather_matches_reference_in_interpreter():
    result = json.loads(run_under_interpreter("tests.benchmarks.test_kv_gather", timeout=600).strip().splitlines()[-1])
    plans = ("32/1", "64/1", "128/1", "32/2", "64/2")
    assert result == {**{f"{p} {lay}": True for p in plans for lay in ("NHD", "HND")},
                      "tma 2": True, "tma 4": True, "flat 32": True, "flat 64": True, "ref nonzero": True}


if __name__ == "__main__":
    _child()
