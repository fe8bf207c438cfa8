"""End to end on the GPU: F.scaled_dot_product_attention routed to torch_fa4 (eager, backward,
fallbacks, torch.compile) and attn_implementation="fa4" in Transformers (forward, training step,
generate). References are float64; a spy on torch_fa4's dispatcher proves its GPU kernels ran."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpu_harness import record_kernel_picks
from naive import naive_attention
from torch_fa4 import sdpa

served = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] in sdpa.SUPPORTED_MAJORS
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not served, reason="needs a CUDA sm_90/sm_100 device")]


@pytest.fixture
def kernels_used(monkeypatch):
    """Names of the torch_fa4 kernel modules the dispatcher picked (None entries: reference)."""
    return record_kernel_picks(monkeypatch)


@pytest.fixture
def fa4_sdpa():
    with sdpa.enabled():
        yield


def test_enable_puts_flash_first_and_disable_restores_priority():
    tiny = torch.zeros(1, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    F.scaled_dot_product_attention(tiny, tiny, tiny)  # PyTorch fixes its default order lazily
    before = list(torch._C._get_sdp_priority_order())
    flash, cudnn = int(SDPBackend.FLASH_ATTENTION), int(SDPBackend.CUDNN_ATTENTION)
    with sdpa.enabled():
        order = list(torch._C._get_sdp_priority_order())
        assert order.index(flash) < order.index(cudnn)
    assert list(torch._C._get_sdp_priority_order()) == before


def _ref_attention(q, k, v, *, causal, scale, dtype=torch.float64):
    """tests/naive.py on (B, H, S, D) tensors, in `dtype` (float64: the oracle; the input dtype: the
    error budget); differentiable."""
    out, _ = naive_attention(*(t.to(dtype).transpose(1, 2) for t in (q, k, v)), causal=causal, scale=scale,
                             differentiable=True)
    return out.transpose(1, 2)


def _rel(x, ref):
    assert not torch.isnan(x).any(), "NaN in result"
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _inputs(b, h, hkv, sq, sk, d, dtype=torch.bfloat16):
    # SDPA inputs as models make them: (B, H, S, D) views of (B, S, H, D) memory.
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype).transpose(1, 2)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype).transpose(1, 2)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=dtype).transpose(1, 2)
    return q, k, v


@pytest.mark.parametrize("causal,scale,h,hkv,d", [(False, None, 8, 8, 128), (True, None, 8, 2, 128),
                                                  (True, 0.1, 4, 1, 64), (False, None, 4, 4, 64)])
def test_sdpa_forward_backward_on_torch_fa4(fa4_sdpa, kernels_used, causal, scale, h, hkv, d):
    q, k, v = _leaves(*_inputs(2, h, hkv, 384, 384, d))
    grad = torch.randn(2, h, 384, d, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=hkv != h)
        out.backward(grad)
    assert ("forward", None) not in kernels_used and any(dr == "forward" for dr, _ in kernels_used)
    assert _kernel_ran(kernels_used, "backward"), kernels_used

    q64, k64, v64 = _leaves(*(t.double() for t in (q, k, v)))
    _ref_attention(q64, k64, v64, causal=causal, scale=scale).backward(grad.double())
    # Error budget: attention written out in bf16 (as the lead's kernel tests), against float64.
    qb, kb, vb = _leaves(q, k, v)
    base = _ref_attention(qb, kb, vb, causal=causal, scale=scale, dtype=torch.bfloat16)
    base.backward(grad)
    ref = _ref_attention(q64, k64, v64, causal=causal, scale=scale).detach()
    assert _rel(out, ref) <= 2 * _rel(base, ref) + 1e-3
    for ours, theirs, r in ((q.grad, qb.grad, q64.grad), (k.grad, kb.grad, k64.grad), (v.grad, vb.grad, v64.grad)):
        assert ours.stride() == torch.empty_like(ours).stride()
        assert _rel(ours, r) <= 2 * _rel(theirs, r) + 1e-3


def test_sdpa_default_backend_choice_reaches_torch_fa4(fa4_sdpa, kernels_used):
    """No sdpa_kernel context: PyTorch's own backend choice (flash first) lands on torch_fa4."""
    q, k, v = _inputs(1, 4, 4, 256, 256, 128)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert _kernel_ran(kernels_used, "forward"), kernels_used
    assert _rel(out, _ref_attention(q, k, v, causal=True, scale=None)) < 1e-2


def test_sdpa_fallback_is_pytorch_kernel(kernels_used):
    """Dropout is not torch_fa4's: the call must give exactly what it gave before enabling."""
    q, k, v = _inputs(2, 4, 4, 256, 256, 64, dtype=torch.float16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        torch.manual_seed(1234)
        before = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
        with sdpa.enabled():
            assert sdpa.forward_reason(q, k, v, dropout_p=0.3) is not None
            torch.manual_seed(1234)
            after = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
            qf, kf, vf = _leaves(q, k, v)
            torch.manual_seed(99)
            F.scaled_dot_product_attention(qf, kf, vf, dropout_p=0.3).sum().backward()
            assert not torch.isnan(qf.grad).any()
    assert kernels_used == []  # torch_fa4 was never asked
    assert torch.equal(before, after)


def test_sdpa_fp32_untouched(fa4_sdpa, kernels_used):
    q, k, v = _inputs(1, 2, 2, 64, 64, 64, dtype=torch.float32)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # fp32: flash never takes it
    assert _rel(out, _ref_attention(q, k, v, causal=True, scale=None)) < 1e-5
    assert kernels_used == []


def test_sdpa_under_torch_compile(fa4_sdpa, kernels_used):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(256, 3 * 256, dtype=torch.bfloat16, device="cuda")

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, 4, 64).unbind(2)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True)
            return out.transpose(1, 2).reshape(b, s, 256)

    torch._dynamo.reset()
    block = Block()
    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(2, 256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        y = compiled(x)
        y.float().square().mean().backward()
    assert _kernel_ran(kernels_used, "forward"), kernels_used
    gx = x.grad.clone()
    x.grad = None
    with sdpa_kernel(SDPBackend.MATH):
        y_ref = block(x)
        y_ref.float().square().mean().backward()
    assert _rel(y, y_ref) < 2e-2
    assert _rel(gx, x.grad) < 5e-2


# ---------------------------------------------------------------------------------------------
# Transformers
# ---------------------------------------------------------------------------------------------


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    from torch_fa4.integrations import transformers as hf

    hf.register_if_available()
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=512, initializer_range=0.05,
    )
    model = transformers.LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    return transformers, model


def _batch(b, s, vocab, padded):
    ids = torch.randint(0, vocab, (b, s), device="cuda")
    mask = torch.ones(b, s, dtype=torch.long, device="cuda")
    if padded:
        mask[1, : s // 3] = 0  # left padding: a mask_mod over key slots inside fa4
    return ids, mask


def _kernel_ran(kernels_used, direction):
    return any(d == direction and m is not None for d, m in kernels_used)


@pytest.mark.parametrize("padded", [False, True])
def test_hf_forward_matches_eager(kernels_used, padded):
    _, model = _tiny_llama()
    model.eval()
    ids, mask = _batch(3, 200, 512, padded)
    logits = {}
    for impl in ("eager", "fa4"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            logits[impl] = model(input_ids=ids, attention_mask=mask).logits.float()
    assert _kernel_ran(kernels_used, "forward"), kernels_used  # padded too: dense calls with a mask_mod
    valid = mask.bool()
    assert _rel(logits["fa4"][valid], logits["eager"][valid]) < 2e-2


@pytest.mark.parametrize("padded", [False, True])
def test_hf_training_step_matches_eager(kernels_used, padded):
    _, model = _tiny_llama()
    model.train()
    ids, mask = _batch(2, 256, 512, padded)
    # Padded query rows have no defined output (fa4 gives 0, as Transformers' flash path; eager a
    # uniform average), so no loss term may read one: drop padded labels and also the label that
    # the last padded position would predict (the first real token after left padding).
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    grads, losses = {}, {}
    # The oracle is eager attention on a float32 copy of the model; fa4's error may be at most
    # twice eager bf16's (both are bf16 models; comparing the two directly has no error budget).
    import copy

    runs = (("eager", model), ("fa4", model), ("eager32", copy.deepcopy(model).float()))
    for name, m in runs:
        m.set_attn_implementation(name.replace("32", ""))
        m.zero_grad()
        loss = m(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses[name] = loss.item()
        grads[name] = torch.cat([p.grad.float().flatten() for p in m.parameters() if p.grad is not None])
    assert _kernel_ran(kernels_used, "backward"), kernels_used
    assert math.isfinite(losses["fa4"]) and abs(losses["fa4"] - losses["eager32"]) < 2e-2 * abs(losses["eager32"])
    assert _rel(grads["fa4"], grads["eager32"]) <= 2 * _rel(grads["eager"], grads["eager32"]) + 1e-3


@pytest.mark.parametrize("padded", [False, True])
def test_hf_generate_matches_eager(kernels_used, padded):
    """Greedy decoding in bf16 may break near-ties differently, so each token fa4 picks must be
    eager's argmax up to a small margin when eager reads the same prefix."""
    _, model = _tiny_llama()
    model.eval()
    ids, mask = _batch(3, 40, 512, padded)
    # no end-of-sequence stop: a row that picks the EOS token (id 2 in LlamaConfig) is padded with
    # pad_token_id from then on, and those pads are nobody's argmax
    model.generation_config.eos_token_id = None
    model.set_attn_implementation("fa4")
    gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert _kernel_ran(kernels_used, "forward"), kernels_used
    new = gen[:, ids.shape[1]:]
    assert new.shape[1] == 12
    model.set_attn_implementation("eager")
    full_mask = torch.cat([mask, torch.ones_like(new)], dim=1)
    position_ids = (full_mask.cumsum(-1) - 1).clamp_min(0)  # as generate() derives them under left padding
    with torch.no_grad():
        logits = model(input_ids=gen, attention_mask=full_mask, position_ids=position_ids).logits.float()
    step_logits = logits[:, ids.shape[1] - 1 : -1]
    chosen = step_logits.gather(-1, new.unsqueeze(-1)).squeeze(-1)
    best = step_logits.max(-1).values
    spread = step_logits.std(-1)
    assert ((best - chosen) <= 0.05 * spread + 1e-3).all(), (best - chosen, spread)
