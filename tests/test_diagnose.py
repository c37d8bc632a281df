"""fx16.diagnose: every value of a cast program against fp32, aligned by stable node id."""

import copy
import io
import json
import math

import pytest
import torch

import fx16
from fx16.analysis.fp32_rules import UnderflowRule
from fx16.diagnosis import diagnose, value_error
from fx16.pipelines import run_passes, without_rules
from fx16.program.casts import is_cast
from fx16.program.node_ids import graph_modules, has_ids, node_id
from helpers import command, export
from models import MLP, Branches, RMSNormMLP


class LogProbabilities(torch.nn.Module):
    """A classifier head taking the log of probabilities that underflow in fp16."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        p = torch.softmax(h * 4.0, dim=-1)
        return self.out(torch.log(p + 1e-12))  # LOG_LINE


class Shift(torch.nn.Module):
    """Adds and removes a large offset: in fp16 the small values vanish (no rule sees it)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc(x) * 0.01
        shifted = (h + 1000.0) - 1000.0  # SHIFT_LINE
        return self.out(shifted)


def _line(marker: str) -> str:
    lines = open(__file__).read().splitlines()
    return f"test_diagnose.py:{next(i for i, text in enumerate(lines, 1) if text.endswith(marker))}"


def _trap():
    torch.manual_seed(0)
    x = torch.randn(8, 16) * 3
    return export(LogProbabilities(), x), x


def test_the_first_divergence_is_the_op_that_lost_precision_with_its_source_line():
    reference, x = _trap()
    cast = copy.deepcopy(reference)  # a pipeline that drops the underflow rule
    run_passes(without_rules(fx16.fp16_passes(cast), UnderflowRule), cast.graph_module)
    found = diagnose(reference, cast, [(x,)])
    first = found.first_divergence
    assert first.id == "log" and first.op == "log.default" and first.dtype == "float16"
    assert first.source.endswith(_line("# LOG_LINE"))
    assert first.amplification > 100  # its inputs were accurate: log made the error
    assert found.amplifiers[0].id == "log"
    assert found.by_id()["linear"].module == "fc" and found.by_id()["linear"].error < 1e-3
    assert "first value over 0.01: log (log.default, float16)" in found.table()
    document = json.loads(found.to_json())
    assert document["first_divergence"]["id"] == "log"
    assert {v["id"] for v in document["values"]} >= {"linear", "relu", "softmax", "log"}


def test_a_program_cast_with_always_fp16_is_diagnosed_with_fx16s_decision():
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    reference = export(Shift(), x)
    # the conditioning rule off: the cancelling subtraction is cast as "fits"
    policy = fx16.PrecisionPolicy.always_fp16(precision_tolerance=math.inf)
    cast = fx16.cast_fp32_to_fp16(copy.deepcopy(reference), policy=policy)
    first = diagnose(reference, cast, [(x,)]).first_divergence
    assert first.id == "sub" and first.source.endswith(_line("# SHIFT_LINE"))
    assert first.decision == "fits" and first.error > 0.5


def _nodes_by_id(ep) -> dict:
    assigned = has_ids(ep.graph_module)
    return {
        node_id(node, prefix, assigned): node
        for prefix, module in graph_modules(ep.graph_module)
        for node in module.graph.nodes
        if node_id(node, prefix, assigned) is not None
    }


def _aligned_ops_match(reference, cast, found) -> None:
    references, casts = _nodes_by_id(reference), _nodes_by_id(cast)
    for value in found.values:
        ref, got = references[value.id], casts[value.id]
        assert ref.target == got.target or (is_cast(ref) and is_cast(got)), value.id


def test_values_align_across_inserted_retargeted_and_removed_casts():
    torch.manual_seed(0)
    norm_input = torch.randn(4, 16)
    trap, trap_input = _trap()
    cases = [  # (fp32 program, input, options)
        (export(RMSNormMLP(), norm_input), norm_input, {"explicit_fp32": "keep"}),
        (export(RMSNormMLP(), norm_input), norm_input, {"explicit_fp32": "retarget"}),
        (trap, trap_input, {}),  # the underflow rule keeps log fp32: upcasts inserted
    ]
    seen = set()
    for reference, x, options in cases:
        cast = fx16.cast_fp32_to_fp16(copy.deepcopy(reference), **options)
        marks = {n.meta.get("fx16.inserted") for n in cast.graph_module.graph.nodes}
        seen |= {"retargeted" if "retargeted" in marks else None}
        seen |= {"inserted" if marks - {None, "retargeted"} else None}
        found = diagnose(reference, cast, [(x,)])
        seen |= {"removed" if found.unaligned else None}
        _aligned_ops_match(reference, cast, found)
        assert all(value.error < 1e-2 for value in found.values)
    assert seen >= {"inserted", "retargeted", "removed"}


def test_values_inside_higher_order_op_bodies_align_and_survive_save_and_load():
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    reference = export(Branches(), x)
    cast = fx16.cast_fp32_to_fp16(copy.deepcopy(reference))
    buffer = io.BytesIO()
    torch.export.save(cast, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    in_memory, from_disk = diagnose(reference, cast, [(x,)]), diagnose(reference, loaded, [(x,)])
    body_values = [v.id for v in in_memory.values if "_graph_0." in v.id]
    assert body_values  # the branch the input takes, value by value
    assert [(v.id, v.error) for v in from_disk.values] == [
        (v.id, v.error) for v in in_memory.values
    ]
    assert [v.decision for v in from_disk.values] == [v.decision for v in in_memory.values]
    _aligned_ops_match(reference, loaded, from_disk)


def test_compare_per_node_names_the_first_diverging_op_and_its_line(tmp_path):
    reference, x = _trap()
    cast = copy.deepcopy(reference)
    run_passes(without_rules(fx16.fp16_passes(cast), UnderflowRule), cast.graph_module)
    torch.export.save(reference, tmp_path / "fp32.pt2")
    torch.export.save(cast, tmp_path / "fp16.pt2")
    torch.save([(x,)], tmp_path / "inputs.pt")
    code, out, err = command(
        "compare",
        "--per-node",
        tmp_path / "fp32.pt2",
        tmp_path / "fp16.pt2",
        "--inputs",
        tmp_path / "inputs.pt",
        "--json",
        tmp_path / "values.json",
    )
    assert code == 0, err
    first = next(line for line in out.splitlines() if line.startswith("first value over"))
    assert "log (log.default, float16)" in first and _line("# LOG_LINE") in first
    assert json.loads((tmp_path / "values.json").read_text())["first_divergence"]["id"] == "log"
    assert "rel. error" in out  # the outputs' comparison follows


def test_a_masking_sentinel_held_as_16_bits_largest_value_is_not_an_error():
    reference = torch.tensor([[-3.4e38, 1.0, 2.0]])
    held = torch.tensor([[-65504.0, 1.0, 2.0]], dtype=torch.float16)
    assert value_error(reference, held) == 0.0
    assert value_error(reference, held.masked_fill(held < 0, float("-inf"))) == 0.0
    assert value_error(reference, torch.tensor([[65504.0, 1.0, 2.0]]).half()) == 1.0  # sign
    assert value_error(torch.tensor([4.0, 2.0]), torch.tensor([4.0, 1.0]).half()) == 0.25


def test_programs_that_do_not_correspond_get_a_typed_error():
    """diagnose(a, b) where b is not a cast of a: one InvalidProgramError naming both."""
    first = export(MLP(), torch.randn(4, 8))
    other = export(torch.nn.Sequential(torch.nn.Linear(6, 3)), torch.randn(2, 6))
    fx16.cast_fp32_to_fp16(other)
    with pytest.raises(fx16.InvalidProgramError, match="the programs do not correspond"):
        fx16.diagnose(first, other)


@pytest.mark.parametrize(
    "options, words",
    [(dict(threshold=-1), "threshold must be a number >= 0"), (dict(top=-2), "top must be")],
)
def test_diagnose_options_are_checked(options, words):
    program = export(MLP(), torch.randn(4, 8))
    with pytest.raises(fx16.InvalidOptionError, match=words):
        fx16.diagnose(program, program, **options)


def test_the_public_function_survives_an_import_of_its_module():
    """``import fx16.diagnosis`` leaves ``fx16.diagnose`` the function."""
    import fx16.diagnosis  # noqa: F401

    assert callable(fx16.diagnose) and fx16.diagnose is fx16.diagnosis.diagnose
