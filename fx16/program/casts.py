"""Reading, writing and inserting dtype casts in an FX graph.

A cast here is a node that changes only a tensor's dtype: ``aten._to_copy``,
``aten.to.dtype`` or ``aten.to.dtype_layout`` with no device, layout or memory
format change and no forced copy. Casts fx16 inserts are ``aten._to_copy`` nodes
marked with ``meta[INSERTED]`` so that cleanup can tell them from the model's
own casts; a model cast whose dtype fx16 retargets is marked the same way.
"""

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import Graph, Node

from fx16.ops.tables import CAST_OPS, is_cast_op
from fx16.program.nodes import SIXTEEN_BIT_DTYPES, node_dtype, node_val

aten = torch.ops.aten

# meta key on nodes fx16 inserted or retargeted; its value says why (one of the WHY_*).
INSERTED = "fx16.inserted"
WHY_UPCAST = "upcast"  # to a wider dtype, for an op that must run wide
WHY_NARROW = "narrow"  # to a 16-bit dtype, for an op that runs narrow
WHY_CAST_BACK = "cast-back"  # a narrow op's result back to what its consumers expect
WHY_RETARGETED = "retargeted"  # the model's own cast, pointed at another dtype
WHY_OUTPUT_DTYPE = "output dtype"  # a mutation written back in its target's dtype

# meta keys copied from a producer onto the casts inserted after it.
_PROVENANCE_KEYS = ("nn_module_stack", "stack_trace", "source_fn_stack", "torch_fn")

_PRESERVE = (None, torch.preserve_format)
_TO_DTYPE = aten.to.dtype  # looked up once: each ``aten.x.y`` is two attribute look-ups


def copy_provenance(source: Node, made: Node) -> None:
    """Give a node fx16 made the module path and source line of the one it stands for."""
    for key in _PROVENANCE_KEYS:
        if key in source.meta:
            made.meta[key] = source.meta[key]


def substitute_inputs(node: Node, replace) -> bool:
    """Make ``node`` read ``replace(arg)`` instead of each input node ``arg``.

    The node is only touched where an input changes: every assignment to a node's
    arguments updates the graph's lookup tables, which adds up over a large graph."""
    replacements = {}
    for arg in node.all_input_nodes:
        new = replace(arg)
        if new is not arg:
            replacements[arg] = new
    for old, new in replacements.items():
        node.replace_input_with(old, new)
    return bool(replacements)


def cast_op_nodes(graph: Graph) -> list[Node]:
    """The nodes calling a cast op (casts or not, see ``is_cast``), in graph order,
    found through the graph's lookup table instead of a walk over every node."""
    found = []
    for target in CAST_OPS:
        found.extend(graph.find_nodes(op="call_function", target=target, sort=False))
    return sorted(found)


def is_cast(node: Node) -> bool:
    """True for a node that changes only the dtype of its first argument."""
    if node.op != "call_function" or not is_cast_op(node.target):
        return False
    if not isinstance(cast_dtype(node), torch.dtype) or not isinstance(node.args[0], Node):
        return False
    source_val = node_val(node.args[0])
    if not isinstance(source_val, torch.Tensor):
        return False
    kwargs = node.kwargs
    device = kwargs.get("device")
    if device is not None and device != source_val.device:
        return False
    if kwargs.get("layout") not in (None, torch.strided):
        return False
    if kwargs.get("memory_format") not in _PRESERVE:
        return False
    if node.target is _TO_DTYPE:
        copy = node.args[3] if len(node.args) > 3 else kwargs.get("copy", False)
        memory_format = node.args[4] if len(node.args) > 4 else None
        return not copy and memory_format in _PRESERVE
    return True


def is_inserted(node: Node) -> bool:
    return INSERTED in node.meta


def before_inserted_casts(node: Node) -> Node:
    """The value a chain of casts fx16 inserted starts from (``node`` itself if none)."""
    while is_inserted(node) and is_cast(node):
        node = node.args[0]
    return node


def cast_back_source(node: Node, dtype: torch.dtype) -> Node | None:
    """If ``node`` is a cast-back fx16 inserted after a ``dtype`` value, that value."""
    if node.meta.get(INSERTED) == WHY_CAST_BACK and node_dtype(node.args[0]) == dtype:
        return node.args[0]
    return None


def cast_dtype(node: Node) -> torch.dtype | None:
    """The dtype a cast node converts to (None when it keeps the input dtype)."""
    if node.target is _TO_DTYPE and len(node.args) > 1:
        return node.args[1]
    return node.kwargs.get("dtype")


def set_cast_dtype(node: Node, dtype: torch.dtype) -> None:
    """Point a cast node at another dtype and update its recorded value to match."""
    if node.target is _TO_DTYPE and len(node.args) > 1:
        node.args = (node.args[0], dtype, *node.args[2:])
    else:
        node.kwargs = {**node.kwargs, "dtype": dtype}
    node.meta["val"] = retype_val(node.meta["val"], dtype)


# Retyped fake values, kept on their fake mode (and freed with it) under this attribute,
# by (shape, strides, device, dtype): a transformer's layers repeat the same few, and
# building a FakeTensor costs ~100 µs. Node metadata is read-only, so nodes with equal
# metadata may share one value (torch.export itself shares them between a multi-output op
# and its getitems).
_RETYPED = "_fx16_retyped"


def retype_val(val: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The same fake tensor (shape, strides, device) with another dtype.

    Builds the FakeTensor directly from a meta tensor, once per distinct metadata:
    many times cheaper than ``val.to(dtype)``, which dispatches a real ``_to_copy``.
    """
    if val.dtype == dtype:
        return val
    if not isinstance(val, FakeTensor):
        return val.to(dtype)
    cache = _retyped_cache(val.fake_mode)
    seen = cache.get((id(val), dtype))  # this very value retyped before (it is held)
    if seen is not None and seen[0] is val:
        return seen[1]
    shape, strides, offset = val.shape, val.stride(), val.storage_offset()
    key = (shape, strides, offset, val.device, dtype)
    try:
        found = cache.get(key)
    except TypeError:  # a symbolic size (a SymInt is not hashable): by its text
        shape, strides, offset = tuple(map(str, shape)), tuple(map(str, strides)), str(offset)
        key = (shape, strides, offset, val.device, dtype)
        found = cache.get(key)
    if found is None:
        meta = torch.empty_strided(val.shape, val.stride(), dtype=dtype, device="meta")
        found = cache[key] = FakeTensor(val.fake_mode, meta, val.device)
    cache[(id(val), dtype)] = (val, found)
    return found


def _retyped_cache(mode: FakeTensorMode) -> dict:
    """The retyped values of ``mode``, an attribute of the mode: a global table keyed by
    mode would keep every mode alive (its values point back to it)."""
    cache = getattr(mode, _RETYPED, None)
    if cache is None:
        cache = {}
        setattr(mode, _RETYPED, cache)
    return cache


class CastInserter:
    """Inserts casts into one graph, at most one per (producer, dtype).

    A cast goes right after its producer (after the last placeholder when the
    producer is a placeholder), so one cast serves every later consumer.
    Build a fresh one for every pass run: it caches nodes of that graph.
    """

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self._casts: dict[tuple[Node, torch.dtype], Node] = {}
        self._last_placeholder: Node | None = None

    def cast(self, source: Node, dtype: torch.dtype, why: str) -> Node:
        """A cast of ``source`` to ``dtype``: the cached one, or a new one."""
        key = (source, dtype)
        cast = self._casts.get(key)
        if cast is None or cast.graph is not self.graph or cast.args[0] is not source:
            cast = self._insert(source, dtype, why)
            self._casts[key] = cast
        return cast

    def cast_after(self, node: Node, dtype: torch.dtype, why: str) -> Node:
        """Insert a cast of ``node`` and move every current user of ``node`` onto it."""
        cast = self._insert(node, dtype, why)
        node.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
        return cast

    def _insert(self, source: Node, dtype: torch.dtype, why: str) -> Node:
        return self.cast_placed_after(self._anchor(source), source, dtype, why)

    def cast_placed_after(self, anchor: Node, source: Node, dtype: torch.dtype, why: str) -> Node:
        """A new cast of ``source`` right after ``anchor`` (not cached, no user moved)."""
        with self.graph.inserting_after(anchor):
            cast = self.graph.call_function(aten._to_copy.default, (source,), {"dtype": dtype})
        cast.meta["val"] = retype_val(source.meta["val"], dtype)
        copy_provenance(source, cast)
        cast.meta[INSERTED] = why
        return cast

    def _anchor(self, source: Node) -> Node:
        if source.op != "placeholder":
            return source
        if self._last_placeholder is None:
            self._last_placeholder = self.graph.find_nodes(op="placeholder")[-1]
        return self._last_placeholder


_FLOAT_RANK = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_SIGNED_BITS = {torch.int8: 8, torch.int16: 16, torch.int32: 32, torch.int64: 64}
_UNSIGNED_BITS = {torch.uint8: 8}
_MANTISSA_BITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}


def represents_exactly(narrow: torch.dtype, wide: torch.dtype) -> bool:
    """True when every value of dtype ``narrow`` is a value of dtype ``wide``.

    Examples: fp16 -> fp32 (yes), int16 -> fp32 (yes: 16 bits fit a 24-bit
    significand), fp16 -> bf16 (no: bf16 has fewer significand bits), fp32 -> fp16
    (no), int32 -> fp32 (no).
    """
    if narrow == wide or narrow == torch.bool:
        return True
    if narrow in _FLOAT_RANK and wide in _FLOAT_RANK:
        if narrow in SIXTEEN_BIT_DTYPES and wide in SIXTEEN_BIT_DTYPES:
            return False
        return _FLOAT_RANK[narrow] <= _FLOAT_RANK[wide]
    if narrow in _SIGNED_BITS and wide in _SIGNED_BITS:
        return _SIGNED_BITS[narrow] <= _SIGNED_BITS[wide]
    if narrow in _UNSIGNED_BITS and wide in _SIGNED_BITS:
        return _UNSIGNED_BITS[narrow] < _SIGNED_BITS[wide]
    integer_bits = _SIGNED_BITS.get(narrow) or _UNSIGNED_BITS.get(narrow)
    if integer_bits is not None and wide in _MANTISSA_BITS:
        return integer_bits <= _MANTISSA_BITS[wide] + (narrow in _UNSIGNED_BITS)
    return False


def source_dtype(cast: Node) -> torch.dtype | None:
    return node_dtype(cast.args[0])
