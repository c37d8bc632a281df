"""ScaleDomainsPass: apply the plan ``ScaleDomainsAnalysis`` made, then calibrate again."""

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16 import meta
from fx16.analysis.calibration import CalibrationAnalysis, recalibrate
from fx16.analysis.scale_domains import ScaleDomainsAnalysis
from fx16.analysis.scale_plan import ScalePlan
from fx16.contracts import require
from fx16.program import Program
from fx16.program.casts import copy_provenance
from fx16.program.lazy_code import compile_when_needed
from fx16.program.nodes import set_argument
from fx16.program.propagation import fresh_result
from fx16.program.state_commit import convert_state_tensors
from fx16.program.subgraphs import nested_graph_modules

aten = torch.ops.aten


class ScaleDomainsPass(PassBase):
    """Carry the planned values at their power-of-two scales.

    Reads: ``meta["fx16.scale_plan"]`` of the program's graph module and of each body's
    (``ScaleDomainsAnalysis``). Writes:
    each folded state tensor, multiplied by its power of two (every name of a shared
    tensor alike); the scalars the plan scales (a norm's eps, an add's constant); a
    ``mul`` by a power of two where the plan needs one at run time, marked
    ``meta["fx16.range_scale"]``; ``meta["fx16.scale_exponent"]`` on every value carried
    at a scale. Then runs ``CalibrationAnalysis`` again (``calibration``: the same
    inputs), so the analyses after it observe the scaled values. Without a plan, or
    with an empty one, changes nothing."""

    preserves = (CalibrationAnalysis,)  # it calibrates the rewritten program again

    def __init__(self, program: Program, calibration: list | None = None) -> None:
        self.program = Program.of(program)
        self.calibration = calibration

    def requires(self, graph_module: GraphModule) -> None:
        require(graph_module, type(self).__name__, (ScaleDomainsAnalysis,))

    def call(self, graph_module: GraphModule) -> PassResult:
        plans = [
            (module, module.meta.pop(meta.SCALE_PLAN, None))
            for module in nested_graph_modules(graph_module)
        ]
        plans = [(module, plan) for module, plan in plans if plan is not None and plan.wanted]
        if not plans:
            return PassResult(graph_module, False)
        reference = graph_module.meta.get(meta.CALIBRATION_OUTPUTS)
        applied = [(self._apply(module, plan), plan) for module, plan in plans]
        for module, _ in plans:
            if module is not graph_module:
                compile_when_needed(module)
        self._calibrate(graph_module)
        outputs = graph_module.meta.get(meta.CALIBRATION_OUTPUTS)
        if reference is None or same_outputs(reference, outputs):
            for (_, unscaled), plan in applied:
                _bound(unscaled, plan)
            return PassResult(graph_module, True)
        # a rule that does not commute as its table says: the plans are taken back whole
        for (undo, _), _ in reversed(applied):
            undo()
        for module, _ in plans:
            if module is not graph_module:
                compile_when_needed(module)
        graph_module.meta[meta.SCALE_DOMAINS] = []
        graph_module.meta[REVERTED] = "the scaled program's fp32 outputs moved on calibration"
        self._calibrate(graph_module)
        return PassResult(graph_module, False)

    def _calibrate(self, graph_module: GraphModule) -> None:
        recalibrate(graph_module, self.program, self.calibration)

    def _apply(self, graph_module: GraphModule, plan: ScalePlan):
        """Apply ``plan``; returns the function that takes it back."""
        stored = self._fold(plan)
        scalars = {}
        for (node, location), value in plan.scalars.items():
            kind, key = location
            scalars[(node, location)] = (
                node.args[key] if kind == "args" else node.kwargs.get(key, _ABSENT)
            )
            set_argument(node, location, value)
        graph = graph_module.graph
        inserted, replaced, unscaled = [], {}, {}
        for node, delta in plan.after.items():
            chain = _multiply(graph, node, delta, "starts a scale domain")
            first, scaled = chain[0], chain[-1]
            node.replace_all_uses_with(scaled, delete_user_cb=lambda user, f=first: user is not f)
            replaced[node] = scaled
            inserted.extend(chain)
        for (node, delta), readers in plan.edges.items():
            source = replaced.get(node, node)
            chain = _multiply(graph, source, delta, "undoes a domain's scale for its reader")
            scaled = chain[-1]
            for step in chain if meta.negligible(node) else ():
                step.meta[meta.NEGLIGIBLE] = meta.negligible(node)  # the same value
            for reader in readers:
                reader.replace_input_with(source, scaled)
            inserted.extend(chain)
            unscaled[scaled] = node
        for node, exponent in plan.exponents.items():
            if isinstance(exponent, int) and exponent:
                node.meta[meta.SCALE_EXPONENT] = exponent
        graph.lint()

        def undo() -> None:
            for target, tensor in stored.items():
                self.program.replace_state_tensor(target, tensor)
            for (node, location), value in scalars.items():
                if value is _ABSENT:
                    node.kwargs = {k: v for k, v in node.kwargs.items() if k != location[1]}
                else:
                    set_argument(node, location, value)
            for scaled in reversed(inserted):
                scaled.replace_all_uses_with(scaled.args[0])
                graph.erase_node(scaled)
            for node in plan.exponents:
                node.meta.pop(meta.SCALE_EXPONENT, None)

        return undo, unscaled

    def _fold(self, plan: ScalePlan) -> dict[str, torch.Tensor]:
        """Multiply each folded state tensor by its power of two, once per tensor;
        returns the tensors replaced, by name."""
        targets = []
        for slot in self.program.state_slots():
            tensor = self.program.state_tensor(slot.target)
            if tensor is not None and plan.folds.get(id(tensor)):
                targets.append(slot.target)

        def folded(tensor: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return tensor.detach() * 2.0 ** plan.folds[id(tensor)]

        return convert_state_tensors(self.program, targets, folded)


def _bound(unscaled: dict[Node, Node], plan: ScalePlan) -> None:
    """A multiply that undoes a domain's scale holds, on other inputs, what any member
    of the domain held (a where or a max picks any member's values): its observed
    magnitude is raised to the domain's largest, so the rules judge the unscaled value
    by it."""
    for scaled, source in unscaled.items():
        bound = plan.bounds.get(source)
        seen = meta.observed_max_abs(scaled)
        if bound is not None and seen is not None and bound > seen:
            scaled.meta[meta.OBSERVED_MAX_ABS] = bound


def same_outputs(reference: list, outputs: list | None) -> bool:
    """The fp32 program's outputs on each calibration input, before and after scaling,
    agree: powers of two are exact, so only fp32's own rounding of values near its
    range's ends may differ."""
    if outputs is None or len(reference) != len(outputs):
        return False
    for before, after in zip(reference, outputs):
        if len(before) != len(after):
            return False
        for a, b in zip(before, after):
            if not isinstance(a, torch.Tensor):
                if a != b:
                    return False
            elif not a.is_floating_point():
                if not torch.equal(a, b):
                    return False
            elif not _close(a, b):
                return False
    return True


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.double(), b.double()
    finite, nan = torch.isfinite(a), torch.isnan(a)
    if not torch.equal(finite, torch.isfinite(b)) or not torch.equal(nan, torch.isnan(b)):
        return False
    infinite = ~finite & ~nan
    if not torch.equal(a[infinite], b[infinite]):
        return False
    if not finite.any():
        return True
    scale = float(a[finite].abs().max())
    return bool(((a[finite] - b[finite]).abs() <= 1e-5 * scale + 1e-4 * a[finite].abs()).all())


_ABSENT = object()
# graph_module.meta key: why a plan was taken back (a rule that did not hold)
REVERTED = "fx16.scale_domains_reverted"


# The widest single steps: powers of two that are 16-bit numbers (2**-24 its smallest).
_MOST_STEP, _LEAST_STEP = 15, -24


def _multiply(graph, node: Node, delta: int, why: str) -> list[Node]:
    """``node * 2**delta``, placed after ``node`` (after the last placeholder for one): one
    multiply, or a chain of them where 2**delta is beyond the largest 16-bit number (each
    factor one, so no scale a domain makes is an fp32 scalar)."""
    anchor = node
    if node.op == "placeholder":
        anchor = next(n for n in graph.nodes if n.op != "placeholder").prev
    chain, left = [], delta
    while left or not chain:
        step = max(_LEAST_STEP, min(_MOST_STEP, left))
        with graph.inserting_after(anchor):
            anchor = graph.call_function(aten.mul.Tensor, (chain[-1] if chain else node, 2.0**step))
        anchor.meta["val"] = fresh_result(anchor)
        copy_provenance(node, anchor)
        anchor.meta[meta.RANGE_SCALE] = f"x 2**{step}: {why}"
        chain.append(anchor)
        left -= step
    return chain
