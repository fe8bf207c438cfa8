"""Summarise an Nsight Compute source-page CSV (scripts/ncu_source.sh): the instructions with the
most warp-stall samples, each with its main stall reasons, and the reasons summed over the kernel.

    python scripts/ncu_source_top.py src.csv [N]
"""

import csv
import sys


def _num(x):
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return 0.0


def main(path, top=40):
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if "Source" in ln and ("Address" in ln or "#" in ln))
    rows = list(csv.DictReader(lines[start:]))
    cols = list(rows[0].keys())
    total_col = next((c for c in cols if "Sampling" in c and "All" in c), None) or \
        next(c for c in cols if "Sampling" in c)
    reason_cols = [c for c in cols if c.startswith("stall_") or "Stall" in c and c != total_col
                   and "Sampling" not in c]
    total = sum(_num(r[total_col]) for r in rows) or 1.0
    print(f"{len(rows)} instructions, {total:.0f} samples ({total_col})")
    sums = {c: sum(_num(r[c]) for r in rows) for c in reason_cols}
    print("reasons:", ", ".join(f"{c}={v / total:.1%}" for c, v in sorted(sums.items(), key=lambda x: -x[1]) if v > 0.005 * total))
    ranked = sorted(range(len(rows)), key=lambda i: -_num(rows[i][total_col]))[:top]
    for i in sorted(ranked):
        r = rows[i]
        n = _num(r[total_col])
        why = sorted(((c, _num(r[c])) for c in reason_cols), key=lambda x: -x[1])[:3]
        why = " ".join(f"{c.replace('stall_', '')}:{v:.0f}" for c, v in why if v > 0)
        src = (r.get("Source") or "").strip()[:70]
        print(f"{i:5d} {n / total:6.2%}  {src:<70} {why}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
