#!/usr/bin/env bash
# Nsight Compute on one launch of the main kernel of each implementation (ours, flash-attn-4) per
# row: stall reasons, pipe and shared-memory utilisation, L2 / DRAM rates, instruction mix. Run on
# the GPU machine after .gpu-kit/setup.sh; clocks are left alone (--clock-control none). Logs go to $OUT.
#   KIND=bwd|fwd ROWS="128:4096:0 64:4096:0" bash scripts/ncu_rows.sh
set -u
KIND=${KIND:-bwd}
source "$(dirname "$0")/ncu_common.sh"
for row in ${ROWS:-128:4096:0 64:4096:0}; do
  for impl in torch_fa4 flash-attn-4; do
    k=$(ncu_kernel_name "$KIND" "$impl")
    log="$OUT/ncu_${KIND}_${impl}_${row//:/_}.log"
    "$NCU" --clock-control none -k "regex:$k" --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section InstructionStats --section LaunchStats \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum" \
      python benchmarks/profile_kernels.py $flag --rows "$row" --impl $impl --iters 1 > "$log" 2>&1
    echo "== $KIND $impl $row"
    grep -E "Duration|Registers Per|Issue Slots|Executed Ipc A|Local Memory Spilling Req|inst_executed.sum|highest-utilized" "$log" | head -12
    grep -E "L2 Cache Throughput|DRAM Throughput|L2 Hit Rate" "$log" | sed 's/  */ /g' | head -3
    grep -E "issue_stalled" "$log" | awk '{ if ($NF+0 > 0.3) print }' | sed 's/smsp__average_warps_issue_stalled_//' | head -14
  done
done
