# Sourced by the ncu scripts after they set KIND (bwd|fwd): the output folder ($OUT, created), the
# Nsight Compute binary ($NCU), the profile_kernels.py flag of the kind ($flag) and ncu_kernel_name.
OUT=${OUT:-ncu_out}
mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/ncu_kernel_name.sh"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
flag=""; [ "$KIND" = bwd ] && flag=--bwd
