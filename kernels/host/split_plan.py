"""How the last round of a grid is split (kernels/common/split_tail.py has the whole scheme); free
of CuTe DSL so the host can plan a launch without importing it."""


def choose(num_items: int, num_ctas: int, tiles_per_item: int, pair: int = 1, min_tiles: int = 4,
           max_ways: int = 8, piece_cost_tiles: float = 2.0, min_gain: float = 0.15,
           single_round: bool = False) -> tuple:
    """(split items r, ways k) for a grid of `num_items` equal items on `num_ctas` CTAs, or (0, 1)
    when splitting does not shorten the last round by at least `min_gain` of an item. The last
    round then takes ceil(r k / C) pieces in a row, each 1/k of an item plus a fixed cost of about
    `piece_cost_tiles` key tiles (its own Q load, prologue, state store and merge). Pieces keep at
    least `min_tiles` key tiles; `pair` = 2 keeps r even (K / V multicast clusters take items in
    pairs). single_round: a grid of fewer items than CTAs counts as a last round too (its idle SMs
    can take pieces: decode's few long items), else it is left whole."""
    if num_ctas <= 0 or tiles_per_item <= 0 or num_items == num_ctas:
        return 0, 1
    if num_items < num_ctas and not single_round:
        return 0, 1
    r = num_items % num_ctas
    if r == 0 or r % pair:
        return 0, 1
    fixed = piece_cost_tiles / tiles_per_item
    best, best_k = 1.0, 1
    for k in range(2, max_ways + 1):
        if tiles_per_item < k * min_tiles:
            break
        last_round = -(-(r * k) // num_ctas) * (1.0 / k + fixed)
        if last_round < best - 1e-9:
            best, best_k = last_round, k
    if best > 1.0 - min_gain:
        return 0, 1
    return r, best_k


def state_values(head_dim_v: int) -> int:
    """fp32 values one consumer thread stores per piece: its share of a warpgroup's 64 x Dv O
    tile (Dv / 2), then the reference max and the row sum of each of its two rows."""
    return head_dim_v // 2 + 4
