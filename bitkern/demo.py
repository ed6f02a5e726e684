"""`python -m bitkern demo`: a Llama-style transformer block in float, quantized with a few types; a table of
output error, weight memory and speed against the float block on the current device."""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from .nn import quantize_model
from .nn.prepare import prepare
from .nn.storage import QuantizedModule

DEFAULT_TYPES = ("int8", "int4", "nf4", "mxfp4")


class SwiGLU(nn.Module):
    """Llama's MLP: down(silu(gate(x)) · up(x)), no biases."""

    def __init__(self, dim: int = 4096, hidden: int = 11008):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class TransformerBlock(nn.Module):
    """A pre-norm decoder block: RMSNorm, causal multi-head self-attention, RMSNorm, SwiGLU MLP."""

    def __init__(self, dim: int = 1024, heads: int = 16, hidden: int = 2816):
        super().__init__()
        if dim % heads:
            raise ValueError(f"heads={heads} must divide dim={dim}")
        self.heads = heads
        self.attention_norm = nn.RMSNorm(dim)
        self.query, self.key, self.value, self.output = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.mlp_norm = nn.RMSNorm(dim)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        h = self.attention_norm(x)
        q, k, v = (proj(h).reshape(batch, tokens, self.heads, -1).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.output(attention.transpose(1, 2).reshape(batch, tokens, dim))
        return x + self.mlp(self.mlp_norm(x))


def run(dtypes=DEFAULT_TYPES, dim: int = 1024, heads: int = 16, hidden: int = 2816, tokens: int = 64,
        group_size: int | None = None, compute_dtype: torch.dtype = torch.bfloat16, device: str | None = None,
        seed: int = 0, seconds: float = 0.5) -> list[dict]:
    """Quantize one float block per type; return and print error, weight memory and speed vs float.

    Every kernel is prepared (tuned, built or loaded) before anything is timed; then one token (decoding) and
    `tokens` tokens (a prompt) are timed for about `seconds` per model and size, the models taking turns call
    by call so that drift in the machine's speed hits them all alike.
    """
    if tokens < 2:
        raise ValueError(f"tokens={tokens} must be at least 2 (one token is timed on its own)")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(seed)
    block = TransformerBlock(dim, heads, hidden).to(device).eval()
    inputs = {n: torch.randn(1, n, dim, device=device) for n in (1, tokens)}
    half_inputs = {n: t.bfloat16() for n, t in inputs.items()}
    models = [("float32", None, block, inputs), ("bfloat16", None, copy.deepcopy(block).to(torch.bfloat16), half_inputs)]
    for name in dtypes:
        quantized = quantize_model(copy.deepcopy(block), name, group_size=group_size, compute_dtype=compute_dtype)
        layer = next(m for m in quantized.modules() if isinstance(m, QuantizedModule))
        models.append((name, layer.group_size, quantized, inputs))
    with torch.no_grad():
        for _, _, model, sizes in models:
            if any(isinstance(m, QuantizedModule) for m in model.modules()):
                prepare(model, tokens=list(sizes), dtype=inputs[1].dtype)
        x = inputs[tokens]
        update = block(x) - x
        times = _interleaved_seconds(models, seconds)
        rows = [{"dtype": name, "group": group, "weight_bytes": _weight_bytes(model),
                 "error": float((model(sizes[tokens]).float() - x - update).norm() / update.norm()),
                 **{f"ms_{n}": 1e3 * times[name, n] for n in sizes}}
                for name, group, model, sizes in models]
    _print(rows, dim, heads, hidden, tokens, compute_dtype, device)
    return rows


def _weight_bytes(model: nn.Module) -> int:
    """Bytes of the Linear weights: the float ones, or the quantized ones' codes and scales."""
    return sum(m.nbytes if isinstance(m, QuantizedModule) else m.weight.numel() * m.weight.element_size()
               for m in model.modules() if isinstance(m, (nn.Linear, QuantizedModule)))


def _interleaved_seconds(models, seconds: float) -> dict:
    """Median seconds per call of every (model name, size), timed in rounds of one call each."""
    calls = [(name, n, model, x) for name, _, model, sizes in models for n, x in sizes.items()]
    samples = {(name, n): [] for name, n, _, _ in calls}
    deadline = time.perf_counter() + seconds * len(calls)
    rounds = 0
    while rounds < 5 or (time.perf_counter() < deadline and rounds < 200):
        for name, n, model, x in calls:
            samples[name, n].append(_seconds(model, x))
        rounds += 1
    return {key: statistics.median(values) for key, values in samples.items()}


def _seconds(model, x) -> float:
    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    model(x)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _print(rows, dim, heads, hidden, tokens, compute_dtype, device) -> None:
    base, half = rows[0], rows[1]
    print(f"bitkern demo: transformer block dim={dim} heads={heads} SwiGLU hidden={hidden} on {device}; "
          f"quantized layers compute in {str(compute_dtype).removeprefix('torch.')}")
    print(f"{'dtype':<10}{'group':>6}{'weights':>11}{'vs fp32':>9}{'error':>10}"
          f"{'1 token':>11}{'x fp32':>8}{'x bf16':>8}{f'{tokens} tokens':>12}{'x fp32':>8}{'x bf16':>8}")
    for r in rows:
        error = f"{r['error']:.2e}"
        print(f"{r['dtype']:<10}{r['group'] or '-':>6}{r['weight_bytes'] / 2**20:>7.1f} MiB"
              f"{base['weight_bytes'] / r['weight_bytes']:>8.2f}x{error:>10}"
              + "".join(f"{r[k]:>8.2f} ms{base[k] / r[k]:>8.2f}{half[k] / r[k]:>8.2f}"
                        for k in ("ms_1", f"ms_{tokens}")))
    print("error: relative L2 error of the block's update (output - input) vs float32; x fp32 / x bf16: speed-up "
          "over the float32 / bfloat16 block (above 1: faster); weights: the Linear layers' storage.")
