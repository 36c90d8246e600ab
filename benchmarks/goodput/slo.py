"""SLO attainment and goodput, as pure functions over per-request records and (rate, attainment) points.

A request attains the SLO (vLLM's definition) when it succeeded, its TTFT <= T and its TPOT <= I
(a one-token output has no TPOT and passes that part); the strict variant asks every
inter-token gap <= I instead of their mean. Attainment at a rate is the share of all requests
sent, failed ones included, that attain it. Goodput is the highest offered rate whose attainment
is at least the target, refined by bisection between it and the next measured rate above it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from benchmarks.serve import RequestRecord, meets_slos, percentile

DEFINITIONS = ("vllm", "strict")


@dataclass(frozen=True)
class SLO:
    ttft_ms: float
    tpot_ms: float  # TPOT bound (vllm), or the bound on every inter-token gap (strict)

    def metrics(self, definition: str) -> dict[str, float]:
        """The benchmarks.serve SLO dict of a definition: vllm -> TTFT and TPOT, strict -> TTFT and every ITL."""
        if definition == "vllm":
            return {"ttft": self.ttft_ms, "tpot": self.tpot_ms}
        if definition == "strict":
            return {"ttft": self.ttft_ms, "itl": self.tpot_ms}
        raise ValueError(f"unknown SLO definition {definition!r}; expected one of {', '.join(DEFINITIONS)}")


def attainment(records: Sequence[RequestRecord], slo: SLO, definition: str = "vllm") -> float:
    """Fraction (0..1) of all records that attain the SLO; 0.0 for no records."""
    if not records:
        return 0.0
    slos_ms = slo.metrics(definition)
    return sum(meets_slos(r, slos_ms) for r in records) / len(records)


def misses(records: Sequence[RequestRecord], slo: SLO) -> dict[str, float]:
    """Why requests miss: the fraction (0..1) of all records that failed, went over the TTFT
    bound, over the TPOT bound, or had any inter-token gap over it, and the median first gap
    (ms; decode's first token after the first one: in PD, the wait for the prompt's KV) against
    the median of each request's largest later gap. A request may count under several."""
    ok = [r for r in records if r.success]
    n = max(len(records), 1)
    over = lambda values: sum(v > slo.tpot_ms / 1e3 for v in values) / n  # noqa: E731

    def median(values: list[float]) -> float | None:
        p50 = percentile(values, 50)
        return None if p50 is None else 1e3 * p50

    return {"failed": (len(records) - len(ok)) / n,
            "ttft": sum(r.ttft_s > slo.ttft_ms / 1e3 for r in ok) / n,
            "tpot": over([r.tpot_s for r in ok if r.tpot_s is not None]),
            "itl": over([max(r.itl_s) for r in ok if r.itl_s]),
            "first_gap_p50_ms": median([r.itl_s[0] for r in ok if r.itl_s]),
            "max_later_gap_p50_ms": median([max(r.itl_s[1:]) for r in ok if len(r.itl_s) > 1])}


def bracket(points: Mapping[float, float], target: float) -> tuple[float | None, float | None]:
    """(lo, hi): lo is the highest rate whose attainment >= target (None if none), hi the lowest
    measured rate above lo (every such rate misses the target; None if lo is the highest)."""
    if not points:
        raise ValueError("no measured rates")
    passing = [r for r, a in points.items() if a >= target]
    lo = max(passing) if passing else None
    above = [r for r in points if lo is None or r > lo]
    return lo, (min(above) if above else None)


@dataclass(frozen=True)
class Goodput:
    rate: float  # the highest measured rate meeting the target; 0.0 when none did
    lo: float | None  # bracket after refinement (see bracket())
    hi: float | None
    lower_bound: bool  # every measured rate met the target: the goodput is at least `rate`

    def to_json(self) -> dict:
        return {"rate": self.rate, "bracket": [self.lo, self.hi], "lower_bound": self.lower_bound}


def goodput_of(points: Mapping[float, float], target: float) -> Goodput:
    lo, hi = bracket(points, target)
    return Goodput(rate=lo or 0.0, lo=lo, hi=hi, lower_bound=hi is None)


def search_goodput(measure: Callable[[float], float], rates: Sequence[float], target: float,
                   bisect_steps: int, min_step: float = 0.0,
                   points: dict[float, float] | None = None,
                   stop_at_miss: bool = False) -> tuple[Goodput, dict[float, float]]:
    """Measure every rate (ascending; with stop_at_miss none above the first that misses the
    target), then bisect `bisect_steps` times between the bracket (from 0 when no rate passed; not
    at all when every rate passed). measure(rate) -> attainment. Stops early when the bracket is
    narrower than 2 * min_step. Returns (goodput, all points)."""
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"rates must be positive, got {list(rates)}")
    points = {} if points is None else points
    for rate in sorted(set(rates)):
        points[rate] = measure(rate)
        if stop_at_miss and points[rate] < target:
            break
    for _ in range(bisect_steps):
        lo, hi = bracket(points, target)
        if hi is None:
            break
        lo = lo or 0.0
        if hi - lo <= 2 * min_step:
            break
        mid = (lo + hi) / 2
        points[mid] = measure(mid)
    return goodput_of(points, target), points
