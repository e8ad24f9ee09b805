"""Price each candidate on the graph of the precision regime it runs in.

A 16-bit run is not one regime (executor/precision.py, executor/data_parallel.py):
- bf16 under FSDP (a data-parallel group of zero 2/3, or zero 0/1 beside tp or pp, or optimizer
  offload, which FSDP2's CPUOffloadPolicy runs): bf16 parameters
  through MixedPrecisionPolicy and no autocast, so nearly every tensor is bf16 (the `bfloat16` trace);
- bf16 otherwise, and fp16 always: fp32 parameters under CUDA autocast, where norms, the GELU's pow,
  the residual stream and the loss stay fp32 (the `autocast-bfloat16`/`autocast-float16` trace);
- fp32, tf32 and fp8: the fp32 trace (fp8's 16-bit activations are the fp32 trace rescaled);
- another stack's 16-bit model (`TrainingConfig.half_model`: Megatron-LM's and DeepSpeed's fp16): the
  `float16`/`bfloat16` trace, no autocast; its fp8 runs too (Megatron-Core's fp8 holds a bf16 model).
The autocast trace emulates CUDA's autocast lists; CPU autocast has others (layer_norm stays bf16), so
on a CPU device profile (its name says cpu) an autocast run keeps the fp32 trace at 16 bits, as before.
`regime_dtype` picks the trace dtype (`tracer.autocast.trace_dtype_for`); `RegimeEstimator` keeps one
`Estimator` per trace dtype, tracing each regime the first time a candidate needs it (the tracer's
caches make that once per process, and once on disk for a named model), and dispatches each estimate,
stage partition and simulation to the candidate's own.

With a graph given by the caller (no model to trace again), every candidate is priced on that graph.
"""

from __future__ import annotations

from collections.abc import Callable

from costmodel.profiles import DeviceProfile
from costmodel.strategy import ParallelDims, Strategy, TrainingConfig
from planner.estimate import Estimate, Estimator
from planner.space import MeshChoice
from planner.units import model_units
from tracer.autocast import is_autocast, trace_dtype_for
from tracer.ir import OpGraph


def runs_fsdp(dims: ParallelDims, zero: int, offload_optimizer: bool) -> bool:
    """Whether the executor wraps the model in FSDP2 (`executor.data_parallel.uses_fsdp`): optimizer
    offload always does (CPUOffloadPolicy), and a data-parallel group of zero 2/3 or beside tp or pp."""
    if offload_optimizer:
        return True
    if dims.dp * dims.cp == 1:
        return False
    return zero >= 2 or dims.tp > 1 or dims.pp > 1


def regime_dtype(dims: ParallelDims, train: TrainingConfig, device: DeviceProfile) -> str:
    if train.half_model and train.precision in ("fp16", "bf16", "fp8"):  # another stack's 16-bit model, no autocast
        return "float16" if train.precision == "fp16" else "bfloat16"
    fsdp = runs_fsdp(dims, train.zero, train.offload_optimizer)
    return _on_device(trace_dtype_for(train.precision, fsdp), device)


def _on_device(dtype: str, device: DeviceProfile) -> str:
    return "float32" if is_autocast(dtype) and "cpu" in device.name.lower() else dtype


class RegimeEstimator:
    """`Estimator`'s interface over one graph per precision regime (see the module docstring)."""

    def __init__(self, graph: OpGraph, estimator: Estimator, trace: Callable[..., OpGraph] | None) -> None:
        """`trace(dtype=...)` traces the model at a trace dtype; None prices everything on `graph`."""
        self.base, self.trace, self.device = graph, trace, estimator.cluster.device
        self.units = estimator.units
        self._graphs: dict[str, OpGraph] = {"float32": graph}
        self._estimators: dict[str, Estimator] = {"float32": estimator}

    def graph(self, dtype: str) -> OpGraph:
        if self.trace is None:
            return self.base
        if dtype not in self._graphs:
            self._graphs[dtype] = self.trace(dtype=dtype)
        return self._graphs[dtype]

    def for_dtype(self, dtype: str) -> Estimator:
        if self.trace is None:
            return self._estimators["float32"]
        if dtype not in self._estimators:
            graph = self.graph(dtype)
            units = model_units(graph)
            if [u.id for u in units] != [u.id for u in self.units]:
                raise AssertionError(f"the {dtype} trace has other units than the fp32 trace")
            base = self._estimators["float32"]
            self._estimators[dtype] = Estimator(graph, base.cluster, units)
        return self._estimators[dtype]

    def for_strategy(self, strategy: Strategy) -> Estimator:
        return self.for_dtype(regime_dtype(strategy.dims, strategy.train, self.device))

    def graph_for(self, strategy: Strategy) -> OpGraph:
        return self.graph(regime_dtype(strategy.dims, strategy.train, self.device))

    def estimate(self, mesh: MeshChoice, train: TrainingConfig) -> Estimate:
        return self.for_dtype(regime_dtype(mesh.dims, train, self.device)).estimate(mesh, train)

    def time_floor(self, mesh: MeshChoice, mb: int, num_microbatches: int, grad_accum: int, precision: str,
                   bubble_factor: float, compile: bool = False, cross_entropy: str = "chunked") -> float:
        """The smaller floor of the regimes the mesh runs `precision` in, with and without offload."""
        dtypes = {_on_device(trace_dtype_for(precision, runs_fsdp(mesh.dims, mesh.zero, offload)), self.device)
                  for offload in (False, True)}
        return min(self.for_dtype(d).time_floor(mesh, mb, num_microbatches, grad_accum, precision, bubble_factor,
                                                compile, cross_entropy) for d in dtypes)
