"""ConvertParametersPass: state tensors to fp16 unless they overflow or are not fp32."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fx16
from fx16.decisions import PRECISION, Reason
from fx16.ops.numerics import FP16_TINY
from fx16.passes import ConvertParametersPass
from fx16.program import Program
from fx16.program.stats import program_stats
from helpers import export, node_named, run
from models import MLP, MixedBuffers, OverflowWeight


class WithConstant(torch.nn.Module):
    """forward uses a lifted tensor constant and a non-persistent buffer."""

    def __init__(self, values):
        super().__init__()
        self.table = torch.tensor(values)
        self.register_buffer("offset", torch.tensor(values) * 0.5, persistent=False)

    def forward(self, x):
        return x * self.table + self.offset


def _convert(ep):
    return ConvertParametersPass(Program(ep))(ep.graph_module)


def test_parameters_become_fp16_and_meta_follows():
    """p_layers_0_weight:f32 placeholder   becomes   p_layers_0_weight:f16 (state and meta)."""
    ep = export(MLP(), torch.randn(2, 8))
    result = _convert(ep)
    assert result.modified
    for name, tensor in ep.state_dict.items():
        assert tensor.dtype == torch.float16, name
        assert isinstance(tensor, torch.nn.Parameter)
    weight = node_named(ep, "p_layers_0_weight")
    assert weight.meta["val"].dtype == torch.float16
    assert weight.meta[PRECISION].reason == Reason.FITS


def test_weights_beyond_the_range_at_either_end_stay_fp32():
    """1e5 overflows fp16; 1e-9s, every element below its normal range, would be zeros
    (once: lifted to 2**-24, 17x too large, and reported as fitting)."""
    ep = export(OverflowWeight(), torch.randn(2, 4))
    _convert(ep)
    for name, reason in (("big", Reason.VALUE_OVERFLOW), ("tiny", Reason.VALUE_BELOW_RANGE)):
        assert ep.state_dict[name].dtype == torch.float32
        assert node_named(ep, f"p_{name}").meta[PRECISION].reason == reason
        assert node_named(ep, f"p_{name}").meta["val"].dtype == torch.float32
    assert torch.all(ep.state_dict["tiny"] == 1e-9)


def test_lifted_constants_and_non_persistent_buffers_are_converted():
    ep = export(WithConstant([1.5, -2.0]), torch.randn(2))
    _convert(ep)
    assert {v.dtype for v in ep.constants.values()} == {torch.float16}


def test_constant_with_inf_is_converted_but_large_finite_is_not():
    ep = export(WithConstant([float("inf"), 1.0]), torch.randn(2))
    _convert(ep)
    assert ep.constants["table"].dtype == torch.float16
    assert torch.isinf(ep.constants["table"][0])
    ep = export(WithConstant([1e6, 1.0]), torch.randn(2))
    _convert(ep)
    assert ep.constants["table"].dtype == torch.float32


def test_non_fp32_state_is_untouched():
    model = MixedBuffers()
    ep = export(model, torch.randn(2, 8))
    before = {k: v.clone() for k, v in ep.state_dict.items()}
    _convert(ep)
    for key in ("half_bias", "qweight", "double_gain"):
        assert torch.equal(ep.state_dict[key], before[key])
        assert ep.state_dict[key].dtype == before[key].dtype


def test_second_run_changes_nothing():
    ep = export(MLP(), torch.randn(2, 8))
    _convert(ep)
    assert not _convert(ep).modified


def test_shared_tensor_converted_once():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4, bias=False)
            self.b = torch.nn.Linear(4, 4, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    ep = export(Tied(), torch.randn(2, 4))
    _convert(ep)
    tensors = [t for t in ep.state_dict.values()]
    assert all(t.dtype == torch.float16 for t in tensors)


@settings(max_examples=18, deadline=None)
@given(st.lists(st.floats(min_value=-1e6, max_value=1e6, width=32), min_size=1, max_size=8))
def test_conversion_is_exactly_rounding_or_nothing(values):
    ep = export(WithConstant(values), torch.randn(len(values)))
    original = ep.constants["table"].clone()
    _convert(ep)
    table = ep.constants["table"]
    if original.abs().max() > 65504:
        assert table.dtype == torch.float32 and torch.equal(table, original)
    else:
        assert table.dtype == torch.float16
        nonzero = original != 0
        assert torch.all(table[nonzero] != 0)
        assert torch.all((table.float() - original).abs() <= original.abs() * 2**-11 + FP16_TINY)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_tied_weights_stay_tied():
    ep = export(Tied(), torch.tensor([1, 2]))
    assert list(ep.state_dict) == ["embed.weight", "head.weight"]
    _convert(ep)
    assert ep.state_dict["embed.weight"] is ep.state_dict["head.weight"]
    assert ep.state_dict["head.weight"].dtype == torch.float16


def test_with_calibration_the_overflow_check_reads_no_weight_again(monkeypatch):
    """Calibration already saw every weight: the pass decides from the interval it
    recorded (same decisions), and reads a weight itself only without calibration."""
    import fx16.passes.convert_parameters as convert_parameters
    from fx16.analysis import CalibrationAnalysis

    reads = []
    check = convert_parameters.finite_interval
    monkeypatch.setattr(
        convert_parameters, "finite_interval", lambda t: reads.append(t) or check(t)
    )
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    calibrated = export(OverflowWeight(), x)
    CalibrationAnalysis(Program(calibrated))(calibrated.graph_module)
    _convert(calibrated)
    assert reads == []
    plain = export(OverflowWeight(), x)
    _convert(plain)
    assert len(reads) == len(plain.state_dict)
    for name in plain.state_dict:
        assert calibrated.state_dict[name].dtype == plain.state_dict[name].dtype
    assert torch.float32 in {t.dtype for t in plain.state_dict.values()}


class ConstantParts(torch.nn.Module):
    """A zero bias, a weight of ones, a weight of positive values from 0.5, and one
    holding a value that flushes: only the last can flush."""

    def __init__(self):
        super().__init__()
        self.zero = torch.nn.Parameter(torch.zeros(4))
        self.ones = torch.nn.Parameter(torch.ones(4))
        self.positive = torch.nn.Parameter(torch.linspace(0.5, 2.0, 4))
        self.mixed = torch.nn.Parameter(torch.tensor([0.5, -1e-9, 0.0, 2.0]))

    def forward(self, x):
        return x * self.ones * self.positive + self.zero + self.mixed


def _searches_recorded(monkeypatch, name: str) -> list:
    """The sources ``fx16.ops.numerics.<name>`` (a step of the search for elements that
    flush) is called on from now on, copied, in order."""
    import fx16.ops.numerics

    searched, search = [], getattr(fx16.ops.numerics, name)
    monkeypatch.setattr(
        fx16.ops.numerics,
        name,
        lambda source, *rest: searched.append(source.clone()) or search(source, *rest),
    )
    return searched


def test_only_a_tensor_whose_interval_allows_a_flush_is_checked_for_one(monkeypatch):
    """The overflow check's interval (min, max) also shows which tensors cannot flush:
    those are copied plainly; the one with a tiny value is checked, and lifted."""
    checked = _searches_recorded(monkeypatch, "_lift_flushed_blocks")
    ep = export(ConstantParts(), torch.randn(2, 4))
    _convert(ep)
    assert [source.tolist() for source in checked] == [
        torch.tensor([0.5, -1e-9, 0.0, 2.0]).tolist()
    ]
    assert ep.state_dict["mixed"].tolist() == [0.5, -FP16_TINY, 0.0, 2.0]
    for name in ("zero", "ones", "positive"):
        stored = ep.state_dict[name]
        assert stored.dtype == torch.float16
        assert torch.equal(stored, ConstantParts().state_dict()[name].half())


def test_a_tied_weight_one_name_keeps_fp32_is_stored_once_in_fp32():
    """The head's name is kept fp32 (here by force_fp32, as the accuracy budget's
    fallback does): the embedding's name stays fp32 too, so the program holds the
    tensor once, not in both dtypes; the weight bytes do not grow, and the embedding's
    16-bit readers get a cast."""
    torch.manual_seed(0)
    model, ids = Tied().eval(), torch.tensor([1, 2, 7])
    before = program_stats(export(model, ids)).weight_bytes
    ep = fx16.cast_fp32_to_fp16(export(model, ids), force_fp32={"p_head_weight"})
    assert ep.state_dict["embed.weight"] is ep.state_dict["head.weight"]
    assert ep.state_dict["embed.weight"].dtype == torch.float32
    embed = node_named(ep, "p_embed_weight").meta[PRECISION]
    assert embed.reason == Reason.SHARED_FP32 and embed.detail == "head.weight stays fp32"
    assert program_stats(ep).weight_bytes == before
    with torch.no_grad():
        expected = model(ids)
    assert float((run(ep, ids)[0].float() - expected).abs().max()) < 2e-3 * float(
        expected.abs().max()
    )


class TinyProductAndDivisor(torch.nn.Module):
    """Two weights with the same elements below half the smallest fp16 subnormal: one a
    linear's weight, one a divisor."""

    def __init__(self):
        super().__init__()
        values = torch.randn(4, 4) * 0.5
        values[0, :2] = torch.tensor([2e-8, -1e-9])
        self.weight = torch.nn.Parameter(values.clone())
        self.divisor = torch.nn.Parameter(values.clone())

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight) / self.divisor


def test_a_weight_only_products_read_is_rounded_to_nearest_without_the_search(monkeypatch):
    """The linear's weight is converted as ``.half()`` does, its tiny elements to zero
    (the nearest value, which moves a product least), and nothing searches it for them;
    the divisor's are searched for and lifted to +-2**-24."""
    searched = _searches_recorded(monkeypatch, "_lift_flushed")
    model = TinyProductAndDivisor()
    ep = export(model, torch.randn(4, 4))
    _convert(ep)
    assert len(searched) == 1 and torch.equal(searched[0].view(4, 4), model.divisor.detach())
    assert torch.equal(ep.state_dict["weight"], model.weight.detach().half())
    assert ep.state_dict["weight"][0, :2].tolist() == [0.0, -0.0]
    assert ep.state_dict["divisor"][0, :2].tolist() == [FP16_TINY, -FP16_TINY]
