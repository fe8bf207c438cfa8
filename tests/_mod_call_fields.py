"""AttentionCall keywords for mods, as the kernel tests (compile tests on the CPU, GPU tests) build
calls by hand: the mods traced and registered, their captured tensors, and a block mask."""


def mod_call_fields(score_mod, mask_mod, block_size, sq, sk, heads=None, device="cuda") -> dict:
    """The keywords for the mods (none where both are None) and, with block_size, a block mask of
    mask_mod at that (q, kv) tile size with `heads` heads (None: one for all) over sq x sk."""
    fields = {}
    if score_mod is not None or mask_mod is not None:
        from torch_fa4.mods.prepare import prepare
        from torch_fa4.mods.registry import lookup

        key, aux = prepare(score_mod, mask_mod)
        fields = dict(mod_key=key, mods=lookup(key), aux_tensors=tuple(aux))
    if block_size is not None:
        from torch_fa4.mods import create_block_mask

        bm = create_block_mask(mask_mod, None, heads, sq, sk, device=device, BLOCK_SIZE=block_size)
        fields.update(block_mask=tuple(bm.as_tensors()), block_mask_q=bm.BLOCK_SIZE[0],
                      block_mask_kv=bm.BLOCK_SIZE[1])
    return fields
