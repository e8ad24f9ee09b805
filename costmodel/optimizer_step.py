"""The optimizer step's time on one rank (no offload).

Model: one memory-bound pass over the state the step reads and writes, times the device's measured
factor for the optimizer at the run's precision:

    B     = E * (2 w + g + 2 s)                          `optimizer_step_bytes`
    t_opt = k[optimizer/precision](B) * B / (W * e_mem(B))   `optimizer_step_time`

- E: parameter elements the rank updates (its shard under ZeRO >= 1);
- w, g, s: bytes per element of the weights (read and written), the gradient (read) and the optimizer
  state (read and written), from `costmodel.memory` (WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES;
  adafactor: 4);
- W, e_mem: the device's memory bandwidth and its `memory_efficiency` at B;
- k: the device's `optimizer_factors` (`soap calibrate` times torch's optimizer on this machine, as the
  executor builds it, and divides by the same estimate); 1 where the profile has none. On a GPU the
  fused AdamW is about one pass; on a CPU torch's foreach AdamW runs a dozen elementwise passes
  (lerp, mul, addcmul, sqrt, div, add, addcdiv, ...), several times the one-pass estimate.

fp16 adds the GradScaler's unscale before the step (`executor.precision`: torch's GradScaler, or
ShardedGradScaler over the rank's shard): one fused pass (`_amp_foreach_non_finite_check_and_unscale_`)
that reads and writes every gradient the rank steps, E * 2 g bytes at the device's plain memory speed
(`grad_unscale_bytes`; not scaled by k, which `soap calibrate` measures on the optimizer alone).
"""

from __future__ import annotations

from costmodel.profiles import DeviceProfile


def optimizer_step_bytes(elements: float, *, precision: str, optimizer: str) -> float:
    """Bytes one optimizer step reads and writes over `elements` parameters (B above)."""
    from costmodel.memory import GRAD_BYTES, OPTIMIZER_BYTES, WEIGHT_BYTES

    state = OPTIMIZER_BYTES.get(optimizer, 4)  # adafactor: a few bytes per element at most
    return elements * (2 * WEIGHT_BYTES[precision] + GRAD_BYTES[precision] + 2 * state)


def grad_unscale_bytes(elements: float, *, precision: str) -> float:
    """Bytes the fp16 GradScaler's unscale reads and writes over `elements` gradients (0 at other precisions)."""
    from costmodel.memory import GRAD_BYTES

    return 2 * elements * GRAD_BYTES[precision] if precision == "fp16" else 0.0


def optimizer_factor(device: DeviceProfile, *, optimizer: str, precision: str, nbytes: float) -> float:
    """The device's measured factor k for `optimizer` at `precision` (1 where it has none)."""
    curve = device.optimizer_factors.get(f"{optimizer}/{precision}")
    return 1.0 if curve is None else curve.at(nbytes)


def memory_pass_time(device: DeviceProfile, nbytes: float) -> float:
    """One memory-bound pass over `nbytes` at the device's bandwidth and efficiency."""
    return nbytes / (device.memory_bandwidth * device.memory_efficiency.at(max(nbytes, 1.0))) if nbytes > 0 else 0.0


def optimizer_step_time(device: DeviceProfile, elements: float, *, precision: str, optimizer: str) -> float:
    """t_opt above, plus fp16's unscale pass: the step over `elements` parameters on one rank, computing alone."""
    nbytes = optimizer_step_bytes(elements, precision=precision, optimizer=optimizer)
    step = optimizer_factor(device, optimizer=optimizer, precision=precision, nbytes=nbytes) * memory_pass_time(device, nbytes)
    return step + memory_pass_time(device, grad_unscale_bytes(elements, precision=precision))
