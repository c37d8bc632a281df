"""Shared test helpers: export small models, run casts, check programs like a downstream user."""

import contextlib
import copy
import io
import math
import os
import subprocess
import sys
import traceback
from collections import Counter
from pathlib import Path

import torch
import torch.utils._pytree as pytree

from fx16.pipelines import fp16_passes, run_passes
from fx16.program import Program
from fx16.program.casts import is_cast, is_inserted
from fx16.program.stats import relative_error
from fx16.testing.checks import assert_meta_matches_runtime  # noqa: F401  (tests import it)
from fx16.testing.checks import check_valid_program as check_program

aten = torch.ops.aten


def export(model: torch.nn.Module, *args, decompose: bool = False, dynamic_shapes=None):
    ep = torch.export.export(model.eval(), tuple(args), dynamic_shapes=dynamic_shapes)
    return ep.run_decompositions() if decompose else ep


def targets(ep) -> Counter:
    """How many call_function nodes there are per ``node.target``."""
    return Counter(n.target for n in ep.graph_module.graph.nodes if n.op == "call_function")


def casts(ep) -> list[torch.fx.Node]:
    return [n for n in ep.graph_module.graph.nodes if is_cast(n)]


def inserted_casts(ep) -> list[torch.fx.Node]:
    return [n for n in casts(ep) if is_inserted(n)]


def node_named(ep, name: str) -> torch.fx.Node:
    return next(n for n in ep.graph_module.graph.nodes if n.name == name)


class DtypeRecorder(torch.fx.Interpreter):
    """Runs a graph and keeps the dtype of each node's tensor result, by node name
    (under ``torch.autocast``: the dtypes eager autocast gives the graph's ops)."""

    def __init__(self, graph_module):
        super().__init__(graph_module)
        self.dtypes = {}

    def run_node(self, node):
        result = super().run_node(node)
        if isinstance(result, torch.Tensor):
            self.dtypes[node.name] = result.dtype
        return result


def inputs_for(ep, args):
    """``args`` converted to the dtypes the program's user inputs now expect."""
    placeholders = Program(ep).user_input_placeholders()
    flat, spec = pytree.tree_flatten(args)
    converted = [
        value.to(node.meta["val"].dtype) if isinstance(value, torch.Tensor) else value
        for value, node in zip(flat, placeholders)
    ]
    return pytree.tree_unflatten(converted, spec)


def run(ep, *args):
    """Run the program on ``args`` (converted to its input dtypes); a flat list of outputs."""
    with torch.no_grad():
        return pytree.tree_leaves(ep.module()(*inputs_for(ep, args)))


def fp64_reference(model: torch.nn.Module, *args):
    model64 = copy.deepcopy(model).double()
    args64 = [
        a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
    ]
    with torch.no_grad():
        return pytree.tree_leaves(model64(*args64))


def max_error(reference, outputs) -> float:
    return max(relative_error(r, o) for r, o in zip(reference, outputs) if r.is_floating_point())


def apply_passes_and_check(ep, passes, model, args, tolerance: float = 1e-2):
    """coremltools-style pass check: run, validate the program, compare with fp64, rerun.

    Returns the (changed) program. Asserts the result agrees with an fp64 run of
    ``model`` within ``tolerance`` relative error.
    """
    run_passes(passes, ep.graph_module)
    check_program(ep)
    error = max_error(fp64_reference(model, *args), run(ep, *args))
    assert error < tolerance, f"relative error {error:.3g} above {tolerance}"
    return ep


def scale_only(ep, **options) -> None:
    """Run the fp16 pipeline on ``ep`` up to and including ``ScaleDomainsPass``: the
    scaled program, still fp32."""
    passes = fp16_passes(ep, **options)
    stages = [type(p).__name__ for p in passes]
    run_passes(passes[: stages.index("ScaleDomainsPass") + 1], ep.graph_module)


def scaled_exactly(model, *args, decompose: bool = False):
    """The model exported (``decompose``: to core ATen first) and scaled in fp32
    (``scale_only``); asserts the plan applied whole, not taken back, and the scaled
    program computes the model's outputs bit for bit."""
    from fx16.passes.scale_domains import REVERTED

    ep = export(model, *args, decompose=decompose)
    scale_only(ep)
    assert REVERTED not in ep.graph_module.meta, ep.graph_module.meta.get(REVERTED)
    with torch.no_grad():
        want, got = pytree.tree_leaves(model(*args)), pytree.tree_leaves(ep.module()(*args))
    assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got))
    return ep


def range_multiplies(ep) -> list[str]:
    """The runtime multiplies a scale plan added to ``ep``'s graph."""
    from fx16 import meta

    return [node.name for node in ep.graph.nodes if meta.range_scaled(node)]


def state_snapshot(ep):
    """Everything a cast may change, in comparable form."""
    return (
        {
            name: module.code
            for name, module in ep.graph_module.named_modules()
            if isinstance(module, torch.fx.GraphModule)
        },
        {k: (v.dtype, v.clone()) for k, v in ep.state_dict.items()},
        {k: (v.dtype, v.clone()) for k, v in ep.constants.items() if isinstance(v, torch.Tensor)},
        str(ep.graph_signature),
    )


def assert_same_state(a, b) -> None:
    assert a[0] == b[0]
    assert str(a[3]) == str(b[3])
    for left, right in ((a[1], b[1]), (a[2], b[2])):
        assert left.keys() == right.keys()
        for key in left:
            assert left[key][0] == right[key][0], key
            torch.testing.assert_close(left[key][1], right[key][1], equal_nan=True)


def apply_rule(rule_class, ep):
    """Run one cleanup rule (or the driver) on ``ep`` and check the program it leaves."""
    result = rule_class(Program(ep))(ep.graph_module)
    ep.graph_module.recompile()
    check_program(ep)
    return result


def eager(model, *args):
    with torch.no_grad():
        return model(*args)


def command(*args, cwd=None):
    """Run the ``fx16`` command (see ``run_fx16``): (exit code, stdout, stderr)."""
    result = run_fx16(args, cwd=cwd)
    return result.returncode, result.stdout, result.stderr


# The checkout under test: a subprocess imports its fx16 (not an editable install's).
CHECKOUT = Path(__file__).resolve().parent.parent


def with_checkout(env: dict | None) -> dict:
    """``env`` (default: this process's) with the checkout first on PYTHONPATH after the
    folders ``env`` already puts there."""
    env = dict(os.environ if env is None else env)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(CHECKOUT)])
    return env


def run_fx16(args, cwd=None, env=None) -> subprocess.CompletedProcess:
    """Run ``fx16 ARGS`` with its exit code, stdout and stderr as a user sees them.

    In this process (``fx16.cli.main``, what ``python -m fx16`` runs, output captured):
    a fresh interpreter costs seconds of start-up per call. In a subprocess where the
    command needs a working directory or an environment of its own."""
    argv = [str(arg) for arg in args]
    if cwd is not None or env is not None:
        return subprocess.run(
            [sys.executable, "-m", "fx16", *argv],
            capture_output=True,
            text=True,
            cwd=cwd,
            env=with_checkout(env),
            timeout=300,
        )
    from fx16.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:  # --help, --version, a usage error
            code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
        except Exception:  # what the interpreter would print before exiting with 1
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


class GeluTanh(torch.nn.Module):
    """GELU's tanh approximation written out, as GPT-2 and many models do: its cube has
    condition number 3."""

    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x.pow(3))))


def gelu_tanh_mlp() -> torch.nn.Module:
    """Two MLP blocks, linear -> the written-out GELU -> linear."""
    torch.manual_seed(0)
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(64, 256), GeluTanh(), torch.nn.Linear(256, 64))
        for _ in range(2)
    ]
    return torch.nn.Sequential(*blocks).eval()
