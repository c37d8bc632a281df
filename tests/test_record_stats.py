"""RecordStatsPass: the program's figures before fx16 changed it, recorded once."""

import torch
from fuzz_profile import examples
from hypothesis import given, settings

import fx16
from fx16.passes import RecordStatsPass
from fx16.passes.scalars_as_constants import STEM as SCALAR_STEM
from fx16.program.casts import is_cast
from fx16.program.stats import BEFORE_KEY, program_stats
from fx16.program.subgraphs import nested_graph_modules
from fx16.testing import programs
from helpers import export
from models import RMSNormMLP


def test_it_records_the_figures_before_the_cast_and_keeps_the_first_record():
    """Reads the program, changes nothing; a second run (the int16 list after the fp16
    one, a second cast) keeps the first record, so the report compares with the
    program the user gave."""
    torch.manual_seed(0)
    ep = export(RMSNormMLP(), torch.randn(2, 16))
    code, before = ep.graph_module.code, program_stats(ep)
    result = RecordStatsPass(ep)(ep.graph_module)
    assert not result.modified and ep.graph_module.code == code
    assert ep.graph_module.meta[BEFORE_KEY] == before and before.casts > 0
    fx16.cast_fp32_to_fp16(ep, explicit_fp32="calibrated")  # the norm's region in 16-bit
    RecordStatsPass(ep)(ep.graph_module)  # after the cast: the first record stays
    assert ep.graph_module.meta[BEFORE_KEY] == before
    # the weights halve; fx16's 16-bit scalar constants (2 bytes each) are weights too
    scalars = [key for key in ep.constants if key.startswith(SCALAR_STEM)]
    assert scalars  # the stable RMSNorm's 2**-6
    assert program_stats(ep).weight_bytes == before.weight_bytes // 2 + 2 * len(scalars)


def test_both_pass_lists_start_with_it():
    ep = export(RMSNormMLP(), torch.randn(2, 16))
    assert isinstance(fx16.fp16_passes(ep)[0], RecordStatsPass)
    assert isinstance(fx16.int16_passes(ep)[0], RecordStatsPass)


@settings(max_examples=examples(8), deadline=None)
@given(programs())
def test_on_any_program_the_record_is_the_programs_figures_and_nothing_changes(case):
    """The record's weight bytes and casts, counted here from the program itself (each
    distinct state tensor's bytes; every dtype-only conversion node, bodies included),
    not by the function the pass calls; and the graph is unchanged."""
    ep = case.export()
    code = ep.graph_module.code
    RecordStatsPass(ep)(ep.graph_module)
    record = ep.graph_module.meta[BEFORE_KEY]
    assert ep.graph_module.code == code
    tensors = {id(t): t for t in (*ep.state_dict.values(), *ep.constants.values())}
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    casts = sum(is_cast(n) for m in nested_graph_modules(ep.graph_module) for n in m.graph.nodes)
    assert (record.weight_bytes, record.casts, record.inserted_casts) == (weight_bytes, casts, 0)
