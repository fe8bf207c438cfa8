"""Compile one sm90 backward variant on the CPU and count the SASS instructions of its main
consumer loop (the backward branch whose body holds the 32 / N HGMMAs).

    PYTHONPATH=$PWD python scripts/bwd_loop_sass.py D CAUSAL OUTDIR [DETERMINISTIC]   (from the repository root)

The variant is the one a call of that head dim picks (kernels/sm90/bwd_variant.py).
"""
import collections
import os
import re
import sys

sys.path.insert(0, "tests")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
from test_sm90_bwd_compile import _call  # noqa: E402
from sass import sass_of  # noqa: E402
from torch_fa4.kernels.sm90 import bwd  # noqa: E402

d = int(sys.argv[1]); causal = sys.argv[2] == "1"; out = sys.argv[3]
os.makedirs(out, exist_ok=True)
for f in os.listdir(out):
    if f.endswith(".cubin"):
        os.remove(os.path.join(out, f))
deterministic = len(sys.argv) > 4 and sys.argv[4] == "1"
key = bwd.variant_key(_call(d=d, causal=causal), deterministic)
bwd.compile_variant(key, dump_dir=out)
s = sass_of(out)
open(os.path.join(out, "k.sass"), "w").write(s)
lines = s.splitlines()
print("kernel: HGMMA", s.count("HGMMA."), "waits", s.count("WARPGROUP.DEPBAR"),
      "spills", s.count("LDL") + s.count("STL"), "instructions",
      sum(1 for l in lines if re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", l)))
labels = {}
for i, l in enumerate(lines):
    m = re.match(r"^\.(L_x_\d+):", l.strip())
    if m:
        labels[m.group(1)] = i
best = None
for i, l in enumerate(lines):
    m = re.search(r"BRA.*`\(\.(L_x_\d+)\)", l)
    if m and m.group(1) in labels and labels[m.group(1)] < i:
        body = [x for x in lines[labels[m.group(1)]: i + 1] if re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", x)]
        ops = collections.Counter()
        for x in body:
            mm = re.search(r"/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)", x)
            if mm:
                ops[mm.group(2)] += 1
        if ops["HGMMA"] and (best is None or ops["HGMMA"] > best[1]["HGMMA"] or
                             (ops["HGMMA"] == best[1]["HGMMA"] and len(body) < best[0])):
            best = (len(body), ops)
if best:
    print("main loop:", best[0], "instructions;", ", ".join(f"{k} {v}" for k, v in best[1].most_common(24)))
# The step loops (split_mask_loops compiles an unmasked and one or two masked ones): loops with
# HGMMAs that hold no smaller such loop, leaving out the mbarrier retry stubs after the last EXIT
# (their branches jump back into a loop's middle). Instruction count and FSEL / MUFU per loop:
# the unmasked body has no FSEL.
last_exit = max((i for i, l in enumerate(lines) if re.search(r"\bEXIT\b", l)), default=len(lines))
spans = []
for i, l in enumerate(lines):
    m = re.search(r"BRA.*`\(\.(L_x_\d+)\)", l)
    if m and m.group(1) in labels and labels[m.group(1)] < i < last_exit:
        a = labels[m.group(1)]
        body = [x for x in lines[a: i + 1] if re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", x)]
        if any("HGMMA" in x for x in body):
            spans.append((a, i, body))
inner = [(a, i, body) for a, i, body in spans
         if not any(a <= a2 and i2 <= i and (a2, i2) != (a, i) for a2, i2, _ in spans)]
print("step loops:", "; ".join(f"{len(body)} instructions (FSEL {sum(' FSEL' in x for x in body)}, "
                               f"MUFU {sum('MUFU' in x for x in body)})" for _, _, body in inner))
