"""KV layout of an instance and the rank-pair plan between two instances of any TP sizes.

Each rank caches a contiguous slice of the model's KV heads: with K heads over T ranks, rank r
holds heads [r*K/T, (r+1)*K/T) when K >= T, and head r // (T/K) (replicated) when K < T (see
engine/layers/linear.py QKVParallelLinear). A transfer from a prefill of TP=Tp to a decode of
TP=Td moves, for every decode rank, each of its heads from one prefill rank that holds it.
"""
import msgspec


class KVLayout(msgspec.Struct, frozen=True):
    """An instance's KV cache as the handshake describes it (num_kv_heads: the model's, all ranks)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tp_size: int = 1

    @property
    def heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    def first_head(self, rank: int) -> int:
        """The model-wide index of rank's first KV head."""
        replicas = max(1, self.tp_size // self.num_kv_heads)
        return rank // replicas * self.heads_per_rank

    def rank_heads(self) -> list[list[int]]:
        """rank -> the model-wide KV heads it caches (the map the handshake exchanges)."""
        return [list(range(self.first_head(r), self.first_head(r) + self.heads_per_rank))
                for r in range(self.tp_size)]

    def split_error(self) -> str | None:
        k, t = self.num_kv_heads, self.tp_size
        if t < 1 or (k % t and t % k):
            return f"{k} KV heads cannot be split over tensor-parallel size {t}"
        return None

    def mismatch(self, other: "KVLayout") -> str | None:
        """Why two instances cannot exchange KV blocks (None: they can, whatever their TP sizes)."""
        diffs = [f"{f}: {getattr(self, f)} vs {getattr(other, f)}" for f in self.__struct_fields__
                 if f != "tp_size" and getattr(self, f) != getattr(other, f)]
        if diffs:
            return "KV layouts differ (" + ", ".join(diffs) + ")"
        return self.split_error() or other.split_error()


class RankPair(msgspec.Struct, frozen=True, array_like=True):
    """One prefill rank -> one decode rank: num_heads heads from local head src_head on the
    prefill rank to local head dst_head on the decode rank."""

    src_rank: int
    dst_rank: int
    src_head: int
    dst_head: int
    num_heads: int


def plan_pairs(src: KVLayout, dst: KVLayout) -> list[RankPair]:
    """The rank pairs that move every KV head each dst rank needs (replicated source heads are
    read from the replica dst_rank % replicas, spreading the load). Raises ValueError when the
    layouts cannot be mapped."""
    error = src.mismatch(dst)
    if error:
        raise ValueError(error)
    pairs = []
    for d in range(dst.tp_size):
        g0 = dst.first_head(d)
        g = g0
        while g < g0 + dst.heads_per_rank:
            holders = [p for p in range(src.tp_size) if src.first_head(p) <= g < src.first_head(p) + src.heads_per_rank]
            p = holders[d % len(holders)]
            end = min(g0 + dst.heads_per_rank, src.first_head(p) + src.heads_per_rank)
            pairs.append(RankPair(p, d, g - src.first_head(p), g - g0, end - g))
            g = end
    return pairs
