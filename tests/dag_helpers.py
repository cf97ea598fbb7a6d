"""Shared helpers for DAG tests: random DAG strategies, brute-force oracles, plan invariants.

The brute-force functions are deliberately naive (enumeration, Floyd-Warshall) so they can serve
as oracles for the fast passes in ``gpuloom.engine.streams``; use them on graphs of <= 8-10 nodes.
"""

from __future__ import annotations

import itertools
import random
from typing import Iterable, Iterator

from hypothesis import strategies as st

Edge = tuple[int, int]


# ---------------------------------------------------------------------------- generators


@st.composite
def dags(draw, min_nodes: int = 0, max_nodes: int = 8, shuffle: bool = True, duplicates: bool = True):
    """(num_nodes, edges) of a random DAG; node ids shuffled so they are not a topological order."""
    n = draw(st.integers(min_nodes, max_nodes))
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    density = draw(st.integers(1, 9))  # keep a pair with probability ~ density/10
    keep = draw(st.lists(st.integers(0, 9), min_size=len(pairs), max_size=len(pairs)))
    perm = draw(st.permutations(range(n))) if shuffle else list(range(n))
    edges = [(perm[i], perm[j]) for (i, j), k in zip(pairs, keep) if k < density]
    if duplicates and edges:
        extra = draw(st.lists(st.sampled_from(edges), max_size=3))
        edges = edges + extra
    return n, edges


def random_dag(n: int, edges_per_node: float, rng: random.Random, *, window: int | None = None) -> list[Edge]:
    """Sparse random DAG: node v draws ~edges_per_node producers among the `window` nodes before it."""
    edges = []
    for v in range(1, n):
        lo = 0 if window is None else max(0, v - window)
        k = min(v - lo, max(1, round(rng.expovariate(1 / edges_per_node))))
        for u in rng.sample(range(lo, v), k):
            edges.append((u, v))
    return edges


def layered_dag(layers: int, width: int, fan_in: int, rng: random.Random) -> tuple[int, list[Edge]]:
    """`layers` layers of `width` nodes; each node takes `fan_in` producers from the layer above."""
    edges = []
    for layer in range(1, layers):
        for i in range(width):
            v = layer * width + i
            for j in rng.sample(range(width), fan_in):
                edges.append(((layer - 1) * width + j, v))
    return layers * width, edges


# ---------------------------------------------------------------------------- oracles


def brute_reach(n: int, edges: Iterable[Edge]) -> list[list[bool]]:
    """reach[u][v]: a path of length >= 1 leads from u to v (Floyd-Warshall)."""
    r = [[False] * n for _ in range(n)]
    for u, v in edges:
        r[u][v] = True
    for w in range(n):
        for u in range(n):
            if r[u][w]:
                for v in range(n):
                    if r[w][v]:
                        r[u][v] = True
    return r


def comparable(reach: list[list[bool]], a: int, b: int) -> bool:
    return reach[a][b] or reach[b][a]


def brute_transitive_reduction(n: int, edges: Iterable[Edge]) -> set[Edge]:
    """Edges (u, v) with no intermediate w such that u reaches w and w reaches v."""
    edges = set(edges)
    r = brute_reach(n, edges)
    return {(u, v) for u, v in edges if not any(r[u][w] and r[w][v] for w in range(n))}


def brute_max_antichain(n: int, edges: Iterable[Edge]) -> int:
    """Size of the largest set of pairwise incomparable nodes (enumerates subsets)."""
    r = brute_reach(n, edges)
    best = 0
    for mask in range(1 << n):
        nodes = [i for i in range(n) if mask >> i & 1]
        if len(nodes) > best and all(not comparable(r, a, b) for a, b in itertools.combinations(nodes, 2)):
            best = len(nodes)
    return best


def brute_max_matching(edges: Iterable[Edge]) -> int:
    """Largest set of (left, right) edges sharing no left and no right end (enumerates subsets)."""
    edges = sorted(set(edges))
    for k in range(len(edges), 0, -1):
        for combo in itertools.combinations(edges, k):
            if len({u for u, _ in combo}) == k and len({v for _, v in combo}) == k:
                return k
    return 0


def chain_partitions(n: int, edges: Iterable[Edge]) -> Iterator[list[list[int]]]:
    """Every partition of the nodes into chains (blocks of pairwise comparable nodes)."""
    r = brute_reach(n, edges)
    blocks: list[list[int]] = []

    def rec(i: int) -> Iterator[list[list[int]]]:
        if i == n:
            yield [list(b) for b in blocks]
            return
        for b in blocks:
            if all(comparable(r, i, x) for x in b):
                b.append(i)
                yield from rec(i + 1)
                b.pop()
        blocks.append([i])
        yield from rec(i + 1)
        blocks.pop()

    yield from rec(0)


def cross_edges(partition: list[list[int]], edges: Iterable[Edge]) -> int:
    """Number of edges whose ends lie in different blocks."""
    block = {u: i for i, b in enumerate(partition) for u in b}
    return sum(1 for u, v in set(edges) if block[u] != block[v])


def brute_critical_path(n: int, edges: Iterable[Edge], durations: list[float]) -> float:
    """Heaviest path (sum of node durations) by enumerating every path from every node."""
    succ: dict[int, set[int]] = {}
    for u, v in edges:
        succ.setdefault(u, set()).add(v)
    best = 0.0

    def walk(u: int, total: float) -> None:
        nonlocal best
        best = max(best, total)
        for v in succ.get(u, ()):
            walk(v, total + durations[v])

    for u in range(n):
        walk(u, durations[u])
    return best


# ---------------------------------------------------------------------------- plan invariants


def check_plan(plan, n: int, edges: Iterable[Edge], *, concurrent: bool = True) -> None:
    """Assert what every StreamPlan for the DAG (n, edges) must satisfy.

    * order is a topological order; stream 0 holds order[0]; streams numbered by first appearance;
    * two nodes on one stream are ordered in the DAG (unless ``concurrent=False``, for plans that
      serialize on purpose, like the single-stream plan);
    * waits are exactly the reduction edges whose ends are on different streams;
    * every DAG edge is implied by stream order plus waits (reachability in that graph).
    """
    edges = set(edges)
    assert plan.num_nodes == n
    assert sorted(plan.order) == list(range(n))
    pos = {u: i for i, u in enumerate(plan.order)}
    for u, v in edges:
        assert pos[u] < pos[v], f"order puts {v} before its producer {u}"
    if n:
        assert plan.stream_of[plan.order[0]] == 0
    firsts = []
    for u in plan.order:
        if plan.stream_of[u] not in firsts:
            firsts.append(plan.stream_of[u])
    assert firsts == list(range(plan.num_streams)), "streams are not numbered by first appearance"
    r = brute_reach(n, edges)
    for nodes in plan.streams() if concurrent else []:
        for a, b in itertools.combinations(nodes, 2):
            assert r[a][b], f"{a} and {b} share a stream but {a} does not reach {b}"
    red = brute_transitive_reduction(n, edges)
    crossing = {(u, v) for u, v in red if plan.stream_of[u] != plan.stream_of[v]}
    assert set(plan.waits) == crossing
    assert len(plan.waits) == len(set(plan.waits)) == plan.num_syncs
    assert plan.reduction_edges == len(red)
    implied = [(a, b) for nodes in plan.streams() for a, b in zip(nodes, nodes[1:])] + list(plan.waits)
    r2 = brute_reach(n, implied)
    for u, v in edges:
        assert r2[u][v], f"edge {(u, v)} is not enforced by stream order or waits"


def plan_implies_edges_fast(plan, edges: Iterable[Edge]) -> bool:
    """Same 'every edge is enforced' check with bitsets, for graphs with thousands of nodes."""
    n = plan.num_nodes
    succ: list[list[int]] = [[] for _ in range(n)]
    for nodes in plan.streams():
        for a, b in zip(nodes, nodes[1:]):
            succ[a].append(b)
    for p, c in plan.waits:
        succ[p].append(c)
    reach = [0] * n
    for u in reversed(plan.order):
        x = 0
        for v in succ[u]:
            x |= reach[v] | (1 << v)
        reach[u] = x
    return all(reach[u] >> v & 1 for u, v in edges)


def oracle_chain_cover(n: int, edges: Iterable[Edge], *, prefer: str = "streams") -> tuple[int, int]:
    """(streams, syncs) of the best chain cover, from a max-weight matching (networkx blossom).

    Chains are matchings of the closure's bipartite graph (streams = n - size); a reduction edge
    inside a chain saves a sync. ``prefer="streams"``: the fewest streams, then the fewest syncs;
    ``"syncs"``: the other way round. Independent of gpuloom's code, for DAGs of ~10-30 nodes.
    """
    import networkx as nx

    edges = set(edges)
    r = brute_reach(n, edges)
    red = brute_transitive_reduction(n, edges)
    big = 2 * n + 2
    g = nx.Graph()
    for u in range(n):
        for v in range(n):
            if r[u][v]:
                inside = (u, v) in red
                w = big + inside if prefer == "streams" else big * inside + 1
                g.add_edge(("L", u), ("R", v), weight=w)
    matching = nx.max_weight_matching(g)
    kept = 0
    for a, b in matching:
        (_, u), (_, v) = (a, b) if a[0] == "L" else (b, a)
        kept += (u, v) in red
    return n - len(matching), len(red) - kept
