"""CuTe layout arithmetic on static layouts, in plain Python (trace-time only).

`cute.crd2idx`, `get_slice(t).partition_C(...)` and friends emit MLIR ops even when every input is
a compile-time constant (the static result is read back from the op's type); a kernel that asks
for hundreds of such constants (per-element offsets, every thread's first coordinate) spends a
noticeable part of its compile in those ops. These helpers compute the same integers from the
layouts' static shapes and strides, with CuTe's semantics (colexicographic coordinates), and fall
back to the DSL when a layout is not static.
"""

from __future__ import annotations

import math

import cutlass.cute as cute


def _all_int(x) -> bool:
    return all(map(_all_int, x)) if isinstance(x, tuple) else type(x) is int


def _size(shape) -> int:
    return math.prod(_size(s) for s in shape) if isinstance(shape, tuple) else shape


def _crd2idx(coord, shape, stride) -> int:
    if isinstance(coord, tuple):
        if not isinstance(shape, tuple) or len(coord) != len(shape):
            raise ValueError("coordinate not congruent with the shape")
        return sum(_crd2idx(c, s, d) for c, s, d in zip(coord, shape, stride))
    if isinstance(shape, tuple):  # a flat index into a hierarchical mode
        return _crd2idx(_idx2crd(coord, shape), shape, stride)
    return coord * stride


def _idx2crd(idx: int, shape):
    """Flat index -> coordinate congruent with `shape` (colexicographic)."""
    if isinstance(shape, tuple):
        out = []
        for i, s in enumerate(shape):
            if i == len(shape) - 1:
                out.append(_idx2crd(idx, s))
            else:
                n = _size(s)
                out.append(_idx2crd(idx % n, s))
                idx //= n
        return tuple(out)
    return idx


def _static_shape_stride(layout):
    """(shape, stride) as Python ints, or None if the layout is not a static plain layout."""
    if not isinstance(layout, cute.Layout) or not cute.is_static(layout):
        return None
    shape_stride = (layout.shape, layout.stride)
    return shape_stride if _all_int(shape_stride) else None


def indexer(layout):
    """A function coord -> int(cute.crd2idx(coord, layout)) for static coordinates: plain Python
    when the layout is static (read once here), the DSL otherwise. Build it once per layout."""
    ss = _static_shape_stride(layout)

    def index(coord) -> int:
        if ss is None or not _all_int(coord):
            return int(cute.crd2idx(coord, layout))
        return _crd2idx(coord, *ss)

    return index


def _static_tiler(tiler):
    """Per mode: an int (the mode's size, identity) or (size, shape, stride) of a static layout;
    None if some mode is neither."""
    if not isinstance(tiler, tuple):
        return None
    modes = [t if type(t) is int else _static_shape_stride(t) for t in tiler]
    if any(m is None for m in modes):
        return None
    return tuple(m if type(m) is int else (_size(m[0]), *m) for m in modes)


def _tile_coord(idx: int, tiler):
    """Coordinate in a tile of `tiler` (from _static_tiler) of the tile's flat index."""
    local = _idx2crd(idx, tuple(t if type(t) is int else t[0] for t in tiler))
    return tuple(c if type(t) is int else _crd2idx(c, t[1], t[2]) for c, t in zip(local, tiler))


def _first_coords(tv, tiler, num_threads: int, reference) -> list:
    """Each thread's first coordinate from a static (thread, value) layout and tiler; falls back to
    `reference(t)` (the DSL's own answer) when either is not static."""
    if tv is None or tiler is None:
        return [reference(t) for t in range(num_threads)]
    return [_tile_coord(_crd2idx((t, 0), *tv), tiler) for t in range(num_threads)]


def first_coords_mma_C(tiled_mma, num_threads: int, ident) -> list:
    """[tiled_mma.get_slice(t).partition_C(ident)[0] for t in range(num_threads)]: the (m, n)
    coordinate of each thread's first accumulator value. `ident`: an identity tensor of the tile."""
    perm = tiled_mma.permutation_mnk
    # the M and N modes' permutations (tile sizes where there is none)
    tiler = _static_tiler(tuple(tiled_mma.get_tile_size(i) if perm[i] is None else perm[i] for i in range(2)))
    return _first_coords(_static_shape_stride(tiled_mma.tv_layout_C_tiled), tiler, num_threads,
                         lambda t: tiled_mma.get_slice(t).partition_C(ident)[0])


def first_coords_copy_D(tiled_copy, num_threads: int, ident) -> list:
    """[tiled_copy.get_slice(t).partition_D(ident)[0] for t in range(num_threads)]: the coordinate
    of each thread's first destination value."""
    return _first_coords(_static_shape_stride(tiled_copy.layout_dst_tv_tiled),
                         _static_tiler(tiled_copy.tiler_mn), num_threads,
                         lambda t: tiled_copy.get_slice(t).partition_D(ident)[0])
