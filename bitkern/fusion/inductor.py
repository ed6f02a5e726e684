"""The torch.compile path: an Inductor post-grad pass that folds the elementwise op after a bitkern linear — a
residual add, ReLU/SiLU/GELU, or the SwiGLU gating of a [gate; up] layer stored in SwiGLU order (`swiglu_ordered`:
its output read through `unstack_swiglu`, then silu(first half) · second half, as vLLM's SiluAndMul computes it) —
into the kernel's epilogue (`torch.ops.bitkern.linear_epilogue`), where the cost model says it wins.  A graph
compiled for a dynamic number of rows serves every count from one up: a fusion is made only if it wins both at
one row and at the count the graph was traced with.

Inductor fuses nothing into custom ops, but it does fuse pointwise ops with each other: an add whose result feeds
another pointwise or reduction op (a residual add before an RMSNorm) costs no kernel of its own once compiled, so
the cost model prices its fusion by the bytes alone (and keeps it when that is below the margin); an op whose
result goes only to bitkern kernels or out of the graph is a kernel of its own, and folding it saves it.
A norm folded into bitkern kernels' prologue (`bitkern.fuse`'s `FoldedNorm`) is decided again here, against
the compiled baseline: eagerly an unfused norm is several torch ops, compiled it is one Inductor kernel, or none
where its input comes from a pointwise op (the residual add) it fuses into, while the prologue costs each kernel
that reads x its statistics pass.  Where the folded norm does not win, the pass computes x̂ in the graph
(`ops.matmul.norm_reference`, traced) and hands the kernels x̂ with no norm.
`install()` appends the pass to `torch._inductor.config.post_grad_custom_post_pass` (a list: a user's pass
stays)."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx.operator_schemas import normalize_function

from ..nn.dispatcher import schemas
from ..nn.kernel_call import KernelCall
from ..ops.matmul import SWIGLU_BLOCK, norm_reference
from ..ttype import WeightFormat
from . import cost
from .cost import Call, Variant, decide

aten = torch.ops.aten
_ACTIVATIONS = {aten.relu.default: "relu", aten.silu.default: "silu", aten.gelu.default: "gelu"}
_ADD = aten.add.Tensor
_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_CONVERT = torch.ops.prims.convert_element_type.default
_LINEAR_ARGUMENTS = ("x", "weight", "weight_format", "bias", "output_dtype", "activation_quant")


class FusionPass(CustomGraphPass):
    """Rewrites `bitkern::linear -> add(·, residual)`, `bitkern::linear -> relu/silu/gelu` (the linear's only
    user) and `bitkern::linear -> unstack_swiglu -> silu(gate) · up` into one `bitkern::linear_epilogue` call where
    the cost model fuses; `decisions` lists what it decided (pattern, rows, modeled gain, fused) for each
    signature of the last graphs it ran on (rows: the counts it was decided at; gain: the smallest).  always: fuse
    every match whatever the cost model says (its gain is still recorded)."""

    def __init__(self, always: bool = False):
        self.decisions = []
        self.always = always

    def __call__(self, graph: torch.fx.Graph) -> None:
        self._unfold_norms(graph)
        priced = {}  # repeated layers: one decision per signature
        position = {node: index for index, node in enumerate(graph.nodes)}
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not torch.ops.bitkern.linear.default:
                continue
            match = _match(node)
            if match is None:
                continue
            epilogue, residual, matched = match
            user = matched[-1]
            arguments = _arguments(node)
            x, weight, weight_format, bias, output_dtype, quant = (arguments[name] for name in _LINEAR_ARGUMENTS)
            rows = _rows(node)
            own_kernel = all(_leaves_inductor(u) for u in user.users)
            key = (weight_format, x.meta["val"].dtype, output_dtype, bias is not None, epilogue, residual is not None,
                   rows, own_kernel, quant)
            if key not in priced:
                priced[key] = self._decide(arguments, node, epilogue, residual is not None, rows, own_kernel)
            if not priced[key]:
                continue
            with graph.inserting_before(user):
                fused_node = graph.call_function(torch.ops.bitkern.linear_epilogue.default,
                                                 (x, weight, weight_format, bias, output_dtype, epilogue, residual),
                                                 {"activation_quant": quant})
            fused_node.meta.update(user.meta)
            user.replace_all_uses_with(fused_node)
            for dead in sorted([*matched, node], key=position.get, reverse=True):  # users before what they use
                if not dead.users:
                    graph.erase_node(dead)

    def _decide(self, arguments: dict, node, epilogue: str, residual: bool, rows: tuple, own_kernel: bool) -> bool:
        """Whether to fuse the linear `node` (its `arguments`): the cost model's verdict at every row count in `rows`
        (recorded in `decisions`)."""
        call = _call(arguments)
        out_bytes = node.meta["val"].shape[-1] * node.meta["val"].element_size()
        # SwiGLU: the ops read gate and up, and write half as much; the others read and write the output
        traffic = 1.5 * out_bytes if epilogue == "swiglu" else 2 * out_bytes
        unfused = Variant([call], torch_ops=1 if own_kernel else 0, bytes_per_row=traffic)
        fused = Variant([dataclasses.replace(call, epilogue=epilogue, residual=residual)])
        verdicts = [decide(unfused, fused, m) for m in rows]
        fuse = self.always or all(verdict.fuse for verdict in verdicts)
        self.decisions.append((epilogue if not residual else "residual", rows,
                               min(verdict.gain for verdict in verdicts), fuse))
        return fuse

    def _unfold_norms(self, graph: torch.fx.Graph) -> None:
        """Keep each norm prologue (the linear_epilogue calls normalizing one x with one norm) where the cost model
        says it wins over Inductor computing x̂; else compute x̂ in the graph once and drop the calls' norm."""
        groups, priced = {}, {}
        for node in graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.bitkern.linear_epilogue.default:
                arguments = _arguments(node)
                if arguments["norm"] != "none":
                    key = tuple(arguments[name] for name in ("x", "norm", "norm_weight", "norm_bias", "norm_eps"))
                    groups.setdefault(key, []).append((node, arguments))
        for (x, norm, norm_weight, norm_bias, eps), members in groups.items():
            calls = [_call(arguments) for _, arguments in members]
            rows, own_kernel = _rows(members[0][0]), not _is_pointwise(x)
            converted = any(isinstance(v, torch.fx.Node) and v.op not in ("placeholder", "get_attr")
                            for v in (norm_weight, norm_bias))
            key = (tuple(calls), rows, own_kernel, converted)
            if key not in priced:
                priced[key] = self._decide_norm(calls, rows, own_kernel, converted, x.meta["val"])
            if priced[key]:
                continue
            with graph.inserting_before(members[0][0]):
                normalized = _traced(graph, lambda h, weight, *bias: norm_reference(norm, h, weight,
                                                                                    bias[0] if bias else None, eps),
                                     [x, norm_weight, norm_bias])
            for node, _ in members:
                _set_arguments(node, x=normalized, norm="none", norm_weight=None, norm_bias=None)

    def _decide_norm(self, calls: list, rows: tuple, own_kernel: bool, converted: bool, x) -> bool:
        """Whether to keep a norm in its kernels' prologue: against the kernels without it after Inductor's x̂ (a
        kernel of its own unless x comes from a pointwise op; it writes x̂ and the kernels read it).  Kept, the
        norm's parameters cost a kernel of their own where the graph converts them to float32 (`FoldedNorm`)."""
        plain = [dataclasses.replace(call, norm="none") for call in calls]
        unfused = Variant(plain, torch_ops=int(own_kernel), bytes_per_row=2 * x.shape[-1] * x.element_size())
        normed = [dataclasses.replace(call, on_plain_kernel=True) for call in calls]
        verdicts = [decide(unfused, Variant(normed, torch_ops=int(converted)), m) for m in rows]
        keep = self.always or all(verdict.fuse for verdict in verdicts)
        self.decisions.append(("norm", rows, min(verdict.gain for verdict in verdicts), keep))
        return keep

    def uuid(self):
        """Inductor's cache key of the pass: its code, and bitkern's op schemas, which the graphs it compiles call
        (a C++ wrapper compiled against another schema reads its arguments wrongly: a crash)."""
        return get_hash_for_files((__file__, cost.__file__), extra=f"always={self.always}\n{schemas()}")


def _arguments(node) -> dict:
    """A linear or linear_epilogue call's arguments by name, defaults filled in."""
    return dict(normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs)


def _set_arguments(node, **values) -> None:
    """Set arguments of a call node by name where the call passes them (positionally or by keyword), and in the
    eager input values Inductor's layout constraints read (`eager_input_vals`, the same structure)."""
    names = [argument.name for argument in node.target._schema.arguments]

    def replaced(args, kwargs, value_of):
        args = [value_of(values[names[i]]) if names[i] in values else a for i, a in enumerate(args)]
        return tuple(args), {k: value_of(values[k]) if k in values else v for k, v in kwargs.items()}

    node.args, node.kwargs = replaced(node.args, node.kwargs, lambda value: value)
    if "eager_input_vals" in node.meta:
        node.meta["eager_input_vals"] = replaced(*node.meta["eager_input_vals"], lambda value: value.meta["val"]
                                                 if isinstance(value, torch.fx.Node) else value)


def _call(arguments: dict) -> Call:
    """The cost model's `Call` of a linear or linear_epilogue call (its `_arguments`)."""
    return Call(arguments["weight_format"], arguments["x"].meta["val"].dtype, arguments["output_dtype"],
                arguments["bias"] is not None, arguments.get("epilogue", "none"),
                arguments.get("residual") is not None, arguments.get("norm", "none"), arguments.get("norm_eps", 1e-6),
                activation_quant=arguments["activation_quant"])


def epilogue_kernel_calls(graph: torch.fx.Graph) -> list[KernelCall]:
    """The kernels of the graph's linear_epilogue calls (what a FusionPass left there), as `bitkern.prepare` takes
    them: an engine that runs the graph makes them ready at its token counts, as it does its layers' own."""
    calls = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.bitkern.linear_epilogue.default:
            arguments = _arguments(node)
            described = WeightFormat.decode(arguments["weight_format"])
            calls.append(KernelCall(_call(arguments).kernel_spec(), *described.shape, described.layout,
                                    arguments["x"].meta["val"].device))
    return list(dict.fromkeys(calls))


def _is_pointwise(node) -> bool:
    """Whether `node` is a pointwise aten op, or a view of one's output (Inductor fuses a following reduction over
    it into that op's kernel)."""
    while node.op == "call_function" and node.target in _RESHAPES:
        node = node.args[0]
    return node.op == "call_function" and torch.Tag.pointwise in getattr(node.target, "tags", ())


def _traced(graph: torch.fx.Graph, function, inputs: list):
    """The node of `function(*inputs)` (graph nodes; trailing Nones left out), traced to aten ops through
    Inductor's decompositions and copied into `graph` at its insertion point."""
    from torch._inductor.pattern_matcher import fwd_only

    while inputs and inputs[-1] is None:
        inputs = inputs[:-1]
    values = [node.meta["val"] for node in inputs]
    with torch._guards.detect_fake_mode(values) or contextlib.nullcontext():
        traced = fwd_only(function, values, run_functional_passes=False)
    placeholders = [node for node in traced.graph.nodes if node.op == "placeholder"]
    return graph.graph_copy(traced.graph, dict(zip(placeholders, inputs)))


def _match(node) -> tuple | None:
    """(epilogue, residual node or None, the nodes the fused call replaces, ending with the one whose value it
    takes) for the linear `node`, or None where no pattern matches."""
    silu = _silu_end(node)
    if silu is not None:
        return "silu", None, [*_between(node, silu), silu]
    if len(node.users) != 1:
        return None
    (user,) = node.users
    epilogue, residual = _epilogue_of(node, user)
    if epilogue is not None:
        return epilogue, residual, [user]
    chain = _swiglu_of(node)
    return None if chain is None else ("swiglu", None, chain)


def _epilogue_of(node, user) -> tuple:
    """(epilogue, residual node) that `user` applies to the linear `node`'s output, or (None, None)."""
    if user.target in _ACTIVATIONS and len(user.args) == 1 and user.kwargs.get("approximate", "none") == "none":
        return _ACTIVATIONS[user.target], None
    if user.target is _ADD and len(user.args) == 2 and user.kwargs.get("alpha", 1) == 1:
        other = user.args[1] if user.args[0] is node else user.args[0]
        if isinstance(other, torch.fx.Node) and other is not node and _same_shape(other, node):
            return "none", other
    return None, None


def _silu_end(node):
    """The node computing silu(node) as Inductor's decomposition writes it, node / (1 + exp(-node)) (or
    node · sigmoid(node)), in float32 between two conversions for a 16-bit node, when all of node's users belong
    to it; else None."""
    users = list(node.users)
    dtype = node.meta["val"].dtype
    if dtype != torch.float32 and len(users) == 1 and users[0].target is _CONVERT and users[0].args[1] == torch.float32:
        inner = _silu_end(users[0])
        back = inner and _only_user(inner, _CONVERT)
        return back if back is not None and back.args[1] == dtype else None
    targets = sorted(str(u.target) for u in users)
    if targets == ["aten.div.Tensor", "aten.neg.default"]:
        neg, div = sorted(users, key=lambda u: str(u.target), reverse=True)
        exp = _only_user(neg, aten.exp.default)
        add = exp and _only_user(exp, _ADD)
        if add and add.args == (exp, 1) and list(add.users) == [div] and div.args == (node, add):
            return div
    if targets == ["aten.mul.Tensor", "aten.sigmoid.default"]:
        sigmoid, mul = sorted(users, key=lambda u: str(u.target), reverse=True)
        if mul in sigmoid.users and set(mul.args) == {node, sigmoid}:
            return mul
    return None


def _only_user(node, target):
    """node's single user if it calls `target` with node as its first argument, else None."""
    users = list(node.users)
    return users[0] if len(users) == 1 and users[0].target is target and users[0].args[0] is node else None


def _swiglu_of(node) -> list | None:
    """The nodes, in order, by which the linear `node`'s output y (2n columns, rows in `swiglu_rows` order) becomes
    silu(gate) · up: unstack_swiglu (a reshape to [..., n/16, 2, 16], the swap of the last-but-two axes, a copy, a
    reshape back), the two halves, the silu of the first, the product; None unless all that is there, used by
    nothing else."""
    width = node.meta["val"].shape[-1]
    (split,) = node.users
    if split.target not in _RESHAPES or tuple(split.meta["val"].shape[-3:]) != (width // (2 * SWIGLU_BLOCK), 2,
                                                                              SWIGLU_BLOCK):
        return None
    rank = split.meta["val"].dim()
    swap = [*range(rank - 3), rank - 2, rank - 3, rank - 1]
    permute = _single_user(split)
    if permute is None or permute.target is not aten.permute.default or list(permute.args[1]) != swap:
        return None
    chain = [split, permute]
    following = _single_user(permute)
    if following is not None and following.target is aten.clone.default:
        chain.append(following)
        following = _single_user(following)
    if following is None or following.target not in _RESHAPES or following.meta["val"].dim() != node.meta["val"].dim() \
            or following.meta["val"].shape[-1] != width:
        return None
    chain.append(following)
    halves = sorted(following.users, key=lambda u: u.args[2] if len(u.args) > 2 else 0)
    last = following.meta["val"].dim() - 1
    if len(halves) != 2 or any(h.target is not aten.slice.Tensor or h.args[1] not in (-1, last) for h in halves):
        return None
    gate, up = halves
    half = width // 2
    if gate.args[2:] != (0, half) or up.args[2] != half or (len(up.args) > 3 and up.args[3] < width):
        return None
    silu = _silu_end(gate)
    if silu is None or len(silu.users) != 1:
        return None
    (product,) = silu.users
    if product.target is not aten.mul.Tensor or set(product.args) != {silu, up} or len(up.users) != 1:
        return None
    return [*chain, gate, up, *_between(gate, silu), silu, product]


def _single_user(node):
    return next(iter(node.users)) if len(node.users) == 1 else None


def _between(start, end) -> list:
    """The nodes strictly between `start` and `end` on the paths from one to the other (silu's inner ops)."""
    inner, stack = [], [u for u in start.users if u is not end]
    while stack:
        current = stack.pop()
        if current is end or current in inner:
            continue
        inner.append(current)
        stack.extend(current.users)
    return inner


def _same_shape(other, node) -> bool:
    mine, theirs = node.meta.get("val"), other.meta.get("val")
    return mine is not None and theirs is not None and theirs.shape == mine.shape and theirs.dtype == mine.dtype


def _rows(node) -> tuple:
    """The row counts M to decide the call at: its M, or for a graph traced with a dynamic M, one row and the size
    hint it was traced with."""
    shape = node.meta["val"].shape
    rows, dynamic = 1, False
    for size in shape[:-1]:
        dynamic = dynamic or not isinstance(size, int)
        rows *= size if isinstance(size, int) else (size.node.hint or 1)
    return (1, rows) if dynamic and rows > 1 else (rows,)


def _leaves_inductor(node) -> bool:
    """Whether `node` is something Inductor does not fuse a pointwise producer into (a custom op, the output)."""
    return node.op == "output" or (node.op == "call_function" and getattr(node.target, "namespace", None) == "bitkern")


def install() -> FusionPass:
    """Append a `FusionPass` to Inductor's post-grad custom passes (once; a pass already there stays) and return
    it."""
    from torch._inductor import config

    current = config.post_grad_custom_post_pass
    passes = [] if current is None else list(current) if isinstance(current, (list, tuple)) else [current]
    for existing in passes:
        if isinstance(existing, FusionPass):
            return existing
    fusion_pass = FusionPass()
    config.post_grad_custom_post_pass = [*passes, fusion_pass]
    return fusion_pass
