import time, torch, collections
import torch_fa4
from torch_fa4 import eager_autograd as E, ops, dispatch
from torch_fa4.kernels.sm90 import bwd as B
T = []
mark = lambda l: T.append((l, time.perf_counter()))
def wrap(mod, name, label):
    f = getattr(mod, name)
    def w(*a, **k):
        mark(label + ">"); r = f(*a, **k); mark(label + "<"); return r
    setattr(mod, name, w)
wrap(dispatch, "backward", "dispatch.backward"); wrap(B, "backward", "bwd.backward"); wrap(dispatch, "kernel_for", "kernel_for")
ob = ops.bwd._init_fn if hasattr(ops.bwd, "_init_fn") else None
orig_bw = E.AttentionFunction.backward
def bw(ctx, go, gl):
    mark("Function.backward>"); r = orig_bw(ctx, go, gl); mark("Function.backward<"); return r
E.AttentionFunction.backward = staticmethod(bw)
orig_mc = ops.make_call
def mc(*a):
    mark("make_call>"); r = orig_mc(*a); mark("make_call<"); return r
ops.make_call = mc
q, k, v = (torch.randn(16, 1024, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
out = torch_fa4.attention(q, k, v); g = torch.randn_like(out)
def one():
    mark("grad>"); torch.autograd.grad(out, (q, k, v), g, retain_graph=True); mark("grad<")
for _ in range(10): one()
acc = collections.defaultdict(list)
for i in range(60):
    T.clear(); one()
    for (l0, a), (l1, b) in zip(T, T[1:]):
        acc[f"{l0} -> {l1}"].append((b - a) * 1e6)
    if i % 10 == 9: torch.cuda.synchronize()
for key, v in acc.items():
    print(f"{key:50s} median {sorted(v)[len(v)//2]:7.1f} us  min {min(v):7.1f}")
