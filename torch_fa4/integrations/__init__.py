"""torch_fa4 behind other libraries' attention entry points: `sdpa` (PyTorch's
`scaled_dot_product_attention`, opt-in) and `transformers` (`attn_implementation="fa4"`)."""
