"""Dimension-role propagation rules on hand-made shapes (pure functions, no model)."""

from tracer.blocks import BlockType, layers_to_trace
from tracer.ir import DimRole
from tracer.roles import _reshape_roles

S, A, P, N, T = DimRole.SAMPLE, DimRole.ATTRIBUTE, DimRole.PARAMETER, DimRole.NONE, DimRole.TOKEN


def test_splitting_hidden_into_heads_keeps_parameter_roles():
    assert _reshape_roles((2, 16, 64), (S, A, P), (2, 16, 4, 16)) == (S, A, P, P)


def test_merging_batch_and_sequence_makes_a_token_dim_that_splitting_passes_on():
    """A flattened [batch * seq] dim (HF's logits and labels for the loss) grows with the micro-batch and
    is divided by context parallelism, so it answers to both roles."""
    assert _reshape_roles((2, 16, 64), (S, A, P), (32, 64)) == (T, P)
    assert _reshape_roles((1, 16, 64), (S, A, P), (16, 64)) == (T, P)
    assert _reshape_roles((128, 64), (T, P), (64, 2, 64)) == (T, N, P)  # MoE: [tokens * top_k] -> [tokens, top_k]
    assert _reshape_roles((32, 256), (S, P), (2, 16, 256)) == (S, A, P)


def test_a_token_dim_scales_with_the_micro_batch_and_splits_with_the_sequence():
    from costmodel.opcost import local_scale
    from tracer.ir import TensorMeta

    logits = TensorMeta((16, 100), "float32", (T, P))
    assert local_scale(logits, sample_scale=4, split={"attribute": 2}) == 2
    assert local_scale(logits, sample_scale=1, split={"attribute": 4, "parameter": 2}) == 1 / 8


def test_batch_of_one_keeps_its_sample_dim_through_reshapes():
    assert _reshape_roles((1, 16, 64), (S, A, P), (1, 16, 4, 16)) == (S, A, P, P)
    assert _reshape_roles((1, 16, 4, 16), (S, A, P, P), (1, 16, 64)) == (S, A, P)


def test_unsqueezed_dims_are_none():
    assert _reshape_roles((16, 64), (A, P), (1, 16, 64)) == (N, A, P)


def _types(*index_lists):
    return [BlockType(f"b{i}", "stack", "Layer", tuple(ix), 10) for i, ix in enumerate(index_lists)]


def test_two_layers_traced_for_a_uniform_stack():
    assert layers_to_trace(_types(range(32))) == 2


def test_a_distinct_first_block_needs_one_more_layer():
    assert layers_to_trace(_types([0], range(1, 12))) == 3


def test_late_first_occurrence_of_a_type_is_reached():
    assert layers_to_trace(_types([0, 1, 2], range(3, 61))) == 5
