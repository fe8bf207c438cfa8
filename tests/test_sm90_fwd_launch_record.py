"""CPU: the forward's launch records (kernels/sm90/fwd_launch_record.py) launch what the general
path launches.

The compiled kernel is replaced by a recorder of its launch arguments, so these run without CuTe
DSL or a GPU: for each call shape the general path's launch and the record's first and later
launches must pass the same variant, the same tensors and scalars, and equal per-launch buffers
(the dynamic scheduler's counter, the split tail's workspace and counters).
"""

import pytest
import torch

from torch_fa4.call import AttentionCall
from torch_fa4.kernels.host import fwd_launch, shape_memo
from torch_fa4.kernels.sm90 import fwd_host, fwd_launch_record


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch as (variant, arguments); the kernel itself a recorder."""
    seen = []

    def compile_stub(cfg, *args, **kwargs):
        return lambda *launch_args: seen.append((cfg, launch_args))

    monkeypatch.setattr(fwd_host, "compile_fwd", compile_stub)
    return seen


def _tensors(*shapes, strided=False):
    made = []
    for shape in shapes:
        if strided:  # the SDPA layout: (B, H, S, D) storage seen as (B, S, H, D)
            b, s, h, d = shape
            made.append(torch.randn(b, h, s, d).bfloat16().transpose(1, 2))
        else:
            made.append(torch.randn(*shape).bfloat16())
    return made


CASES = {
    # (q shape, k / v shape, call options, SM count)
    "causal_gqa_d128": ((2, 300, 4, 128), (2, 500, 2, 128), dict(causal=True), 132),
    "plain_d64_long": ((1, 4096, 2, 64), (1, 4096, 2, 64), {}, 132),
    "d256_s1k": ((2, 1024, 2, 256), (2, 1024, 2, 256), {}, 132),
    "window_softcap": ((1, 700, 2, 128), (1, 700, 2, 128), dict(window_left=64, window_right=0, softcap=20.0), 132),
    "split_tail": ((1, 16384, 16, 128), (1, 16384, 16, 128), {}, 132),  # 2048 items on 132 SMs
    "sdpa_layout": ((2, 333, 4, 96), (2, 333, 4, 96), dict(causal=True), 114),
    "alibi_causal": ((2, 256, 4, 128), (2, 256, 4, 128), dict(causal=True, mods="alibi"), 132),
    "document_block_mask": ((1, 512, 2, 64), (1, 512, 2, 64), dict(mods="document"), 132),
    "packed_varlen": ((700, 4, 128), (900, 2, 128), dict(causal=True, varlen=((0, 300, 700), (0, 500, 900))), 132),
}


def _make_call(q, k, v, options):
    """An AttentionCall as the fwd op makes it: mods traced and resolved, a block mask built."""
    from torch_fa4 import mods as M
    from torch_fa4.mods import registry

    options = dict(options)
    kind = options.pop("mods", None)
    varlen = options.pop("varlen", None)
    extra = {}
    if kind == "alibi":
        key, aux = M.prepare(M.alibi(M.alibi_slopes(q.shape[-2])), None)
        extra = dict(mod_key=key, mods=registry.lookup(key), aux_tensors=tuple(aux))
    elif kind == "document":
        S = q.shape[1]
        doc = torch.arange(S) // 200  # documents of 200 tokens, a captured tensor

        def same_document(b, h, q_idx, kv_idx):
            return doc[q_idx] == doc[kv_idx]

        key, aux = M.prepare(None, same_document)
        bm = M.create_block_mask(same_document, None, None, S, S, device="cpu")
        extra = dict(mod_key=key, mods=registry.lookup(key), aux_tensors=tuple(aux),
                     block_mask=tuple(bm.as_tensors()), block_mask_q=bm.BLOCK_SIZE[0], block_mask_kv=bm.BLOCK_SIZE[1])
    elif varlen is not None:
        cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in varlen)
        extra = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int((cu_q[1:] - cu_q[:-1]).max()),
                     max_seqlen_k=int((cu_k[1:] - cu_k[:-1]).max()))
    return AttentionCall(q=q, k=k, v=v, scale=q.shape[-1] ** -0.5, **options, **extra)


def _same_launch(a, b):
    """Two launches pass the same variant and arguments: the call's own tensors and equal
    per-launch buffers (counters zeroed; the split workspace, written before it is read, by shape)."""
    (cfg_a, args_a), (cfg_b, args_b) = a, b
    assert cfg_a == cfg_b
    assert len(args_a) == len(args_b)
    workspace = len(args_a) - 4  # (the split's state, uninitialised; then counters, items, page table)
    for i, (x, y) in enumerate(zip(args_a, args_b)):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor), f"argument {i}"
            if i < 5:  # q, k, v, out, lse: the call's own tensors
                assert x is y, f"argument {i}"
                continue
            assert x.shape == y.shape and x.dtype == y.dtype and x.stride() == y.stride(), f"argument {i}"
            if i != workspace:
                assert torch.equal(x, y), f"argument {i}"
        else:
            assert x == y, f"argument {i}: {x!r} != {y!r}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_records_launch_what_the_general_path_launches(case, launches, monkeypatch):
    q_shape, kv_shape, options, sms = CASES[case]
    monkeypatch.setattr(fwd_launch, "_sm_count_of", lambda call: sms)
    strided = case == "sdpa_layout"
    q, = _tensors(q_shape, strided=strided)
    k, v = _tensors(kv_shape, kv_shape, strided=strided)
    call = _make_call(q, k, v, options)
    out = torch.empty(call.out_shape(), dtype=q.dtype)
    lse = torch.empty(call.lse_shape())

    real_run = fwd_launch_record.run
    monkeypatch.setattr(fwd_launch_record, "run", lambda *a: False)
    fwd_host.forward(call, out, lse)
    monkeypatch.setattr(fwd_launch_record, "run", real_run)
    fwd_host.forward(call, out, lse)  # derives the record, then launches from it
    fwd_host.forward(call, out, lse)
    assert len(launches) == 3
    records = list(fwd_launch_record._records.values())
    assert len(records) == 1 and isinstance(records[0], fwd_launch_record.LaunchRecord)
    # a record keeps no tensor of the call alive (only scalars, the variant and buffer shapes)
    assert not any(isinstance(x, torch.Tensor) for x in (*records[0].scalars, *(records[0].split or ())))
    _same_launch(launches[0], launches[1])
    _same_launch(launches[0], launches[2])
    cfg = launches[0][0]
    if case == "split_tail":
        # (the plan test_split_plan checks; the page table is the last argument)
        assert cfg.split_ways == 5 and launches[2][1][-2] == 68
    if case == "causal_gqa_d128":
        assert cfg.dynamic_schedule  # (a counter per launch, zeroed)
    if case == "document_block_mask":
        assert cfg.block_sparse
    if options.get("mods"):
        # new values of the captured tensors (and block mask): the same record, launched with them
        call.aux_tensors = tuple(t + 1 if t.is_floating_point() else t.flip(0) for t in call.aux_tensors)
        if call.block_mask:
            call.block_mask = tuple(t.flip(0) for t in call.block_mask)
        fwd_host.forward(call, out, lse)
        assert len(fwd_launch_record._records) == 1
        launched = launches[-1][1]
        for t in (*call.block_mask, *call.aux_tensors):
            assert any(isinstance(a, torch.Tensor) and a.shape == t.shape and torch.equal(a, t) for a in launched)
    if call.is_varlen:
        assert launches[-1][1][5] is call.cu_seqlens_q and launches[-1][1][6] is call.cu_seqlens_k


def test_calls_the_record_does_not_take(launches):
    """Negative scales (run on -q), packed varlen without its maxima and config overrides take
    the general path."""
    q, k, v = _tensors((1, 256, 2, 128), (1, 256, 2, 128), (1, 256, 2, 128))
    out, lse = torch.empty_like(q), torch.empty(1, 2, 256)
    negative = AttentionCall(q=q, k=k, v=v, scale=-0.1)
    for _ in range(2):
        fwd_host.forward(negative, out, lse)
    assert list(fwd_launch_record._records.values()) == [shape_memo.NOT_RECORDED]
    assert all(torch.equal(args[0], -q) and args[8] == pytest.approx(0.1) for _, args in launches)

    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    packed = AttentionCall(q=q[0], k=k[0], v=v[0], scale=0.1, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert not fwd_launch_record.run(packed, out[0], torch.empty(2, 256))
    plain = AttentionCall(q=q, k=k, v=v, scale=0.1)
    fwd_host.forward(plain, out, lse, tile_n=64)  # an override: the general path, no record
    assert launches[-1][0].tile_n == 64 and len(fwd_launch_record._records) == 1

