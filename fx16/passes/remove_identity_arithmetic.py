"""RemoveIdentityArithmeticPass: drop multiplies by 1, divisions by 1 and adds of 0."""

import torch
from torch.fx import Graph, Node

from fx16.ops.tables import NEUTRAL_SCALARS
from fx16.passes.cast_rule import ReplaceBySource
from fx16.program.nodes import node_val

aten = torch.ops.aten

# op -> the scalar second argument that leaves the first as it is
IDENTITIES = {
    getattr(getattr(aten, name), overload): value
    for name, value in NEUTRAL_SCALARS.items()
    for overload in ("Tensor", "Scalar")
}


class RemoveIdentityArithmeticPass(ReplaceBySource):
    """``x * 1``, ``x / 1``, ``x + 0`` and ``x - 0`` on a scalar are replaced by x.

    Input graph:  cos:f16 -> mul(cos, 1.0) -> y
    Output graph: cos:f16 -> y

    Models write these (a rotary embedding's ``cos * attention_scaling`` with a scale
    of 1). A runtime pays for each: ExecuTorch's ``to_edge`` makes the Python scalar
    an fp32 constant and casts it to fp16 on every call. The result is x's own value:
    the same dtype (no promotion: ``int_x * 1.0`` is left alone), the same shape, and
    both contiguous (a ``view`` of the result needs its layout; the op may copy a
    strided x into a contiguous result). One sign differs: ``-0.0 + 0``
    is ``+0.0``, where the result is x's ``-0.0``. The two compare equal and only
    division by zero and ``copysign`` tell them apart.

    Refuses like RemoveNoopCastsPass: when a write in place reaches the result or x
    (the op's copy keeps them apart), or when reading x would alias tensors where torch
    forbids it (an input returned, a higher-order op given one tensor twice, a body
    returning a view of its input or one tensor twice).

    Costs: nothing; it removes ops.
    """

    def candidates(self, graph: Graph) -> list[Node]:
        """The calls of ``IDENTITIES``' ops, in graph order (found by target, no walk)."""
        found = [
            node
            for target in IDENTITIES
            for node in graph.find_nodes(op="call_function", target=target, sort=False)
        ]
        return sorted(found)

    def match(self, node: Node) -> bool:
        if len(node.args) != 2 or not isinstance(node.args[0], Node):
            return False
        scalar = node.args[1]
        if isinstance(scalar, bool) or not isinstance(scalar, (int, float)):
            return False
        if scalar != IDENTITIES[node.target] or set(node.kwargs) - {"alpha"}:
            return False
        source, result = node_val(node.args[0]), node_val(node)
        return (
            isinstance(source, torch.Tensor)
            and isinstance(result, torch.Tensor)
            and source.dtype == result.dtype
            and source.shape == result.shape
            and source.is_contiguous()
            and result.is_contiguous()
        )
