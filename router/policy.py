"""Routing policies: pick one instance among the routable instances of one role."""
import itertools
from typing import Protocol, Sequence

from tandem.router.config import RoutingPolicyName
from tandem.router.registry import Instance


class RoutingPolicy(Protocol):
    def choose(self, role: str, candidates: Sequence[Instance]) -> Instance:
        """`candidates` is non-empty; the counters are kept per role."""
        ...


class RoundRobinPolicy:
    """Cycle through the instances of each role, ordered by instance id."""

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count] = {}

    def choose(self, role: str, candidates: Sequence[Instance]) -> Instance:
        ordered = sorted(candidates, key=lambda inst: inst.instance_id)
        turn = next(self._counters.setdefault(role, itertools.count()))
        return ordered[turn % len(ordered)]


class LeastLoadPolicy:
    """Fewest requests: the instance's reported running + waiting plus the router's own in-flight
    requests to it (which covers the time between two pings). Ties go round-robin."""

    def __init__(self) -> None:
        self._tie_break = RoundRobinPolicy()

    def choose(self, role: str, candidates: Sequence[Instance]) -> Instance:
        least = min(inst.num_pending for inst in candidates)
        return self._tie_break.choose(role, [inst for inst in candidates if inst.num_pending == least])


def make_policy(name: RoutingPolicyName) -> RoutingPolicy:
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_load":
        return LeastLoadPolicy()
    raise ValueError(f"unknown routing policy {name!r}; expected round_robin or least_load")
