"""A consumer's wait on a TMA ring stage that peeks first (the sm90 forward's consumers).

`consumer_wait` alone may compile to an inline retry loop: try-wait, then a sleep, a re-check and
a back branch, all predicated on the try having failed. Predicated-off instructions still take
issue slots, so a stage that has already landed (the usual case in a pipelined loop) costs four
instructions per warp. Peeking first (`consumer_try_wait`, one try-wait) and waiting only when the
peek failed leaves two on that path, a try-wait and a branch, with the retry loop out of line. In
the D64 forward key loop this took 441 issued instructions per warp per key tile to 430 (CPU
compile, SASS; NOTES Experiment 78): besides the waits' predicated instructions, ptxas kept the V
operand's descriptor arithmetic in uniform registers once the inline retry loop was gone. Where
ptxas already emits the compact form (the sm90 backward's ring waits) peeking changes nothing.

`peek` False gives the plain wait (for side-by-side measurement). The producers keep the plain
`producer_acquire`: a producer runs ahead until the ring is full, so its peek would mostly fail.
"""

from cutlass import const_expr


def wait_full(pipe, state, peek: bool):
    """Consumer side: wait until `state`'s stage has landed."""
    if const_expr(peek):
        pipe.consumer_wait(state, pipe.consumer_try_wait(state))
    else:
        pipe.consumer_wait(state)
