"""CPU: the sm90 backward's dQ conversion kernel (kernels/sm90/bwd_dq_convert.py) compiles for
sm_90a per output dtype and reads fp32 / writes 16-bit values as 16-byte vectors. Its results
and its host predicate on CUDA tensors: tests/gpu/test_sm90_bwd_prepare.py."""

import pytest
import torch

cutlass = pytest.importorskip("cutlass")

from sass import sass_of  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_compiles_to_vector_accesses(dtype, tmp_path):
    from torch_fa4.kernels.sm90 import bwd_dq_convert

    bwd_dq_convert.compile_kernel(dtype, dump_dir=str(tmp_path))
    sass = sass_of(tmp_path)
    assert sass.count("LDG.E.128") == 2, "8 floats per thread are not two 16-byte loads"
    assert sass.count("STG.E.128") == 1, "8 16-bit values per thread are not one 16-byte store"
    assert sass.count("FMUL") == 8  # the scale, once per element
    assert "LDL" not in sass and "STL" not in sass
    assert "ACQBULK" in sass, "no grid-dependency wait (programmatic dependent launch)"
    assert "c[0x0][0xc]" in sass, "no read of the grid size (the buffer is walked last chunk first)"


def test_cpu_tensors_take_the_torch_path():
    from torch_fa4.kernels.sm90 import bwd_dq_convert

    assert not bwd_dq_convert.takes(torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16))
