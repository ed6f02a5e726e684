"""A toy CPU template: what adding one takes (docs/architecture.md).  This one file is the whole template; in
bitkern it would be bitkern/codegen/cpu/toy.py plus "toy" in the registry line of bitkern/codegen/cpu/__init__.py.

It computes the Matmul tensor expression (`bitkern.ops.expr`) on the tile16 layout with the plainest schedule:
`columns` output columns per parallel task, everything else left to LLVM.
"""

from dataclasses import dataclass

from bitkern.codegen.cpu.kernel import CpuTemplate, Footprint, operand_bytes
from bitkern.codegen.cpu.layout import Tile16Storage
from bitkern.codegen.template import Work
from bitkern.ops.expr import matmul_expr


@dataclass(frozen=True)
class ToyConfig:
    columns: int = 16  # output columns per parallel task


class ToyTemplate(CpuTemplate):
    name = "toy"
    title = "toy"
    config_type = ToyConfig
    exact_buffers = False  # a tensor expression: TVM compacts its buffers

    def unsupported(self, spec, n, k, device):
        return "int8 activations (it sums in float32)" if spec.activation_dtype == "int8" else None

    def configs(self, spec, n, k, bucket, device, hint):
        return [ToyConfig(columns) for columns in (16, 64) if n % columns == 0] or [ToyConfig(n)]

    def resources(self, spec, k, config):
        return Footprint()

    def work(self, spec, n, k, m, config, device):
        """Every weight decoded once and M rows of multiply-adds, counted as the generic template's vector
        operations (whose prices the tuner has), a task per `columns` columns."""
        lanes = device.vector_bytes // 4
        operations = {"generic_decode_vector": n * k / lanes, "generic_fma_vector": n * k * m / lanes}
        return Work(max(1, n // config.columns), operand_bytes(spec, n, k, m), operations)

    def program(self, spec, n, k, config, layout, bucket, device):
        from tvm import s_tir, te

        self.check_config(config)
        expr = matmul_expr(spec, n, k, Tile16Storage(spec, n, k))
        sch = s_tir.Schedule(te.create_prim_func([*expr.inputs, expr.output]).with_attr("global_symbol", "main"))
        _, columns, _ = sch.get_loops(sch.get_sblock("acc"))
        tasks, _ = sch.split(columns, [None, config.columns])
        sch.parallel(tasks)
        return sch.mod["main"], []


TEMPLATE = ToyTemplate()
