# Sourced through scripts/ncu_common.sh: the main kernel's name (a regex for ncu -k) of an implementation.
#   ncu_kernel_name bwd|fwd torch_fa4|flash-attn-4
ncu_kernel_name() {
  case "$1/$2" in
    bwd/torch_fa4) echo Sm90AttentionBackward ;;
    bwd/flash-attn-4) echo FlashAttentionBackwardSm90 ;;
    fwd/torch_fa4) echo FlashFwdSm90 ;;
    fwd/flash-attn-4) echo FlashAttentionForwardSm90 ;;
  esac
}
