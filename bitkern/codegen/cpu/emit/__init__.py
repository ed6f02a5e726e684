"""The TIR emitters of the CPU templates, written with TVM's IR builder (importing them imports TVM; the template
objects in `bitkern.codegen.cpu` import them when they build a kernel): `tile16.Tile16Builder`, the base the AMX
(`amx`) and AVX512-BF16 (`dot`) kernels share; the lookup kernel (`lut`); what the
three do with non-finite activations (`nonfinite`); helpers (`tir`, `groups`)."""
