"""The accuracy search's remedies: which uses of 16-bit values move the outputs most.

``fx16.accuracy.budget`` asks ``remedies`` each round. The fp32 program, kept aside
(``Reference``), runs once more with autograd on (its graph kept from the first
round); one backward run per bounded group of gradients gives, for every use u of
a float value v that the cast program holds in 16-bit, sum |dL/du * (v - fp16(v))|:
how far that use's rounding moves the outputs along the current error. A remedy
returns the use to fp32 (the consumer, reading its producer in fp32); remedies that
move no matmul/conv/attention FLOPs to fp32 come first, each group ranked by that score
per FLOP they move to fp32 (an elementwise op or reduction counting
``ELEMENTWISE_WEIGHT`` of its FLOPs).
"""

import torch
import torch.utils._pytree as pytree
from torch.fx import Node
from torch.fx.node import map_arg

from fx16.decisions import was_narrowed
from fx16.ops.tables import ASSERT_METADATA_OPS
from fx16.passes.insert_fp16_casts import OUTPUTS
from fx16.program.casts import before_inserted_casts, is_cast, is_inserted
from fx16.program.cost import flops, is_product
from fx16.program.interpreter import LeanInterpreter
from fx16.program.nodes import SIXTEEN_BIT_DTYPES, is_float_tensor, node_dtype

# What an fp32 elementwise op or reduction costs per FLOP, next to an fp32 product's.
ELEMENTWISE_WEIGHT = 1 / 16


def names(remedies: list) -> set[str]:
    """The nodes a list of remedies returns to fp32."""
    return set().union(*(fix for _, fix in remedies))


class _Recorder(LeanInterpreter):
    """Runs a graph with autograd on, keeping every float value by node name
    (detached: the same storage the autograd graph keeps, not a copy).

    It also hands each consumer its own view of every float input, kept in ``edges``
    by (producer name, consumer name), so that gradients tell apart how much a value
    matters through each of its uses."""

    def __init__(self, graph_module) -> None:
        super().__init__(graph_module)
        self.values: dict[str, torch.Tensor] = {}
        self.edges: dict[tuple[str, str], torch.Tensor] = {}

    def run_node(self, node: Node):
        result = super().run_node(node)
        if is_float_tensor(result):
            self.values[node.name] = result.detach()
        return result

    def fetch_args_kwargs_from_env(self, node: Node):
        args, kwargs = super().fetch_args_kwargs_from_env(node)
        views = {}
        for source in node.all_input_nodes:
            value = self.env.get(source)
            if is_float_tensor(value) and value.requires_grad:
                views[source] = self.edges[(source.name, node.name)] = value.view_as(value)
        if views:
            args = map_arg(node.args, lambda source: views.get(source, self.env[source]))
            kwargs = map_arg(node.kwargs, lambda source: views.get(source, self.env[source]))
        return args, kwargs


def reference_outputs(graph_module, inputs: list) -> list:
    with torch.no_grad():
        return pytree.tree_leaves(graph_module(*inputs))


class Reference:
    """The fp32 program, kept aside: its graph, inputs and outputs per call, and
    (built on first need, then kept) an autograd graph per input with the values it
    holds, so that each round costs backward runs only (one per group of gradients,
    see ``impacts``), not a forward too.

    Memory: the inputs share the program's fp32 weights (no copy); the only fp32
    activations kept are those the autograd graph must keep, and only once a
    round needs gradients (a cast within budget on the first try keeps none)."""

    def __init__(self, graph_module, inputs: list[list], outputs: list[list], buffers: set[str]):
        self.graph_module, self.inputs, self.outputs = graph_module, inputs, outputs
        self.buffers = buffers  # placeholder names
        self.tapes: list[tuple[list, list, list]] | None = None
        self.values: list[dict[str, torch.Tensor]] = []  # per input, by node name

    def impacts(self, errors: list[list]) -> list[dict[tuple[str, str], float] | None]:
        """sum |dL/du * (v - fp16(v))| for every use u of a float value v in the fp32
        program, by (producer, consumer) name, per calibration input; with L = sum over
        outputs of <fp32 output - cast output, output>: how much rounding each use of
        each value moves the outputs along the error the cast program makes now.
        None for an input where backward cannot run (an op without a derivative).

        Gradients are asked for in groups of uses of at most ``_GRADIENT_ELEMENTS``
        elements, each reduced to its impact at once, so the fp32 gradients of all the
        weights are never held together: one backward run per group, and a single
        group for a program of up to 64M weights."""
        if self.tapes is None:
            self.tapes = []
            for inputs in self.inputs:
                outputs, edges, views, values = self._tape(inputs)
                self.tapes.append((outputs, edges, views))
                self.values.append(values)
        found = []
        for (outputs, edges, views), values, output_errors in zip(self.tapes, self.values, errors):
            pairs = [
                (out, error)
                for out, error in zip(outputs, output_errors)
                if error is not None and is_float_tensor(out) and out.requires_grad
            ]
            impacts: dict[tuple[str, str], float] = {}
            try:
                for group in _groups(views) if pairs else []:
                    grads = torch.autograd.grad(
                        [out for out, _ in pairs],
                        [views[index] for index in group],
                        grad_outputs=[error.to(out.dtype) for out, error in pairs],
                        allow_unused=True,
                        retain_graph=True,
                    )
                    for index, grad in zip(group, grads):
                        value = values.get(edges[index][0])
                        if grad is not None and value is not None:
                            impacts[edges[index]] = float((grad * _rounding(value)).abs().sum())
            except RuntimeError:  # an op with no derivative (a custom op without one)
                found.append(None)
                continue
            found.append(impacts)
        return found

    def _tape(self, inputs: list) -> tuple[list, list, list, dict]:
        """Buffers take no gradient: batch norm's running statistics cannot have one.
        The other float inputs take part as detached aliases (weights are not copied)."""
        recorder = _Recorder(self.graph_module)
        placeholders = self.graph_module.graph.find_nodes(op="placeholder")
        with torch.enable_grad():
            leaves = [
                x.detach().requires_grad_()
                if is_float_tensor(x) and placeholder.name not in self.buffers
                else x
                for x, placeholder in zip(inputs, placeholders)
            ]
            outputs = pytree.tree_leaves(recorder.run(*leaves))
        edges = list(recorder.edges)
        return outputs, edges, [recorder.edges[edge] for edge in edges], recorder.values


# Elements of the uses whose gradients one backward run asks for (256 MiB in fp32).
_GRADIENT_ELEMENTS = 1 << 26


def _groups(views: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``views`` in consecutive groups of at most ``_GRADIENT_ELEMENTS``
    elements (a larger view is a group of its own)."""
    groups: list[list[int]] = [[]]
    size = 0
    for index, view in enumerate(views):
        if groups[-1] and size + view.numel() > _GRADIENT_ELEMENTS:
            groups.append([])
            size = 0
        groups[-1].append(index)
        size += view.numel()
    return groups if groups[0] else []


def _rounding(value: torch.Tensor) -> torch.Tensor:
    """What storing ``value`` in fp16 changes in it."""
    return value - value.to(torch.float16).to(value.dtype)


def remedies(graph_module, reference: Reference, observed: list[list], forced: set[str]):
    """What could return to fp32 next, with its score, highest first: a list of
    (score, names), none of them in ``forced``, with a positive score.

    Each use of a value stored in 16-bit (a 16-bit op's result, a 16-bit parameter or
    input, or an fp32 result cast down) is scored by the first-order effect of its
    rounding on the output error, elementwise and without cancellation:
    sum |dL/du * (v - fp16(v))| on the fp32 program, with u that consumer's view of v
    and L the outputs projected on the current error (see ``Reference.impacts``).
    Summing signed terms instead let roundings that happen to cancel on the
    calibration inputs look harmless, and the budget then failed on other inputs.

    Removing that rounding for that use takes the consumer in fp32 (``OUTPUTS`` for a
    program output), reading the value's producer in fp32 (the producer too, when it
    computes in 16-bit); its other consumers keep reading 16-bit. So fp32 regions grow
    as connected pieces and stop where the error does. Remedies that return no product
    to fp32 come first (elementwise ops and reductions cost bytes, a product in fp32
    8-16x its time), each group by score per cost (``_fp32_cost`` of the nodes they
    return to fp32), best first.
    """
    errors = [
        [
            (ref - obs.to(ref.dtype)).detach()
            if is_float_tensor(ref) and is_float_tensor(obs)
            else None
            for ref, obs in zip(reference_outputs, outputs)
        ]
        for reference_outputs, outputs in zip(reference.outputs, observed)
    ]
    impacts = reference.impacts(errors)

    def impact(producer: str, consumer: str) -> float:
        total = 0.0
        for values, found in zip(reference.values, impacts):
            if found is not None:
                total += found.get((producer, consumer), 0.0)
            elif (value := values.get(producer)) is not None:
                total += float(_rounding(value).abs().sum())  # no backward: rounding alone
        return total

    best: dict[frozenset, float] = {}
    for node in graph_module.graph.nodes:
        stored = _stored_in_16_bit(node)
        if stored is None:
            continue
        producer, computes_in_16_bit = stored
        for consumer in _readers(node):
            fix = {OUTPUTS if consumer.op == "output" else consumer.name}
            if computes_in_16_bit:
                fix.add(producer.name)
            fix = frozenset(fix - forced)
            if fix:
                best[fix] = max(best.get(fix, 0.0), impact(producer.name, consumer.name))
    nodes = {node.name: node for node in reference.graph_module.graph.nodes}
    costs = {name: _fp32_cost(node) for name, node in nodes.items()}

    def rank(remedy) -> tuple[bool, float]:
        """Remedies that move no product FLOPs first, then by score per cost."""
        score, fix = remedy
        moves_products = any(name in nodes and is_product(nodes[name]) for name in fix)
        return not moves_products, score / (1 + sum(costs.get(name, 0.0) for name in fix))

    remedies = [(score, fix) for fix, score in best.items() if score > 0.0]
    return sorted(remedies, key=rank, reverse=True)


def _fp32_cost(node: Node) -> float:
    """What computing ``node`` in fp32 costs, in product FLOPs (see the module)."""
    return flops(node) * (1.0 if is_product(node) else ELEMENTWISE_WEIGHT)


def _stored_in_16_bit(node: Node) -> tuple[Node, bool] | None:
    """(producer, whether the producer itself computes in 16-bit) for a value the
    cast program holds in 16-bit where the fp32 program held fp32; None otherwise."""
    if node.op not in ("placeholder", "call_function"):
        return None
    if is_inserted(node) and is_cast(node):
        source = before_inserted_casts(node)
        if node_dtype(node) in SIXTEEN_BIT_DTYPES and node_dtype(source) == torch.float32:
            return source, False
        return None
    if was_narrowed(node):
        return node, True
    return None


def _readers(node: Node) -> list[Node]:
    """The original nodes (or the output) that read ``node``'s value, through any
    casts fx16 inserted after it; ``_assert_tensor_metadata`` checks left out."""
    readers, pending = [], list(node.users)
    while pending:
        user = pending.pop()
        if user.target in ASSERT_METADATA_OPS:
            continue
        if is_inserted(user) and is_cast(user):
            pending.extend(user.users)
        elif user not in readers:
            readers.append(user)
    return readers
