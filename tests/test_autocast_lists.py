"""The ``autocast`` policy against eager ``torch.autocast`` on PyTorch's own test lists.

``torch.testing._internal.autocast_test_lists.AutocastCPUTestLists`` is what PyTorch
tests its CPU autocast with: every list (ops in the lower-precision list, the fp32
list, the promote lists; torch functions, ``torch._C._nn`` functions and methods),
each case under bf16 and fp16. Each case runs three ways, as a program would feed the
op: float inputs; inputs made 16-bit by a 16-bit op (``prelu``, in autocast's
lower-precision list); inputs cast to 16-bit by the program itself. fx16's static
``PrecisionPolicy.autocast`` must give every op of the exported program the dtype
eager autocast gives it, and its outputs must stay within twice eager autocast's own
error against an fp64 run of the same program.
"""

import math

import pytest
import torch
import torch.utils._pytree as pytree

import fx16
from fx16 import PrecisionPolicy
from fx16.program import Program
from fx16.program.stats import relative_error
from helpers import DtypeRecorder, assert_meta_matches_runtime

autocast_test_lists = pytest.importorskip("torch.testing._internal.autocast_test_lists")

LISTS = (
    "torch_16",
    "torch_fp32",
    "nn_16",
    "nn_fp32",
    "torch_need_autocast_promote",
    "torch_expect_builtin_promote",
    "methods_expect_builtin_promote",
)
CASES = autocast_test_lists.AutocastCPUTestLists(torch.device("cpu"))
VARIANTS = ("float inputs", "made 16-bit by a 16-bit op", "cast 16-bit by the program")


def _function(list_name: str, op: str):
    if list_name.startswith("torch"):
        return getattr(torch, op)
    if list_name.startswith("nn"):
        return getattr(torch._C._nn, op)
    return lambda tensor, *args: getattr(tensor, op)(*args)


class _OneOp(torch.nn.Module):
    """The case's op on the program's tensor inputs (the case's tensors, nested lists
    flattened into inputs), each float input first made 16-bit as ``variant`` says.
    ``reference``: the program's own casts are round trips into the fp64 inputs, and
    nothing else rounds."""

    def __init__(self, function, args, kwargs, variant, low, reference=False):
        super().__init__()
        self.function, self.args, self.kwargs = function, args, kwargs
        self.variant, self.low, self.reference = variant, low, reference

    def forward(self, *tensors):
        given = iter(tensors)

        def fed(arg):
            if not isinstance(arg, torch.Tensor):
                return arg
            tensor = next(given)
            if not tensor.is_floating_point():
                return tensor
            if self.variant == VARIANTS[2]:
                narrowed = tensor.to(self.low)
                return narrowed.to(tensor.dtype) if self.reference else narrowed
            if self.variant == VARIANTS[1] and not self.reference and tensor.dim() > 0:
                return torch.nn.functional.prelu(tensor, torch.ones(1))
            return tensor

        return self.function(*pytree.tree_map(fed, self.args), **self.kwargs)


def _cases():
    for list_name in LISTS:
        for entry in getattr(CASES, list_name):
            for low in (torch.bfloat16, torch.float16):
                for variant in VARIANTS:
                    name = f"{list_name}-{entry[0]}-{str(low)[6:]}-{variant.replace(' ', '_')}"
                    yield pytest.param(list_name, entry, low, variant, id=name)


# a program that casts its own inputs to 16-bit for an op with no 16-bit CPU kernel
# fails as exported (without autocast): calibration skips its example inputs, and says so
@pytest.mark.filterwarnings("ignore:fx16 skipped. the program fails on its example inputs")
@pytest.mark.parametrize(("list_name", "entry", "low", "variant"), list(_cases()))
def test_static_autocast_is_eager_autocast(list_name, entry, low, variant):
    op, args = entry[0], entry[1]
    kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}
    tensors = [leaf for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor)]
    inputs = tuple(t.float() if t.is_floating_point() else t for t in tensors)
    model = _OneOp(_function(list_name, op), args, kwargs, variant, low)
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=low):
            eager = model(*inputs)
    except RuntimeError as refused:  # none on torch 2.13; a case eager autocast refuses
        pytest.skip(f"eager autocast refuses it too: {str(refused)[:80]}")
    ep = torch.export.export(model, inputs)
    recorder = DtypeRecorder(ep.graph_module)
    with torch.no_grad(), torch.autocast("cpu", dtype=low):
        recorder.run(*Program(ep).graph_inputs(inputs))

    cast = fx16.cast_fp32_to_fp16(ep, policy=PrecisionPolicy.autocast("cpu", low))
    cast.graph_module.graph.lint()
    assert_meta_matches_runtime(cast, inputs)
    compared = [
        (node.name, node.meta["val"].dtype, recorder.dtypes[node.name])
        for node in cast.graph_module.graph.nodes
        if node.op == "call_function"
        and node.name in recorder.dtypes
        and not node.meta.get("fx16.inserted")
        and isinstance(node.meta.get("val"), torch.Tensor)
    ]
    assert compared, "no op of the program was compared"
    assert [(name, ours) for name, ours, _ in compared] == [
        (name, eager_dtype) for name, _, eager_dtype in compared
    ]

    got = pytree.tree_leaves(cast.module()(*inputs))
    eager = pytree.tree_leaves(eager)
    reference_model = _OneOp(model.function, args, kwargs, variant, low, reference=True)
    with torch.no_grad():
        doubles = tuple(t.double() if t.is_floating_point() else t for t in inputs)
        reference = pytree.tree_leaves(reference_model(*doubles))
    for ours, theirs, exact in zip(got, eager, reference, strict=True):
        assert ours.dtype == theirs.dtype
        if not theirs.is_floating_point():
            assert torch.equal(ours, theirs)
            continue
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
        own_error = relative_error(exact, theirs)
        bound = 2 * own_error + 8 * torch.finfo(torch.float32).eps
        assert relative_error(exact, ours) <= bound, (relative_error(exact, ours), own_error)
        assert not math.isnan(own_error)
