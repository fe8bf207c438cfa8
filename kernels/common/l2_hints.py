"""L2 eviction priorities for TMA loads (the `cache_policy` operand of cp.async.bulk.tensor).

A tile that many CTAs read (the forward's K and V, the backward's Q, dO and row statistics) is
marked evict-last, so it stays in L2 while the other CTAs of its head still need it; a tile read by
one CTA only (the forward's Q, the backward's K and V) is marked evict-first, so it does not push
the shared ones out. The values are the fixed L2 cache-policy encodings of sm_90 (the same ones
`createpolicy.fractional` returns for a fraction of 1.0).
"""

from cutlass import Int64

EVICT_FIRST = 0x12F0000000000000
EVICT_LAST = 0x14F0000000000000


def policy(on: bool, value: int):
    """`cache_policy` for cute.copy: the encoding when hints are on, None (no operand) otherwise."""
    return Int64(value) if on else None
