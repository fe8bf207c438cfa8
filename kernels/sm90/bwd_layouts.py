"""Register- and shared-memory layout helpers for the sm90 backward kernel.

Swizzled shared-memory tiles (read both K-major and MN-major), the backward's wgmmas, and stores
of register fragments into swizzled tiles with hoisted addresses. The accumulator views (rows,
cols) and (A operand) are common/acc_layout.py's.
"""

from __future__ import annotations

import re

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as hopper
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..common import static_layout as SL


def transposed(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a (possibly swizzled) shared-memory tensor."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def smem_layout(dtype, rows: int, cols: int, stages: int | None, swizzle_width: int):
    """Row-major (cols contiguous) swizzled tile, optionally staged, for wgmma and TMA.

    `swizzle_width` (elements) picks the swizzle atom: the widest of 128/64/32 bytes that divides
    it. A tile also read transposed (MN-major) by a wgmma that splits `cols` between warpgroups
    needs an atom no wider than each warpgroup's share, hence the explicit width.
    """
    atom = hopper.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, swizzle_width)
    atom = warpgroup.make_smem_layout_atom(atom, dtype)
    shape = (rows, cols) if stages is None else (rows, cols, stages)
    return cute.tile_to_shape(atom, shape, order=(0, 1) if stages is None else (0, 1, 2))


def make_mma(dtype, a_major, b_major, atom_layout, tile_mn, a_in_registers: bool = False):
    source = warpgroup.OperandSource.RMEM if a_in_registers else warpgroup.OperandSource.SMEM
    return hopper.make_trivial_tiled_mma(dtype, dtype, a_major, b_major, cutlass.Float32,
                                         atom_layout_mnk=atom_layout, tiler_mn=tile_mn, a_source=source)


def _ptr_swizzle(ptr):
    """(bits, base, shift) of a swizzled pointer's Sw<B,M,S> (byte units), None if unswizzled."""
    m = re.search(r"S<(\d+),(\d+),(\d+)>", str(ptr.type))
    return tuple(int(g) for g in m.groups()) if m else None


def _swizzled_bases(dst_ptr, lows, thread_offsets, align, extra_bytes=None):
    """One shared-memory pointer per low offset: the swizzled address of this thread's pointer
    plus that offset.

    A swizzle is linear over GF(2) on the bits below 2^(B+M+S): for offsets with disjoint bits
    swz(x | l) = swz(x) ^ swz(l). When every thread's offset inside the (span-aligned) tile
    (`thread_offsets`, bytes, static) shares no bit with a low offset l, x + l = x | l and that
    base is one XOR of the thread's own swizzled address with a constant; otherwise each base is
    swizzled on its own. `extra_bytes` (dynamic, a multiple of the swizzle span) is added after
    swizzling, so the swizzled address itself stays loop-invariant."""
    bits, base, shift = _ptr_swizzle(dst_ptr)
    span = 1 << (bits + base + shift)
    ymask = ((1 << bits) - 1) << base
    t = dst_ptr.toint()
    dtype = dst_ptr.dtype
    xor_ok = thread_offsets is not None and all(
        (o % span) & l == 0 for o in thread_offsets for l in lows)
    out = {}
    phys0 = None
    for l in lows:
        if xor_ok:
            if phys0 is None:
                phys0 = t ^ ((t >> shift) & ymask)
                if extra_bytes is not None:
                    phys0 = phys0 + extra_bytes
            phys = phys0 ^ (l ^ ((l >> shift) & ymask)) if l else phys0  # swz(l), static
        else:
            a = t + l
            phys = a ^ ((a >> shift) & ymask)
            if extra_bytes is not None:
                phys = phys + extra_bytes
        out[l] = cute.make_ptr(dtype, phys, cute.AddressSpace.smem, assumed_align=align)
    return out


def copy_to_swizzled(src: cute.Tensor, dst: cute.Tensor, thread_offsets=None):
    """Register fragment -> this thread's partition of a swizzled shared-memory tile.

    `autovec_copy` swizzles the full address of every vector (add, shift, xor per store), and
    ptxas cannot hoist those: the swizzle does not commute with adding the per-value offset. It
    does commute with any offset that is a multiple of 2^(B+M+S) bytes (the swizzle reads and
    writes only the bits below that), so the static per-value offsets split into a low part
    (few distinct values, one swizzled base address each, computed here once) and a high part
    that becomes the store's immediate offset. Same addresses, same data as autovec_copy.
    `thread_offsets`: see _swizzled_bases (then the bases are XORs of one address).
    """
    sw = _ptr_swizzle(dst.iterator)
    if sw is None:
        cute.autovec_copy(src, dst)
    else:
        bits, base, shift = sw
        span = 1 << (bits + base + shift)
        eb = dst.element_type.width // 8
        n = int(cute.size(dst))
        dst_index = SL.indexer(dst.layout)
        offs = [dst_index(e) * eb for e in range(n)]
        align = dst.iterator.alignment
        # vector width: contiguous runs within an aligned chunk of the pointer's alignment
        v = max(1, min(align // eb, 4))
        while v > 1 and not all(
            offs[e + i] == offs[e] + i * eb and offs[e] % (v * eb) == 0
            for e in range(0, n, v) for i in range(v)
        ):
            v //= 2
        lows = sorted({o % span for o in offs[::v]})
        bases = _swizzled_bases(dst.iterator, lows, thread_offsets, v * eb)
        src_index = SL.indexer(src.layout)
        for e in range(0, n, v):
            low = offs[e] % span
            d = cute.make_tensor(bases[low] + (offs[e] - low) // eb, cute.make_layout(v))
            s = cute.make_tensor(src.iterator + src_index(e), cute.make_layout(v))
            cute.autovec_copy(s, d)


def copy_atom_to_swizzled(atom, values: int, src: cute.Tensor, dst: cute.Tensor, thread_offsets=None,
                          extra=None):
    """`cute.copy` through a shared-memory store atom (stmatrix) that takes `values` elements of
    one contiguous run per call, with the call addresses derived as in copy_to_swizzled.

    src: the register fragment retiled for the copy, dst: the thread's partition of the swizzled
    tile (same size); call k stores flat values [k * values, (k + 1) * values). extra: (index,
    stride in elements), a dynamic slot offset added after swizzling (stride a multiple of the
    swizzle span), e.g. the slot of a double buffer."""
    bits, base, shift = _ptr_swizzle(dst.iterator)
    span = 1 << (bits + base + shift)
    eb = dst.element_type.width // 8
    n = int(cute.size(dst))
    assert n % values == 0
    dst_index = SL.indexer(dst.layout)
    offs = [dst_index(e) * eb for e in range(n)]
    starts = list(range(0, n, values))
    for e0 in starts:
        assert all(offs[e0 + i] == offs[e0] + i * eb for i in range(values)), "call run not contiguous"
    lows = sorted({offs[e0] % span for e0 in starts})
    extra_bytes = None
    if extra is not None:
        idx, stride = extra
        assert (stride * eb) % span == 0, "slot stride must be a multiple of the swizzle span"
        extra_bytes = idx * (stride * eb)
    bases = _swizzled_bases(dst.iterator, lows, thread_offsets, values * eb, extra_bytes)
    src_calls = cute.logical_divide(cute.group_modes(src, 0, cute.rank(src)), cute.make_layout(values))
    for k, e0 in enumerate(starts):
        low = offs[e0] % span
        d = cute.make_tensor(bases[low] + (offs[e0] - low) // eb, cute.make_layout(values))
        cute.copy(atom, src_calls[None, k], d)
