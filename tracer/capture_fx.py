"""The `hf-fx` front-end: transformers.utils.fx (HFTracer), available only with transformers < 5.

HFTracer symbolically traces the model into a GraphModule with the same submodules; the dispatch
recorder then runs that GraphModule on meta tensors to get ATen ops with module FQNs.
"""

from __future__ import annotations

from typing import Any

from tracer.capture import Capture
from tracer.errors import SoapError


def capture_hf_fx(model: Any, inputs: dict[str, Any]) -> Capture:
    import transformers

    major = int(transformers.__version__.split(".")[0])
    if major >= 5:
        raise SoapError(f"the hf-fx front-end needs transformers < 5 (transformers.utils.fx was removed in 5.0; "
                        f"{transformers.__version__} is installed); use --frontend export or dispatch")
    from transformers.utils.fx import symbolic_trace

    from tracer.capture_dispatch import capture_dispatch

    names = [k for k, v in inputs.items() if hasattr(v, "shape")]
    graph_module = symbolic_trace(model, input_names=names)
    captured = capture_dispatch(graph_module, {k: inputs[k] for k in names})
    return Capture(ops=captured.ops, frontend="hf-fx", values=captured.values)
