"""
The AttnRes family and WAV (kernels/attnres.py): what the twins keep for backward, the gradients of
sources shared by several reads, bfloat16 autocast.
"""
import pytest
import torch

from conftest import TRITON_MARKS, bfloat16_errors, rel_rms, routing_run, tiny_model, two_backwards


def test_full_attnres_keeps_no_stacked_copies_for_backward():
    """With the fast twins (the default), saved activations grow linearly with depth, not as L^2:
    16-layer Full AttnRes keeps about what PreNorm keeps (each source once), not a stack of up to
    33 sources per sublayer (as the reference does)."""
    from counters import saved_bytes
    idx = torch.randint(27, (2, 32))
    saved = {r: saved_bytes(tiny_model(r, n_layer=16), idx, idx) for r in ('prenorm', 'attnres', 'wav')}
    assert saved['attnres'] < 1.5 * saved['prenorm'] and saved['wav'] < 2.0 * saved['prenorm']


@pytest.mark.parametrize('backend', ['torch', pytest.param('triton', marks=TRITON_MARKS)])
@pytest.mark.parametrize('residual', ['attnres', 'block_attnres', 'delta_attnres', 'wav'])
def test_shared_source_gradients_equal_the_class_twice_and_from_an_inner_sublayer(residual, backend):
    """In eager mode a finished source's gradient is one tensor that every later read adds its share
    to, handed to autograd by the source's first reader (Reads, kernels/depth_mix.py; the PyTorch twin also
    computes each such source's 1/RMS once). In float64
    (blocks of one layer: each source read by up to five later reads): the output and every gradient
    equal the class's within 1e-10, from the output and from an inner sublayer's input (the later
    reads never run backward), and a retained graph backpropagates again to the same gradients."""
    knobs = {} if residual in ('attnres', 'delta_attnres') else dict(res_block_size=1)
    for inner in (None, 3):
        got, want = (routing_run(residual, knobs, 3, b, inner=inner) for b in (backend, 'reference'))
        assert all((a is None and b is None) or rel_rms(a, b) <= 1e-10 for a, b in zip(got, want)), (residual, inner)
    assert all(torch.equal(a, b) for a, b in zip(*two_backwards(residual, backend, n_layer=3, **knobs)))


@pytest.mark.parametrize('residual', ['attnres', 'block_attnres', 'delta_attnres', 'wav', 'mgr'])
def test_depth_mix_twins_under_bfloat16_autocast(residual):
    """Under CPU bfloat16 autocast, as in training (a float32 embedding beside bfloat16 updates), the
    PyTorch twins (the depth mix and its shared gradients, MGR's step) are as close to the float32
    reference as the reference itself is under autocast."""
    twin, reference = bfloat16_errors(residual, n_layer=4)
    assert twin <= 1.5 * reference + 1e-3
