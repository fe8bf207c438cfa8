"""Compile one sm90 backward variant on the CPU and count the SASS instructions of its main
consumer loop (the backward branch whose body holds the 32 / N HGMMAs).

    PYTHONPATH=$PWD python scripts/bwd_loop_sass.py D CAUSAL OUTDIR [DETERMINISTIC]   (from the repository root)

The TORCH_FA4_BWD_* environment overrides (kernels/sm90/bwd.py) pick the variant as in a call.
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
# Every loop whose body holds one step's HGMMAs and no inner step loop (split_mask_loops compiles
# an unmasked and a masked step loop): its instruction count and its MUFU / FSEL, which tell the
# unmasked body (no FSEL) from the masked one.
loops = []
for i, l in enumerate(lines):
    m = re.search(r"BRA.*`\(\.(L_x_\d+)\)", l)
    if m and m.group(1) in labels and labels[m.group(1)] < i:
        body = [x for x in lines[labels[m.group(1)]: i + 1] if re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", x)]
        loops.append((len(body), sum("HGMMA" in x for x in body), sum(" FSEL" in x for x in body),
                      sum("MUFU" in x for x in body)))
if loops:
    step = min(h for _, h, _, _ in loops if h)
    print("step loops:", "; ".join(f"{n} instructions (FSEL {f}, MUFU {u})" for n, h, f, u in loops if h == step))
