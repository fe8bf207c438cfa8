"""CPU: the memos of a call with mods and a block mask (torch_fa4/mods/call_memo.py, the folding
per key in api.py, dispatch's choice per layout with shape_memo.mods_layout, torch block masks'
lists in block_mask.py) never serve a stale answer.

Every test changes one thing a memo could miss -- a captured tensor or a block mask written in
place, a closure cell or a global rebound, another closure of the same code, an attribute of the
block mask reassigned, a tensor that died -- and checks that the op receives exactly what a
process without any memo would hand it (every memo emptied before that call), and, with a faked
Hopper whose kernel is a stand-in that computes attention from the block lists it is given, the
output against float64.
"""

import gc
import math
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

import torch_fa4
from naive import naive_attention, rel_error
from torch_fa4 import api, dispatch
from torch_fa4.kernels.host import shape_memo
from torch_fa4.mods import block_lists, block_mask as block_mask_module, call_memo


def _forget_everything():
    """Every memo of the mods' host path emptied: the next call derives all afresh."""
    shape_memo.clear_all()
    block_lists._CACHE.clear()
    block_mask_module._TORCH_LISTS._entries.clear()


@pytest.fixture
def derivations(monkeypatch):
    """How many calls derived their mod arguments (missed call_memo's memo)."""
    seen = []
    real = api._folded
    monkeypatch.setattr(api, "_folded", lambda *a: seen.append(1) or real(*a))
    return seen


def _same_arguments(got, want):
    """Op arguments equal, tensors by value; the captured tensors must be the very same objects."""
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        if i == 0:  # the captured tensors: the call's own, never a remembered one
            assert len(a) == len(b) and all(x is y for x, y in zip(a, b))
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert x.dtype == y.dtype and torch.equal(x, y)
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            assert a is b
        else:
            assert a == b and type(a) is type(b), (i, a, b)


def _fresh_arguments(op_args, call):
    """The op arguments `call()` gets from a process that remembers nothing."""
    _forget_everything()
    call()
    return op_args[-1]


def _check_against_fresh(op_args, call):
    """call() twice with its memos as they are (the second a hit where nothing changed), then with
    every memo emptied: all three hand the op the same arguments."""
    call()
    first = op_args[-1]
    call()
    second = op_args[-1]
    _same_arguments(second, first)
    _same_arguments(first, _fresh_arguments(op_args, call))
    return first


S, DOC = 512, 100


def _qkv(S=S, B=1, H=2, D=64, dtype=torch.float32):
    return [torch.randn(B, H, S, D, dtype=dtype) for _ in range(3)]


def _document_causal(doc_ids):
    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[q_idx] == doc_ids[kv_idx])
    return document_causal


def _document_call(doc_ids):
    """A torch_fa4 block mask of causal documents `doc_ids` and a flex_attention call with it on
    fresh q, k, v."""
    bm = torch_fa4.create_block_mask(_document_causal(doc_ids), None, None, S, S, device="cpu")
    q, k, v = _qkv()
    return bm, lambda: torch_fa4.flex_attention(q, k, v, block_mask=bm)


def _lists(bm_args):
    return [t.clone() for t in bm_args]


# ---- the op's arguments: a memo hit equals a fresh derivation -------------------------------------

def test_repeated_call_is_a_hit_with_the_same_arguments(op_args, derivations):
    doc_ids = torch.arange(S) // DOC
    mask = _document_causal(doc_ids)
    bm = torch_fa4.create_block_mask(mask, None, None, S, S, device="cpu")
    q, k, v = _qkv()
    call = lambda: torch_fa4.flex_attention(q, k, v, block_mask=bm)
    args = _check_against_fresh(op_args, call)
    assert args[8] is True and args[10] == 0  # causal folded out of the mask
    assert derivations == [1, 1]  # the first call and the fresh one; the second was a hit
    assert len(call_memo.MOD_ARGUMENTS) == 1


def test_captured_tensor_written_in_place(op_args):
    doc_ids = torch.arange(S) // DOC
    bm, call = _document_call(doc_ids)
    before = _lists(_check_against_fresh(op_args, call)[4])
    doc_ids.copy_(torch.arange(S) // 256)  # documents on tile bounds: the diagonal tiles become full
    after = _check_against_fresh(op_args, call)[4]
    assert any(not torch.equal(a, b) for a, b in zip(before, after))  # (the re-listing did change)


def test_block_mask_written_in_place(op_args):
    doc_ids = torch.arange(S) // DOC
    bm, call = _document_call(doc_ids)
    before = _lists(_check_against_fresh(op_args, call)[4])
    bm.kv_num_blocks[..., -1] = 0  # the last query tile loses its partial tiles
    after = _check_against_fresh(op_args, call)[4]
    assert not torch.equal(before[0], after[0])
    bm.full_kv_indices.zero_()  # and through a view of one of them
    bm.full_kv_num_blocks.view(-1)[1:].fill_(1)
    _check_against_fresh(op_args, call)


def test_block_mask_attribute_reassigned(op_args):
    doc_ids = torch.arange(S) // DOC
    mask = _document_causal(doc_ids)
    bm = torch_fa4.create_block_mask(mask, None, None, S, S, device="cpu")
    q, k, v = _qkv()
    call = lambda: torch_fa4.flex_attention(q, k, v, block_mask=bm)
    _check_against_fresh(op_args, call)
    other = torch_fa4.create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, S, S, device="cpu")
    bm.kv_num_blocks, bm.kv_indices = other.kv_num_blocks, other.kv_indices
    args = _check_against_fresh(op_args, call)
    assert args[4][0] is not None


def test_closure_cell_rebound(op_args):
    doc_ids = torch.arange(S) // DOC

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[q_idx] == doc_ids[kv_idx])

    bm = torch_fa4.create_block_mask(document_causal, None, None, S, S, device="cpu")
    q, k, v = _qkv()
    call = lambda: torch_fa4.flex_attention(q, k, v, block_mask=bm)
    first = _check_against_fresh(op_args, call)
    old = doc_ids
    doc_ids = torch.arange(S) // 256  # the same function object now reads another tensor
    second = _check_against_fresh(op_args, call)
    assert second[0][0] is doc_ids and first[0][0] is old
    assert any(not torch.equal(a, b) for a, b in zip(first[4], second[4]))


_GLOBAL_DOCS = torch.arange(S) // DOC


def _global_document_causal(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (_GLOBAL_DOCS[q_idx] == _GLOBAL_DOCS[kv_idx])


def test_global_rebound(op_args, monkeypatch):
    bm = torch_fa4.create_block_mask(_global_document_causal, None, None, S, S, device="cpu")
    q, k, v = _qkv()
    call = lambda: torch_fa4.flex_attention(q, k, v, block_mask=bm)
    first = _check_against_fresh(op_args, call)
    monkeypatch.setitem(globals(), "_GLOBAL_DOCS", torch.arange(S) // 256)
    second = _check_against_fresh(op_args, call)
    assert second[0][0] is _GLOBAL_DOCS and first[0][0] is not _GLOBAL_DOCS


def test_another_closure_of_the_same_code(op_args):
    """Two mods from one factory: the same code and key, their own tensors and lists."""
    q, k, v = _qkv()
    masks = [_document_causal(torch.arange(S) // d) for d in (DOC, 256)]
    bms = [torch_fa4.create_block_mask(m, None, None, S, S, device="cpu") for m in masks]
    got = []
    for bm in bms + bms:
        torch_fa4.flex_attention(q, k, v, block_mask=bm)
        got.append(op_args[-1])
    assert got[0][12] == got[1][12]  # one key
    for i, bm in enumerate(bms):
        _same_arguments(got[i + 2], got[i])
        _same_arguments(got[i], _fresh_arguments(op_args, lambda: torch_fa4.flex_attention(q, k, v, block_mask=bm)))
    assert got[0][0][0] is not got[1][0][0]


def test_mask_mod_without_block_mask_and_score_mods(op_args):
    """No block mask: the mod arguments still come from this call (captured tensors, the fold)."""
    slopes = torch.rand(2)
    q, k, v = _qkv()

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    call = lambda: torch_fa4.flex_attention(q, k, v, score_mod=alibi, mask_mod=lambda b, h, qi, kv: qi >= kv)
    first = _check_against_fresh(op_args, call)
    assert first[8] is True and first[4] == []  # causal folded, no block mask
    slopes.mul_(2)  # values only the kernel reads: the same arguments
    _check_against_fresh(op_args, call)
    slopes = torch.rand(2)  # another tensor
    assert _check_against_fresh(op_args, call)[0][0] is slopes


@pytest.mark.parametrize("change", ["causal", "window", "length", "softcap", "seqused_k"])
def test_scalars_and_lengths_are_part_of_the_key(op_args, change):
    doc_ids = torch.arange(S) // DOC
    mask = _document_causal(doc_ids)
    bm = torch_fa4.create_block_mask(mask, None, None, S, S, device="cpu")
    q, k, v = (t.transpose(1, 2) for t in _qkv())
    kw = dict(block_mask=bm)
    _check_against_fresh(op_args, lambda: torch_fa4.attention(q, k, v, **kw))
    if change == "causal":
        kw["causal"] = True
    elif change == "window":
        kw["window_size"] = (64, 0)
    elif change == "softcap":
        kw["softcap"] = 5.0
    elif change == "seqused_k":
        kw["seqused_k"] = torch.tensor([S - 3], dtype=torch.int32)
    else:
        q = q[:, :S - 100]
    _check_against_fresh(op_args, lambda: torch_fa4.attention(q, k, v, **kw))


def test_entries_go_with_their_tensors():
    q, k, v = _qkv()
    doc_ids = torch.arange(S) // DOC
    bm = torch_fa4.create_block_mask(_document_causal(doc_ids), None, None, S, S, device="cpu")
    torch_fa4.flex_attention(q, k, v, block_mask=bm)
    assert len(call_memo.MOD_ARGUMENTS) == 1
    del bm, doc_ids
    gc.collect()
    assert len(call_memo.MOD_ARGUMENTS) == 0  # (nothing else of torch_fa4 kept them alive either)


def test_inference_tensors_are_not_kept(op_args):
    with torch.inference_mode():
        doc_ids = torch.arange(S) // DOC
        bm, call = _document_call(doc_ids)
        _check_against_fresh(op_args, call)
        assert len(call_memo.MOD_ARGUMENTS) == 0


# ---- torch's own BlockMask ------------------------------------------------------------------------

def _torch_block_mask(mask_mod, full_blocks=True, index_dtype=torch.int32):
    """A torch BlockMask of `mask_mod` (optionally without full blocks, or int64 lists)."""
    bm = torch_fa4.create_block_mask(mask_mod, None, None, S, S, device="cpu")
    if full_blocks:
        return TorchBlockMask.from_kv_blocks(bm.kv_num_blocks.to(index_dtype), bm.kv_indices.to(index_dtype),
                                             bm.full_kv_num_blocks.to(index_dtype), bm.full_kv_indices.to(index_dtype),
                                             BLOCK_SIZE=128, mask_mod=mask_mod, seq_lengths=(S, S))
    classes = bm.tile_classes()  # every visible tile as partial
    from torch_fa4.mods.block_mask import _compress
    num, idx = _compress(classes > 0)
    return TorchBlockMask.from_kv_blocks(num.to(index_dtype), idx.to(index_dtype), BLOCK_SIZE=128,
                                         mask_mod=mask_mod, seq_lengths=(S, S))


@pytest.mark.parametrize("full_blocks, index_dtype", [(False, torch.int32), (True, torch.int64), (True, torch.int32)])
def test_torch_block_mask(op_args, derivations, full_blocks, index_dtype):
    doc_ids = torch.arange(S) // DOC
    mask = _document_causal(doc_ids)
    bm = _torch_block_mask(mask, full_blocks, index_dtype)
    q, k, v = _qkv()
    call = lambda: torch_fa4.flex_attention(q, k, v, block_mask=bm)
    first = _check_against_fresh(op_args, call)
    assert derivations == [1, 1]  # (the converted lists are the same tensors on the second call)
    bm.kv_num_blocks[..., -1] = 0
    second = _check_against_fresh(op_args, call)
    assert not torch.equal(first[4][0], second[4][0])
    doc_ids.copy_(torch.arange(S) // 256)
    _check_against_fresh(op_args, call)


def test_torch_lists_keep_no_caller_tensor():
    block_mask_module._TORCH_LISTS._entries.clear()
    doc_ids = torch.arange(S) // DOC
    bm = _torch_block_mask(_document_causal(doc_ids), full_blocks=False)
    first = block_mask_module._torch_lists(bm)
    assert first[0] is bm.kv_num_blocks and first[2] is block_mask_module._torch_lists(bm)[2]
    made = next(iter(block_mask_module._TORCH_LISTS._entries.values()))[1]
    assert made[0] is None and made[1] is None and made[2] is not None


# ---- index bounds are checked on every call --------------------------------------------------------

def test_index_tensor_out_of_range_after_a_hit():
    doc_ids = torch.arange(S) // DOC
    table = torch.zeros(8)

    def score(s, b, h, q_idx, kv_idx):
        return s + table[doc_ids[q_idx]]

    bm = torch_fa4.create_block_mask(_document_causal(doc_ids), None, None, S, S, device="cpu")
    q, k, v = _qkv()
    torch_fa4.flex_attention(q, k, v, score_mod=score, block_mask=bm)
    torch_fa4.flex_attention(q, k, v, score_mod=score, block_mask=bm)
    doc_ids[-1] = 8
    with pytest.raises(torch_fa4.mods.ModIndexError):
        torch_fa4.flex_attention(q, k, v, score_mod=score, block_mask=bm)


# ---- a faked Hopper whose kernel computes from the block lists it is given -----------------------

def _block_list_forward(call, out, lse):
    """What a block-sparse kernel computes: tiles in no list are skipped, partial tiles apply the
    mask_mod, full tiles do not; the built-in causal / window masks on top (float64)."""
    q, k, v = (t.double() for t in (call.q, call.k, call.v))
    B, Sq, H, D = q.shape
    Sk = k.shape[1]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(H // k.shape[2], dim=2)) * call.scale
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    i = torch.arange(Sq).view(1, 1, Sq, 1)
    j = torch.arange(Sk).view(1, 1, 1, Sk)
    visible = torch.ones(B, H, Sq, Sk, dtype=torch.bool)
    diag = i + Sk - Sq
    if call.causal:
        visible &= j <= diag
    if call.window_right >= 0:
        visible &= j <= diag + call.window_right
    if call.window_left >= 0:
        visible &= j >= diag - call.window_left
    if call.mods is not None and call.mods.mask_graph is not None:
        keep = call.mods.mask_torch(b, h, i, j, call.mask_aux).bool()
        if call.block_mask:
            classes = torch_fa4.mods.BlockMask(*call.block_mask, (call.block_mask_q, call.block_mask_kv), None,
                                               (Sq, Sk)).tile_classes().long()
            tiles = classes.repeat_interleave(call.block_mask_q, 2)[:, :, :Sq]
            tiles = tiles.repeat_interleave(call.block_mask_kv, 3)[..., :Sk]
            keep = (tiles == 2) | ((tiles == 1) & keep)
        visible &= keep
    s = s.masked_fill(~visible, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out.copy_(torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(H // v.shape[2], dim=2)))
    lse.copy_(torch.logsumexp(s, dim=-1))


@pytest.fixture
def block_list_hopper(monkeypatch):
    """Compute capability 9.0 on CPU tensors, the sm90 forward a stand-in reading the block lists;
    returns the calls it ran."""
    from torch_fa4.kernels import sm90

    monkeypatch.setattr(dispatch, "on_gpu", lambda call: True)
    monkeypatch.setattr(dispatch, "capability", lambda device: (9, 0))
    ran = []
    monkeypatch.setattr(sm90, "forward",
                        lambda call, out, lse: ran.append(call) or _block_list_forward(call, out, lse))
    return ran


def _document_ids(cuts):
    ids = torch.zeros(S, dtype=torch.int64)
    for c in cuts:
        ids[c:] += 1
    return ids


def test_kernel_results_after_every_change(block_list_hopper):
    """Output against float64 while the documents move: in place in the captured tensor with the
    block mask rebuilt in place, then through a rebound cell with a new block mask."""
    q, k, v = (t.to(torch.bfloat16) for t in _qkv())
    doc_ids = _document_ids([128, 256, 384])  # tile-aligned: the tiles below the diagonal are empty

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_ids[q_idx] == doc_ids[kv_idx])

    bm = torch_fa4.create_block_mask(document_causal, None, None, S, S, device="cpu")

    def check():
        out = torch_fa4.flex_attention(q, k, v, block_mask=bm)
        want, _ = naive_attention(*(t.transpose(1, 2) for t in (q, k, v)), mask_mod=document_causal)
        assert rel_error(out.transpose(1, 2).double(), want) < 1e-2

    for _ in range(2):
        check()
    doc_ids.copy_(_document_ids([100, 300]))  # now visible there: stale lists would skip them
    new = torch_fa4.create_block_mask(document_causal, None, None, S, S, device="cpu")
    for mine, theirs in zip(bm.as_tensors(), new.as_tensors()):
        mine.copy_(theirs)
    for _ in range(2):
        check()
    doc_ids = _document_ids([50, 450])
    bm = torch_fa4.create_block_mask(document_causal, None, None, S, S, device="cpu")
    for _ in range(2):
        check()
    assert len(block_list_hopper) == 6
    assert all(call.causal and call.block_mask for call in block_list_hopper)


def test_dispatch_choice_follows_the_mods(block_list_hopper):
    """The family's choice is kept per layout with mods too: a call the kernel refuses (block
    rows of 64 queries, more captured tensors than it takes) after one it took, same q, k, v,
    runs on the reference."""
    q, k, v = (t.to(torch.bfloat16) for t in _qkv())
    doc_ids = _document_ids([100, 300])
    mask = _document_causal(doc_ids)
    bm = torch_fa4.create_block_mask(mask, None, None, S, S, device="cpu")
    torch_fa4.flex_attention(q, k, v, block_mask=bm)
    assert len(block_list_hopper) == 1
    short = torch_fa4.create_block_mask(mask, None, None, S, S, device="cpu", BLOCK_SIZE=(64, 128))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the fallback is warned once per process)
        out = torch_fa4.flex_attention(q, k, v, block_mask=short)
    assert len(block_list_hopper) == 1  # the reference ran
    want, _ = naive_attention(*(t.transpose(1, 2) for t in (q, k, v)), mask_mod=mask)
    assert rel_error(out.transpose(1, 2).double(), want) < 1e-2
    from torch_fa4.kernels.sm90.fwd_config import MAX_AUX

    def biases(tables):
        def score(s, b, h, q_idx, kv_idx):
            for t in tables:
                s = s + t[h]
            return s
        return score

    few, many = (biases(tuple(torch.rand(2) for _ in range(n))) for n in (MAX_AUX, MAX_AUX + 1))
    torch_fa4.flex_attention(q, k, v, score_mod=few)
    assert len(block_list_hopper) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch_fa4.flex_attention(q, k, v, score_mod=many)
    assert len(block_list_hopper) == 2
    want, _ = naive_attention(*(t.transpose(1, 2) for t in (q, k, v)), score_mod=many)
    assert rel_error(out.transpose(1, 2).double(), want) < 1e-2


def test_reference_path_output_after_changes():
    """On the CPU (the reference) the outputs follow every change too."""
    q, k, v = _qkv()
    doc_ids = _document_ids([100, 300])
    mask = _document_causal(doc_ids)
    bm = torch_fa4.create_block_mask(mask, None, None, S, S, device="cpu")
    for cuts in ([100, 300], [100, 300], [128, 256]):
        doc_ids.copy_(_document_ids(cuts))
        out = torch_fa4.flex_attention(q, k, v, block_mask=bm)
        want, _ = naive_attention(*(t.transpose(1, 2) for t in (q, k, v)), mask_mod=mask)
        assert rel_error(out.transpose(1, 2).double(), want) < 1e-5


# ---- the dynamic schedule's item counters ----------------------------------------------------------

def test_counter_pool_hands_out_each_counter_once_between_fills():
    from torch_fa4.kernels.host.fwd_launch import CounterPool

    pool = CounterPool(torch.device("cpu"), 3)
    taken = [pool.take() for _ in range(3)]
    assert [t.data_ptr() for t in taken] == [pool.buffer.data_ptr() + 4 * i for i in range(3)]
    for t in taken:
        assert t.shape == (1,) and t.dtype == torch.int32 and t.item() == 0
        t.add_(5)  # what a launch leaves behind
    again = pool.take()  # all used: the buffer is zeroed first
    assert again.data_ptr() == pool.buffer.data_ptr() and not pool.buffer.any()


def test_counters_off_the_gpu_are_fresh_zeros():
    from torch_fa4.kernels.host.fwd_launch import schedule_counter

    a, b = schedule_counter(torch.device("cpu")), schedule_counter(torch.device("cpu"))
    assert a.data_ptr() != b.data_ptr() and not a.any() and not b.any()
