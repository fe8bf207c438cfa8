"""Split tail: the last work items of a grid split along the keys into pieces that run on
different SMs, their partial results merged by whichever piece finishes last.

A grid of N equal items on C SMs runs ceil(N / C) rounds; the last holds r = N mod C items and
leaves the other SMs idle. Split into k pieces of consecutive key tiles each, those r items
spread over r * k SMs and the last round takes ceil(r * k / C) / k of an item. The host picks r
and k (`host.split_plan`); the tile scheduler numbers the pieces after the whole items.

A piece runs the ordinary key loop over its key tiles and ends holding unnormalised O and its
online-softmax state (reference max and row sums per row): exactly what merging two pieces needs,
the same rescale as one more key tile. Each consumer warpgroup's 64 rows are independent, so the
merge is per warpgroup: every piece stores its state in a global workspace slot, value-major so
that a warp's stores and loads are 128-byte lines and a thread reads back the values it holds
itself; a counter per (split item, warpgroup) counts the pieces stored, and the piece that brings
it to k loads the others' states, merges them into its own and runs the ordinary epilogue. The
counters are zero at launch. In the forward the last piece sets its counter back to zero, so a
launch leaves them as it found them: the host keeps one zeroed buffer per device and stream
(`kernels/host/split_scratch.py`) instead of zeroing a new one per call.

Memory order: each thread's stores, then its gpu-scope fence, then the warpgroup barrier, then
one thread's acq_rel atomic (cumulative over what the barrier made it see); on the reading side
the atomic, the barrier, a fence, then the loads. The workspace lines a reader loads were never
in its SM's L1 during the launch.

The sm90 backward splits its last round too (`finish_sum_piece`): a work tile there is one key
tile's walk over the query tiles, split into pieces of consecutive query tiles. A piece ends
holding partial dK / dV sums, so merging is adding; the whole consumer group (both warpgroups,
whose halves the epilogue stores together) counts as one, with one counter per split tile.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from torch_fa4.kernels.common.acc_layout import rows_cols


@cute.jit
def _store_state(ws: cute.Tensor, slot: Int32, lane: Int32, acc_o: cute.Tensor, ref: cute.Tensor,
                 row_sum: cute.Tensor):
    o = rows_cols(acc_o)
    rows, cols = cute.size(o, mode=[0]), cute.size(o, mode=[1])
    for r in cutlass.range_constexpr(rows):
        for c in cutlass.range_constexpr(cols):
            ws[slot, r * cols + c, lane] = o[r, c]
        ws[slot, rows * cols + r, lane] = ref[r]
        ws[slot, rows * cols + rows + r, lane] = row_sum[r]


@cute.jit
def _merge_state(ws: cute.Tensor, slot: Int32, lane: Int32, acc_o: cute.Tensor, ref: cute.Tensor,
                 row_sum: cute.Tensor):
    """Another piece's state into this thread's: both move to the larger reference max (a row
    that saw no key in one piece has reference -inf there and contributes nothing)."""
    o = rows_cols(acc_o)
    rows, cols = cute.size(o, mode=[0]), cute.size(o, mode=[1])
    for r in cutlass.range_constexpr(rows):
        other_ref = ws[slot, rows * cols + r, lane]
        other_sum = ws[slot, rows * cols + rows + r, lane]
        new = cute.arch.fmax(ref[r], other_ref)
        safe = cutlass.select_(new == -Float32.inf, Float32(0.0), new)
        mine = cute.math.exp2(ref[r] - safe, fastmath=True)
        theirs = cute.math.exp2(other_ref - safe, fastmath=True)
        for c in cutlass.range_constexpr(cols):
            o[r, c] = o[r, c] * mine + ws[slot, r * cols + c, lane] * theirs
        row_sum[r] = row_sum[r] * mine + other_sum * theirs
        ref[r] = new


@cute.jit
def _count_piece(counters: cute.Tensor, index: Int32, flags: cute.Tensor, flag: Int32, lane: Int32,
                 threads: cutlass.Constexpr[int], barrier_id: Int32, ways,
                 leave_zero: cutlass.Constexpr[bool] = False) -> cutlass.Boolean:
    """After every thread of a group stored its part of a piece: the piece counted in
    `counters[index]`, and whether it was the last of its `ways` (the same answer on every thread
    of the group; `flags[flag]` hands the counter's value to them). leave_zero: the last piece
    sets the counter back to zero."""
    cute.arch.fence_acq_rel_gpu()
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
    if lane == 0:
        flags[flag] = cute.arch.atomic_add(counters.iterator + index, Int32(1), sem="acq_rel", scope="gpu")
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
    last = flags[flag] == ways - 1
    if last:
        cute.arch.fence_acq_rel_gpu()
        if leave_zero and lane == 0:  # every piece has counted: nothing reads it again in this launch
            counters[index] = Int32(0)
    return last


@cute.jit
def finish_piece(ws: cute.Tensor, counters: cute.Tensor, flags: cute.Tensor, piece: Int32, split_index: Int32,
                 ways: cutlass.Constexpr[int], wg: Int32, num_wg: cutlass.Constexpr[int], lane: Int32, acc_o: cute.Tensor,
                 ref: cute.Tensor, row_sum: cute.Tensor, barrier_id: Int32) -> cutlass.Boolean:
    """One warpgroup's end of a piece: store its state, count it, and if it is the last piece of
    its item, merge the others' states into acc_o / ref / row_sum. Returns whether this warpgroup
    is the one that writes the item's rows (every thread of the warpgroup gets the same answer).

    ws: (slots, values, 128) fp32, slot (split_index * num_wg + wg) * ways + piece; counters:
    (split items * num_wg,) int32, zero at launch and at exit; flags: a shared int32 per warpgroup (the
    counter's value handed to the whole warpgroup); barrier_id: a named barrier of the
    warpgroup's 128 threads."""
    item_wg = split_index * num_wg + wg
    first_slot = item_wg * ways
    _store_state(ws, first_slot + piece, lane, acc_o, ref, row_sum)
    last = _count_piece(counters, item_wg, flags, wg, lane, 128, barrier_id, ways, leave_zero=True)
    if last:
        for q in cutlass.range_constexpr(ways):
            if q != piece:
                _merge_state(ws, first_slot + q, lane, acc_o, ref, row_sum)
    return last


@cute.jit
def finish_sum_piece(ws: cute.Tensor, counters: cute.Tensor, flags: cute.Tensor, piece: Int32, split_index: Int32,
                     ways: Int32, lane: Int32, threads: cutlass.Constexpr[int], accs: tuple,
                     barrier_id: Int32) -> cutlass.Boolean:
    """A group of `threads` threads ends a piece whose partial results add up: each thread stores
    its fp32 register accumulators `accs` in the piece's workspace slot, the piece is counted, and
    the last piece of its tile adds the others' parts into its own. Returns whether this group
    writes the tile (the same answer on every thread).

    ws: (slots, values, threads) fp32, slot split_index * ways + piece, value-major (a warp's
    stores and loads are whole lines), values: the accumulators' sizes summed; counters: (split
    tiles,) int32, zero at launch; flags: a shared int32; barrier_id: a named barrier of the
    group's threads. `ways` may be a run-time value."""
    first_slot = split_index * ways
    offsets = [sum(cute.size(a) for a in accs[:i]) for i in range(len(accs))]  # static
    for i in cutlass.range_constexpr(len(accs)):
        for e in cutlass.range_constexpr(cute.size(accs[i])):
            ws[first_slot + piece, offsets[i] + e, lane] = accs[i][e]
    last = _count_piece(counters, split_index, flags, 0, lane, threads, barrier_id, ways)
    if last:
        for q in cutlass.range(ways, unroll=1):
            if q != piece:
                for i in cutlass.range_constexpr(len(accs)):
                    for e in cutlass.range_constexpr(cute.size(accs[i])):
                        accs[i][e] = accs[i][e] + ws[first_slot + q, offsets[i] + e, lane]
    return last
