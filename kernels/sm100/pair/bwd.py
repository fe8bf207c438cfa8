"""sm100 CTA-pair backward entry point: which calls the cta_group::2 backward takes, and running it.

The passes around the kernel (row statistics and the zeroed fp32 dQ buffer, the dQ conversion)
are the 1-CTA sm100 backward's (kernels/sm100/bwd.py, run_variant); the kernel is
pair/bwd_kernel.py. Compile-verified only: no Blackwell GPU has run it, and the first-use
self-check guards it at run time (a variant that fails runs on the next family).

`unsupported_reason` accepts exactly the kinds of variants tests/test_sm100_pair_bwd_compile.py
compiles for sm_100a: fp16 / bf16, (D, Dv) in bwd_config.PAIR_HEAD_DIMS (128 / 128, 192 / 128,
192 / 192, 256 / 256), causal, sliding window, softcap, GQA / MQA, seqused_k, varlen with
cu_seqlens on both sides and score_mod / mask_mod. It refuses other head dims (below 128 the
1-CTA kernel's accumulators fit one CTA: that kernel takes them) and block masks (their walk is
the 1-CTA kernel's, over 128-key tiles); those calls run on the next family. Deterministic dQ,
which `unsupported_reason` cannot see, runs from here on the 1-CTA sm100 kernel (D = 128) or the
portable backward (D = 192 / 256): the variant `variant_key` names, so the self-check checks the
kernel that runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from torch_fa4.kernels.sm100 import bwd as single
from torch_fa4.kernels.sm100.bwd_config import PAIR_HEAD_DIMS, TILE_M, pair_keys

if TYPE_CHECKING:
    from torch_fa4.call import AttentionCall
    from torch_fa4.kernels.sm90.bwd_config import BwdConfig

ARCH = single.ARCH


def unsupported_reason(call: "AttentionCall") -> Optional[str]:
    if (reason := single.unsupported_reason(call, (128, 192, 256))) is not None:
        return reason
    if (call.head_dim, call.head_dim_v) not in PAIR_HEAD_DIMS:
        return (f"sm100 CTA-pair backward takes (D, Dv) in {PAIR_HEAD_DIMS}, not "
                f"({call.head_dim}, {call.head_dim_v})")
    if call.block_mask:
        return "a block mask (the sm100 CTA-pair backward walks densely)"
    return None


def variant_key(call: "AttentionCall", deterministic: bool) -> "BwdConfig":
    """The compiled variant that runs `call`: the 1-CTA key read for pairs (tile_n: the pair's
    keys, 256 at D = 128, 128 at D = 192); deterministic: the 1-CTA kernel's own key."""
    import dataclasses

    base = single.variant_key(call, deterministic) if call.head_dim <= 128 else None
    if deterministic:
        if base is None:  # D = 192 / 256: the portable backward's deterministic kernel
            from torch_fa4.kernels.portable import bwd as portable

            return ("portable", portable.variant(call, True))
        return base
    from torch_fa4.kernels.sm90.bwd_config import BwdConfig
    from torch_fa4.kernels.sm90.bwd_variant import window

    pair_n = 2 * pair_keys(call.head_dim, call.head_dim_v)
    right, left = window(call)
    fields = dict(
        dtype=call.q.dtype, head_dim=call.head_dim, head_dim_v=call.head_dim_v,
        group=call.num_heads // call.num_heads_kv, has_right=right is not None, has_left=left is not None,
        softcap=call.softcap > 0, varlen=call.is_varlen, seqused_k=call.seqused_k is not None,
        deterministic=False, mods_key=call.mods.key if call.mods is not None else "", sparse=None,
        tile_n=pair_n, tile_m=TILE_M, persistent=False, fused_dq=False, split_tail=False,
        mask_key_tail=not call.is_varlen and call.seqused_k is None and call.k.shape[1] % pair_n != 0)
    return dataclasses.replace(base, **fields) if base is not None else BwdConfig(**fields)


def is_pair(config: "BwdConfig") -> bool:
    """A pair key (tile_n: the pair's keys) rather than a 1-CTA one (deterministic)."""
    return not config.deterministic and config.tile_n == 2 * pair_keys(config.head_dim, config.head_dim_v)


def compile_variant(config: "BwdConfig", arch: str = ARCH, dump_dir: Optional[str] = None):
    """Compile one variant against symbolic shapes (no GPU needed); dump_dir: also write the cubin
    there (always compiles, bypassing the cache). A 1-CTA key compiles the 1-CTA kernel."""
    if not is_pair(config):
        return single.compile_variant(config, arch, dump_dir)
    from torch_fa4.kernels.sm90.bwd_compile import (cached_compile, compile_with_stream, cute_dtype,
                                                    kernel_args)

    def build(dump, jit=True):
        from torch_fa4.kernels.sm100.pair.bwd_kernel import Sm100PairAttentionBackward

        mods = None
        if config.mods_key:
            from torch_fa4.mods import registry

            mods = registry.lookup(config.mods_key)
        kernel = Sm100PairAttentionBackward(cute_dtype(config.dtype), config, mods)
        args = kernel_args(config, mods, with_captured_grads=False)
        return compile_with_stream(kernel, args, arch, dump, jit)

    return cached_compile(("sm100_pair_bwd", arch, config), build, dump_dir)


def backward(call: "AttentionCall", dout, out, lse, dq, dk, dv, deterministic: bool) -> None:
    """dq, dk, dv of `call` for output gradient dout (out, lse: the forward's)."""
    key = variant_key(call, deterministic)
    if isinstance(key, tuple):
        from torch_fa4.kernels.portable import bwd as portable

        portable.backward(call, dout, out, lse, dq, dk, dv, deterministic)
        return
    if not is_pair(key):  # deterministic at D = 128: the 1-CTA kernel's own entry point
        single.backward(call, dout, out, lse, dq, dk, dv, deterministic)
        return
    single.run_variant(call, key, compile_variant(key), dout, out, lse, dq, dk, dv)
