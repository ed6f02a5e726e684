"""The torch.compile path: an Inductor post-grad pass that folds the elementwise op after a bitkern linear — a
residual add, ReLU/SiLU/GELU — into the kernel's epilogue (`torch.ops.bitkern.linear_epilogue`), where the cost
model says it wins.

Inductor fuses nothing into custom ops, but it does fuse pointwise ops with each other: an add whose result feeds
another pointwise or reduction op (a residual add before an RMSNorm) costs no kernel of its own once compiled, so
the cost model prices its fusion by the bytes alone (and keeps it when that is below the margin); an op whose
result goes only to bitkern kernels or out of the graph is a kernel of its own, and folding it saves it.
`install()` appends the pass to `torch._inductor.config.post_grad_custom_post_pass` (a list: a user's pass
stays)."""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .cost import Call, Variant, decide

_ACTIVATIONS = {torch.ops.aten.relu.default: "relu", torch.ops.aten.silu.default: "silu",
                torch.ops.aten.gelu.default: "gelu"}
_ADD = torch.ops.aten.add.Tensor


class FusionPass(CustomGraphPass):
    """Rewrites `bitkern::linear -> add(·, residual)` and `bitkern::linear -> relu/silu/gelu` (the linear's only
    user) into one `bitkern::linear_epilogue` call where the cost model fuses; `decisions` lists what it decided
    (pattern, rows, modeled gain, fused) for each match of the last graphs it ran on."""

    def __init__(self):
        self.decisions = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        priced = {}  # repeated layers: one decision per signature
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not torch.ops.bitkern.linear.default:
                continue
            if len(node.users) != 1:
                continue
            (user,) = node.users
            epilogue, residual = _epilogue_of(node, user)
            if epilogue is None:
                continue
            x, weight, weight_format, bias, output_dtype = node.args
            rows = _rows(node)
            own_kernel = all(_leaves_inductor(u) for u in user.users)
            key = (weight_format, x.meta["val"].dtype, output_dtype, bias is not None, epilogue, residual is not None,
                   rows, own_kernel)
            if key not in priced:
                call = Call(weight_format, x.meta["val"].dtype, output_dtype, bias is not None)
                out_bytes = node.meta["val"].shape[-1] * node.meta["val"].element_size()
                unfused = Variant([call], torch_ops=1 if own_kernel else 0, bytes_per_row=2 * out_bytes)
                fused = Variant([Call(weight_format, call.activation, output_dtype, bias is not None, epilogue,
                                      residual is not None)])
                priced[key] = decide(unfused, fused, rows)
                self.decisions.append((epilogue if residual is None else "residual", rows, priced[key].gain,
                                       priced[key].fuse))
            if not priced[key].fuse:
                continue
            with graph.inserting_before(user):
                fused_node = graph.call_function(torch.ops.bitkern.linear_epilogue.default,
                                                 (x, weight, weight_format, bias, output_dtype, epilogue, residual))
            fused_node.meta.update(user.meta)
            user.replace_all_uses_with(fused_node)
            graph.erase_node(user)
            graph.erase_node(node)

    def uuid(self):
        return get_hash_for_files((__file__,))


def _epilogue_of(node, user) -> tuple:
    """(epilogue, residual node) that `user` applies to the linear `node`'s output, or (None, None)."""
    if user.target in _ACTIVATIONS and len(user.args) == 1 and user.kwargs.get("approximate", "none") == "none":
        return _ACTIVATIONS[user.target], None
    if user.target is _ADD and len(user.args) == 2 and user.kwargs.get("alpha", 1) == 1:
        other = user.args[1] if user.args[0] is node else user.args[0]
        if isinstance(other, torch.fx.Node) and other is not node and _same_shape(other, node):
            return "none", other
    return None, None


def _same_shape(other, node) -> bool:
    mine, theirs = node.meta.get("val"), other.meta.get("val")
    return mine is not None and theirs is not None and theirs.shape == mine.shape and theirs.dtype == mine.dtype


def _rows(node) -> int:
    """M of the call (a size hint where it is symbolic)."""
    shape = node.meta["val"].shape
    rows = 1
    for size in shape[:-1]:
        rows *= size if isinstance(size, int) else (size.node.hint or 1)
    return rows


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
