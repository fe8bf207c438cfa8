"""CPU: the CuTe DSL lowering of mods compiles (sm_90a cubins, no GPU needed) and reads each
captured tensor with one global load per access."""

import glob
import re

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from _mod_cases import cases  # noqa: E402

from torch_fa4.mods.prepare import trace_graphs  # noqa: E402


@pytest.mark.parametrize("name", ["alibi_doc_causal", "bias_bf16_doc2d", "transcendental_bool_table"])
def test_probe_kernel_compiles(name, tmp_path):
    from torch_fa4.kernels.common import mod_lowering

    score_mod, mask_mod = cases()[name]
    mods, aux = trace_graphs(score_mod, mask_mod)
    mod_lowering.compile_probe(mods.score_graph, mods.mask_graph, arch="sm_90a", dump_dir=str(tmp_path))
    assert glob.glob(str(tmp_path / "*.cubin")), "no cubin written"
    ptx = open(glob.glob(str(tmp_path / "*.ptx"))[0]).read()
    loads = len(re.findall(r"\bld\.global", ptx))
    graph_loads = sum(1 for g in (mods.score_graph, mods.mask_graph) for n in g.nodes if n.op == "load")
    assert loads == 1 + graph_loads, "expected the score load plus one load per captured-tensor access"


def test_identity_grad_detected():
    from torch_fa4.kernels.common import mod_lowering

    alibi, _ = cases()["alibi_doc_causal"]
    bucketed, _ = cases()["bucketed_chunked"]
    softcap, _ = cases()["softcap_window"]
    for mod, identity in ((alibi, True), (bucketed, True), (softcap, False)):
        mods, _ = trace_graphs(mod, None)
        assert mod_lowering.mod_graph_is_identity_grad(mods.score_grad_graph) is identity


def test_tile_helper_compiles():
    from torch_fa4.kernels.common import mod_lowering

    for name in ("alibi_doc_causal", "transcendental_bool_table"):
        score_mod, mask_mod = cases()[name]
        mods, _ = trace_graphs(score_mod, mask_mod)
        assert mod_lowering.compile_tile_probe(mods.score_graph, mods.mask_graph, arch="sm_90a") is not None
