"""Mixed precision on pre-Hopper GPUs (issue 16, item 2): what autocast can and cannot speed up.

An autocast fp16/bf16 step runs the matmuls (and the attention core) on tensor cores at the 16-bit
peak, keeps layer norms and the loss in fp32 (tracer/autocast.py), halves the bytes of the other
elementwise ops at most, adds the casts, and leaves launch overhead and the fp32 optimizer step as
they are. So, against the fp32 step of the same model and batch on the same device:

    T16 >= M32 / R + (T32 - M32) / 2,    R = effective_peak(fp16 or bf16) / effective_peak(fp32)

where M32 is the fp32 step's matmul and attention time (`_matmul_time`): a matmul is at best R times
faster (the efficiency curve is read at the same FLOPs), anything else at best twice (its bytes halve,
its launch does not shrink). `test_autocast_step_is_never_faster_than_the_peak_ratios_allow` holds
every GPU profile to it.

The reference for BERT-large on a V100 is the issue's "end-to-end mixed precision on V100 is commonly
reported at 2-3x" (no measured V100 figure is in shared/reference). The model gives that range at a
fine-tuning micro-batch (4 x 128 tokens), where launches and small GEMMs weigh. At a pretraining
micro-batch (32 x 128) the matmuls take 699 ms of the fp32 step's 764 and 90 ms of the fp16 step's 148,
with GEMMs at 65-80% of either peak, and the speedup is 5.2x: 3x there would need fp16 GEMMs near 40 TF
(a third of the V100's 125), which no source here supports, so that case is a strict xfail that names
the gap.
"""

import dataclasses
import sys
from pathlib import Path

import pytest

from costmodel.opcost import MATMUL_LIKE, kernel_class, op_time
from costmodel.profiles import load_cluster, load_device
from costmodel.simulator import simulate
from costmodel.strategy import ParallelDims, Strategy, TrainingConfig
from tracer.autocast import trace_dtype_for

sys.path.insert(0, str(Path(__file__).parent))
from test_physics import GPU_DEVICES  # noqa: E402

LOSS_TARGETS = frozenset({"aten.cross_entropy_loss.default", "aten.nll_loss.default", "aten.log_softmax.default"})


def _graph(precision, seq):
    import tracer

    return tracer.trace("bert-large-uncased", seq_len=seq, dtype=trace_dtype_for(precision, False))


def _single_gpu(device_name):
    """One GPU of `device_name`: no collectives, so the step is its compute and its optimizer."""
    return dataclasses.replace(load_cluster("dgx-h100"), device=load_device(device_name))


def _step(device_name, precision, *, seq, mb):
    train = TrainingConfig(global_batch=mb, seq_len=seq, micro_batch=mb, num_microbatches=1, grad_accum=1,
                           precision=precision, recompute="none")
    strategy = Strategy(dims=ParallelDims(), train=train)
    return simulate(_graph(precision, seq), strategy, _single_gpu(device_name)).step_time_s


def _op_times(device_name, precision, *, seq, mb):
    """(op, forward + backward seconds of all its instances) over the graph of `precision`'s regime."""
    graph, device = _graph(precision, seq), load_device(device_name)
    for op in graph.ops:
        cost = op_time(op, device=device, precision=precision, micro_batch=mb, batch_traced=graph.batch)
        yield op, graph.multiplicity(op) * (cost.fwd_s + cost.bwd_s)


def _matmul_time(device_name, precision, *, seq, mb):
    return sum(t for op, t in _op_times(device_name, precision, seq=seq, mb=mb) if op.kind in MATMUL_LIKE)


def _kept_fp32_time(device_name, precision, *, seq, mb):
    """Layer norms and the loss: autocast runs them in fp32 whatever the run's precision."""
    return sum(t for op, t in _op_times(device_name, precision, seq=seq, mb=mb)
               if kernel_class(op) == "norm" or op.target in LOSS_TARGETS)


def _low_precisions(device_name):
    return [p for p in ("fp16", "bf16") if p in load_device(device_name).peak_flops]


CASES = [(name, low) for name in GPU_DEVICES for low in _low_precisions(name)]


@pytest.mark.parametrize("device_name,low", CASES)
def test_autocast_step_is_never_faster_than_the_peak_ratios_allow(device_name, low):
    seq, mb = 128, 8
    device = load_device(device_name)
    ratio = device.effective_peak(low) / device.effective_peak("fp32")
    t32, t16 = _step(device_name, "fp32", seq=seq, mb=mb), _step(device_name, low, seq=seq, mb=mb)
    m32 = _matmul_time(device_name, "fp32", seq=seq, mb=mb)
    assert 0 < m32 < t32
    assert t16 >= m32 / ratio + (t32 - m32) / 2
    assert t32 / t16 <= ratio


@pytest.mark.parametrize("device_name,low", CASES)
def test_norms_and_loss_cost_the_same_under_autocast_as_in_fp32(device_name, low):
    """They compute, read and write fp32 in both runs: halving their bytes would make fp16 too fast."""
    kept32 = _kept_fp32_time(device_name, "fp32", seq=128, mb=8)
    assert kept32 > 0
    assert _kept_fp32_time(device_name, low, seq=128, mb=8) == pytest.approx(kept32, rel=1e-9)


def test_bert_large_fp16_speedup_on_a_v100_at_a_fine_tuning_batch_is_the_reported_two_to_three():
    t32, t16 = (_step("v100-sxm2-16g", p, seq=128, mb=4) for p in ("fp32", "fp16"))
    assert 2.0 <= t32 / t16 <= 3.2


@pytest.mark.xfail(strict=True, reason="issue 16 item 2, open: at 32 x 128 the model gives ~5x (fp32 GEMMs at "
                   "~11-12.6 TF, fp16 at ~82-100 TF); 2-3x would need fp16 GEMMs near 40 TF, without a source")
def test_bert_large_fp16_speedup_on_a_v100_at_a_pretraining_batch_is_the_reported_two_to_three():
    t32, t16 = (_step("v100-sxm2-16g", p, seq=128, mb=32) for p in ("fp32", "fp16"))
    assert 2.0 <= t32 / t16 <= 3.2
