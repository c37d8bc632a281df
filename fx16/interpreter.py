"""Interpreters for analyses that look at every value: calibration, emulation, the budget."""

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Interpreter, Node

from fx16.subgraphs import AUTOCAST, COND, INVOKE_SUBGRAPH, MAP, SET_GRAD, WHILE_LOOP


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


class BodyInterpreter(LeanInterpreter):
    """A LeanInterpreter that runs the bodies of higher-order ops node by node too:
    cond (the branch taken), while_loop (every iteration), map (every slice),
    autocast and set_grad_enabled regions, invoke_subgraph; each body by a new
    interpreter from ``inside`` (a subclass shares its records with it). Other
    higher-order ops run whole."""

    def inside(self, body: GraphModule) -> "BodyInterpreter":
        """The interpreter that runs ``body`` for this one."""
        raise NotImplementedError

    def _run(self, body: GraphModule, operands) -> Any:
        return self.inside(body).run(*operands)

    def call_function(self, target, args, kwargs):
        if target is COND:
            predicate, true_body, false_body, operands = args
            return tuple(self._run(true_body if bool(predicate) else false_body, operands))
        if target is WHILE_LOOP:
            condition, body, carried, additional = args
            carried = tuple(carried)
            while bool(pytree.tree_leaves(self._run(condition, (*carried, *additional)))[0]):
                carried = tuple(self._run(body, (*carried, *additional)))
            return carried
        if target is MAP and args[1][0].shape[0] > 0:
            body, mapped, others = args
            slices = [
                self._run(body, (*(tensor[index] for tensor in mapped), *others))
                for index in range(mapped[0].shape[0])
            ]
            return [torch.stack(parts) for parts in zip(*slices)]
        if target is AUTOCAST:
            device, dtype, enabled, cache, body, *operands = args
            with torch.autocast(device_type=device, dtype=dtype, enabled=enabled):
                return tuple(self._run(body, operands))
        if target is SET_GRAD:
            enabled, body, *operands = args
            with torch.set_grad_enabled(enabled):
                return tuple(self._run(body, operands))
        if target is INVOKE_SUBGRAPH:
            body, _, *operands = args
            return tuple(self._run(body, operands))
        return super().call_function(target, args, kwargs)
