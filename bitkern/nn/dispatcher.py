"""bitkern's ops on torch's dispatcher (torch.library) with one Python call per plain call.

`torch.library.custom_op` runs two Python kernels per call (its autograd wrapper, then the body, with an alias
check), ~20 µs at M=1 on Zen 4: more than a small layer's kernel, and paid by every op of a compiled graph. `op`
defines the same thing (schema from the type hints, fake implementation, autograd formula), but its Autograd
kernel runs the body itself when nothing needs it below: plain CPU/CUDA tensors, no dispatch mode, nothing for
autograd to record. Everything else (tracing, fake and meta tensors, functionalization, inputs that need
gradients) takes the dispatcher's usual way."""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

_LIBRARY = torch.library.Library("bitkern", "FRAGMENT")  # the namespace's other ops are defined elsewhere too
SCHEMAS: dict[str, str] = {}  # op name -> its schema, as defined here


def schemas() -> str:
    """Every op's schema defined here, one per line: what a compiled graph's C++ wrapper calls them by, so a graph
    compiled against other schemas (an older bitkern) must not be reused (`fusion.inductor.FusionPass.uuid`)."""
    return "\n".join(f"{name}{schema}" for name, schema in sorted(SCHEMAS.items()))


class Op:
    """A defined op (`torch.ops.bitkern.<name>`): calling it calls the op; `register_fake` and
    `register_autograd` take what `torch.library.custom_op`'s methods of those names take."""

    def __init__(self, name: str, body):
        self.name, self.body = name, body
        SCHEMAS[name] = torch.library.infer_schema(body, mutates_args=())
        _LIBRARY.define(name + SCHEMAS[name], tags=(torch.Tag.pt2_compliant_tag,))
        self.overload = getattr(getattr(torch.ops.bitkern, name), "default")
        self.register_autograd(self._no_backward, lambda ctx, inputs, output: None)
        _LIBRARY.impl(name, body, "CompositeExplicitAutograd")
        _LIBRARY.impl(name, self._autograd_kernel, "Autograd", with_keyset=True)
        self.__doc__, self.__wrapped__ = body.__doc__, body
        self.defaults = [parameter.default for parameter in inspect.signature(body).parameters.values()]

    def __call__(self, *args, **kwargs):
        return self.overload(*args, **kwargs)

    def register_fake(self, fake):
        torch.library.register_fake(f"bitkern::{self.name}", fake, lib=_LIBRARY)
        return fake

    def register_autograd(self, backward, setup_context) -> None:
        """Gradients by `backward(ctx, grad)` from what `setup_context(ctx, inputs, output)` kept."""
        overload = self.overload

        def forward(ctx, *args):
            with torch._C._AutoDispatchBelowAutograd():
                output = overload(*args)
            setup_context(ctx, args, output)
            return output

        self.function = type(f"Backward_{self.name}", (torch.autograd.Function,),
                             {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    def _no_backward(self, ctx, *grads):
        raise RuntimeError(f"torch.ops.bitkern.{self.name} has no gradient (it is for inference only)")

    def _autograd_kernel(self, keyset, *args):
        """The op at the Autograd key: the body itself for plain calls, else autograd's record or the keys below."""
        grad_enabled = torch.is_grad_enabled()
        if _plain(args, grad_enabled):
            return self.body(*args)
        if grad_enabled and _requires_grad(args):
            return self.function.apply(*args, *self.defaults[len(args):])  # the dispatcher leaves out defaults
        with torch._C._AutoDispatchBelowAutograd():
            return self.overload.redispatch(keyset & torch._C._after_autograd_keyset, *args)


def op(name: str):
    """Decorator: `torch.ops.bitkern.<name>` with the decorated function as its body (for any device; inputs and
    output typed as `torch.library.custom_op` takes them)."""
    return lambda body: Op(name, body)


def _tensors(args) -> list:
    """The tensors among op arguments, and in their lists."""
    tensors = []
    for argument in args:
        if isinstance(argument, Tensor):
            tensors.append(argument)
        elif type(argument) is list:
            tensors.extend(item for item in argument if isinstance(item, Tensor))
    return tensors


def _requires_grad(args) -> bool:
    return any(tensor.requires_grad for tensor in _tensors(args))


def _plain(args, grad_enabled: bool) -> bool:
    """Whether the body may run at the Autograd key: plain tensors with real data, none that autograd must record
    (with `grad_enabled`), and no dispatch mode.  One loop: it runs on every call."""
    for argument in args:
        for tensor in (argument if type(argument) is list else (argument,)):
            if isinstance(tensor, Tensor) and (type(tensor) is not Tensor or tensor.is_meta
                                               or (grad_enabled and tensor.requires_grad)):
                return False
    return not torch._C._len_torch_dispatch_stack()
