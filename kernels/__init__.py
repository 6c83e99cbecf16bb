"""
How fast: the same maths as residuals.py, computed faster. residuals.py says what each method
computes (plain autograd, the oracle); this package holds every fast path behind one knob,
`--kernels=reference|torch|triton|auto` (docs/PERFORMANCE.md: what each costs, and why):

    reference  each class's own forward in residuals.py, exactly as written
    torch      the fast PyTorch twins, with hand-written backwards
    triton     the same schedules with Triton kernels (CUDA; on CPU tensors through Triton's
               interpreter where TRITON_INTERPRET=1 is set before triton is imported: the tests)
    auto       triton on CUDA when it imports, else torch

`route(residual, x, sublayers, backend)` runs a method: the twin that FAST (below) lists for its
class, or the class's own forward. The tests hold every twin equal to its class in float64, in
value and in every gradient, and pin the operators and bytes of a training step. Every path
computes at its inputs' precision, upcasting half precision only.

One file a family, each in the same order: what it computes (equations, forward and backward),
its PyTorch functions, its Triton kernels (defined where triton imports), the custom ops that
launch them and their fakes, its autograd Functions, and the schedule its methods run, which reads
the backend once.

    common.py          the helpers the families share: cast, rms_inverse, token_tile,
                       accumulator, on_device, GradPool (the gradients that several backwards
                       give one tensor), ...
    depth_mix.py       m queries read S sources in one pass: mix_torch, _depth_mix_fwd/_bwd,
                       DepthMix, PooledRead; Reads (many, continued, one, matched) and
                       reads(backend), through which attnres.py and mgr.py read
    attnres.py         attnres, delta_attnres, block_attnres, wav: two-phase reads (GatedAdd)
    streams.py         HC and the mHC family: rebuilt, with TorchStreams (HCStep, MHCStep,
                       MHCLiteStep) or TritonStreams; the streams rebuilt in the backward
                       (StreamSegment)
    stream_kernels.py  HC's and mHC-lite's Triton step (_stream_mix_fwd/_bwd) and its custom ops
    mgr.py             mgr: MGRStep, the fused step (gates, update, AttnPool), its backward
                       inverting the update; TORCH_STEP or TRITON_STEP
    dense.py           denseformer, mudd: the states in one buffer (DenseStates, DenseMix);
                       MUDD's mix in _mudd_mix_fwd/_bwd, its weights' first projection
                       (RMSProjection)

This file: the knob (resolve), the twins' one setting beyond it (MGR's fallback p), route, and
FAST, the twins by class.
"""
import functools
import os

import residuals

from . import attnres, dense, mgr, streams
from .common import triton

KERNELS = ('auto', 'reference', 'torch', 'triton')

# MGR's fast backward inverts the lerp, keeping the originals of the p largest gates per token;
# -1 keeps every input instead (mgr.mgr). The one setting of a twin beyond the backend: train.py and
# bench.py take it as --mgr_fallback_p with this default and rule, GPT.set_kernels checks it and
# hands it to route.
MGR_FALLBACK_P = 1
MGR_FALLBACK_P_RULE = (lambda p: p >= -1, '-1 (no inversion) or at least 0')


def resolve(kernels, device_type):
    """'reference', 'torch' or 'triton' for the --kernels knob on this device; a clear error when
    triton can't run."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}; choose one of: {', '.join(KERNELS)}")
    if (kernels in ('reference', 'torch')
            or (kernels == 'auto' and (triton is None or device_type != 'cuda'))):
        return 'torch' if kernels == 'auto' else kernels
    if triton is None:
        raise ValueError("kernels=triton needs the triton package: pip install triton (Linux), "
                         "or use --kernels=torch")
    if device_type != 'cuda' and os.environ.get('TRITON_INTERPRET') != '1':
        raise ValueError(f"kernels=triton runs on CUDA, and this run is on {device_type}; "
                         "use --kernels=torch, or set TRITON_INTERPRET=1 to run the kernels "
                         "through Triton's (slow) interpreter")
    return 'triton'


def check_mgr_fallback_p(p):
    """p itself, or a clear error where MGR_FALLBACK_P_RULE refuses it."""
    allowed, what = MGR_FALLBACK_P_RULE
    if not allowed(p):
        raise ValueError(f"mgr_fallback_p must be {what}, got {p}")
    return p


def route(residual, x, sublayers, backend='torch', mgr_fallback_p=MGR_FALLBACK_P):
    """Run a residual method on the embedding x through the sublayers: the fast twin of its class
    (FAST) with backend 'torch' or 'triton', else its own forward. mgr_fallback_p reaches MGR's twin,
    the one twin with a setting."""
    fast = FAST.get(type(residual)) if backend != 'reference' else None
    if fast is None:
        return residual(x, sublayers)
    if fast is mgr.mgr:
        return fast(residual, x, sublayers, backend, mgr_fallback_p)
    return fast(residual, x, sublayers, backend)


# The fast twins, by the class of residuals.py whose maths each computes (route looks up the exact
# class). The stream methods share one schedule: each names the step that computes its connections
# by hand, and its Triton kernel's parameters (None: no kernel; the step by hand runs on triton too).
FAST = {residuals.AttnRes: attnres.attnres,
        residuals.BlockAttnRes: attnres.block_attnres,
        residuals.DeltaAttnRes: attnres.delta_attnres,
        residuals.WAV: attnres.wav,
        residuals.HyperConnections: functools.partial(streams.rebuilt, streams.HCStep, streams.hc_kernel),
        residuals.MHC: functools.partial(streams.rebuilt, streams.MHCStep, streams.mhc_kernel),
        residuals.MHCLite: functools.partial(streams.rebuilt, streams.MHCLiteStep, streams.mhc_lite_kernel),
        residuals.KromHC: functools.partial(streams.rebuilt, streams.KromHCStep, streams.kromhc_kernel),
        residuals.FracConnections: functools.partial(streams.rebuilt, streams.FracStep, streams.hc_kernel),
        residuals.MultiGateResiduals: mgr.mgr,
        residuals.DenseFormer: dense.denseformer,
        residuals.MUDDFormer: dense.mudd}
