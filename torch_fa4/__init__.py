"""torch_fa4: FlashAttention-4 as a PyTorch-native drop-in."""
