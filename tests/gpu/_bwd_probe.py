# temporary probe (backward engineer): run one backward case per process
import sys, os
sys.path.insert(0, os.path.dirname(__file__))
import torch
import test_sm90_bwd as t
case = sys.argv[1]
BF = torch.bfloat16
cases = {
 "varlen_plain": lambda: t._case(BF, 2, 128, 128, 2, 2, 128, 128, varlen=True),
 "varlen": lambda: t._case(BF, 3, 300, 260, 4, 2, 128, 128, varlen=True, causal=True),
 "seqused": lambda: t._case(BF, 3, 150, 300, 2, 2, 64, 64, seqused=True),
 "empty_cta": lambda: t._case(BF, 1, 64, 300, 2, 2, 64, 64, left=10, right=0),
 "det": lambda: t._case(BF, 2, 256, 520, 4, 2, 128, 128, causal=True, deterministic=True),
}
try:
    cases[case](); print(case, "PASS")
except Exception as e:
    print(case, "FAIL", type(e).__name__, str(e).splitlines()[0][:300])
