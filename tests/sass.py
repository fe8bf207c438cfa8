"""SASS of the cubins a CuTe DSL compile wrote: how the CPU compile tests inspect machine code.

nvdisasm comes from the `nvidia-cuda-nvdisasm` wheel (a test extra); a machine without it skips
the SASS checks rather than failing them.
"""

import glob
import os
import re
import shutil
import subprocess

import pytest


def nvdisasm_path():
    exe = shutil.which("nvdisasm")
    if exe:
        return exe
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        hits = glob.glob(os.path.join(root, "*", "bin", "nvdisasm"))
        if hits:
            return hits[0]
    return None


def sass_of(dump_dir, pattern="*.cubin") -> str:
    """Disassemble the one cubin matching `pattern` under `dump_dir`."""
    cubins = glob.glob(os.path.join(str(dump_dir), pattern))
    assert cubins, f"no cubin matching {pattern} written to {dump_dir}"
    exe = nvdisasm_path()
    if exe is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    return subprocess.run([exe, "-c", cubins[0]], capture_output=True, text=True, check=True).stdout


def without_addresses(lines) -> list:
    """SASS lines without their /*address*/ comments, stripped: code that merely moved elsewhere
    in the binary compares equal, so two compiles can be compared instruction by instruction."""
    return [re.sub(r"/\*[0-9a-f]+\*/", "", x).strip() for x in lines]


def hinted_loads(sass: str) -> tuple:
    """(TMA loads carrying an L2 cache-policy operand, all TMA loads) in `sass`: a load without a
    policy reads `desc[URZ]` (kernels/common/l2_hints.py)."""
    loads = [line for line in sass.splitlines() if "UTMALDG" in line]
    return sum("desc[URZ]" not in line for line in loads), len(loads)


def spills_between_matmuls(sass: str) -> int:
    """Local-memory spill instructions between the first and the last HGMMA: the key loop, where
    a spill costs on every key tile (the prologue and epilogue run once per work item)."""
    lines = sass.splitlines()
    hgmma = [i for i, line in enumerate(lines) if "HGMMA" in line]
    if not hgmma:
        return 0
    body = lines[hgmma[0]: hgmma[-1] + 1]
    return sum(1 for line in body if "LDL" in line or "STL" in line)


def exps_after_pv_wait(sass: str) -> list:
    """For each key-loop softmax (from a `WARPGROUP.DEPBAR.LE gsb0, 0x1`, the wait for S with P V
    still in flight, to the next HGMMA): how many MUFU.EX2 ptxas placed after the P V wait
    (`WARPGROUP.DEPBAR.LE gsb0, 0x0`). Exponentials after that wait no longer run under P V."""
    counts, after, open_ = [], None, False
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            open_, after = True, None
        elif not open_:
            continue
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line and after is None:
            after = 0
        elif "MUFU.EX2" in line and after is not None:
            after += 1
        elif "HGMMA" in line:
            counts.append(after)
            open_ = False
    return counts


_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+\S")
_LABEL = re.compile(r"^\s*\.(L_x_\d+):")
_BRANCH = re.compile(r"BRA.*`\(\.(L_x_\d+)\)")


def key_loops(sass: str) -> list:
    """Every innermost loop holding an HGMMA, as its SASS lines (labels included): a loop is a
    backward branch to a label above it; innermost: no other such loop nested inside."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    spans = []
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if m and labels.get(m.group(1), i) < i:
            spans.append((labels[m.group(1)], i))
    with_mma = [(a, b) for a, b in spans if any("HGMMA" in x for x in lines[a: b + 1])]
    return [lines[a: b + 1] for a, b in with_mma
            if not any((c, d) != (a, b) and a <= c and d <= b for c, d in with_mma)]


def issued_when_ready(loop: list) -> int:
    """Instructions a warp issues per pass of `loop` (key_loops) when every ring stage it waits
    for has already landed: a try-wait followed by a forward `@P BRA` is a peeked wait and skips
    to that label; everything else issues, predicated off or not."""
    labels = {m.group(1): i for i, line in enumerate(loop) if (m := _LABEL.match(line))}
    count, i, prev = 0, 0, ""
    while i < len(loop):
        line = loop[i]
        if _INSTRUCTION.search(line):
            count += 1
            m = re.search(r"@P\d BRA `\(\.(L_x_\d+)\)", line)
            if m and "TRYWAIT" in prev and labels.get(m.group(1), -1) > i:
                i, prev = labels[m.group(1)], line
                continue
            prev = line
        i += 1
    return count


def cuda_major() -> int:
    """The CUDA major version of the toolkit CuTe DSL compiles with (its `_cutlass_ir` flavour: 12
    or 13; the newest installed one when no driver is present)."""
    import sys

    import cutlass  # noqa: F401  (loads the flavour)

    for name, module in list(sys.modules.items()):
        found = re.search(r"\.cu(\d+)\.", getattr(module, "__file__", None) or "")
        if "_cutlass_ir" in name and found:
            return int(found.group(1))
    return 12  # a build without flavour tags


def spills(sass: str) -> tuple:
    """(local-memory spill instructions in all of `sass`, those inside a loop: between a backward
    branch and its target, where a spill costs on every iteration rather than once per CTA)."""
    lines = sass.splitlines()
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"\bBRA\b[^`]*`\(\.L_x_(\d+)\)", line)
        if m:
            label = f".L_x_{m.group(1)}:"
            starts = [j for j, x in enumerate(lines) if x.strip().startswith(label)]
            if starts and starts[0] < i:
                loops.append((starts[0], i))
    at = [i for i, line in enumerate(lines) if re.search(r"\b(LDL|STL)\b", line)]
    return len(at), sum(1 for i in at if any(a <= i <= b for a, b in loops))
