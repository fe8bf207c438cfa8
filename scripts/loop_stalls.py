"""The static schedule of a kernel's key loop, read from the control bits ptxas encodes in each
SASS instruction: how many cycles the warp is told to stall after it (the stall field), summed
over the loop, with the instructions that wait on a scoreboard. A CPU-only reading that counts
what instruction counts miss: two loops of one length can hold different dependency chains.

    python scripts/loop_stalls.py CUBIN MMAS_PER_TILE [--dump FILE]

MMAS_PER_TILE picks the loop as tests/sass.py's key-loop helpers do (the forward's unmasked step:
head_dim/16 + tile_n/16 HGMMAs, 12 at D64). Control bits (Volta and later; the high 64-bit word of
each 128-bit instruction, which `nvdisasm -hex` prints on the line after it): stall count bits
41-44, yield 45, write scoreboard 46-48, read scoreboard 49-51, wait mask 52-57, reuse 58-61.
NOTES "Experiment 155" compares ours with flash-attn-4's loop this way.
"""

import argparse
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from sass import issued_when_ready, key_loops, nvdisasm_path  # noqa: E402

_WORD = re.compile(r"/\* (0x[0-9a-f]+) \*/")


def with_control_words(cubin: str) -> str:
    """SASS of `cubin`, each instruction line ending in `##<high word as decimal>`."""
    lines = subprocess.run([nvdisasm_path(), "-hex", "-c", cubin], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    merged, i = [], 0
    while i < len(lines):
        line = lines[i]
        if re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", line) and i + 1 < len(lines) and _WORD.search(lines[i + 1]) \
                and not re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", lines[i + 1]):
            merged.append(line.split("/* 0x")[0].rstrip() + f" ##{int(_WORD.search(lines[i + 1]).group(1), 16)}")
            i += 2
        else:
            merged.append(line)
            i += 1
    return "\n".join(merged)


def stall_profile(loop: list) -> dict:
    total, waits, per_op, n = 0, 0, {}, 0
    for line in loop:
        m = re.search(r"##(\d+)$", line)
        if not m:
            continue
        control = int(m.group(1)) >> 41
        stall, wait_mask = control & 0xF, (control >> 11) & 0x3F
        op = re.search(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line).group(1)
        total += stall
        waits += wait_mask != 0
        per_op[op] = per_op.get(op, 0) + stall
        n += 1
    return dict(instructions=n, issued_when_ready=issued_when_ready(loop), stall_cycles=total,
                scoreboard_waits=waits, stall_cycles_by_op=dict(sorted(per_op.items(), key=lambda t: -t[1])))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cubin")
    ap.add_argument("mmas_per_tile", type=int)
    ap.add_argument("--dump", help="write the loop's SASS (with control words) here")
    args = ap.parse_args()
    loops = [lp for lp in key_loops(with_control_words(args.cubin))
             if sum("HGMMA" in x for x in lp) == args.mmas_per_tile]
    if not loops:
        sys.exit(f"no loop with {args.mmas_per_tile} HGMMAs")
    loop = min(loops, key=issued_when_ready)
    prof = stall_profile(loop)
    top = ", ".join(f"{k} {v}" for k, v in list(prof.pop("stall_cycles_by_op").items())[:12])
    print(", ".join(f"{k} {v}" for k, v in prof.items()))
    print("stall cycles by opcode:", top)
    if args.dump:
        with open(args.dump, "w") as f:
            f.write("\n".join(loop) + "\n")


if __name__ == "__main__":
    main()
