"""StabilizePass: rewrite patterns that 16-bit spoils into forms that compute well in it.

fx16's other remedy for such a pattern is fp32, which on the Neural Engine leaves the
accelerator and on a GPU costs bandwidth and casts. Each rule here rewrites a known
unstable pattern of the fp32 program into an equivalent one (the same result in exact
arithmetic; fp64 agrees to a few ulps, see ``tests/test_stabilize.py``) whose
intermediate values stay inside 16-bit's range, so the precision rules that run after
it find nothing to keep in fp32, and the rewritten form holds on every input, not
only on the calibration inputs. The one rule that changes a result, ``EpsClamp``,
says by how much, and runs only when asked for (``eps_clamp=True``, ``--eps-clamp``).

On by default: ``PrecisionPolicy(stabilize=True)`` (``stabilize=False`` in the cast
functions, ``--no-stabilize`` on the command line, turns it off) puts it early in
``fx16.fp16_passes``, before the analyses, which then see the stable forms.
A pattern whose result fx16 decided already (a program it cast before) is left as that
cast left it, so casting twice equals casting once.
Reads: the graph, ``meta["fx16.precision"]``. Writes: the rewritten nodes (the replaced
ones removed), ``meta["val"]`` and the model's provenance on the new ones, and
``meta["fx16.stabilized"]`` (the rule's name and what it did) on the node that now gives
the pattern's result; the report lists them. A program without any pattern is left
byte-identical.
"""

from dataclasses import replace

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fx16.analysis.explicit_fp32 import model_fp32_regions
from fx16.analysis.facts import Facts
from fx16.decisions import decision_of
from fx16.meta import STABILIZED
from fx16.passes.stable_rewrites.gelu import TanhGelu
from fx16.passes.stable_rewrites.logs import Expm1, Log1p, LogSigmoid, LogSoftmax
from fx16.passes.stable_rewrites.magnitude import MagnitudeScaling
from fx16.passes.stable_rewrites.norms import EpsClamp, RmsNormScaling, TwoPassVariance
from fx16.program.node_ids import assign_ids


def standard_rules(low: torch.dtype, exact: bool = True, eps_clamp: bool = False) -> list:
    """fx16's rules: the ``exact`` ones (the same result in real arithmetic), the
    RMSNorm one first (its pattern holds an ``rsqrt(v + eps)``); with ``eps_clamp``,
    the one that changes results last."""
    exact_rules = [
        RmsNormScaling(),
        MagnitudeScaling(),
        LogSoftmax(),
        LogSigmoid(),
        Log1p(),
        Expm1(),
        TwoPassVariance(),
        TanhGelu(),
    ]
    return (exact_rules if exact else []) + ([EpsClamp(low)] if eps_clamp else [])


class StabilizePass(PassBase):
    """Apply ``rules`` (default: ``standard_rules(low, exact, eps_clamp)``) in order, each
    in one sweep over the graph (a rule's pattern may hold a later rule's: RMSNorm's holds
    ``rsqrt(v + eps)``); see the module docstring for what it reads and writes.

    A rule is a ``StableRewrite`` (``fx16.passes.stable_rewrites.matching``): a ``name``,
    ``match(node)`` (a ``Rewrite`` or None: its ``result``, the
    node whose readers the replacement takes over, is ``node`` or one after it) and
    ``build(graph, rewrite)`` (the node giving the pattern's result); with ``roots``,
    the ops its matches start from, only the nodes calling one are offered to it (found
    by target, not by a walk over every node)."""

    def __init__(
        self,
        low: torch.dtype = torch.float16,
        exact: bool = True,
        eps_clamp: bool = False,
        rules: list | None = None,
        keep_model_fp32: bool = False,
    ) -> None:
        """``keep_model_fp32``: leave alone a pattern inside an fp32 region the model opens
        itself (``x.float()`` before an RMSNorm's variance), as the policy keeps those
        regions fp32 (``explicit_fp32="keep"``): fp32 has the range, and the rewrite's ops
        would only add fp32 work (22 ops in the demo block's two norms)."""
        self.rules = standard_rules(low, exact, eps_clamp) if rules is None else list(rules)
        self.keep_model_fp32 = keep_model_fp32

    def call(self, graph_module: GraphModule) -> PassResult:
        modified = False
        regions = model_fp32_regions(graph_module)
        kept = regions if self.keep_model_fp32 else frozenset()
        for module in Facts.of(graph_module).graph_modules:  # the bodies of cond, loops, too
            if self.rewrite(module.graph, kept, regions):
                if module is not graph_module:
                    module.recompile()  # the root is recompiled by whoever runs the pipeline
                modified = True
        if modified:
            Facts.invalidate(graph_module)
            assign_ids(graph_module)  # the nodes it made: fx16.diagnose compares them too
        return PassResult(graph_module, modified)

    def rewrite(
        self, graph: Graph, kept: set[Node] = frozenset(), regions: set[Node] = frozenset()
    ) -> bool:
        """Apply every rule to one graph, but not to a pattern whose result is in ``kept``;
        a rewrite whose result is in ``regions`` (the model's own fp32 regions) is built
        knowing it (``Rewrite.in_model_fp32``); whether any pattern was rewritten."""
        modified = False
        for rule in self.rules:
            for node in _offered(graph, getattr(rule, "roots", None)):
                if node.graph is not graph:  # removed by an earlier rewrite
                    continue
                rewrite = rule.match(node)
                decided = rewrite is not None and decision_of(rewrite.result) is not None
                if rewrite is None or rewrite.result in kept or decided:
                    continue  # (decided: by an earlier cast, which left the pattern as it is)
                if rewrite.result in regions:
                    rewrite = replace(rewrite, in_model_fp32=True)
                made = rule.build(graph, rewrite)
                made.meta[STABILIZED] = (rule.name, rewrite.detail)
                rewrite.result.replace_all_uses_with(made)
                for replaced in rewrite.replaced:
                    if not replaced.users:
                        graph.erase_node(replaced)
                modified = True
        return modified


def _offered(graph: Graph, targets) -> list[Node]:
    """The nodes that call one of ``targets`` (None: any op), in graph order."""
    if targets is None:
        return [node for node in graph.nodes if node.op == "call_function"]
    found = []
    for target in targets:
        found.extend(graph.find_nodes(op="call_function", target=target, sort=False))
    return sorted(found)
