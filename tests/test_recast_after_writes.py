"""RecastAfterWritesPass: a reader after a write in place reads the written value, not a
cast fx16 placed before the write."""

import torch

import fx16
from fx16.passes import RecastAfterWritesPass
from fx16.program.casts import is_cast, is_inserted
from helpers import check_program, eager, export, run

aten = torch.ops.aten
FP32 = torch.float32


class WriteThenWideRead(torch.nn.Module):
    """h = 2x (16-bit); h.view(-1)[:2] *= 0.5; exp(h) kept fp32 by force_fp32."""

    def forward(self, x):
        h = x * 2.0
        first = h.exp()  # read before the write
        h.view(-1)[:2].mul_(0.5)
        return first, h.exp()  # read after it


def _upcasts(ep):
    return [
        n
        for n in ep.graph.nodes
        if is_cast(n)
        and is_inserted(n)
        and n.kwargs["dtype"] == torch.float32
        and n.args[0].name == "mul"
    ]


def test_a_reader_after_a_write_gets_its_own_cast():
    """mul -> c=to(f32) -> {exp, exp_1} with mul_ between   becomes
    mul -> c -> exp; mul_; c2=to(f32, mul) -> exp_1: and the values are eager's."""
    x = torch.arange(6.0).reshape(2, 3) / 4
    ep = export(WriteThenWideRead(), x)
    fx16.cast_fp32_to_fp16(ep, force_fp32=["exp", "exp_1"])
    check_program(ep)
    upcasts = _upcasts(ep)
    assert len(upcasts) == 2, ep.graph
    write = next(n for n in ep.graph.nodes if n.target == aten.mul_.Tensor)
    order = list(ep.graph.nodes)
    assert order.index(upcasts[0]) < order.index(write) < order.index(upcasts[1])
    for got, want in zip(run(ep, x), eager(WriteThenWideRead(), x)):
        torch.testing.assert_close(got.float(), want, rtol=2e-3, atol=2e-3)


def test_nothing_to_do_without_writes():
    class NoWrite(torch.nn.Module):
        def forward(self, x):
            return (x * 2.0).exp()

    ep = export(NoWrite(), torch.ones(2, 3))
    fx16.cast_fp32_to_fp16(ep, force_fp32=["exp"])
    assert not RecastAfterWritesPass()(ep.graph_module).modified
