"""
DenseFormer and MUDD (kernels/dense.py): the states in one buffer equal the class, backpropagate
twice and from an inner sublayer, and under bfloat16 autocast.
"""
import pytest
import torch

from conftest import TRITON_MARKS, bfloat16_errors, rel_rms, routing_run, two_backwards

DENSE_VARIANTS = [('denseformer', {}), ('denseformer', {'denseformer_dilation': 2}),
                  ('denseformer', {'denseformer_dilation': 3, 'denseformer_period': 2}),
                  ('mudd', {}), ('mudd', {'mudd_multiway': False})]


@pytest.mark.parametrize('backend', ['torch', pytest.param('triton', marks=TRITON_MARKS)])
@pytest.mark.parametrize('residual,knobs', DENSE_VARIANTS)
@pytest.mark.parametrize('n_layer', [1, 4, 6])
def test_dense_states_in_one_buffer_equal_the_class(residual, knobs, n_layer, backend, few_programs):
    """The buffered twins (kernels=torch: one product per mix, forward and backward, gradients
    handed over by the first reader; kernels=triton: MUDD's mixes in one kernel each way, in tiles
    of 4 tokens) against the classes through autograd, in float64: output and the gradients of e
    and of every routing parameter within 1e-10."""
    if n_layer % knobs.get('denseformer_period', 1):
        pytest.skip('the period must divide n_layer')
    reference, fast = (routing_run(residual, knobs, n_layer, b) for b in ('reference', backend))
    assert all(rel_rms(got, want) <= 1e-10 for got, want in zip(fast, reference))


@pytest.mark.parametrize('residual,knobs,backend', [(*DENSE_VARIANTS[2], 'torch'), (*DENSE_VARIANTS[3], 'torch'),
                                                    pytest.param(*DENSE_VARIANTS[3], 'triton', marks=TRITON_MARKS)])
def test_dense_states_backpropagate_twice_from_an_inner_sublayer_and_under_autocast(residual, knobs, backend):
    """A retained graph backpropagates again to the same gradients; a backward from an inner
    sublayer's input matches the reference; under bfloat16 autocast the twin is as close to the
    float32 reference as the reference is (the products run in float32 in both: MUDD's kernel too)."""
    assert all(torch.equal(a, b) for a, b in zip(*two_backwards(residual, backend, n_layer=4, **knobs)))
    inner = [routing_run(residual, knobs, 6, b, inner=7) for b in ('reference', backend)]
    assert all((got is None and want is None) or rel_rms(got, want) <= 1e-10 for got, want in zip(*inner))
    twin, reference = bfloat16_errors(residual, backend, n_layer=6, **knobs)
    assert twin <= 1.5 * reference + 1e-3
