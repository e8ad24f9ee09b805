"""Calibration from runs: refit a profile's efficiency terms from measured training steps.

Model. The simulated step time of run i splits (approximately linearly) into four parts:

    T_i = C_i + K_i + M_i + A_i

- C_i: compute (FLOP- and memory-bound kernel time, bubbles and the optimizer step included),
- K_i: kernel launch overhead (number of kernels x `kernel_overhead_us`),
- M_i: exposed gradient, parameter and pipeline communication (collective and transfer time on the
  critical path),
- A_i: exposed activation collectives (TP / SP / CP / EP: synchronous, one per region).
The parts are measured on the simulator itself (`executor.validation.refit.step_parts`: the step with
the overhead zeroed, with the activation collectives made free, and with all communication made free).
A measured step m_i is modelled as

    m_i ~= a C_i + b K_i + c M_i + d A_i,    a, b, c, d > 0,

and the multipliers minimize the squared log ratios plus a weak pull toward 1 (so a term that no run
exercises stays where it was):

    min_theta  sum_i (log(sum_j e^theta_j F_ij) - log m_i)^2 + lambda sum_j theta_j^2,   theta = log(a, b, c, d)

solved by damped Gauss-Newton (`fit_multipliers`, pure numpy), each theta_j kept inside its term's
physical bounds (`PHYSICAL_BOUNDS`):

    compute                  [1/4, 4]    the rates come from microbenchmarks (or published tables) of the same
                                         kernels; a step 4x off them is work the simulator does not see
    kernel launch            [1/10, 10]  a launch costs microseconds to tens of microseconds on every device
    communication            [1/10, 10]  link bandwidths and latencies from datasheets or nccl-tests
    activation collectives   [1/10, 100] synchronous TP/CP/EP collectives wait for the slowest rank, which a
                                         host-thread transport (gloo) can stretch by tens of times

A multiplier that ends at its bound (`Multipliers.at_bound`) is not a calibration: the runs need a
factor no device explains, so the model misses something there (a kernel class it does not price,
contention it does not simulate). The fit keeps the bound, `soap calibrate --from-runs` names the term
and says so, and no profile gets a factor such as "kernel launch x31.8" written into it.

Applying them (`apply_multipliers`) is exact for each term: every device rate (peak FLOP/s at every
precision, memory bandwidth) is divided by a, `kernel_overhead_us` multiplied by b, and every link's
bandwidth divided and latency multiplied by c (each collective's time is latency plus bytes over
bandwidth), and the device's per-call framework overhead (`collective_call_overhead_us`) multiplied by c;
the activation collectives ride the same links, so the device's `activation_collective_factor` is
multiplied by d / c.
Each changed number gets a source naming the runs log and the date.

Allocator reserve (`fit_allocator_reserve`). PyTorch's caching allocator reserves more device memory than
its live tensors hold (fragmentation, per-stream pools); CUDA runs out when the reserved bytes reach the
device's. Runs that report both peaks (CUDA's `max_memory_allocated` a_i and `max_memory_reserved` r_i
over the same window), less the segment of the loss's largest fp32 transient T_i that the allocator keeps
(`costmodel.memory_activations.loss_transient`: the fp32 logits under the upcast loss, one slice under the
chunked one; 0 for a run without a plan), give the rest of the device's reserve as a fraction of the
allocated peak:

    f = median_i ((r_i - a_i - T_i) / a_i),   clamped to [0, MAX_ALLOCATOR_RESERVE]

(the median: one run with a fragmented cache must not move it), so that predicted reserved memory is
allocated x (1 + f) + T (`costmodel.memory.reserve_bytes`). On soap's 19 lent-GPU runs the transient alone
predicts the reserved peak within 2.1% on average, f about 0 (`benchmarks/allocator_reserve.py`).
"""

from __future__ import annotations

import copy
import datetime
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from costmodel.profiles_json import MAX_ALLOCATOR_RESERVE, MAX_STEP_FACTOR
from tracer.errors import SoapError

TERMS = ("compute", "kernel_overhead", "communication", "activation_communication")
PRIOR_WEIGHT = 1e-6
PHYSICAL_BOUNDS: dict[str, tuple[float, float]] = {
    "compute": (0.25, 4.0),
    "kernel_overhead": (0.1, 10.0),
    "communication": (0.1, 10.0),
    "activation_communication": (0.1, 100.0),
}
"""The range a fitted multiplier may take per term (module docstring): beyond it the model is wrong."""
TERM_NAMES = {"compute": "compute", "kernel_overhead": "kernel launch", "communication": "communication",
              "activation_communication": "activation collectives"}


@dataclass(frozen=True)
class StepParts:
    """One run: its simulated step split into the three terms, and what was measured."""

    compute_s: float
    kernel_overhead_s: float
    communication_s: float
    measured_s: float
    activation_communication_s: float = 0.0

    @property
    def features(self) -> tuple[float, float, float, float]:
        return (self.compute_s, self.kernel_overhead_s, self.communication_s, self.activation_communication_s)


@dataclass(frozen=True)
class Multipliers:
    """Measured/predicted factors per term (1.0: the profile was right)."""

    compute: float = 1.0
    kernel_overhead: float = 1.0
    communication: float = 1.0
    activation_communication: float = 1.0
    at_bound: tuple[str, ...] = ()
    """Terms whose fit ended at a bound of `PHYSICAL_BOUNDS`: the runs asked for more (module docstring)."""

    def bound_note(self) -> str | None:
        """One line naming the terms at their bounds, or None."""
        if not self.at_bound:
            return None
        terms = ", ".join(f"{TERM_NAMES[t]} x{self.as_dict()[t]:.3g}" for t in self.at_bound)
        return (f"at the physical bound: {terms}; the runs ask for more than any device explains, so the cost "
                "model misses time there (kept at the bound, not written beyond it)")

    def as_dict(self) -> dict[str, float]:
        return {"compute": self.compute, "kernel_overhead": self.kernel_overhead, "communication": self.communication,
                "activation_communication": self.activation_communication}

    def predict(self, parts: StepParts) -> float:
        return self.compute * parts.compute_s + self.kernel_overhead * parts.kernel_overhead_s + \
            self.communication * parts.communication_s + \
            self.activation_communication * parts.activation_communication_s


def fit_multipliers(runs: Sequence[StepParts], *, iterations: int = 100) -> Multipliers:
    """Least squares on log ratios (see the module docstring)."""
    if not runs:
        raise SoapError("no runs to fit; run `soap validate` or `soap execute` first to fill the runs log")
    if any(r.measured_s <= 0 for r in runs):
        raise SoapError("a run has a non-positive measured step time; remove it from the runs log")
    features = np.array([r.features for r in runs], dtype=float)
    target = np.log(np.array([r.measured_s for r in runs], dtype=float))
    theta = np.zeros(len(TERMS))
    low = np.log([PHYSICAL_BOUNDS[t][0] for t in TERMS])
    high = np.log([PHYSICAL_BOUNDS[t][1] for t in TERMS])
    damping = 1e-3
    prior = np.sqrt(PRIOR_WEIGHT)

    def residuals(t: np.ndarray) -> np.ndarray:
        predicted = features @ np.exp(t)
        return np.concatenate([np.log(np.maximum(predicted, 1e-300)) - target, prior * t])

    cost = float(residuals(theta) @ residuals(theta))
    for _ in range(iterations):
        weights = features * np.exp(theta)
        share = weights / np.maximum(weights.sum(axis=1, keepdims=True), 1e-300)
        jac = np.vstack([share, prior * np.eye(len(TERMS))])
        r = residuals(theta)
        step = np.linalg.solve(jac.T @ jac + damping * np.eye(len(TERMS)), -jac.T @ r)
        trial = np.clip(theta + step, low, high)
        trial_cost = float(residuals(trial) @ residuals(trial))
        if trial_cost < cost:
            theta, cost, damping = trial, trial_cost, damping / 3
            if np.abs(step).max() < 1e-9:
                break
        else:
            damping *= 10
    a, b, c, d = np.exp(theta)
    bound = tuple(t for t, x, lo, hi in zip(TERMS, theta, low, high) if x <= lo + 1e-9 or x >= hi - 1e-9)
    return Multipliers(compute=float(a), kernel_overhead=float(b), communication=float(c),
                       activation_communication=float(d), at_bound=bound)


def apply_multipliers(cluster_inline: dict, m: Multipliers, *, source: str) -> dict:
    """A copy of an inline cluster profile (cluster JSON with its device under "device") refitted by `m`."""
    out = copy.deepcopy(cluster_inline)
    stamp = f"{source}, {datetime.date.today().isoformat()}"
    device = out["device"]
    for entry in device["peak_tflops"].values():
        scale_entry(entry, 1 / m.compute, stamp)
    scale_entry(device["memory_bandwidth_gbps"], 1 / m.compute, stamp)
    scale_entry(device["kernel_overhead_us"], m.kernel_overhead, stamp)
    if "collective_call_overhead_us" in device:
        scale_entry(device["collective_call_overhead_us"], m.communication, stamp)
    for link in out["links"].values():
        scale_entry(link["bandwidth_gbps"], 1 / m.communication, stamp)
        scale_entry(link["latency_us"], m.communication, stamp)
    if m.activation_communication != m.communication or "activation_collective_factor" in device:
        device.setdefault("activation_collective_factor", {"value": 1.0, "source": "activation collectives"})
        entry = device["activation_collective_factor"]
        scale_entry(entry, m.activation_communication / m.communication, stamp)
        # runs that no model explains can drive the ratio past the loader's bound: it saturates there
        entry["value"] = min(max(entry["value"], 1 / MAX_STEP_FACTOR), MAX_STEP_FACTOR)
    return out


def scale_entry(entry: dict, factor: float, source: str) -> None:
    """Multiply a profile entry `{"value", "source"}` by `factor`, its source saying so; a refit replaces an
    earlier refit's note instead of stacking another."""
    entry["value"] = float(f"{entry['value'] * factor:.4g}")
    entry["source"] = f"{entry['source']}; x{factor:.3g} {source}" if "refit" not in entry["source"] else \
        f"{entry['source'].split('; x')[0]}; x{factor:.3g} {source}"


def fit_allocator_reserve(peaks: Sequence[tuple[float, ...]]) -> float:
    """The allocator reserve fraction from (allocated, reserved) peak pairs, or (allocated, reserved, loss
    transient) triples whose transient is taken off first (see the module docstring)."""
    ratios = [(peak[1] - peak[0] - (peak[2] if len(peak) > 2 else 0.0)) / peak[0]
              for peak in peaks if peak[0] > 0 and peak[1] > 0]
    if not ratios:
        raise SoapError("no run reports both max_memory_allocated and max_memory_reserved; run `soap validate "
                        "--device cuda` or `soap execute` on CUDA to record some")
    return min(max(statistics.median(ratios), 0.0), MAX_ALLOCATOR_RESERVE)
