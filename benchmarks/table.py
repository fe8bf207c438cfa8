"""A bench.py results.json as the README's markdown table (ratio = torch_fa4 / flash-attn-4).

    python benchmarks/table.py benchmarks/results/2026-11-28_h100_grid.json
"""

import json
import sys

COLUMNS = ["torch_fa4", "flash-attn-4", "sdpa-cudnn", "sdpa-flash", "flex"]
HEADERS = ["torch_fa4", "flash-attn-4", "cuDNN (SDPA)", "flash (SDPA)", "FlexAttention (compiled)"]


def main(path: str) -> None:
    data = json.load(open(path))
    print(f"| row | {' | '.join(HEADERS)} | ratio |")
    print("|---" * (len(HEADERS) + 2) + "|")
    for row in data["rows"]:
        cells = [f"{row[c]:.0f}" if row.get(c) else "" for c in COLUMNS]
        ours, ref = row.get("torch_fa4"), row.get("flash-attn-4")
        ratio = f"{ours / ref:.2f}" if ours and ref else ""
        print(f"| {row['row']} | {' | '.join(cells)} | {ratio} |")


if __name__ == "__main__":
    main(sys.argv[1])
