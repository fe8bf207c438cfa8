"""What the GPU tests share: which device this is (their skip markers), spies that prove a kernel (not
the reference) ran, the NaN poisoning of a forward's outputs before each launch, a public call that
may not fall back, fresh random inputs, and the comparison of a directly launched forward against
float64 attention (tests/naive.py).

Imported as `gpu_harness` (pytest puts tests/gpu on sys.path for the test files in it; tests/conftest.py
puts tests/ there for `naive`). Nothing here touches CUDA beyond asking the device's capability.
"""

import warnings

import pytest
import torch

from naive import call_options, naive_attention, naive_varlen

HAS_CUDA = torch.cuda.is_available()
ON_SM90 = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
ON_SM100 = HAS_CUDA and torch.cuda.get_device_capability() == (10, 0)


def gpu_marks(runs_here: bool, reason: str):
    """A test module's pytestmark: marked `gpu`, and skipped (saying `reason`) where not `runs_here`."""
    return [pytest.mark.gpu, pytest.mark.skipif(not runs_here, reason=reason)]


SM90_ONLY = gpu_marks(ON_SM90, "needs a CUDA sm_90 device")
SM100_ONLY = gpu_marks(ON_SM100, "needs a CUDA sm_100 device")


def _direction_and_module(call, direction, module):
    return direction, None if module is None else module.__name__


def dispatch_spy(original, picked: list, entry=_direction_and_module):
    """A stand-in for dispatch.kernel_for that answers as `original` and appends
    entry(call, direction, module) (default: (direction, module name or None for the reference))
    to `picked`."""

    def spy(call, direction, **kw):
        module = original(call, direction, **kw)
        picked.append(entry(call, direction, module))
        return module

    return spy


def record_kernel_picks(monkeypatch, entry=_direction_and_module) -> list:
    """Patch dispatch.kernel_for with a dispatch_spy for the test; returns the list it fills."""
    from torch_fa4 import dispatch

    picked = []
    monkeypatch.setattr(dispatch, "kernel_for", dispatch_spy(dispatch.kernel_for, picked, entry))
    return picked


def poison_forward(monkeypatch, fwd_host, record=None) -> list:
    """Wrap fwd_host.forward for the test: every launch first fills out / lse with NaN (an element
    the kernel does not write then shows) and, given `record`, appends record(call, overrides) to
    the returned list (so a test knows which kernel variant ran, and that one did)."""
    seen = []
    real_forward = fwd_host.forward

    def poisoned_forward(call, out, lse, **overrides):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        if record is not None:
            seen.append(record(call, overrides))
        real_forward(call, out, lse, **overrides)

    monkeypatch.setattr(fwd_host, "forward", poisoned_forward)
    return seen


def default_variant(fwd_host):
    """A poison_forward `record`: the variant fwd_host picks for the call and its overrides."""
    return lambda call, overrides: fwd_host.default_config(call, **overrides)


def public(fn, *args, **kw):
    """Run a public API call; a fallback to the reference is an error, not a warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="torch_fa4:.*falls back")
        out = fn(*args, **kw)
    torch.cuda.synchronize()
    return out


def random_qkv(B, Sq, Sk, H, Hkv, D, dtype=torch.bfloat16):
    """Fresh standard-normal q (B, Sq, H, D) and k, v (B, Sk, Hkv, D) on the GPU."""
    return (torch.randn(B, Sq, H, D, device="cuda", dtype=dtype),
            torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype),
            torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype))


def launch_poisoned(fwd_host, call, **overrides):
    """out, lse of fwd_host.forward(call) launched directly into NaN-filled buffers."""
    out = torch.full(call.out_shape(), float("nan"), dtype=call.q.dtype, device="cuda")
    lse = torch.full(call.lse_shape(), float("nan"), dtype=torch.float32, device="cuda")
    fwd_host.forward(call, out, lse, **overrides)
    torch.cuda.synchronize()
    return out, lse


def check_against_float64(call, out, lse, score_mod=None, mask_mod=None, empty_lse_exact=False):
    """The kernel's out / lse for `call` against float64 attention (tests/naive.py): no NaN, error at
    most twice eager attention's in the inputs' dtype, the same rows with a finite LSE and those
    within 2e-3; with `empty_lse_exact`, the others equal to the oracle's (-inf). Returns
    (error, eager error)."""
    assert not out.isnan().any(), "unwritten or NaN output"
    assert not lse.isnan().any(), "unwritten or NaN lse"
    opts = dict(call_options(call), score_mod=score_mod, mask_mod=mask_mod)
    ref_out, ref_lse = naive_varlen(call.q, call.k, call.v, **opts, device=call.q.device)
    eager_out, _ = naive_varlen(call.q, call.k, call.v, **opts, differentiable=True)  # in the inputs' dtype
    err = (out.double() - ref_out).abs().max().item()
    eager_err = (eager_out.double() - ref_out).abs().max().item()
    assert err <= 2 * eager_err + 1e-4, f"kernel err {err:.3e} vs eager {eager_err:.3e}"
    lse = lse.double()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse -inf pattern differs"
    if empty_lse_exact:
        assert torch.equal(lse[~finite], ref_lse[~finite])
    if finite.any():
        assert (lse[finite] - ref_lse[finite]).abs().max().item() < 2e-3
    return err, eager_err


def rel(x, ref):
    """Relative L2 error of x against ref (x must hold no NaN)."""
    assert not torch.isnan(x).any()
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def leaves(*ts):
    """Detached copies of ts that require grad."""
    return [t.detach().clone().requires_grad_() for t in ts]


def compare_to_float64(out, lse, ref_out, ref_lse, eager_out, empty_lse_exact=False, empty_rows_zero=False):
    """out (B, S, H, Dv) / lse (B, H, S) of one dense call against the float64 oracle's ref_out / ref_lse:
    no NaN, error at most twice eager_out's (the same attention in the inputs' dtype), the same rows
    with a finite LSE and those within 2e-3 + 1e-4 |lse|; with `empty_lse_exact`, the other rows'
    LSE equal to the oracle's (-inf); with `empty_rows_zero`, their output exactly zero."""
    assert not out.isnan().any(), "unwritten or NaN output"
    assert not lse.isnan().any(), "unwritten or NaN lse"
    out, lse = out.double().cpu(), lse.double().cpu()
    ref_out, ref_lse, eager_out = ref_out.double().cpu(), ref_lse.double().cpu(), eager_out.double().cpu()
    err = (out - ref_out).abs().max().item() if out.numel() else 0.0
    eager_err = (eager_out - ref_out).abs().max().item() if out.numel() else 0.0
    assert err <= 2 * eager_err + 1e-4, f"kernel err {err:.3e} vs eager {eager_err:.3e}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse -inf pattern differs"
    if empty_lse_exact:
        assert torch.equal(lse[~finite], ref_lse[~finite])
    if finite.any():
        tol = 2e-3 + 1e-4 * ref_lse[finite].abs()
        lse_err = (lse[finite] - ref_lse[finite]).abs()
        assert (lse_err <= tol).all(), lse_err.max()
    if empty_rows_zero:
        empty_rows = (~finite).transpose(1, 2)  # (B, S, H)
        assert (out[empty_rows] == 0).all()


def check_mods_against_naive(out, lse, q, k, v, mods_gpu, mods_cpu, empty_lse_exact=False,
                             empty_rows_zero=False, **kw):
    """compare_to_float64 for one dense call with mods: mods_* are (score_mod, mask_mod) whose captured
    tensors live on the GPU (for eager attention in the inputs' dtype: bf16 matmuls, fp32 scores
    and softmax, P rounded to the inputs' dtype) and on the CPU (for the float64 oracle)."""
    ref_out, ref_lse = naive_attention(q, k, v, score_mod=mods_cpu[0], mask_mod=mods_cpu[1], **kw)
    eager, _ = naive_attention(q, k, v, score_mod=mods_gpu[0], mask_mod=mods_gpu[1], differentiable=True,
                               score_dtype=torch.float32, **kw)
    compare_to_float64(out, lse, ref_out, ref_lse, eager, empty_lse_exact, empty_rows_zero)


def random_document_ids(S, device, docs=5):
    """Document ids (S,) of `docs` documents of random nonzero lengths."""
    from torch_fa4 import mods as M

    cuts = torch.sort(torch.randperm(S - 1)[: docs - 1] + 1).values
    lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([S])]))
    return M.document_ids_from_lengths(lengths).to(device)


def causal_documents_call(D, block_mask, B=2, S=700, H=4):
    """A public call under a causal document mask on fresh inputs (a block mask through flex_attention,
    or a mask_mod through attention). Returns out (B, S, H, D), lse, q, k, v and the mask on the GPU
    and on the CPU."""
    import torch_fa4
    from torch_fa4 import mods as M

    q, k, v = random_qkv(B, S, S, H, H, D)
    ids = random_document_ids(S, "cuda")
    mask = M.and_masks(M.document_mask(ids), M.causal_mask)
    if block_mask:
        bm = torch_fa4.create_block_mask(mask, None, None, S, S, device="cuda")
        assert bm.sparsity() > 0
        out, lse = public(torch_fa4.flex_attention, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                          block_mask=bm, return_lse=True)
        out = out.transpose(1, 2)
    else:
        out, lse = public(torch_fa4.attention, q, k, v, mask_mod=mask, return_lse=True)
    cpu_mask = M.and_masks(M.document_mask(ids.cpu()), M.causal_mask)
    return out, lse, q, k, v, mask, cpu_mask


def public_training_step(q, k, v, **kw):
    """torch_fa4.attention(**kw) on leaf copies of q, k, v (a fallback is an error), then its backward
    from a fresh random gradient. Returns what attention returned, that gradient and the leaves."""
    import torch_fa4

    qa, ka, va = leaves(q, k, v)
    with warnings.catch_warnings():
        # A fallback to the reference warns: make exactly that fail here (CuTe DSL's own
        # deprecation warnings are not ours to judge).
        warnings.filterwarnings("error", message="torch_fa4: .*falls back")
        result = torch_fa4.attention(qa, ka, va, **kw)
        out = result[0] if isinstance(result, tuple) else result
        grad = torch.randn_like(out)
        out.backward(grad)
    return result, grad, (qa, ka, va)


def check_training_step(out, grad, ours, q, k, v, attend, attend64=None):
    """The output and input gradients of public_training_step (out, grad, ours: its leaves) against
    float64: attend64 (default attend) on float64 copies of q, k, v is the oracle, attend on copies in
    their own dtype the error scale (each at most twice its relative error, + 1e-3). attend*:
    differentiable (q, k, v) -> (out, lse). Returns the oracle's (out, lse)."""
    q64, k64, v64 = leaves(*(t.double() for t in (q, k, v)))
    ref = (attend64 or attend)(q64, k64, v64)
    ref[0].backward(grad.double())
    qb, kb, vb = leaves(q, k, v)  # eager attention in the inputs' dtype: the error budget
    base, _ = attend(qb, kb, vb)
    base.backward(grad)
    assert rel(out, ref[0]) <= 2 * rel(base, ref[0]) + 1e-3
    for mine, eager, want in zip(ours, (qb, kb, vb), (q64, k64, v64)):
        assert rel(mine.grad, want.grad) <= 2 * rel(eager.grad, want.grad) + 1e-3
    return ref


def capture_graph(fn):
    """fn's outputs and the CUDA graph that recomputes them (warmed up first, outside the capture, on
    a side stream as torch.cuda.graph expects)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
