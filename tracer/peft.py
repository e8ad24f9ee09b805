"""PEFT settings and the model transform they name: LoRA adapters (and QLoRA's 4-bit base) on a model.

A `PeftSpec` is part of what is trained, like the config: the tracer traces the model with its adapters
injected (`apply_lora`, peft's `inject_adapter_in_model`, which keeps every module FQN and marks only the
adapters trainable), so the graph carries what the cost model prices:
- frozen base weights (`ParamMeta.trainable=False`): no gradient, no optimizer state;
- a frozen linear's backward computes its input gradient only (tracer.oprules: a contraction's
  backward costs a forward per operand that needs grad) and saves no input for a weight gradient;
- each adapter's two matmuls, x @ A^T ([tokens, r]) and (.) @ B^T, with their parameters
  (r x (in + out) per target), the tensors autograd saves for them (x, unless an earlier op saved it,
  and the [tokens, r] product; a dropout's output and mask when lora_dropout > 0) and their FLOPs;
- QLoRA: the target linears' base weights are NF4 (`QLORA_BASE_DTYPE`, priced by
  `costmodel.peft`), since bitsandbytes cannot quantize meta tensors: the graph is traced as LoRA and
  the base weights of the targets are re-typed (`quantized_base`).

A PEFT run holds its base in the compute dtype and its adapters in fp32, without autocast
(executor/peft.py), so `tracer.trace(peft=...)` traces an autocast regime as the plain 16-bit model.

`default targets`: peft's "all-linear", i.e. every linear (and GPT-2 Conv1D) of the model but the output
head: the attention and MLP projections of each architecture, as peft picks them. Under transformers 5 an MoE's
experts are stacked parameters, not linears, and peft's "all-linear" adapts them too (its `ParamWrapper`: each
expert's delta folded into the stacked weight, `baddbmm(W, A, B)`, every forward); `meta_safe_adapters` lets that
fold run on meta.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from tracer.errors import SoapError

PEFT_METHODS = ("lora", "qlora")
QLORA_BASE_DTYPE = "nf4"
"""The dtype name the graph gives a QLoRA base weight (bitsandbytes NF4, 4 bits per element)."""
ALL_LINEAR = "all-linear"


@dataclass(frozen=True, kw_only=True)
class PeftSpec:
    """LoRA or QLoRA fine-tuning settings (peft's `LoraConfig` fields of the same names)."""

    method: str = "lora"
    """lora: frozen base weights in the run's precision; qlora: frozen base weights in 4-bit NF4 with
    double quantization (bitsandbytes), computed in the run's precision."""
    rank: int = 8
    """r: the adapters' inner dimension."""
    alpha: float = 16.0
    """lora_alpha: the adapters' output is scaled by alpha / rank."""
    targets: tuple[str, ...] = ()
    """Module names (suffixes, as peft matches them) that get adapters; () is peft's "all-linear"."""
    dropout: float = 0.0
    """lora_dropout on the adapters' input."""

    def __post_init__(self) -> None:
        if self.method not in PEFT_METHODS:
            raise SoapError(f"unknown PEFT method {self.method!r}; choose one of {', '.join(PEFT_METHODS)}")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise SoapError(f"--lora-rank must be a positive integer, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
            raise SoapError(f"--lora-alpha must be a positive number, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise SoapError(f"--lora-dropout must be in [0, 1), got {self.dropout!r}")
        if not all(isinstance(t, str) and t for t in self.targets):
            raise SoapError(f"--lora-targets must be module names, e.g. q_proj,v_proj; got {self.targets!r}")

    @property
    def quantized(self) -> bool:
        return self.method == "qlora"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["targets"] = list(self.targets)
        return out

    @classmethod
    def from_value(cls, value: Any) -> PeftSpec | None:
        """A spec from None, a PeftSpec, a method name or a dict of its fields (as `soap.plan(peft=...)` takes)."""
        if value is None or isinstance(value, PeftSpec):
            return value
        if isinstance(value, str):
            return cls(method=value)
        if not isinstance(value, dict):
            raise SoapError(f"peft must be 'lora', 'qlora' or a dict of LoRA settings, got {type(value).__name__}")
        fields = dict(value)
        unknown = set(fields) - {"method", "rank", "alpha", "targets", "dropout"}
        if unknown:
            raise SoapError(f"unknown PEFT setting(s) {', '.join(sorted(unknown))}; use method, rank, alpha, targets, "
                            "dropout")
        targets = fields.get("targets", ())
        fields["targets"] = tuple(targets.split(",")) if isinstance(targets, str) else tuple(targets or ())
        if "alpha" in fields and isinstance(fields["alpha"], int) and not isinstance(fields["alpha"], bool):
            fields["alpha"] = float(fields["alpha"])
        return cls(**fields)

    def describe(self) -> str:
        targets = ",".join(self.targets) if self.targets else ALL_LINEAR
        return f"{self.method} r={self.rank} alpha={self.alpha:g} on {targets}" + (
            f", dropout {self.dropout:g}" if self.dropout else "")


def lora_config(spec: PeftSpec) -> Any:
    """peft's `LoraConfig` for `spec`."""
    from peft import LoraConfig

    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                      target_modules=list(spec.targets) if spec.targets else ALL_LINEAR)


def apply_lora(model: Any, spec: PeftSpec) -> Any:
    """Inject `spec`'s adapters into `model` in place (module FQNs unchanged, a target's base linear
    becomes `<target>.base_layer`), in fp32 whatever the model's dtype (peft's `autocast_adapter_dtype`),
    and freeze everything else; returns `model`."""
    try:
        from peft import inject_adapter_in_model
    except ImportError:
        raise SoapError("PEFT needs the peft package; install soap[peft]") from None
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPT-2's Conv1D: peft sets fan_in_fan_out itself and says so
        try:
            # on meta, peft builds the adapters there too instead of allocating and initializing them
            on_meta = next(model.parameters()).device.type == "meta"
            inject_adapter_in_model(lora_config(spec), model, low_cpu_mem_usage=on_meta)
        except ValueError as exc:
            raise SoapError(f"--lora-targets: {str(exc).splitlines()[0]}; name modules of this model, "
                            "e.g. q_proj,v_proj") from None
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:  # peft's autocast_adapter_dtype
            param.data = param.data.float()
    return model


@contextmanager
def meta_safe_adapters() -> Iterator[None]:
    """peft's fold of an adapter into stacked expert weights (`_LoraFactorsProxy`) turns autocast off around its
    `baddbmm`, and `torch.autocast` has no meta device ("unsupported scalarType"), so an MoE with adapted experts
    could not be traced. Inside this context the fold runs without that context on meta tensors: a PEFT model
    runs without autocast (the module docstring), so the context changes nothing but the error; elsewhere peft's
    own forward runs, and it is restored on exit."""
    try:
        from peft.tuners.lora.layer import _LoraFactorsProxy
    except ImportError:  # another peft: nothing folded this way
        yield
        return
    import torch

    original = _LoraFactorsProxy.forward

    def forward(self: Any, weight: Any) -> Any:
        if weight.device.type != "meta":
            return original(self, weight)
        return torch.baddbmm(weight, self.lhs, self.rhs, alpha=self.scaling)

    _LoraFactorsProxy.forward = forward
    try:
        yield
    finally:
        _LoraFactorsProxy.forward = original


ADAPTER_PARTS = frozenset({"base_layer", "lora_A", "lora_B", "lora_dropout", "lora_embedding_A", "lora_embedding_B",
                           "lora_magnitude_vector"})
"""The submodules peft puts inside the module it adapts (`dense` becomes `dense.base_layer`, `dense.lora_A.default`,
...)."""


def adapted_module(fqn: str) -> str:
    """The module an FQN inside peft's adapter belongs to (`cls.predictions.transform.dense.lora_A.default` ->
    `cls.predictions.transform.dense`: the unit a pipeline stage holds or replaces); any other FQN unchanged."""
    parts = fqn.split(".")
    for i, part in enumerate(parts):
        if part in ADAPTER_PARTS:
            return ".".join(parts[:i])
    return fqn


def quantized_modules(model: Any) -> list[str]:
    """FQNs of the adapted modules whose base QLoRA quantizes to NF4 (bitsandbytes' `Linear4bit`): a linear's, or
    GPT-2's Conv1D's. Not an MoE's stacked experts (peft's `ParamWrapper`: 3-D weights, which `Linear4bit` cannot
    hold), nor a module the model keeps in fp32 (`_keep_in_fp32_modules`, T5's `wo`): transformers' own 4-bit
    loading leaves those unquantized, and T5's feed-forward casts its input to `wo.weight.dtype`, which for 4-bit
    storage is uint8 (the gradient stopped there: found by benchmarks/plans_execute.py)."""
    import torch

    keep = {*(getattr(model, "_keep_in_fp32_modules", None) or ()),
            *(getattr(model, "_keep_in_fp32_modules_strict", None) or ())}

    def quantizable(base: Any) -> bool:
        return isinstance(base, torch.nn.Linear) or type(base).__name__ == "Conv1D"

    return [name for name, module in model.named_modules()
            if hasattr(module, "lora_A") and name.rsplit(".", 1)[-1] not in keep
            and quantizable(getattr(module, "base_layer", None))]


def target_base_weights(model: Any) -> list[str]:
    """FQNs of the base weights QLoRA quantizes (`quantized_modules`)."""
    return [f"{name}.base_layer.weight" for name in quantized_modules(model)]


def quantized_base(graph: Any, weights: set[str]) -> Any:
    """`graph` with the parameters named in `weights` re-typed as NF4 (`QLORA_BASE_DTYPE`)."""
    from dataclasses import replace

    def retype(op: Any) -> Any:
        if not any(p.name in weights for p in op.params):
            return op
        params = tuple(replace(p, dtype=QLORA_BASE_DTYPE) if p.name in weights else p for p in op.params)
        return replace(op, params=params)

    return replace(graph, ops=tuple(retype(op) for op in graph.ops))
