"""benchmarks.kv_gather's kernel on CPU under the Triton interpreter (a child process): the gather
of a shuffled paged cache, in the cache's layout and head-major, with each plan's key tile, gives
the torch reference's result. No timing."""
import json

from tests.interpreter import run_under_interpreter


def _child() -> None:
    from benchmarks import kv_gather
    k, v, table = kv_gather.caches(seqs=3, ctx=128, device="cpu")
    ref = kv_gather.gather_ref(k, v, table, 128)
    out = {}
    for block_n in (32, 64, 128):
        for hnd, (kc, vc) in ((False, (k, v)), (True, (kv_gather.head_major(k), kv_gather.head_major(v)))):
            got = kv_gather.gather(kc, vc, table, 128, hnd, (block_n, 4, 2))
            out[f"{block_n} {'HND' if hnd else 'NHD'}"] = bool((got == ref).all())
    out["ref nonzero"] = bool(ref.ne(0).any())
    print(json.dumps(out))


def test_gather_matches_reference_in_interpreter():
    result = json.loads(run_under_interpreter("tests.benchmarks.test_kv_gather", timeout=600).strip().splitlines()[-1])
    assert result == {**{f"{n} {lay}": True for n in (32, 64, 128) for lay in ("NHD", "HND")}, "ref nonzero": True}


if __name__ == "__main__":
    _child()
