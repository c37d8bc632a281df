"""LeanInterpreter: torch.fx's Interpreter without its per-node tracing bookkeeping."""

from typing import Any

from torch.fx import Interpreter, Node


class LeanInterpreter(Interpreter):
    """Runs a graph node by node, like ``torch.fx.Interpreter``, for analyses that look
    at every value (calibration, the accuracy search).

    ``Interpreter.run_node`` enters two context managers per node to record the node
    being run for tracebacks of code that traces while it runs; nothing fx16 runs
    traces, and on a 2,000-node graph they cost as much as the ops themselves.
    A failing node is still named by ``Interpreter.run``.
    """

    def run_node(self, node: Node) -> Any:
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        return getattr(self, node.op)(node.target, args, kwargs)
