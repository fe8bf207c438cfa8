#!/usr/bin/env bash
# Nsight Compute on one launch of each backward main kernel (ours, flash-attn-4) per row: stall
# reasons, pipe and shared-memory utilisation. Run on the GPU machine after .gpu-kit/setup.sh;
# clocks are left alone (--clock-control none). Logs go to $OUT.
set -u
OUT=${OUT:-ncu_out}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for row in ${ROWS:-128:4096:0 64:4096:0}; do
  for impl in torch_fa4 flash-attn-4; do
    if [ $impl = torch_fa4 ]; then k=Sm90AttentionBackward; else k=FlashAttentionBackwardSm90; fi
    log="$OUT/ncu_${impl}_${row//:/_}.log"
    "$NCU" --clock-control none -k "regex:$k" --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
      python benchmarks/profile_kernels.py --bwd --rows "$row" --impl $impl --iters 1 > "$log" 2>&1
    echo "== $impl $row"; grep -E "Duration|Registers Per|Stall|Throughput|Pipe|Shared|Issue Slot|Warp Cycles|Executed Ipc|Bank" "$log" | head -40
  done
done
