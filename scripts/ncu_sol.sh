#!/usr/bin/env bash
# Nsight Compute speed-of-light and memory-workload numbers of one forward (or backward) launch per
# implementation: how close each kernel runs to the L2, DRAM and tensor-pipe limits. Run on the
# GPU machine after .gpu-kit/setup.sh; clocks are left alone.
#   KIND=fwd ROWS="128:16384:0 64:16384:0" IMPLS="torch_fa4 flash-attn-4" bash scripts/ncu_sol.sh
set -u
OUT=${OUT:-ncu_out}
KIND=${KIND:-fwd}
mkdir -p "$OUT"
source "$(dirname "$0")/ncu_kernel_name.sh"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
flag=""; [ "$KIND" = bwd ] && flag=--bwd
for row in ${ROWS:-128:16384:0}; do
  for impl in ${IMPLS:-torch_fa4 flash-attn-4}; do
    k=$(ncu_kernel_name "$KIND" "$impl")
    echo "== $KIND $impl $row"
    "$NCU" --clock-control none -k "regex:$k" --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
      python benchmarks/profile_kernels.py $flag --rows "$row" --impl $impl --iters 1 2>&1 \
      | grep -E "Duration|Throughput|Hit Rate|Busy|Bandwidth|Pipe|Executed Ipc|Issue Slots" | sed 's/  */ /g'
  done
done | tee "$OUT/sol_${KIND}.txt"
