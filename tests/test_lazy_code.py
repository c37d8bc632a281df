"""fx16.program.lazy_code: a graph module's code generated when it is first needed."""

import copy
import io

import pytest
import torch
import torch.utils._pytree as pytree
from fuzz_profile import examples
from hypothesis import given, settings
from torch.fx import GraphModule

import fx16
from fx16.program import Program
from fx16.program.lazy_code import compile_when_needed
from fx16.testing import programs
from helpers import export

aten = torch.ops.aten


class AddOne(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((3,), 2.0))

    def forward(self, x):
        return (x + 1) * self.scale


def _add_becomes_sub(graph_module: GraphModule) -> None:
    """Edit the graph: ``x + 1`` becomes ``x - 1``, so stale code gives another result."""
    (add,) = [n for n in graph_module.graph.nodes if n.target == aten.add.Tensor]
    add.target = aten.sub.Tensor


@pytest.fixture
def compiled(monkeypatch):
    """The graph modules torch compiles code for, as they are compiled."""
    seen = []
    recompile = GraphModule.recompile

    def counted(graph_module):
        seen.append(graph_module)
        return recompile(graph_module)

    monkeypatch.setattr(GraphModule, "recompile", counted)
    return seen


def test_the_code_is_generated_when_the_module_is_first_run(compiled):
    x = torch.randn(4, 3)
    ep = export(AddOne(), x)
    graph_module = ep.graph_module
    _add_becomes_sub(graph_module)
    compiled.clear()  # what export compiled
    compile_when_needed(graph_module)
    assert ep.graph_module is graph_module and isinstance(graph_module, GraphModule)
    assert compiled == []  # nothing generated yet
    inputs = Program(ep).graph_inputs((x,))
    (got,) = graph_module(*inputs)
    assert torch.equal(got, (x - 1) * 2.0)  # the edited graph's result, not the old code's
    assert compiled == [graph_module]
    graph_module(*inputs)
    assert compiled == [graph_module]  # once


def test_reading_the_code_generates_it_and_a_later_edit_marks_it_stale_again():
    ep = export(AddOne(), torch.randn(4, 3))
    graph_module = ep.graph_module
    _add_becomes_sub(graph_module)
    compile_when_needed(graph_module)
    assert "torch.ops.aten.sub.Tensor" in graph_module.code
    (sub,) = [n for n in graph_module.graph.nodes if n.target == aten.sub.Tensor]
    sub.target = aten.mul.Tensor
    compile_when_needed(graph_module)
    assert "torch.ops.aten.mul.Tensor" in graph_module.code
    assert graph_module.code == graph_module.graph.python_code("self").src


def test_a_program_so_marked_copies_saves_unlifts_and_decomposes_without_its_code(compiled):
    """``ep.module()``, ``torch.export.save`` and ``run_decompositions`` never run the
    root's code: none of them generates it, and each gives the edited graph's result."""
    x = torch.randn(4, 3)
    ep = export(AddOne(), x)
    _add_becomes_sub(ep.graph_module)
    compiled.clear()  # what export compiled
    compile_when_needed(ep.graph_module)
    expected = (x - 1) * 2.0
    assert torch.equal(ep.module()(x), expected)
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    assert torch.equal(torch.export.load(buffer).module()(x), expected)
    decomposed = copy.deepcopy(ep).run_decompositions()
    assert torch.equal(decomposed.module()(x), expected)
    assert not any(module is ep.graph_module for module in compiled)
    copied = copy.deepcopy(ep)
    (got,) = copied.graph_module(*Program(copied).graph_inputs((x,)))
    assert torch.equal(got, expected)


def test_a_graph_module_class_someone_wrote_is_recompiled_at_once(compiled):
    class Traced(GraphModule):
        pass

    graph_module = torch.fx.symbolic_trace(lambda x: x + 1)
    own = Traced(graph_module, graph_module.graph)
    (add,) = [n for n in own.graph.nodes if n.op == "call_function"]
    add.target = torch.sub
    compiled.clear()
    compile_when_needed(own)
    assert compiled == [own] and type(own).__mro__[1] is Traced
    assert torch.equal(own(torch.ones(2)), torch.zeros(2))


@settings(max_examples=examples(10), deadline=None)
@given(programs())
def test_property_a_cast_program_compiles_its_root_only_when_run_and_runs_its_graph(case):
    """Any fuzzer program (bodies included): the cast generates no code for the root;
    run directly, the root generates it once, and its results are the graph's, node
    by node (``torch.fx.Interpreter``), bit for bit."""
    ep = case.export()
    compiled = []
    recompile = GraphModule.recompile

    def counted(graph_module):
        if graph_module is ep.graph_module:
            compiled.append(graph_module)
        return recompile(graph_module)

    GraphModule.recompile = counted
    try:
        fx16.cast_fp32_to_fp16(ep)
        assert compiled == []
        args, kwargs = fx16.inputs_for(ep, *case.args)
        inputs = Program.of(ep).graph_inputs(args, kwargs, copy_buffers=True)
        with torch.no_grad():
            ran = pytree.tree_leaves(ep.graph_module(*inputs))
            inputs = Program.of(ep).graph_inputs(args, kwargs, copy_buffers=True)
            interpreted = pytree.tree_leaves(torch.fx.Interpreter(ep.graph_module).run(*inputs))
        assert len(compiled) == 1
    finally:
        GraphModule.recompile = recompile
    assert len(ran) == len(interpreted)
    for got, want in zip(ran, interpreted):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
