"""The test run's skip of torch's repeated composite-op materialization
(``tests/cia_materialization.py``) loses no op: one registered after the last
materialization is collected, and decomposition gives the program it gives without it."""

import torch
import torch._export.utils as export_utils

from helpers import export


def test_the_test_run_materializes_only_on_change():
    assert hasattr(export_utils._materialize_cpp_cia_ops, "materialized_registrations")


def test_an_op_registered_after_a_materialization_is_still_collected():
    export_utils._collect_all_valid_cia_ops()  # materializes, then remembers the list
    library = torch.library.Library("fx16_cia_probe", "DEF")
    try:
        library.define("double(Tensor x) -> Tensor")
        library.impl("double", lambda x: x + x, "CompositeImplicitAutograd")
        collected = export_utils._collect_all_valid_cia_ops()
        assert torch.ops.fx16_cia_probe.double.default in collected
    finally:
        library._destroy()


class _Gelu(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.gelu(torch.nn.functional.linear(x, x)).softmax(-1)


def test_decomposition_gives_the_same_program_as_without_the_skip(monkeypatch):
    ep = export(_Gelu(), torch.randn(3, 3))
    skipped = ep.run_decompositions().graph_module.code
    unwrapped = export_utils._materialize_cpp_cia_ops.__wrapped__
    monkeypatch.setattr(export_utils, "_materialize_cpp_cia_ops", unwrapped)
    assert ep.run_decompositions().graph_module.code == skipped
