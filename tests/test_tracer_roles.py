"""Dimension-role propagation rules on hand-made shapes (pure functions, no model)."""

from tracer.blocks import BlockType, layers_to_trace
from tracer.ir import DimRole
from tracer.roles import _reshape_roles

S, A, P, N = DimRole.SAMPLE, DimRole.ATTRIBUTE, DimRole.PARAMETER, DimRole.NONE


def test_splitting_hidden_into_heads_keeps_parameter_roles():
    assert _reshape_roles((2, 16, 64), (S, A, P), (2, 16, 4, 16)) == (S, A, P, P)


def test_merging_batch_and_sequence_keeps_sample_and_splitting_back_restores_sequence():
    assert _reshape_roles((2, 16, 64), (S, A, P), (32, 64)) == (S, P)
    assert _reshape_roles((32, 256), (S, P), (2, 16, 256)) == (S, A, P)


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
