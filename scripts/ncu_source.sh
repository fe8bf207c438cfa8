#!/usr/bin/env bash
# Nsight Compute warp-stall sampling per SASS instruction of one backward (or forward) launch:
# where in the loop the warps wait, and why. Run on the GPU machine after .gpu-kit/setup.sh; clocks
# are left alone. Writes $OUT/src_<impl>.csv (the source page) and a summary of the hottest
# instructions (scripts/ncu_source_top.py).
#   KIND=bwd ROW=128:4096:0 IMPLS="torch_fa4 flash-attn-4" bash scripts/ncu_source.sh
set -u
KIND=${KIND:-bwd}
ROW=${ROW:-128:4096:0}
source "$(dirname "$0")/ncu_common.sh"
for impl in ${IMPLS:-torch_fa4 flash-attn-4}; do
  k=$(ncu_kernel_name "$KIND" "$impl")
  rep="/tmp/src_${KIND}_${impl}"
  "$NCU" --clock-control none -k "regex:$k" --launch-skip 3 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --import-source no -f -o "$rep" \
    python benchmarks/profile_kernels.py $flag --rows "$ROW" --impl $impl --iters 1 > "$OUT/ncu_src_${KIND}_${impl}.log" 2>&1
  "$NCU" --import "$rep.ncu-rep" --page source --csv --print-source sass > "$OUT/src_${KIND}_${impl}.csv" 2>> "$OUT/ncu_src_${KIND}_${impl}.log"
  echo "== $KIND $impl $ROW"
  python scripts/ncu_source_top.py "$OUT/src_${KIND}_${impl}.csv" 45 | tee "$OUT/src_${KIND}_${impl}_top.txt"
  gzip -f "$OUT/src_${KIND}_${impl}.csv"
done
