"""CPU: every variant the two-CTA sm100 forward advertises (kernels/sm100/pair) compiles for sm_100a,
and its SASS is a pair of CTAs sharing each matmul.

As for the one-CTA forward (tests/test_sm100_fwd_compile.py), there is no Blackwell GPU here: CuTe
DSL writes real sm_100a cubins on a CPU machine and nvdisasm shows what they hold. Per variant:
every matmul is a two-CTA tcgen05 UMMA (`UTCHMMA.2CTA`, as many as the kernel issues, and no
one-CTA UMMA beside them), every Q / K / V load a 2-SM TMA load (`UTMALDG....2CTA`: each CTA fills
its own shared memory and signals the leader's barrier), every MMA completion a commit multicast
to both CTAs' barriers (`UTCBAR.2CTA.MULTICAST`), tensor memory allocated for the pair
(`UTCATOMSWS.2CTA`), the pair synchronised by cluster barriers (`UCGABAR_ARV` / `UCGABAR_WAIT`),
scores and O through tensor memory (`LDTM` / `STTM`), no spills beyond the one-CTA kernel's
allowance, and the tiles within tensor memory (512 columns) and shared memory (the kernel asserts
its whole shared storage, 227 KB, while compiling; a CTA holds half of each K / V stage).
One compile per variant (five to thirty seconds each).
"""

import re

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from sass import sass_of  # noqa: E402
from torch_fa4.call import AttentionCall  # noqa: E402


def _call(D, S=512, dtype=torch.bfloat16, varlen=False, seqused=False, **kw):
    q = torch.empty(2, S, 2, D, dtype=dtype)
    if varlen:
        q = q.flatten(0, 1)
        cu = torch.tensor([0, S, 2 * S], dtype=torch.int32)
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=S, max_seqlen_k=S)
    if seqused:
        kw.update(seqused_k=torch.tensor([S, S // 2], dtype=torch.int32))
    return AttentionCall(q=q, k=q, v=q, scale=D ** -0.5, **kw)


# what the pair takes (pair/fwd_host.py): D=256 with any masks, softcap, packed sequences,
# seqused_k; D=128 without causal / window masks or packed sequences; both dtypes
VARIANTS = {
    "d256": dict(D=256),
    "d256_fp16_causal": dict(D=256, dtype=torch.float16, causal=True),
    "d256_causal_varlen": dict(D=256, causal=True, varlen=True),
    "d256_window_softcap": dict(D=256, window_left=128, window_right=0, softcap=20.0),
    "d256_seqused": dict(D=256, seqused=True),
    "d128": dict(D=128),
    "d128_fp16_softcap": dict(D=128, dtype=torch.float16, softcap=30.0),
    "d128_seqused": dict(D=128, seqused=True),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_pair_variant_compiles_to_two_cta_umma(name, tmp_path):
    from torch_fa4.kernels.sm100 import fwd_host
    from torch_fa4.kernels.sm100.fwd_config import SMEM_LIMIT, TMEM_COLUMNS
    from torch_fa4.kernels.sm100.pair import fwd_host as pair_host

    call = _call(**VARIANTS[name])
    assert pair_host.unsupported_reason(call) is None, "the test compiles only advertised variants"
    cfg = pair_host.default_config(call)
    assert cfg.two_cta and cfg.cta_group == 2 and cfg.s_stages == (2 if cfg.head_dim == 256 else 1)
    assert cfg.tmem_columns()["used"] <= TMEM_COLUMNS and cfg.smem_bytes() <= SMEM_LIMIT
    fwd_host.compile_fwd(cfg, arch="sm_100a", dump_dir=str(tmp_path))  # bypasses the cache
    sass = sass_of(tmp_path, "*.sm_100a.cubin")

    # S = Q K^T and O += P V: two call sites each per query tile, D/16 and tile_n/16 k-blocks each,
    # all of them the pair's M = 256 form
    umma = re.findall(r"\bUTCHMMA[.\w]*", sass)
    assert len(umma) == 2 * cfg.q_tiles * (cfg.head_dim // 16 + cfg.tile_n // 16)
    assert all(".2CTA" in u for u in umma), sorted(set(umma))
    loads = re.findall(r"\bUTMALDG[.\w]*", sass)
    assert loads and all(".2CTA" in x for x in loads), sorted(set(loads))
    commits = re.findall(r"\bUTCBAR[.\w]*", sass)
    assert commits and all(c == "UTCBAR.2CTA.MULTICAST" for c in commits), sorted(set(commits))
    assert "UTCATOMSWS.2CTA.FIND_AND_SET" in sass, "tensor memory not allocated for the pair"
    assert "UCGABAR_ARV" in sass and "UCGABAR_WAIT" in sass, "no cluster barrier"
    assert "HGMMA" not in sass
    assert "LDTM" in sass and "STTM" in sass, "S/P/O do not move through tensor memory"
    assert "USETMAXREG" in sass
    spills = sass.count("LDL") + sass.count("STL")
    assert spills <= 24, f"{spills} local-memory spill instructions"


def test_a_pair_halves_each_ctas_kv_stage():
    """A CTA of the pair holds half of each K / V tile: twice the one-CTA kernel's stages fit."""
    from torch_fa4.kernels.sm100 import fwd_host
    from torch_fa4.kernels.sm100.pair import fwd_host as pair_host

    for D in (128, 256):
        call = _call(D)
        one, two = fwd_host.default_config(call), pair_host.default_config(call)
        stage = lambda cfg: (cfg.smem_bytes() - one.q_tiles * 128 * D * 2) // cfg.kv_stages  # noqa: E731
        assert 2 * stage(two) == stage(one)
        assert two.cta_tile_m == 2 * one.cta_tile_m


def test_the_pair_keeps_two_score_buffers_at_d256():
    """D=256 (one query tile): S_0 | S_1 | O in all 512 columns, as FA4's 2-CTA kernel; D=128 (two
    query tiles) already fills them with S_0 | S_1 | O_0 | O_1."""
    from torch_fa4.kernels.sm100.fwd_config import TMEM_COLUMNS
    from torch_fa4.kernels.sm100.pair import fwd_host as pair_host

    d256 = pair_host.default_config(_call(256))
    assert (d256.q_tiles, d256.s_stages) == (1, 2)
    assert d256.tmem_columns() == {"s": (0, 128), "o": (256,), "used": TMEM_COLUMNS}
    d128 = pair_host.default_config(_call(128))
    assert (d128.q_tiles, d128.s_stages) == (2, 1) and d128.tmem_columns()["used"] == TMEM_COLUMNS
