#!/usr/bin/env bash
# Nsight Compute: where one main-kernel launch spends shared-memory bandwidth, ours against
# flash-attn-4 (L1 throughput broken into its sub-units; the shared-memory table: instructions,
# wavefronts and bank conflicts per operation). The backward runs close to the shared-memory
# limit (NOTES Experiment 79), so its per-unit split says where the two kernels differ.
#   KIND=bwd|fwd ROWS="128:16384:1" [IMPLS=torch_fa4] bash scripts/ncu_smem.sh   (after .gpu-kit/setup.sh)
set -u
KIND=${KIND:-bwd}
source "$(dirname "$0")/ncu_common.sh"
METRICS="breakdown:l1tex__throughput.avg.pct_of_peak_sustained_elapsed"
METRICS+=",l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum"
METRICS+=",l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"
METRICS+=",smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_shared_st.sum,smsp__inst_executed.sum,gpu__time_duration.sum"
# L2: reduce-adds (the dQ accumulation), reads and its throughput
METRICS+=",lts__t_sectors_op_red.sum,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__t_sector_hit_rate.pct"
METRICS+=",lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_elapsed"
for row in ${ROWS:-128:16384:1}; do
  for impl in ${IMPLS:-torch_fa4 flash-attn-4}; do
    k=$(ncu_kernel_name "$KIND" "$impl")
    log="$OUT/ncu_smem_${KIND}_${impl}_${row//:/_}.log"
    run() {
      "$NCU" --clock-control none -k "regex:$k" --launch-skip 3 --launch-count 1 "$@" \
        python benchmarks/profile_kernels.py $flag --rows "$row" --impl $impl --iters 1
    }
    run --section MemoryWorkloadAnalysis_Tables --metrics "$METRICS" > "$log" 2>&1 \
      || run --section MemoryWorkloadAnalysis_Tables > "$log.tables_only" 2>&1
    echo "== $KIND $impl $row"
    grep -E "l1tex__|lts__|smsp__inst|gpu__time|Shared|Bank" "$log" | sed 's/  */ /g' | head -40
  done
done
