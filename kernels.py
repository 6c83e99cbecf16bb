"""
How fast: the same maths as residuals.py, computed faster. residuals.py says what each method
computes (plain autograd, the oracle); this file holds every fast path behind one knob,
`--kernels=reference|torch|triton|auto` (docs/PERFORMANCE.md: what each costs, and why):

    reference  each class's own forward in residuals.py, exactly as written
    torch      the fast PyTorch twins below, with hand-written backwards
    triton     the same schedules with Triton kernels (CUDA; on CPU tensors through Triton's
               interpreter where TRITON_INTERPRET=1 is set before triton is imported: the tests)
    auto       triton on CUDA when it imports, else torch

`route(residual, x, sublayers, backend)` runs a method: the twin that FAST (at the bottom) lists for
its class, or the class's own forward. The tests hold every twin equal to its class in float64, in
value and in every gradient, and pin the operators and bytes of a training step. Every path computes
at its inputs' precision, upcasting half precision only.

Index. Each family: what it computes (equations, forward and backward), its PyTorch functions, its
Triton kernels (defined where triton imports), the custom ops that launch them, its autograd
Functions, and the schedule its methods run, which reads the backend once.

    helpers          rms_inverse, token_tile, accumulator, on_device, GradPool (the gradients
                     that several backwards give one tensor), ...
    1. depth mix     m queries read S sources in one pass: mix_torch, _depth_mix_fwd/_bwd,
                     _triton_depth_mix, DepthMix, PooledRead; Reads (many, continued, one,
                     matched) and reads(backend), through which sections 2 and 4 read
    2. AttnRes, WAV  attnres, delta_attnres, block_attnres, wav: two-phase reads (GatedAdd)
    3. HC, mHC       hc, mhc: streams, with TorchStreams (HCStep, MHCStep, MHCLiteStep) or
                     TritonStreams (_stream_mix_fwd/_bwd); the streams rebuilt in the backward
                     (StreamSegment)
    4. MGR           mgr: MGRStep, the fused step (gates, update, AttnPool), its backward
                     inverting the update; TORCH_STEP or TRITON_STEP
    5. Dense, MUDD   denseformer, mudd: the states in one buffer (DenseStates, DenseMix);
                     MUDD's mix in _mudd_mix_fwd/_bwd, its weights' first projection
                     (RMSProjection)
    FAST             the twins by class
"""
import functools
import math
import os
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor
from torch.nn import functional as F

import residuals
from residuals import MATCH_EPS, RMS_EPS, detail_signs, upcast

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels are optional: everything runs with kernels=torch
    triton = None

KERNELS = ('auto', 'reference', 'torch', 'triton')


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


def route(residual, x, sublayers, backend='torch'):
    """Run a residual method on the embedding x through the sublayers: the fast twin of its class
    (FAST, at the bottom) with backend 'torch' or 'triton', else its own forward. A twin's settings
    beyond the backend live on the module it reads (MGR's fallback_p, see mgr)."""
    fast = FAST.get(type(residual)) if backend != 'reference' else None
    return residual(x, sublayers) if fast is None else fast(residual, x, sublayers, backend)


def cast(x, dtype):
    """x in dtype, a new tensor or x itself. An autograd.Function's forward returns outputs through
    this, never through a no-op x.to(dtype), and updates nothing in place: either makes torch 2.11's
    compiler drop the Function's backward, and every gradient comes out zero (2.13 is fine)."""
    return x if x.dtype == dtype else x.to(dtype)


# ----------------------------------------------------------------------- helpers the families share

def rms_inverse(x, keepdim=False):
    """1 / sqrt(mean(x^2) + eps) over the last dimension, in one pass without a squared copy
    (float32 for half-precision x)."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=keepdim,
                                    dtype=torch.float32 if x.element_size() < 4 else x.dtype)
    return rms_inverse_of_norm(norm, x.shape[-1])


def rms_inverse_of_norm(norm, C):
    """1 / sqrt(|x|^2 / C + eps) from the norm |x| of C numbers (eps + |x|^2 / C: one operator)."""
    return torch.rsqrt(torch.add(RMS_EPS, norm.square(), alpha=1 / C))


def next_pow2(x):
    return 1 << max(0, int(x) - 1).bit_length()


def reduction_programs(n_tiles):
    """Programs of a backward kernel that also reduces over tokens (query, bias grads): each loops
    over tiles of tokens and writes one partial sum, so there are no atomics and the result is
    deterministic."""
    return min(n_tiles, 512)


# elements of a (queries, tokens, channels) block in a depth-mix, MGR-step or MUDD-mix program
TILE = 1024


def token_tile(m, C, N):
    """Tokens per program of the depth-mix, MGR-step and MUDD-mix kernels, for m queries (MGR: n
    streams; MUDD: ways) of width C over N tokens: as many as keep an (m, tokens, C) block within
    TILE elements. One token at GPT-2's 768 (a program per token, as the kernels were first
    measured); at small widths several, where one token's program would sit nearly idle (and the
    interpreter, which pays per operation, runs the tests many times faster)."""
    return max(1, min(next_pow2(N), TILE // (next_pow2(m) * next_pow2(C))))


def on_device(values, device):
    """A few host integers (addresses, indices) as an int64 tensor on `device`. On a GPU they go
    through pinned memory asynchronously: a copy from pageable memory waits until the GPU has run
    every queued kernel, and one per read made the host and the GPU take turns. (While a CUDA graph
    is captured, the plain copy, which refuses loudly: a graph would replay a pinned buffer reused
    since.)"""
    if device.type == 'cuda' and not torch.cuda.is_current_stream_capturing():
        return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(
            device, non_blocking=True)
    return torch.tensor(values, dtype=torch.int64, device=device)


def accumulator(dtype):
    """The precision a kernel computes in for inputs of `dtype`: float64 for float64, else float32
    (half precision upcast, as upcast() does): (torch dtype, triton dtype)."""
    return (torch.float64, tl.float64) if dtype == torch.float64 else (torch.float32, tl.float32)


def common_dtype(sources):
    dtypes = {v.dtype for v in sources}
    return dtypes.pop() if len(dtypes) == 1 else functools.reduce(torch.promote_types, dtypes)


def other_dtypes(sources, dtype):
    return {v.dtype for v in sources} - {dtype}


class GradPool:
    """Gradients gathered across the backwards of one forward, where several reads or steps give
    one tensor its gradient: each backward puts its share under a key (a source of the depth reads,
    a sublayer's rows of the stacked stream parameters), added to what is there, and the owner, the
    last of them to run backward (the first in the forward), takes the total and hands it to
    autograd; the others return None for it, so autograd sums nothing. (A backward that stops short
    of the owner, autograd.grad with inputs inside the model, leaves its shares in the pool: a
    second backward through the same graph adds to them.)"""

    def __init__(self):
        self.shares = {}

    def share(self, key):
        """What has been put under key, or None."""
        return self.shares.get(key)

    def put(self, key, share):
        self.shares[key] = share

    def take(self, key):
        """What has been put under key, taken out of the pool."""
        return self.shares.pop(key)

    def take_stacked(self, L):
        """Everything put, under the keys 0..L-1 (a tuple of rows each), stacked over the keys, one
        tensor per place in the tuple (zeros where nothing was put: a backward from an inner
        sublayer), and taken."""
        rows, self.shares = self.shares, {}
        first = next(iter(rows.values()))
        return [torch.stack([rows[i][k] if i in rows else torch.zeros_like(first[k])
                             for i in range(L)]) for k in range(len(first))]


# ================================================================================= 1. the depth mix
#
# m queries q_j (C,) read a list of S sources v_s (B, T, C), with a bias b_js or none; per token:
#
#     r_s = 1 / RMS(v_s),   l_js = r_s q_j . v_s + b_js,   w_js = softmax_s(l_js)
#     mixed_j = sum_s w_js v_s,   lse_j = logsumexp_s l_js
#
# (residuals.DepthAttention's read, for every query at once). A prior (mixed_0, lse_0), a read of
# sources before, counts as one more source with value mixed_0 and logit lse_0, so that a read can
# be continued later (the online softmax of the AttnRes paper's phase 2). Backward, with g_j and h_j
# the gradients of mixed_j and lse_j:
#
#     dl_js = w_js (g_j . v_s - g_j . mixed_j + h_j)
#     dv_s  = sum_j [w_js g_j + dl_js r_s q_j] - (r_s^2 / C) (sum_j dl_js r_s q_j . v_s) v_s
#     dq_j  = sum_s dl_js r_s v_s,   db_js = dl_js (summed over tokens)
#     prior: d mixed_0 = w_j0 g_j,   d lse_0 = dl_j0
#
# A read of WAV's matched detail (Matched) reads D and scales it by s = min(rho, RMS(state) /
# (RMS(D) + eps)) as it reads it (s detached: dD = s dD~).

# ---------------------------------------------------------------------------- the PyTorch functions

def stacked(tensors):
    """torch.stack, or a view for a single tensor (a stack of one is a copy)."""
    return torch.stack(tensors) if len(tensors) > 1 else tensors[0].unsqueeze(0)


def stacked_rms_inverse(values):
    """1/RMS of each of the values (S, B, T, 1), from their norms (one pass over each)."""
    norms = [torch.linalg.vector_norm(v, dim=-1, keepdim=True) for v in values]
    return rms_inverse_of_norm(stacked(norms), values[0].shape[-1])


def _mix_dtype(sources, prior_mixed):
    return common_dtype(sources if prior_mixed is None else [*sources, prior_mixed])


def mix_torch(queries, bias, sources, prior_mixed, prior_lse, single, rinv=None):
    """The depth mix in PyTorch, one source at a time (the sources are never stacked), shaped as the
    kernel's outputs -> mixed, lse (None for a single query: no caller merges its read further) and
    what the backward needs: 1/RMS r (S, B, T, 1), the scores (S, [m,] B, T, 1) and the weights (S,
    [m,] B, T, 1; the prior's row after them). Per token the numbers keep a trailing 1, so that they
    broadcast against the sources (B, T, C) as they are. rinv: the sources' 1/RMS, if known. Out of
    place, as every forward of an autograd.Function here (see cast)."""
    values, q = [upcast(v) for v in sources], upcast(queries)
    (m, C), tokens = q.shape, values[0].shape[:-1]
    shape = (len(values),) + (() if single else (m,)) + tokens + (1,)
    rinv = stacked_rms_inverse(values) if rinv is None else rinv
    r = rinv if single else rinv.unsqueeze(1)
    products = [torch.mm(q, v.reshape(-1, C).T) for v in values]
    scores = stacked(products).view(shape) * r  # q_j . RMSNorm(v_s)
    logits = scores
    if bias is not None:  # any tensor of m S numbers, a query's row after another (as the kernels)
        per_read = shape[:1 if single else 2] + (1,) * (len(tokens) + 1)
        logits = scores + upcast(bias).reshape(m, -1).T.reshape(per_read)
    if prior_lse is not None:  # the prior: one more source, value prior_mixed, logit prior_lse
        logits = torch.cat([logits, prior_lse.view((1,) + prior_lse.shape + (1,))])
        values = values + [upcast(prior_mixed)]
    if single:  # no one merges a single query's read further: no lse
        lse, weights = None, torch.softmax(logits, 0)
    else:
        lse = torch.logsumexp(logits, 0)
        weights = torch.exp(logits - lse)
        lse = lse.squeeze(-1)
    w = weights.unbind()
    mixed = w[0] * values[0]
    for w_s, v in zip(w[1:], values[1:]):
        mixed = torch.addcmul(mixed, w_s, v)
    return mixed, lse, (rinv, scores, weights)


def mix_torch_backward(queries, bias, sources, prior_mixed, saved, grad_mixed, grad_lse, grads):
    """mix_torch's backward (the equations above): each source's gradient in a new tensor (grads[s]
    None) or added to grads[s] (in the computing precision) -> the queries' gradient, [the bias's]
    + [the prior's two] where given, and the sources' gradients (grads[s] itself where given);
    grad_mixed None: only lse was used."""
    rinv, scores, weights = saved
    if grad_mixed is None:
        grad_mixed = weights.new_zeros(weights.shape[1:-1] + sources[0].shape[-1:])
    g, q, S = upcast(grad_mixed), upcast(queries), len(sources)
    values = [upcast(v) for v in sources] + ([] if prior_mixed is None else [upcast(prior_mixed)])
    (m, C), single = q.shape, g.dim() == values[0].dim()
    N = values[0].numel() // C
    # g_j . v_s per token: a batch of N (1, C) x (C, m) products per source (on a CPU faster than a
    # product and a sum over an (m, B, T, C) temporary); a prior of m queries (a row per query, not
    # a source all read) in a product and a sum
    read_by_all = values if single or prior_mixed is None else values[:S]
    G = g.reshape(-1 if single else m, N, C).permute(1, 2, 0)  # (N, C, m)
    gv = stacked([torch.bmm(v.reshape(N, 1, C), G) for v in read_by_all])  # (S, N, 1, m)
    if single:
        gv = gv.view(weights.shape)
    else:
        gv = gv.view(gv.shape[:1] + values[0].shape[:-1] + (m,)).movedim(-1, 1).unsqueeze(-1)
        if prior_mixed is not None:
            gv = torch.cat([gv, (g * values[S]).sum(-1, keepdim=True).unsqueeze(0)])
    # w (g.v - g.out), g.out = sum_s w_s g.v_s: softmax's backward in one operator; + w h for lse's
    # gradient h (the prior's row, if any, last)
    grad_logits = torch.ops.aten._softmax_backward_data(gv, weights, 0, weights.dtype)
    if grad_lse is not None:
        grad_logits = torch.addcmul(grad_logits, weights, upcast(grad_lse).unsqueeze(-1))
    own = grad_logits if prior_mixed is None else grad_logits[:S]
    scaled = own * (rinv if single else rinv.unsqueeze(1))  # dl_js r_s
    along = scaled * scores if single else (scaled * scores).sum(1)
    along = along * rinv  # (r_s^2 sum_j dl_js r_s v_s.q_j; the 1 / C below)
    dq, out = None, []
    g_rows = (g,) if single else g.unbind()
    w, sc, al = weights.unbind(), scaled.unbind(), along.unbind()
    for s, v in enumerate(values[:S]):
        w_rows, dv, rows = (w[s],) if single else w[s].unbind(), grads[s], range(len(g_rows))
        if dv is None:
            dv, rows = w_rows[0] * g_rows[0], rows[1:]
        for j in rows:
            dv.addcmul_(w_rows[j], g_rows[j])
        dv.view(N, C).addmm_(sc[s].view(m, N).T, q)
        dv.addcmul_(v, al[s], value=-1.0 / C)
        v = v.reshape(N, C)
        dq = sc[s].view(m, N) @ v if dq is None else dq.addmm_(sc[s].view(m, N), v)
        out.append(dv)
    extra = []
    if bias is not None:
        db = own.flatten(1 if single else 2).sum(-1)  # (S, [m])
        extra.append((db if single else db.T).reshape(bias.shape).to(bias.dtype))
    if prior_mixed is not None:
        extra += [(w[S] * g).to(prior_mixed.dtype), grad_logits[S].squeeze(-1)]
    return dq.to(queries.dtype), extra, out


class Matched(NamedTuple):
    """A detail that the kernels read matched to its state's RMS (WAV's rms_match: D~ = s D, s =
    min(rho, RMS(state) / (RMS(D) + eps)) per token, detached): they compute s as they read D, from
    the RMS of the state, the last source before it in the read that is not matched, so that no
    matched copy (nor s) is written, and the backward gives D the gradient s dD~ in the same
    pass."""
    detail: Tensor
    state: Tensor
    rho: float


def match_flags(sources):
    """A list of sources, tensors or Matched -> the tensors, whether each is matched (1) or not
    (0), and the matched details' rho (0 if none)."""
    state, rhos = None, set()
    for v in sources:
        if isinstance(v, Matched):
            assert v.state is state, "a matched detail must follow its state"
            rhos.add(float(v.rho))
        else:
            state = v
    tensors = [v.detail if isinstance(v, Matched) else v for v in sources]
    assert len(rhos) <= 1, "one rho per read"
    return tensors, [int(isinstance(v, Matched)) for v in sources], rhos.pop() if rhos else 0.


def rms_match_torch(details, state, rho, eps=MATCH_EPS):
    """WAV's detached RMS matching of several details to one state (residuals.rms_match for each):
    D~ = s D, s = min(rho, RMS(state) / (RMS(D) + eps)) per token, detached. Norms instead of
    pow/mean/sqrt, and the state's RMS once: about half the operators."""
    C = state.shape[-1]
    norm = lambda v: torch.linalg.vector_norm(v, dim=-1, keepdim=True, dtype=upcast(v).dtype)
    with torch.no_grad():
        state_norm = norm(state)
        scales = [(state_norm / (norm(d) + eps * math.sqrt(C))).clamp_(max=rho) for d in details]
    return [d * s.to(d.dtype) for d, s in zip(details, scales)]


# ------------------------------------------------------------------------------- the Triton kernels
#
# One program per tile of BT tokens (token_tile), (queries, tokens, channels) blocks. The sources
# and the queries' rows are read through `table`, one int64 tensor of addresses and flags (see
# source_table), so that no source is stacked or copied and every row is its own tensor.

if triton is not None:
    @triton.jit
    def _depth_mix_fwd(table,      # (5S + 2M,) int64: see source_table
                       LOW,        # any source in the other dtype (its pointer type), or OUT
                       Q,          # (M, C) the queries
                       BIAS,       # (M, S) or None
                       PRIOR,      # (M, N, C) or None: the prior's mixed
                       PRIOR_LSE,  # (M, N) or None
                       OUT,        # the first row's mixed (its pointer type)
                       LSE,        # the first row's lse (its pointer type)
                       S, M, N, C, eps, rho, match_eps,
                       HAS_BIAS: tl.constexpr, HAS_PRIOR: tl.constexpr, ACC: tl.constexpr,
                       BM: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        # a tile of BT tokens: (queries, tokens, channels) blocks, (queries, tokens) statistics
        toks = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        rows, cols = tl.arange(0, BM), tl.arange(0, BC)
        rmask, tmask, cmask = rows < M, toks < N, cols < C
        stat_at, stat_mask = rows[:, None] * N + toks[None, :], rmask[:, None] & tmask[None, :]
        v_at, v_mask = toks[:, None] * C + cols[None, :], tmask[:, None] & cmask[None, :]
        at = rows[:, None, None] * N * C + v_at[None, :, :]  # (a prior: a row per query)
        mask = stat_mask[:, :, None] & cmask[None, None, :]
        # each query's rows of the outputs (mixed, lse) by their addresses, table[3S + j] and
        # table[3S + M + j]: separate tensors, whose gradients reach the backward as they are
        out = tl.load(table + 3 * S + rows, mask=rmask, other=0)
        out = out.to(tl.pointer_type(OUT.dtype.element_ty))
        lse_out = tl.load(table + 3 * S + M + rows, mask=rmask, other=0)
        lse_out = lse_out.to(tl.pointer_type(LSE.dtype.element_ty))
        q = tl.load(Q + rows[:, None] * C + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.).to(ACC)
        if HAS_PRIOR:  # the sources read before: one more source, with its log-sum-exp as its logit
            run_max = tl.load(PRIOR_LSE + stat_at, mask=stat_mask, other=0.).to(ACC)
            run_sum = tl.full((BM, BT), 1., ACC)
            acc = tl.load(PRIOR + at, mask=mask, other=0.).to(ACC)
        else:
            run_max = tl.full((BM, BT), float('-inf'), ACC)
            run_sum = tl.zeros((BM, BT), ACC)
            acc = tl.zeros((BM, BT, BC), ACC)
        state_ss = tl.zeros((BT,), ACC)  # the sum of squares of the last source not matched
        for s in range(S):  # online softmax over the sources: each is read once, in its dtype
            addr = tl.load(table + s)  # (inline: the interpreter is slow to call a jit function)
            if tl.load(table + S + s) == 0:  # table[S + s]: 0 OUT's dtype, 1 LOW's
                v = tl.load(addr.to(tl.pointer_type(OUT.dtype.element_ty)) + v_at, mask=v_mask,
                            other=0.).to(ACC)
            else:
                v = tl.load(addr.to(tl.pointer_type(LOW.dtype.element_ty)) + v_at, mask=v_mask,
                            other=0.).to(ACC)
            ss = tl.sum(v * v, axis=1)
            if tl.load(table + 2 * S + s) != 0:  # a matched detail: scaled to its state's RMS
                v *= tl.minimum(tl.sqrt(state_ss / C) / (tl.sqrt(ss / C) + match_eps), rho)[:, None]
                ss = tl.sum(v * v, axis=1)
            else:
                state_ss = ss
            r = 1 / tl.sqrt(ss / C + eps)
            logit = r[None, :] * tl.sum(q[:, None, :] * v[None, :, :], axis=2)
            if HAS_BIAS:
                logit += tl.load(BIAS + rows * S + s, mask=rmask, other=0.).to(ACC)[:, None]
            new_max = tl.maximum(run_max, logit)
            old, p = tl.exp(run_max - new_max), tl.exp(logit - new_max)
            run_sum = run_sum * old + p
            acc = acc * old[:, :, None] + p[:, :, None] * v[None, :, :]
            run_max = new_max
        mixed = acc / run_sum[:, :, None]
        tl.store(out[:, None, None] + v_at[None, :, :], mixed.to(OUT.dtype.element_ty), mask=mask)
        tl.store(lse_out[:, None] + toks[None, :], run_max + tl.log(run_sum), mask=stat_mask)

    @triton.jit
    def _depth_mix_bwd(table,        # (5S + 4M,) int64: see source_table
                       LOW,          # as in the forward
                       Q,            # (M, C)
                       BIAS,         # (M, S) or None
                       PRIOR,        # (M, N, C) or None
                       PRIOR_LSE,    # (M, N) or None
                       OUT,          # the first row's mixed (its pointer type)
                       LSE,          # the first row's lse (its pointer type)
                       G,            # a row's gradient of mixed (its pointer type)
                       GLSE,         # a row's gradient of lse (its pointer type)
                       DQ,           # (programs, M, C) each program's partial sum
                       DB,           # (programs, M, S) or None: likewise
                       D_PRIOR,      # (M, N, C) or None
                       D_PRIOR_LSE,  # (M, N) or None
                       S, M, N, C, eps, rho, match_eps,
                       HAS_BIAS: tl.constexpr, HAS_PRIOR: tl.constexpr, HAS_GLSE: tl.constexpr,
                       ACC: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                       BS: tl.constexpr):
        pid, programs = tl.program_id(0), tl.num_programs(0)
        rows, cols, srcs = tl.arange(0, BM), tl.arange(0, BC), tl.arange(0, BS)
        rmask, cmask = rows < M, cols < C
        q = tl.load(Q + rows[:, None] * C + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                    other=0.).to(ACC)
        # each query's rows by their addresses, as in the forward: table[5S + j] its mixed, then its
        # lse, then their gradients (address 0: none, read as zeros)
        rows_at = table + 5 * S + rows
        out = tl.load(rows_at, mask=rmask, other=0).to(tl.pointer_type(OUT.dtype.element_ty))
        lse_rows = tl.load(rows_at + M, mask=rmask, other=0)
        lse_rows = lse_rows.to(tl.pointer_type(LSE.dtype.element_ty))
        g_rows = tl.load(rows_at + 2 * M, mask=rmask, other=0)
        glse_rows = tl.load(rows_at + 3 * M, mask=rmask, other=0)
        g_given, glse_given = g_rows != 0, glse_rows != 0
        g_rows = g_rows.to(tl.pointer_type(G.dtype.element_ty))
        glse_rows = glse_rows.to(tl.pointer_type(GLSE.dtype.element_ty))
        dq = tl.zeros((BM, BC), ACC)
        db = tl.zeros((BM, BS), ACC)
        for tile in range(pid, tl.cdiv(N, BT), programs):  # every programs-th tile of BT tokens
            # int64 tokens (the interpreter: Python ints)
            toks = (pid.to(tl.int64) + (tile - pid)) * BT + tl.arange(0, BT)
            tmask = toks < N
            stat_at, stat_mask = rows[:, None] * N + toks[None, :], rmask[:, None] & tmask[None, :]
            v_at, v_mask = toks[:, None] * C + cols[None, :], tmask[:, None] & cmask[None, :]
            at = rows[:, None, None] * N * C + v_at[None, :, :]  # (a prior's)
            mask = stat_mask[:, :, None] & cmask[None, None, :]
            g = tl.load(g_rows[:, None, None] + v_at[None, :, :],
                        mask=mask & g_given[:, None, None], other=0.).to(ACC)
            mixed = tl.load(out[:, None, None] + v_at[None, :, :], mask=mask, other=0.).to(ACC)
            g_out = tl.sum(g * mixed, axis=2)
            g_lse = tl.zeros((BM, BT), ACC)
            if HAS_GLSE:
                g_lse = tl.load(glse_rows[:, None] + toks[None, :],
                                mask=stat_mask & glse_given[:, None], other=0.).to(ACC)
            lse = tl.load(lse_rows[:, None] + toks[None, :], mask=stat_mask, other=0.).to(ACC)
            if HAS_PRIOR:
                prior = tl.load(PRIOR + at, mask=mask, other=0.).to(ACC)
                prior_lse = tl.load(PRIOR_LSE + stat_at, mask=stat_mask, other=0.).to(ACC)
                w = tl.where(stat_mask, tl.exp(prior_lse - lse), 0.)
                tl.store(D_PRIOR + at, (w[:, :, None] * g).to(D_PRIOR.dtype.element_ty), mask=mask)
                d_prior_lse = w * (tl.sum(g * prior, axis=2) - g_out + g_lse)
                tl.store(D_PRIOR_LSE + stat_at, d_prior_lse.to(D_PRIOR_LSE.dtype.element_ty),
                         mask=stat_mask)
            state_ss = tl.zeros((BT,), ACC)
            for s in range(S):  # as in the forward
                addr, low = tl.load(table + s), tl.load(table + S + s)
                if low == 0:
                    v = tl.load(addr.to(tl.pointer_type(OUT.dtype.element_ty)) + v_at,
                                mask=v_mask, other=0.).to(ACC)
                else:
                    v = tl.load(addr.to(tl.pointer_type(LOW.dtype.element_ty)) + v_at,
                                mask=v_mask, other=0.).to(ACC)
                ss, scale = tl.sum(v * v, axis=1), tl.full((BT,), 1., ACC)
                if tl.load(table + 2 * S + s) != 0:
                    scale = tl.minimum(tl.sqrt(state_ss / C) / (tl.sqrt(ss / C) + match_eps), rho)
                    v *= scale[:, None]
                    ss = tl.sum(v * v, axis=1)
                else:
                    state_ss = ss
                r = 1 / tl.sqrt(ss / C + eps)
                score = r[None, :] * tl.sum(q[:, None, :] * v[None, :, :], axis=2)
                logit = score
                if HAS_BIAS:
                    logit += tl.load(BIAS + rows * S + s, mask=rmask, other=0.).to(ACC)[:, None]
                w = tl.where(stat_mask, tl.exp(logit - lse), 0.)
                dl = w * (tl.sum(g * v[None, :, :], axis=2) - g_out + g_lse)  # d loss / d logit
                dv = (tl.sum(w[:, :, None] * g, axis=0)
                      + r[:, None] * tl.sum(dl[:, :, None] * q[:, None, :], axis=0)
                      - (r * r * tl.sum(dl * score, axis=0) / C)[:, None] * v)
                dv = dv * scale[:, None]  # (s detached)
                # each source's gradient in its dtype, written, or added (table[4S + s] = 1) to
                # what other reads of it wrote there
                dv_at, add = tl.load(table + 3 * S + s), tl.load(table + 4 * S + s)
                if low == 0:  # (no name may hold two pointer types: the compiler refuses)
                    dv_hi = dv_at.to(tl.pointer_type(OUT.dtype.element_ty)) + v_at
                    if add != 0:
                        dv += tl.load(dv_hi, mask=v_mask, other=0.).to(ACC)
                    tl.store(dv_hi, dv.to(OUT.dtype.element_ty), mask=v_mask)
                else:
                    dv_lo = dv_at.to(tl.pointer_type(LOW.dtype.element_ty)) + v_at
                    if add != 0:
                        dv += tl.load(dv_lo, mask=v_mask, other=0.).to(ACC)
                    tl.store(dv_lo, dv.to(LOW.dtype.element_ty), mask=v_mask)
                dq += tl.sum((dl * r[None, :])[:, :, None] * v[None, :, :], axis=1)
                if HAS_BIAS:
                    db += tl.where(srcs[None, :] == s, tl.sum(dl, axis=1)[:, None], 0.)
        tl.store(DQ + pid * M * C + rows[:, None] * C + cols[None, :], dq,
                 mask=rmask[:, None] & cmask[None, :])
        if HAS_BIAS:
            tl.store(DB + pid * M * S + rows[:, None] * S + srcs[None, :], db,
                     mask=rmask[:, None] & (srcs[None, :] < S))


def readable(sources, dtype):
    """The depth-mix kernels read each source in the mix's dtype or in one other (under autocast: a
    float32 e beside bfloat16 updates) through its own pointer type, so nothing is copied to one
    dtype; a source of a third dtype is (a temporary copy). -> (the sources, contiguous, and one of
    the other dtype for its pointer type, or None)."""
    others = other_dtypes(sources, dtype)
    low = others.pop() if len(others) == 1 else dtype
    sources = [v.contiguous() if v.dtype in (dtype, low) else v.to(dtype).contiguous()
               for v in sources]
    return sources, next((v for v in sources if v.dtype != dtype), None)


def source_table(sources, match, dtype, grads=(), add=(), rows=()):
    """One table for a depth-mix kernel (one copy to the GPU): the sources' addresses, their kinds
    (0: `dtype`, 1: the other), whether each is a matched detail (1; see Matched), backward the
    addresses of their gradients and whether each is written (0) or added to (1), then the
    addresses of the queries' rows (0: a gradient that is none)."""
    table = [v.data_ptr() for v in sources] + [int(v.dtype != dtype) for v in sources] + list(match)
    table += [g.data_ptr() for g in grads] + list(add)
    table += [0 if t is None else t.data_ptr() for t in rows]
    return on_device(table, sources[0].device)


def contiguous(t):
    """t contiguous, or None."""
    return None if t is None else t.contiguous()


def read_inputs(queries, bias, prior_mixed, prior_lse, mixed, lse, low):
    """The arguments of both depth-mix kernels that give a read's inputs and the types of its rows
    (the kernels take the rows themselves by their addresses in the table)."""
    return dict(LOW=mixed[0] if low is None else low,  # (its pointer type)
                Q=queries.contiguous(),                # (m, C)
                BIAS=contiguous(bias),                 # (m, S) or None
                PRIOR=contiguous(prior_mixed),         # (m, B, T, C) or None
                PRIOR_LSE=contiguous(prior_lse),       # (m, B, T) or None
                OUT=mixed[0],                          # (its pointer type)
                LSE=lse[0])                            # (its pointer type)


# ----------------------------------------------------------------------------------- the custom ops

@torch.library.custom_op('resroute::depth_mix', mutates_args=())
def _triton_depth_mix(queries: Tensor, bias: Optional[Tensor], sources: List[Tensor],
                      match: List[int], rho: float, prior_mixed: Optional[Tensor],
                      prior_lse: Optional[Tensor],
                      single: bool) -> Tuple[List[Tensor], List[Tensor]]:
    """The m queries' rows, mixed (B, T, C) and lse (B, T) each: DepthMix's (m, B, T, C) and
    (m, B, T) as separate tensors. The sources with match[s] = 1 are read matched (Matched, rho).
    A prior: (m, B, T, C) and (m, B, T), or a row each for one query. single: one query's read,
    whose lse no one reads. The bias: any contiguous tensor of m S numbers (a query's row after
    another); its gradient has its shape."""
    dtype = _mix_dtype(sources, prior_mixed)
    acc, acc_tl = accumulator(dtype)
    sources, low = readable(sources, dtype)
    (m, C), S, N = queries.shape, len(sources), sources[0].numel() // queries.shape[1]
    mixed = [sources[0].new_empty(sources[0].shape, dtype=dtype) for _ in range(m)]
    lse = [torch.empty(sources[0].shape[:-1], device=queries.device, dtype=acc) for _ in range(m)]
    BT = token_tile(m, C, N)
    _depth_mix_fwd[(triton.cdiv(N, BT),)](
        table=source_table(sources, match, dtype, rows=mixed + lse),
        **read_inputs(queries, bias, prior_mixed, prior_lse, mixed, lse, low),
        S=S, M=m, N=N, C=C, eps=RMS_EPS, rho=rho, match_eps=MATCH_EPS,
        HAS_BIAS=bias is not None, HAS_PRIOR=prior_mixed is not None, ACC=acc_tl,
        BM=next_pow2(m), BT=BT, BC=next_pow2(C))
    return mixed, lse


@_triton_depth_mix.register_fake
def _(queries, bias, sources, match, rho, prior_mixed, prior_lse, single):
    shape, dtype, m = sources[0].shape, _mix_dtype(sources, prior_mixed), len(queries)
    return ([sources[0].new_empty(shape, dtype=dtype) for _ in range(m)],
            [queries.new_empty(shape[:-1], dtype=accumulator(dtype)[0]) for _ in range(m)])


def saved_rows(ctx, mixed, lse, single):
    """The rows a read saves for its backward (rows_saved unpacks them): mixed and lse; a single
    query's lse (single) has no reader after the read: it is marked non-differentiable and kept on
    ctx instead (autograd detaches each output it saves, once when saved and once when unpacked; a
    tensor without a graph node makes no reference cycle there) -> the rows to save."""
    ctx.rows, ctx.lse = len(mixed), lse if single else None
    if single:
        ctx.mark_non_differentiable(*lse)
        return [*mixed]
    return [*mixed, *lse]


def rows_saved(ctx, saved):
    """saved_rows's rows at the head of `saved` -> mixed, lse, the rest."""
    m = ctx.rows
    if ctx.lse is not None:
        return saved[:m], ctx.lse, saved[m:]
    return saved[:m], saved[m:2 * m], saved[2 * m:]


def _depth_mix_setup(ctx, inputs, output):
    queries, bias, sources, match, rho, prior_mixed, prior_lse, single = inputs
    ctx.match = match, rho
    rows = saved_rows(ctx, *output, single)
    ctx.save_for_backward(queries, bias, prior_mixed, prior_lse, *rows, *sources)
    # an unused row gets no gradient (the kernel reads zeros), not a tensor of zeros
    ctx.set_materialize_grads(False)


def _depth_mix_grads(ctx, grad_mixed, grad_lse):
    queries, bias, prior_mixed, prior_lse, *saved = ctx.saved_tensors
    mixed, lse, sources = rows_saved(ctx, saved)
    dq, grads, extra = _triton_depth_mix_backward(queries, bias, sources, *ctx.match, prior_mixed,
                                                  prior_lse, mixed, lse, grad_mixed, grad_lse)
    extra = iter(extra)
    db = next(extra) if bias is not None else None
    return dq, db, grads, None, None, next(extra, None), next(extra, None), None


_triton_depth_mix.register_autograd(_depth_mix_grads, setup_context=_depth_mix_setup)


@torch.library.custom_op('resroute::depth_mix_backward', mutates_args=())
def _triton_depth_mix_backward(queries: Tensor, bias: Optional[Tensor], sources: List[Tensor],
                               match: List[int], rho: float, prior_mixed: Optional[Tensor],
                               prior_lse: Optional[Tensor], mixed: List[Tensor],
                               lse: List[Tensor], grad_mixed: List[Optional[Tensor]],
                               grad_lse: List[Optional[Tensor]]
                               ) -> Tuple[Tensor, List[Tensor], List[Tensor]]:
    """The gradients of the queries, of the sources, and of the bias and the prior where given,
    from the rows' gradients (None: none)."""
    dtypes = [v.dtype for v in sources]
    sources = readable(sources, mixed[0].dtype)[0]
    grads = [torch.empty_like(v) for v in sources]
    dq, extra = _depth_mix_backward_into(queries, bias, sources, match, rho, prior_mixed,
                                         prior_lse, mixed, lse, grad_mixed, grad_lse, grads,
                                         [0] * len(sources))
    return dq, [cast(g, t) for g, t in zip(grads, dtypes)], extra


@_triton_depth_mix_backward.register_fake
def _(queries, bias, sources, match, rho, prior_mixed, prior_lse, mixed, lse, grad_mixed,
      grad_lse):
    extra = [torch.empty_like(t) for t in (bias, prior_mixed, prior_lse) if t is not None]
    return torch.empty_like(queries), [torch.empty_like(v) for v in sources], extra


def _depth_mix_backward_into(queries, bias, sources, match, rho, prior_mixed, prior_lse, mixed,
                             lse, grad_mixed, grad_lse, grads, add):
    """The backward kernel's launch: each source's gradient written into, or added (add[s] = 1)
    to, grads[s]; -> the queries' gradient, [the bias's] + [the prior's two] where given. The rows
    (mixed, lse) and their gradients (None: none) by their addresses."""
    dtype = mixed[0].dtype
    sources, low = readable(sources, dtype)
    acc, acc_tl = accumulator(dtype)
    (m, C), S, N = queries.shape, len(sources), sources[0].numel() // queries.shape[1]
    BT = token_tile(m, C, N)
    programs = reduction_programs(triton.cdiv(N, BT))
    dq = torch.empty((programs, m, C), device=queries.device, dtype=acc)
    db = None
    if bias is not None:
        db = torch.empty((programs,) + bias.shape, device=queries.device, dtype=acc)
    has_prior = prior_mixed is not None
    d_prior = torch.empty_like(prior_mixed) if has_prior else None
    d_prior_lse = torch.empty_like(prior_lse) if has_prior else None
    grad_mixed, grad_lse = [contiguous(g) for g in grad_mixed], [contiguous(g) for g in grad_lse]
    given = lambda rows, default: next((t for t in rows if t is not None), default)
    _depth_mix_bwd[(programs,)](
        table=source_table(sources, match, dtype, grads, add,
                           [*mixed, *lse, *grad_mixed, *grad_lse]),
        **read_inputs(queries, bias, prior_mixed, prior_lse, mixed, lse, low),
        G=given(grad_mixed, mixed[0]),  # (for their pointer types)
        GLSE=given(grad_lse, lse[0]),
        DQ=dq,
        DB=db,
        D_PRIOR=d_prior,
        D_PRIOR_LSE=d_prior_lse,
        S=S, M=m, N=N, C=C, eps=RMS_EPS, rho=rho, match_eps=MATCH_EPS,
        HAS_BIAS=bias is not None, HAS_PRIOR=has_prior,
        HAS_GLSE=given(grad_lse, None) is not None, ACC=acc_tl,
        BM=next_pow2(m), BT=BT, BC=next_pow2(C), BS=next_pow2(S))
    extra = [] if db is None else [db.sum(0).to(bias.dtype)]
    if has_prior:
        extra += [d_prior, d_prior_lse]
    return dq.sum(0).to(queries.dtype), extra


@torch.library.custom_op('resroute::depth_mix_backward_pooled', mutates_args=('grads',))
def _triton_depth_mix_backward_pooled(queries: Tensor, bias: Optional[Tensor],
                                      sources: List[Tensor], match: List[int], rho: float,
                                      mixed: List[Tensor], lse: List[Tensor],
                                      grad_mixed: List[Optional[Tensor]],
                                      grad_lse: List[Optional[Tensor]], grads: List[Tensor],
                                      add: List[int]) -> Tuple[Tensor, List[Tensor]]:
    """A pooled read's backward (PooledRead): the sources' gradients into `grads`."""
    return _depth_mix_backward_into(queries, bias, sources, match, rho, None, None, mixed, lse,
                                    grad_mixed, grad_lse, grads, add)


@_triton_depth_mix_backward_pooled.register_fake
def _(queries, bias, sources, match, rho, mixed, lse, grad_mixed, grad_lse, grads, add):
    return torch.empty_like(queries), [] if bias is None else [torch.empty_like(bias)]


# ------------------------------------------------------------------------------------ the Functions

class DepthMix(torch.autograd.Function):
    """m queries read a list of S sources in PyTorch (mix_torch), with its hand-written backward.
    queries (m, C), bias (m, S) or None -> mixed (m, B, T, C), lse (m, B, T); single (m = 1): (B, T,
    C), None; a prior (mixed_0, lse_0) of sources read before is merged as one more source. It saves
    per-token numbers (1/RMS per source; scores and weights per query and source) and references to
    the sources, never a stacked copy (with plain autograd, Full AttnRes keeps an (S, B, T, C) stack
    per sublayer: L^2 memory; on a CPU, passes over a temporary stack of the sources cost 1.2-5x the
    time, measured). The kernels' twin: the custom op _triton_depth_mix."""

    @staticmethod
    def forward(ctx, queries, bias, prior_mixed, prior_lse, single, *sources):
        mixed, lse, saved = mix_torch(queries, bias, sources, prior_mixed, prior_lse, single)
        ctx.save_for_backward(queries, bias, prior_mixed, *saved, *sources)
        # an unused lse gets no gradient, rather than a tensor of zeros
        ctx.set_materialize_grads(False)
        return cast(mixed, _mix_dtype(sources, prior_mixed)), lse

    @staticmethod
    def backward(ctx, grad_mixed, grad_lse):
        queries, bias, prior_mixed, *saved = ctx.saved_tensors
        saved, sources = saved[:3], saved[3:]
        dq, extra, grads = mix_torch_backward(queries, bias, sources, prior_mixed, saved,
                                              grad_mixed, grad_lse, [None] * len(sources))
        extra = iter(extra)
        db = next(extra) if bias is not None else None
        sources_grads = [cast(g, v.dtype) for g, v in zip(grads, sources)]
        return dq, db, next(extra, None), next(extra, None), None, *sources_grads


class PooledRead(torch.autograd.Function):
    """One depth read of a Reads' pooled sources (see Reads): forward as an unpooled read; backward,
    each source's share is added into its pooled gradient, and the gradients of the sources this
    read owns (it read them first) are returned. The backend's work is the Reads' (forward_pooled,
    backward_pooled)."""

    @staticmethod
    def forward(ctx, queries, bias, reads, keys, owned, single, match, *sources):
        out = reads.forward_pooled(ctx, queries, bias, sources, match, single)
        ctx.reads, ctx.keys, ctx.owned, ctx.match = reads, keys, owned, match
        # an unused lse gets no gradient, rather than a tensor of zeros
        ctx.set_materialize_grads(False)
        return out

    @staticmethod
    def backward(ctx, *grad_out):
        dq, db, sources = ctx.reads.backward_pooled(ctx, grad_out)
        owned = [cast(ctx.reads.pool.take(key), v.dtype) if own else None
                 for key, own, v in zip(ctx.keys, ctx.owned, sources)]
        return dq, db, None, None, None, None, None, *owned


# ---------------------------------------------------------------------------------------- the reads

def unbound_rows(mixed, lse, single):
    """A read's outputs, mixed (m, B, T, C) and lse (m, B, T), as its m rows [(mixed, lse)]; one
    (m = 1): [(mixed, None)] as they are."""
    return [(mixed, lse)] if single else list(zip(mixed.unbind(), lse.unbind()))


class Reads:
    """The depth reads of one forward, in PyTorch (TritonReads: with the kernels); reads(backend)
    makes one. Three reads, by how many queries read and whether a prior row is given (a row: a
    read left open for more sources, (mixed (B, T, C), lse (B, T))):

        many(queries, sources, bias)       phase 1: m queries read the same sources -> m rows
        continued(row, query, more, bias)  phase 2: a query's row merges `more` -> (B, T, C)
        one(query, sources, bias)          a query reads, no prior (output mixers) -> (B, T, C)

    and matched(details, state, rho), WAV's RMS-matched details as the reads take them.

    The sources that many and one read are the finished sources of the forward, which every later
    block's phase-1 read and the output mixer read again: in eager mode each has one gradient, in
    a GradPool, which every read's backward adds its share to and its first reader hands to
    autograd (autograd's own sum per later reader and source cost WAV at 12 layers 9.7 operators
    per sublayer with the kernels). Compiled, the compiler plans the sums."""

    def __init__(self):
        self.pooled = not torch.compiler.is_compiling()
        self.seen, self.pool, self.rinv = set(), GradPool(), {}

    # the three reads
    def many(self, queries, sources, bias):
        """Phase 1: queries (m, C) read the same sources in one pass, bias (m, S) or None -> the m
        rows, separate tensors (indexing row k of one tensor would give every row's backward a
        zero gradient of the whole size)."""
        return self.pool_read(queries, bias, sources, False)

    def continued(self, row, query, more, bias):
        """Phase 2: one query (1, C) continues its row from phase 1, merging the sources `more`
        that it alone reads (bias (1, S) or None) by an online softmax, in the same pass that reads
        them -> (B, T, C); the row's mixed as it is when there are none."""
        return self.rows(query, bias, more, row, single=True)[0][0] if more else row[0]

    def one(self, query, sources, bias):
        """One query (1, C) reads the sources, with no prior -> (B, T, C)."""
        return self.pool_read(query, bias, sources, True)[0][0]

    def matched(self, details, state, rho):
        """The details RMS-matched to their state (WAV): copies, matched here."""
        return rms_match_torch(details, state, rho) if details else []

    # a read of the backend, unpooled
    def rows(self, queries, bias, sources, prior=None, single=False):
        """m queries (m, C) read S sources, merged with a prior (mixed (m, B, T, C), lse (m, B, T))
        or None -> the m rows [(mixed, lse)]; single (m = 1): [(mixed, None)] (no lse: no one merges
        a single query's read further). The autograd Function's rows are unbound once."""
        prior_mixed, prior_lse = (None, None) if prior is None else prior
        out = DepthMix.apply(queries, bias, prior_mixed, prior_lse, single, *sources)
        return unbound_rows(*out, single)

    # the pool
    def poolable(self, keys, tensors):
        """Whether a read of these sources can go through the pool: each source once."""
        return self.pooled and len(set(keys)) == len(keys)

    def pool_read(self, queries, bias, sources, single):
        keys = [id(v) for v in sources]  # (a Matched: a source of its own)
        tensors, match, rho = match_flags(sources)
        if not self.poolable(keys, tensors):
            return self.rows(queries, bias, sources, single=single)
        owned = [key not in self.seen for key in keys]
        self.seen.update(keys)
        out = PooledRead.apply(queries, bias, self, keys, owned, single, (match, rho), *tensors)
        return self.pooled_rows(out, single)

    def cached_rms_inverse(self, sources):
        """The sources' 1/RMS (S, B, T, 1), each source's computed once per forward."""
        new = [v for v in sources if id(v) not in self.rinv]
        if new:
            rinv = stacked_rms_inverse([upcast(v) for v in new]).unbind()
            self.rinv.update(zip(map(id, new), rinv))
        return stacked([self.rinv[id(v)] for v in sources])

    def forward_pooled(self, ctx, queries, bias, sources, match, single):
        """PooledRead's forward: the read, and what its backward needs saved on ctx."""
        mixed, lse, saved = mix_torch(queries, bias, sources, None, None, single,
                                      self.cached_rms_inverse(sources))
        ctx.save_for_backward(queries, bias, *saved, *sources)
        return cast(mixed, common_dtype(sources)), lse

    def pooled_rows(self, out, single):
        """PooledRead's outputs as rows (see rows)."""
        return unbound_rows(*out, single)

    def backward_pooled(self, ctx, grad_out):
        """PooledRead's backward: each source's share added into its pooled gradient (in the
        computing precision) -> the queries' and the bias's gradients, and the sources."""
        (grad_mixed, grad_lse), (queries, bias, rinv, scores, weights, *sources) = (
            grad_out, ctx.saved_tensors)
        shares = [self.pool.share(key) for key in ctx.keys]
        saved = rinv, scores, weights
        dq, extra, shares = mix_torch_backward(queries, bias, sources, None, saved, grad_mixed,
                                               grad_lse, shares)
        for key, share in zip(ctx.keys, shares):
            self.pool.put(key, share)
        return dq, extra[0] if bias is not None else None, sources


class TritonReads(Reads):
    """Reads with the Triton kernels: each read one launch forward and one backward; the rows are
    separate tensors from the kernel; a matched detail (Matched) is matched by the read that reads
    it."""

    def matched(self, details, state, rho):
        return [Matched(d, state, rho) for d in details]

    def rows(self, queries, bias, sources, prior=None, single=False):
        prior_mixed, prior_lse = (None, None) if prior is None else prior
        mixed, lse = _triton_depth_mix(queries, bias, *match_flags(sources), prior_mixed, prior_lse,
                                       single)
        return list(zip(mixed, lse))

    def poolable(self, keys, tensors):
        """As Reads', and of two dtypes at most (a third is promoted: a copy, read unpooled)."""
        two_dtypes = len(other_dtypes(tensors, common_dtype(tensors))) <= 1
        return two_dtypes and super().poolable(keys, tensors)

    def forward_pooled(self, ctx, queries, bias, sources, match, single):
        mixed, lse = _triton_depth_mix(queries, bias, list(sources), *match, None, None, single)
        ctx.save_for_backward(queries, bias, *saved_rows(ctx, mixed, lse, single), *sources)
        return (*mixed, *lse)

    def pooled_rows(self, out, single):
        """The kernel's rows: the mixed, then the lse, each a tensor."""
        return list(zip(out[:len(out) // 2], out[len(out) // 2:]))

    def backward_pooled(self, ctx, grad_out):
        queries, bias, *saved = ctx.saved_tensors
        mixed, lse, sources = rows_saved(ctx, saved)
        add = [int(self.pool.share(key) is not None) for key in ctx.keys]
        for key, v in zip(ctx.keys, sources):
            if self.pool.share(key) is None:  # its last reader, the first to run backward
                self.pool.put(key, torch.empty(v.shape, dtype=v.dtype, device=v.device))
        grads = [self.pool.share(key) for key in ctx.keys]
        dq, extra = _triton_depth_mix_backward_pooled(
            queries, bias, sources, *ctx.match, mixed, lse, grad_out[:len(mixed)],
            grad_out[len(mixed):], grads, add)
        return dq, extra[0] if bias is not None else None, sources


def reads(backend):
    """The depth reads of one forward: the family's one choice of backend."""
    return TritonReads() if backend == 'triton' else Reads()


# ==================================================================== 2. the AttnRes family and WAV
#
# Full, Block and Delta AttnRes and WAV as their classes compute them, with every read a depth mix
# in the AttnRes paper's two phases. Sublayer i reads h_i = sum_s softmax_s(q_i . RMSNorm(v_s)
# + b_is) v_s over its sources (Full: e and every update so far; Block: e, the finished blocks'
# sums and its own block's partial sum; WAV: those and the blocks' matched details). Phase 1: the
# queries of a block (Full and Delta AttnRes: of a chunk of about sqrt(L) sublayers) read the
# sources finished before it in one pass; phase 2: each sublayer continues its row with the
# sources of its own block. The backward is the reads' (section 1). The schedules read through a
# Reads, which holds the backend.

# ------------------------------------------------------------------------------------- the Function

class GatedAdd(torch.autograd.Function):
    """x + gate read for a scalar gate: one operator forward, two backward (autograd's mul and add
    take two forward and three backward: the gate's gradient as a product and a sum,
    not one dot)."""

    @staticmethod
    def forward(ctx, x, gate, read):
        ctx.save_for_backward(gate, read)
        return torch.addcmul(x, gate, read)

    @staticmethod
    def backward(ctx, grad):
        gate, read = ctx.saved_tensors
        grad_gate = torch.dot(grad.reshape(-1), read.reshape(-1).to(grad.dtype)).to(gate.dtype)
        return grad, grad_gate, (grad * gate).to(read.dtype)


# ------------------------------------------------------------------------------------ the schedules

def rows_of(queries, start, m):
    """The queries of sublayers start..start+m-1 as one (m, C) tensor for a phase-1 read; `queries`
    are the parameter's rows (1, C), split once per forward: one gradient node for them all, where
    indexing the parameter would give each read a full-size zero gradient."""
    return torch.cat(queries[start:start + m]) if m > 1 else queries[start]


def chunked(queries, e, L, read, step):
    """Full AttnRes's reads in chunks of about sqrt(L) sublayers: the chunk's queries read the
    finished sources in one pass, and each merges the chunk's own fresh updates. queries: rows;
    read: a Reads; step(i, h) runs sublayer i on its read h and returns its update. Returns the
    sources e, u_0, ..., u_{L-1}."""
    sources, chunk = [e], max(1, math.isqrt(L))
    for start in range(0, L, chunk):
        m = min(chunk, L - start)
        finished, fresh = read.many(rows_of(queries, start, m), sources, None), []
        for k in range(m):
            h = read.continued(finished[k], queries[start + k], fresh, None)
            fresh.append(step(start + k, h))
        sources = sources + fresh
    return sources


def attnres(module, x, sublayers, backend):
    """Full AttnRes, chunked; the output mixer reads every source."""
    queries, L, read = module.read.queries.split(1), len(sublayers), reads(backend)
    sources = chunked(queries, x, L, read, lambda i, h: sublayers[i](h))
    return read.one(queries[L], sources, None)


def delta_attnres(module, x, sublayers, backend):
    """Delta AttnRes with Full AttnRes's chunked reads of the deltas; x is the PreNorm stream."""
    gates = torch.sigmoid(module.gate_logit).unbind(0)

    def step(i, read):
        nonlocal x
        u = sublayers[i](GatedAdd.apply(x, gates[i], read))
        x = x + u
        return u
    chunked(module.read.queries.split(1), x, len(sublayers), reads(backend), step)
    return x


def block_attnres(module, x, sublayers, backend):
    """Block AttnRes in two phases: the queries of a block read e and the finished block sums in one
    pass; each then merges the block's partial sum PC, once the block has begun."""
    queries, L, sources, read = module.read.queries.split(1), len(sublayers), [x], reads(backend)
    for start in range(0, L, module.block_len):
        m = min(module.block_len, L - start)
        finished, partial = read.many(rows_of(queries, start, m), sources, None), None
        for k in range(m):
            more = [] if partial is None else [partial]
            h = read.continued(finished[k], queries[start + k], more, None)
            u = sublayers[start + k](h)
            partial = u if partial is None else partial + u
        sources = sources + [partial]
    return read.one(queries[L], sources, None)


def wav_plan(module, L):
    """The types of the sources of every read of one WAV forward (-1: e, a block sum or PC; d >= 0:
    a detail of type d): per block (start, m, the finished pool's types, and for each sublayer k the
    types of the block's own sources it merges: none for k = 0, then PC and the begun details), and
    the types of the whole pool at the end."""
    blocks, pool = [], [-1]
    for start in range(0, L, module.block_len):
        m = min(module.block_len, L - start)
        blocks.append((start, m, pool,
                       [[] if k == 0 else [-1] + module.begun(m, k) for k in range(m)]))
        pool = pool + [-1] + module.begun(m, m)
    return blocks, pool


def detail_biases(module, blocks, readout):
    """Every read's bias, in the order wav() reads (each block's phase 1, its sublayers' phase 2,
    the output mixer), gathered in one indexing of detail_bias padded with a zero column (type -1):
    one operator forward and a few backward instead of several per read. -> a list of each read's
    rows x S numbers, flat (the reads take the rows one after another: no view per read)."""
    padded = F.pad(module.detail_bias, (1, 0))
    width, index, shapes = padded.shape[1], [], []

    def read(rows, types):
        index.extend(r * width + t + 1 for r in rows for t in types)
        shapes.append((len(rows), len(types)))
    for start, m, pool, own in blocks:
        read(range(start, start + m), pool)
        for k in range(1, m):
            read([start + k], own[k])
    read([len(padded) - 1], readout)
    flat = padded.flatten()[on_device(index, padded.device)].split([r * c for r, c in shapes])
    return flat


def accumulate(total, c, u):
    """total + c u for a coefficient c: a number of the paper's fixed bases (+1, -1 or 0: a sum, a
    difference or nothing, one operator at most) or a tensor entry of a learned basis."""
    if isinstance(c, Tensor):
        term = c.to(u.dtype) * u
        return term if total is None else total + term
    if c == 0:
        return total
    if total is None:
        return u if c == 1 else -u
    return total + u if c == 1 else total - u


def wav(module, x, sublayers, backend):
    """WAV in Block AttnRes's two phases: the queries of a block read the finished pool (e, the
    block sums and their matched details) in one pass; each then merges PC and the block's partial
    details, which are accumulated online (one tensor per detail type). The plan of the sources'
    types is made first, so that every read's bias is gathered at once."""
    queries, L = module.read.queries.split(1), len(sublayers)
    blocks, types = wav_plan(module, L)
    # the output mixer reads every source, or (conservative) e and the block sums only
    readout = types if module.detail_readout else [t for t in types if t < 0]
    biases = iter(detail_biases(module, blocks, readout))
    sources, read = [x], reads(backend)  # the finished pool
    for start, m, _, own in blocks:
        coeffs = detail_signs(m, module.levels) if module.basis_delta is None else module.basis(m)
        # a fixed basis may repeat a row (m = 2: phase and split are both (+1, -1)):
        # accumulated once
        same = [coeffs.index(row) if module.basis_delta is None else d
                for d, row in enumerate(coeffs)]
        finished = read.many(rows_of(queries, start, m), sources, next(biases))
        partial = raw = None  # PC and the raw partial details P_d
        for k in range(m):
            more = []
            if k > 0:
                more = [partial] + read.matched([raw[d] for d in own[k][1:]], partial, module.rho)
            h = read.continued(finished[k], queries[start + k], more, next(biases) if k else None)
            u = sublayers[start + k](h)
            partial = u if partial is None else partial + u
            if raw is None:
                raw = [None] * len(coeffs)
            raw = [accumulate(raw[d], coeffs[d][k], u) if same[d] == d else None
                   for d in range(len(coeffs))]
            raw = [raw[same[d]] for d in range(len(coeffs))]
        begun = module.begun(m, m)
        # (the last block's details: only by a detail readout)
        read_later = module.detail_readout or start + m < L
        details = [None] * len(begun)
        if read_later:
            details = read.matched([raw[d] for d in begun], partial, module.rho)
        sources = sources + [partial] + details
    if not module.detail_readout:
        sources = [s for s, t in zip(sources, types) if t < 0]
    return read.one(queries[L], sources, next(biases))


# ===================================================== 3. HC and the mHC family: recomputed streams
#
# n streams H (B, T, n, C). Per sublayer i, connections from the streams give its input h = A_m^T H,
# the mixed streams H' = A_r^T H and post, and H <- H' + post^T f(h) (HC: [A_m | A_r] and post = B,
# static plus tanh of a projection of the RMS-normalised streams; mHC-lite: A_m = H_pre,
# A_r = H_res^T, post = H_post, from the flattened streams' projection). The readout: HC's mean,
# mHC-lite's sum of the streams. The twins save no streams: a segment of about sqrt(L) sublayers
# keeps its input streams and a few numbers per token, from which the backward rebuilds the streams.
# Backward of a sublayer: the update's, d H' = d H, d u = sum_s post_s d H_s, d post_s = d H_s . u;
# the mixing's, d H += A d(A^T H), d A = H d(A^T H)^T per token; then the connections' own (HCStep,
# MHCStep: through the projection and the RMS of the streams).

# ---------------------------------------------------------------------------- the PyTorch functions

def stream_mixing(A, H):
    """A^T H per token for streams H (N, n, C): A (N, n, m), or (n, m) for all tokens
    -> (N, m, C)."""
    return torch.bmm(A.mT, H) if A.dim() == 3 else torch.matmul(A.mT, H)


def advance(mixed, post, update):
    """The next streams H' + post^T f(h); post (..., n), or (..., n, 1) as the kernels write it."""
    return torch.addcmul(mixed, post if post.dim() == mixed.dim() else post.unsqueeze(-1),
                         update.unsqueeze(-2))


def advance_backward(grad, update, post):
    """advance's backward, d u = sum_s post_s G_s and d post_s = G_s . u per token, in two batched
    products (the kernels' twin: _triton_advance_backward) -> d update, d post."""
    if post.dim() == 1:  # static HC's post (n,), the same for every token
        d_update = torch.matmul(post.to(grad.dtype), grad)
        d_post = (torch.matmul(grad, update.unsqueeze(-1).to(grad.dtype))
                  .sum_to_size(post.shape + (1,)).squeeze(-1))
        return d_update, d_post
    n, C = grad.shape[-2:]
    G = grad.reshape(-1, n, C)
    d_update = torch.bmm(post.reshape(-1, 1, n).to(G.dtype), G).view(update.shape)
    # (as a row: 5x faster on a CPU)
    d_post = torch.bmm(update.reshape(-1, 1, C).to(G.dtype), G.mT).view(post.shape)
    return d_update, d_post


def flat_streams(H):
    """Streams (..., n, C) as (N, n, C)."""
    return H.view(-1, *H.shape[-2:])


class StreamSegment:
    """A run of consecutive sublayers of a multi-stream method (HC, mHC-lite): the streams entering
    it, what each sublayer's step saved (a few numbers per token, from which it computes its
    connections A and post again: HC's T, the mHC family's H_res, post and 1/RMS, or the kernels'
    XW)
    and each update f(h). Every stream state inside it is rebuilt from these by the forward's own
    ops: H_{j+1} = A_j^T H_j (rows 1..n) + post_j f_j. The streams as the step takes them: H (the
    PyTorch twin), or the kernels' (H, post, u) (see streams)."""

    def __init__(self, start, streams, replay):
        detach = lambda t: None if t is None else t.detach()
        self.streams = (detach(streams) if isinstance(streams, Tensor)
                        else tuple(map(detach, streams)))
        # replay(streams, j, saved, update) -> the streams after sublayer j
        self.start, self.replay = start, replay
        # saved[j - start], updates[j - start]: what sublayer j's step saved, and its update
        self.saved, self.updates, self.rebuilt = [], [], {}

    def streams_at(self, i, autocast):
        """The streams entering sublayer i. The first call rebuilds the segment up to i once; each
        later call (the backward goes down the sublayers) takes its own."""
        if i not in self.rebuilt:
            H = self.streams.contiguous() if isinstance(self.streams, Tensor) else self.streams
            with torch.no_grad(), torch.autocast(**autocast):  # the forward's precision
                for j in range(self.start, i + 1):
                    self.rebuilt[j] = H
                    if j < i:
                        H = self.replay(H, j, self.saved[j - self.start],
                                        self.updates[j - self.start])
        return self.rebuilt.pop(i)


class TorchStreamStep:
    """One sublayer's step in PyTorch, derivatives by hand, for one forward: the stacked connection
    parameters (L, ...) in the forms the step computes with, made once without autograd, and the
    backward's gradient rows, one per sublayer, put in a GradPool, which sublayer 0 (the last to run
    backward) turns into the parameters' gradients (each sublayer's own rows through autograd would
    cost zero-filled full-size gradients and about 70 operators a sublayer). A subclass holds one
    method's maths: __call__(H, i, saved) -> h, H', post and what the replay and the backward need
    (a few numbers per token); backward(...) -> d H, its parameter rows put under i; take() -> the
    parameters' gradients."""

    def __init__(self, params):
        self.params, self.pool = params, GradPool()

    def post_again(self, saved, i):
        """None: Advance saves post."""
        return None

    def rows(self):
        """The rows of every sublayer, stacked, and taken (GradPool.take_stacked)."""
        return self.pool.take_stacked(self.params[0].shape[0])


class HCStep(TorchStreamStep):
    """HC in the forms [A | post] = [width | depth] + [s_a .. s_a, s_b] T, T = tanh(P) (n, n + 2)
    per token, P = rms_norm(H) W per stream. Saves T (as many numbers as A and post); the backward
    takes 1/RMS again from the rebuilt streams."""

    def __init__(self, connections):
        c = connections
        super().__init__([c.width, c.depth]
                         + ([c.width_scale, c.depth_scale, c.proj] if c.dynamic else []))
        with torch.no_grad():
            self.base, self.W_t = torch.cat([c.width, c.depth.unsqueeze(-1)], -1), None
            if c.dynamic:
                L, n = c.depth.shape
                self.scale = torch.cat([c.width_scale.unsqueeze(1).expand(L, n + 1),
                                        c.depth_scale.unsqueeze(1)], 1)
                # W^T (L, K, C): on a CPU, X W with W's few columns in rows is a 2-3x slower GEMM
                # (likewise d W)
                self.W_t = c.proj.mT.contiguous()

    @functools.cached_property
    def W_scaled_t(self):
        """(W s)^T, the backward's, made at its first use: a forward without a backward (decoding)
        makes none."""
        with torch.no_grad():
            return self.W_t * self.scale.unsqueeze(-1)

    def __call__(self, H, i, saved=None):
        """h, H', post of sublayer i and (T,) (static HC: ()) for the streams H (N, n, C); the
        replay gives the forward's saved and takes H' and post only."""
        (N, n, C), Ap, replay = H.shape, self.base[i], saved is not None
        if self.W_t is not None:
            if not replay:  # T = tanh(r (H W)), r = 1/RMS per stream
                P = (torch.mm(H.view(-1, C), self.W_t[i].t()).view(N, n, -1)
                     * rms_inverse(H, keepdim=True))
                saved = (torch.tanh(P),)
            Ap = torch.addcmul(Ap, saved[0], self.scale[i])
        mixed = stream_mixing(Ap[..., 1:-1], H)  # H' = A_r^T H
        if replay:
            return None, mixed, Ap[..., -1], saved
        # h = A_m^T H, a product of its own (in one product with H', f would keep all n + 1 rows
        # alive); post: Advance computes it again (static HC's: a copy)
        h = stream_mixing(Ap[..., :1], H).view(N, C)
        return h, mixed, Ap[..., -1].clone() if self.W_t is None else Ap[..., -1], saved or ()

    def post_again(self, saved, i):
        """A function giving sublayer i's post again from its saved T (Advance's backward: saving
        post would keep n numbers a token more than the segment's T), or None (static HC)."""
        if not saved:
            return None
        return functools.partial(torch.addcmul, self.base[i][:, -1], saved[0][..., -1],
                                 self.scale[i][-1])

    def backward(self, H, i, saved, grad_h, grad_mixed, grad_post):
        (N, n, C), K = H.shape, self.base.shape[-1]
        G = torch.cat([grad_h.unsqueeze(1), grad_mixed], 1)  # d (A^T H): row 0 h, rows 1..n H'
        if not saved:  # static: one A and post for all tokens
            grad_H = torch.matmul(self.base[i][:, :-1], G).to(H.dtype)
            d_Ap = torch.cat([torch.bmm(H, G.mT).sum(0), grad_post.unsqueeze(-1)], -1)
            self.pool.put(i, (d_Ap,))
            return grad_H
        T = saved[0]
        Ap = torch.addcmul(self.base[i], T, self.scale[i])
        grad_H = torch.bmm(Ap[..., :-1], G).to(H.dtype)
        # d [A | post]
        d_Ap = torch.cat([torch.bmm(H, G.mT), grad_post.unsqueeze(-1)], -1).to(T.dtype)
        # d P = scale D: the scale is W_scaled's and d W's
        D = torch.ops.aten.tanh_backward(d_Ap, T)
        r = rms_inverse(H, keepdim=True)
        Hn = H * r
        # P = r (H W): d rms_norm(H) = M = D W_scaled^T, and d H = r (M - (Hn . M) Hn / C); the dots
        # Hn_s . M_s as the diagonal of each token's (n, n) products (on a CPU 2x faster than
        # N n dots)
        M = torch.mm(D.view(-1, K), self.W_scaled_t[i]).view(N, n, C).to(Hn.dtype)
        dot = torch.bmm(M, Hn.mT).diagonal(dim1=-2, dim2=-1).unsqueeze(-1)
        grad_H.addcmul_(M.addcmul_(dot, Hn, value=-1 / C), r)
        # d [width | depth], d [s_a .. s_b] (the sums of d_Ap T per column: a diagonal of one small
        # GEMM), d W^T / scale
        self.pool.put(i, (d_Ap.sum(0), torch.mm(d_Ap.view(-1, K).t(), T.view(-1, K)).diagonal(),
                          torch.mm(D.view(-1, K).t().to(Hn.dtype), Hn.view(-1, C))))
        return grad_H

    def take(self):
        """The gradients of width, depth (and s_a, s_b, W)."""
        rows = self.rows()
        grads = [rows[0][..., :-1].contiguous(), rows[0][..., -1].contiguous()]
        if self.W_t is not None:
            grads += [rows[1][:, :-1].sum(1), rows[1][:, -1].contiguous(),
                      (rows[2] * self.scale.unsqueeze(-1)).mT.contiguous()]
        return [g.to(p.dtype) for g, p in zip(grads, self.params)]


class MHCStep(TorchStreamStep):
    """The mHC family (mHC, KromHC; mHC-lite in MHCLiteStep) with the alphas per column
    a = [a_pre .. a_post .. a_res ..] (K = 2n + H_res's logits): logits a x' W + b, x' = rms_norm of
    the flattened streams; H_res = the coefficients' own mixing of its logits, its backward through
    autograd on those few numbers a token (for mHC, back through its 20 iterations). Saves H_res,
    post and 1/RMS r (n^2 + n + 1 numbers a token); the backward takes the logits again."""

    def __init__(self, coefficients):
        c = coefficients
        super().__init__([c.alpha, c.bias, c.proj])
        (L, K), n = c.bias.shape, c.n
        with torch.no_grad():
            self.alpha = torch.cat([c.alpha[:, :1].expand(L, n), c.alpha[:, 1:2].expand(L, n),
                                    c.alpha[:, 2:].expand(L, K - 2 * n)], 1)
            self.bias, self.W = c.bias.detach(), c.proj.detach()
        self.n, self.split, self.coefficients = n, [n, n, K - 2 * n], c

    @functools.cached_property
    def W_scaled_t(self):
        """(W a)^T (L, K, n C), the backward's, made at its first use: a forward without a backward
        (decoding) makes none. On a CPU, a GEMM with W^T's rows is 1.7x faster than with W's
        columns."""
        with torch.no_grad():
            return (self.W * self.alpha.unsqueeze(1)).mT.contiguous()

    def logits(self, X, r, i):
        """x' W and a x' W + b of the flattened streams X (N, n C)."""
        P = torch.mm(X, self.W[i]) * r
        return P, torch.addcmul(self.bias[i], P, self.alpha[i])

    def residual_mixing(self, logits):
        """H_res (N, n, n) from its logits (N, K - 2n)."""
        return self.coefficients.mixing(logits).to(logits.dtype)

    def residual_backward(self, logits, grad):
        """The gradient of H_res's logits from H_res's, grad (N, n n)."""
        with torch.enable_grad():
            logits = logits.detach().requires_grad_()
            H_res = self.coefficients.mixing(logits)
            return torch.autograd.grad(H_res, logits, grad.view(H_res.shape).to(H_res.dtype))[0]

    def __call__(self, H, i, saved=None):
        """h, H', post of sublayer i and (H_res, post, r) for the streams H (N, n, C); the replay
        gives these and only mixes."""
        if saved is not None:
            return None, torch.bmm(saved[0], H), saved[1], saved
        (N, n, C), X = H.shape, H.view(H.shape[0], -1)
        r = rms_inverse(X, keepdim=True)
        logits = self.logits(X, r, i)[1]
        gates = torch.sigmoid(logits[:, :2 * n])  # H_pre, H_post / 2
        H_res = self.residual_mixing(logits[:, 2 * n:])
        post = 2 * gates[:, n:]
        return (torch.bmm(gates[:, None, :n], H).view(N, C), torch.bmm(H_res, H), post,
                (H_res, post, r))

    def backward(self, H, i, saved, grad_h, grad_mixed, grad_post):
        (H_res, _, r), (N, n, C) = saved, H.shape
        X = H.view(N, -1)
        P, logits = self.logits(X, r, i)
        gates = torch.sigmoid(logits[:, :2 * n])
        grad_H = torch.bmm(H_res.mT, grad_mixed).to(H.dtype)
        grad_H.addcmul_(gates[:, :n, None], grad_h.unsqueeze(1))  # h = H_pre H
        # (a row times H^T: on a CPU 9x faster than H g)
        d_pre = torch.bmm(grad_h.unsqueeze(1), H.mT).view(N, n)
        d_res = self.residual_backward(logits[:, 2 * n:], torch.bmm(grad_mixed, H.mT).view(N, -1))
        d_gates = torch.ops.aten.sigmoid_backward(torch.cat([d_pre, 2 * grad_post], -1), gates)
        d_logits = torch.cat([d_gates, d_res], -1)
        # P = r (X W): d X = r (d_P W^T) - (r^2 / (n C)) (d_P . P) X, d W = X^T (r d_P),
        # d_P = a d_logits (the a in W_scaled_t and in take()); d_P . P from the per-column products
        # d_logits P, which d a sums too
        dP_P = d_logits * P
        G = d_logits * r
        grad_H.view(N, -1).addmm_(G.to(grad_H.dtype), self.W_scaled_t[i].to(grad_H.dtype))
        grad_H.view(N, -1).addcmul_(torch.mv(dP_P, self.alpha[i]).unsqueeze(-1) * r.square(),
                                    X, value=-1 / (n * C))
        # d b, d a per column, d W / a
        self.pool.put(i, (d_logits.sum(0), dP_P.sum(0), torch.mm(X.t(), G.to(X.dtype))))
        return grad_H

    def take(self):
        """The gradients of alpha, bias and W."""
        d_bias, d_alpha, d_W = self.rows()
        d_alpha = torch.stack([part.sum(1) for part in d_alpha.split(self.split, 1)], 1)
        return [g.to(p.dtype)
                for g, p in zip([d_alpha, d_bias, d_W * self.alpha.unsqueeze(1)], self.params)]


class MHCLiteStep(MHCStep):
    """mHC-lite's H_res = softmax(logits_res) @ permutations, and its backward, by hand."""

    def __init__(self, coefficients):
        super().__init__(coefficients)
        self.perms = coefficients.permutations.flatten(1)

    def residual_mixing(self, logits):
        return torch.mm(torch.softmax(logits, -1),
                        self.perms.to(logits.dtype)).view(-1, self.n, self.n)

    def residual_backward(self, logits, grad):
        w = torch.softmax(logits, -1)
        d_w = torch.mm(grad, self.perms.t().to(grad.dtype))
        return torch.ops.aten._softmax_backward_data(d_w.to(w.dtype), w, -1, w.dtype)


# ---------------------------------------------------------- the Triton kernels: one step a sublayer
#
# One kernel per sublayer forward: the RMS of the streams, the projection XW (HC: each stream's
# (C, n + 2) product, in the same pass over the columns; mHC-lite's (n C, 2n + n!) one: a GEMM
# outside, by cuBLAS), the connections from it, the mixing A^T H and the outputs h, H', post. One
# kernel backward, on the rebuilt streams: the mixing's, the connections' and (HC) the projection's
# gradients, and each program's partial sums of the parameters' gradients (no atomics; HC's W among
# them: C (n + 2) numbers a program, where mHC-lite's n C (2n + n!) would be 16x as many: its GEMMs
# stay outside). The streams are rebuilt by the same forward kernel from the saved XW (a few numbers
# per token). The update H <- H' + post^T f(h) is never written: the next step's kernels take the
# last H', post and u = f(h) and form the streams as they read them (ADD), forward, replay and
# backward, and HC's backward kernel does the update's backward too (d H' = d H,
# d u = sum_s post_s d H_s, d post_s = d H_s . u). mHC-lite's projection of the streams is
# H' W + sum_s post_s (u W_s), two GEMMs combined in the kernel; its backward kernel writes the
# streams it formed for the GEMM of W's gradient and does the update's backward too, by linearity:
# d H = d H_kernel + d XW W^T (a GEMM after it), so d u = sum_s post_s d H_kernel,s + (post^T d XW)
# [W_1 | .. | W_n]^T (the kernel writes post^T d XW, n K numbers a token; a GEMM adds its product)
# and d post_s = d H_kernel,s . u + d XW . (u W_s) (the forward's u W_s, saved), so no pass reads
# the whole d H again. The readout's streams, after the last sublayer, are formed by advance
# (_advance_bwd).
# Kinds: HC (dynamic), HC static, mHC-lite.
HC, HC_STATIC, MHC_LITE = 0, 1, 2


STREAM_BC = 256  # columns per pass: the (n + 1, n, BC) products stay small in registers


# elements of a program's largest block: (tokens, n + 1, n, BC), HC's projection
# (tokens, n, BC, n + 2) or mHC-lite's (tokens, n!, n + 1, n)
STREAM_TILE = 8192


def stream_columns(C):
    """Columns per pass of the stream kernels (BC)."""
    return min(next_pow2(C), STREAM_BC)


def stream_tile(n, C, n_perm, N):
    """Tokens per program of the stream kernels: one at GPT-2's width (n = 4: an (n + 1, n, 256)
    block, or HC's projection (n, 256, n + 2), fills the budget), several at small widths (as
    token_tile for the depth mix)."""
    NP, NP2 = next_pow2(n), next_pow2(n + 2)
    block = NP2 * NP * max(stream_columns(C), next_pow2(n_perm))
    return max(1, min(next_pow2(N), STREAM_TILE // block))


if triton is not None:
    @triton.jit
    def _sigmoid(x):
        return 1 / (1 + tl.exp(-x))

    @triton.jit
    def _sublayer_params(P0, P1, P2, P3, i, n, K, LITE: tl.constexpr, DYNAMIC: tl.constexpr):
        """Sublayer i's rows of the stacked parameters (L, ...): HC width, depth, s_a, s_b; mHC-lite
        alpha, bias (P2: the permutations, shared)."""
        if LITE:
            return P0 + i * 3, P1 + i * K, P2, P3
        elif DYNAMIC:
            return P0 + i * n * (n + 1), P1 + i * n, P2 + i, P3 + i
        else:
            return P0 + i * n * (n + 1), P1 + i * n, P2, P3

    @triton.jit
    def _hc_connect(XW,  # (N, n, K), K = n + 2 (DYNAMIC)
                    P0,  # width (n, n+1)
                    P1,  # depth (n,)
                    P2,  # s_a (DYNAMIC)
                    P3,  # s_b (DYNAMIC)
                    t,
                    tmask,
                    r,
                    n,
                    K,
                    DYNAMIC: tl.constexpr,
                    ACC: tl.constexpr,
                    BT: tl.constexpr, NP: tl.constexpr, NP1: tl.constexpr):
        """HC's connections of the tokens t (BT,): A^T (BT, NP1, NP) (row 0 reads h, rows 1..n the
        streams H') and post (BT, NP), from XW ((n, K) per token, K = n + 2) and r: 1/RMS per stream
        (BT, NP). Also returns what the backward needs: P^T, its tanh, the depth column's P and tanh
        (zeros for static HC)."""
        k, j = tl.arange(0, NP), tl.arange(0, NP1)
        kmask, jmask = k < n, j < n + 1
        m2 = jmask[:, None] & kmask[None, :]
        tk = tmask[:, None] & kmask[None, :]
        width = tl.load(P0 + k[None, :] * (n + 1) + j[:, None], mask=m2, other=0.).to(ACC)
        AT = tl.broadcast_to(width[None, :, :], (BT, NP1, NP))
        post = tl.broadcast_to(tl.load(P1 + k, mask=kmask, other=0.).to(ACC)[None, :], (BT, NP))
        PT = tl.zeros((BT, NP1, NP), ACC)
        TT = tl.zeros((BT, NP1, NP), ACC)
        pb = tl.zeros((BT, NP), ACC)
        tb = tl.zeros((BT, NP), ACC)
        if DYNAMIC:
            PT = r[:, None, :] * tl.load(
                XW + t[:, None, None] * n * K + k[None, None, :] * K + j[None, :, None],
                mask=tmask[:, None, None] & m2[None, :, :], other=0.).to(ACC)
            TT = 2 * _sigmoid(2 * PT) - 1  # tanh
            AT += tl.load(P2).to(ACC) * TT
            pb = r * tl.load(XW + t[:, None] * n * K + k[None, :] * K + n + 1, mask=tk,
                             other=0.).to(ACC)
            tb = 2 * _sigmoid(2 * pb) - 1
            post += tl.load(P3).to(ACC) * tb
        return AT, post, PT, TT, pb, tb

    @triton.jit
    def _lite_connect(XW,  # (N, K), K = 2n + n!
                      P0,  # alpha (3,)
                      P1,  # bias (K,)
                      P2,  # the permutations (n!, n) as stream indices
                      t,
                      tmask,
                      r,
                      n,
                      K,
                      n_perm,
                      ACC: tl.constexpr,
                      NP: tl.constexpr, NP1: tl.constexpr, PP: tl.constexpr):
        """mHC-lite's connections of the tokens t (BT,): A^T (BT, NP1, NP) (row 0 reads h, rows 1..n
        the streams H') and post (BT, NP), from XW ((K,) per token, K = 2n + n!) and r: 1/RMS of all
        n streams together (BT,). Also returns what the backward needs: the permutation table, the
        softmax weights, P's parts and h_pre."""
        k, j, p = tl.arange(0, NP), tl.arange(0, NP1), tl.arange(0, PP)
        kmask, jmask, pmask = k < n, j < n + 1, p < n_perm
        tk, tp = tmask[:, None] & kmask[None, :], tmask[:, None] & pmask[None, :]
        a_pre, a_post, a_res = tl.load(P0).to(ACC), tl.load(P0 + 1).to(ACC), tl.load(P0 + 2).to(ACC)
        p_pre = r[:, None] * tl.load(XW + t[:, None] * K + k[None, :], mask=tk, other=0.).to(ACC)
        p_post = r[:, None] * tl.load(XW + t[:, None] * K + n + k[None, :], mask=tk,
                                      other=0.).to(ACC)
        p_res = r[:, None] * tl.load(XW + t[:, None] * K + 2 * n + p[None, :], mask=tp,
                                     other=0.).to(ACC)
        h_pre = _sigmoid(a_pre * p_pre + tl.load(P1 + k, mask=kmask, other=0.).to(ACC)[None, :])
        post = 2 * _sigmoid(a_post * p_post
                            + tl.load(P1 + n + k, mask=kmask, other=0.).to(ACC)[None, :])
        bias_res = tl.load(P1 + 2 * n + p, mask=pmask, other=0.).to(ACC)
        z = tl.where(pmask[None, :], a_res * p_res + bias_res[None, :], float('-inf'))
        w = tl.exp(z - tl.max(z, axis=1)[:, None])
        w = w / tl.sum(w, axis=1)[:, None]
        # perm[p, j]: the stream that row j of permutation p reads (-1 outside); row j of A^T is
        # H_res row j-1
        perm = tl.load(P2 + p[:, None] * n + j[None, :] - 1,
                       mask=pmask[:, None] & (j[None, :] >= 1) & jmask[None, :], other=-1)
        AT = tl.sum(tl.where(perm[None, :, :, None] == k[None, None, None, :], w[:, :, None, None],
                             0.), axis=1)
        AT = tl.where(j[None, :, None] == 0, h_pre[:, None, :], AT)
        return AT, post, perm, w, p_pre, p_post, p_res, h_pre

    @triton.jit
    def _stream_rms(ss, n, C, eps, LITE: tl.constexpr):
        """r from the streams' sums of squares ss (BT, NP): per stream (HC), or one for all n
        streams (mHC-lite)."""
        if LITE:
            return 1 / tl.sqrt(tl.sum(ss, axis=1) / (n * C) + eps)
        else:
            return 1 / tl.sqrt(ss / C + eps)

    @triton.jit
    def _last_post(POST_IN, t, tk, n, ADD: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr,
                   NP: tl.constexpr):
        """With ADD, the last sublayer's post at the tokens t (BT, NP) (else zeros, unused)."""
        if ADD:
            return tl.load(POST_IN + t[:, None] * n + tl.arange(0, NP)[None, :], mask=tk,
                           other=0.).to(ACC)
        else:
            return tl.zeros((BT, NP), ACC)

    @triton.jit
    def _streams_tile(H,  # (N, n, C) at `streams` (+ columns)
                      U_IN,  # (N, C) (ADD)
                      post_in,
                      streams,
                      t,
                      tmask,
                      cols,
                      tk3,
                      cmask,
                      C,
                      ADD: tl.constexpr,
                      ACC: tl.constexpr):
        """The streams at the tokens t and columns cols (BT, NP, BC): H itself, or with ADD the last
        sublayer's H' (at H) + post^T u, formed here and never written; and u (BT, BC) (ADD
        only)."""
        HT = tl.load(H + streams + cols[None, None, :], mask=tk3 & cmask, other=0.).to(ACC)
        u = tl.zeros((1, 1), ACC)
        if ADD:
            u = tl.load(U_IN + t[:, None] * C + cols[None, :],
                        mask=tmask[:, None] & (cols < C)[None, :], other=0.).to(ACC)
            HT += post_in[:, :, None] * u[:, None, :]
        return HT, u

    @triton.jit
    def _combined_projection(XW,  # (N, K), written
                             XW_IN,  # H' W (N, K)
                             UW,  # u [W_1 | .. | W_n] (N, n, K)
                             post_in,
                             t,
                             tmask,
                             k,
                             kmask,
                             n,
                             K,
                             ACC: tl.constexpr, KP: tl.constexpr):
        """mHC-lite's XW = H W of the streams H = H' + post^T u (of the last sublayer) from its two
        GEMMs, XW_IN = H' W and UW = u [W_1 | .. | W_n] (W_s: stream s's rows of W):
        XW_IN + sum_s post_s UW_s, written to XW."""
        q = tl.arange(0, KP)
        tq = tmask[:, None] & (q < K)[None, :]
        uw = tl.load(UW + t[:, None, None] * n * K + k[None, :, None] * K + q[None, None, :],
                     mask=tq[:, None, :] & kmask[None, :, None], other=0.).to(ACC)
        xw = tl.load(XW_IN + t[:, None] * K + q[None, :], mask=tq, other=0.).to(ACC)
        tl.store(XW + t[:, None] * K + q[None, :], xw + tl.sum(post_in[:, :, None] * uw, axis=1),
                 mask=tq)

    @triton.jit
    def _stream_mix_fwd(H,  # the streams (N, n, C), at (stride_t, stride_k, 1)
                        POST_IN,  # the last sublayer's post (N, n) (ADD)
                        U_IN,  # the last sublayer's update u (N, C) (ADD)
                        UW,  # mHC-lite: u [W_1 | .. | W_n] (N, n, K) (COMBINE)
                        W,  # HC: the stacked projections (L, C, K) (PROJECT)
                        XW_IN,  # mHC-lite: H' W (N, K) (COMBINE)
                        XW,  # HC: (N, n, K) (written with PROJECT); mHC-lite: (N, K)
                        P0,  # HC: width (L, n, n+1); mHC-lite: alpha (L, 3)
                        P1,  # HC: depth (L, n); mHC-lite: bias (L, K)
                        P2,  # HC: s_a (L,); mHC-lite: the permutations (n!, n)
                        P3,  # HC: s_b (L,)
                        OUT_H,  # h (N, C) (not with REPLAY)
                        OUT_MIXED,  # H' (N, n, C)
                        OUT_POST,  # post (N, n)
                        i,
                        stride_t,
                        stride_k,
                        N,
                        n,
                        C,
                        K,
                        n_perm,
                        eps,
                        LITE: tl.constexpr, DYNAMIC: tl.constexpr, PROJECT: tl.constexpr,
                        COMBINE: tl.constexpr, REPLAY: tl.constexpr, ADD: tl.constexpr,
                        ACC: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr, NP1: tl.constexpr,
                        KP: tl.constexpr, PP: tl.constexpr, BC: tl.constexpr):
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)  # a tile of BT tokens
        # sublayer i's: rows of (L, ...)
        P0, P1, P2, P3 = _sublayer_params(P0, P1, P2, P3, i, n, K, LITE, DYNAMIC)
        if PROJECT:
            W += i * C * K
        k, j, c, q = tl.arange(0, NP), tl.arange(0, NP1), tl.arange(0, BC), tl.arange(0, KP)
        tmask, kmask = t < N, k < n
        streams = t[:, None, None] * stride_t + k[None, :, None] * stride_k  # (+ columns)
        tk = tmask[:, None, None] & kmask[None, :, None]
        post_in = _last_post(POST_IN, t, tmask[:, None] & kmask[None, :], n, ADD, ACC, BT, NP)
        ss = tl.zeros((BT, NP), ACC)
        xw = tl.zeros((BT, NP, KP), ACC)
        # the streams' sums of squares (and HC's XW), BC columns at a time
        for c0 in range(0, C, BC):
            cols = c0 + c
            HT, u = _streams_tile(H, U_IN, post_in, streams, t, tmask, cols, tk,
                                  (cols < C)[None, None, :], C, ADD, ACC)
            ss += tl.sum(HT * HT, axis=2)
            if PROJECT:
                Wc = tl.load(W + cols[:, None] * K + q[None, :],
                             mask=(cols < C)[:, None] & (q < K)[None, :], other=0.).to(ACC)
                xw += tl.sum(HT[:, :, :, None] * Wc[None, None, :, :], axis=2)
        # written, then read back by _hc_connect (after a barrier: other threads wrote it)
        if PROJECT:
            tl.store(XW + t[:, None, None] * n * K + k[None, :, None] * K + q[None, None, :], xw,
                     mask=tk & (q < K)[None, None, :])
            tl.debug_barrier()
        if COMBINE:  # likewise, read back by _lite_connect
            _combined_projection(XW, XW_IN, UW, post_in, t, tmask, k, kmask, n, K, ACC, KP)
            tl.debug_barrier()
        r = _stream_rms(ss, n, C, eps, LITE)
        if LITE:  # (the rest: what the backward needs)
            AT, post, _, _, _, _, _, _ = _lite_connect(XW, P0, P1, P2, t, tmask, r, n, K, n_perm,
                                                       ACC, NP, NP1, PP)
        else:
            AT, post, _, _, _, _ = _hc_connect(XW, P0, P1, P2, P3, t, tmask, r, n, K, DYNAMIC, ACC,
                                               BT, NP, NP1)
        out = OUT_MIXED.dtype.element_ty
        tj = tmask[:, None, None] & (j[None, :, None] >= 1) & (j[None, :, None] < n + 1)
        t0 = tmask[:, None, None] & (j[None, :, None] == 0)
        for c0 in range(0, C, BC):  # A^T H: row 0 is h, rows 1..n are H'
            cols = c0 + c
            cmask = (cols < C)[None, None, :]
            HT, u = _streams_tile(H, U_IN, post_in, streams, t, tmask, cols, tk, cmask, C, ADD, ACC)
            mixed = tl.sum(AT[:, :, :, None] * HT[:, None, :, :], axis=2)
            tl.store(OUT_MIXED + t[:, None, None] * n * C + (j[None, :, None] - 1) * C
                     + cols[None, None, :], mixed.to(out), mask=tj & cmask)
            if not REPLAY:
                tl.store(OUT_H + t[:, None, None] * C + j[None, :, None] * 0 + cols[None, None, :],
                         mixed.to(out), mask=t0 & cmask)
        tl.store(OUT_POST + t[:, None] * n + k[None, :], post.to(OUT_POST.dtype.element_ty),
                 mask=tmask[:, None] & kmask[None, :])

    @triton.jit
    def _mixing_grad(G_H, G_MIXED, t, j, cols, tj, t0, cmask, n, C, ACC: tl.constexpr):
        """The gradient G of A^T H at the tokens t and columns cols (BT, NP1, BC): row 0 h's, rows
        1..n H''s."""
        G = tl.load(G_MIXED + t[:, None, None] * n * C + (j[None, :, None] - 1) * C
                    + cols[None, None, :], mask=tj & cmask, other=0.).to(ACC)
        G += tl.load(G_H + t[:, None, None] * C + j[None, :, None] * 0 + cols[None, None, :],
                     mask=t0 & cmask, other=0.).to(ACC)
        return G

    @triton.jit
    def _mixing_grams(H,  # (N, n, C) at `streams` (+ columns)
                      U_IN,  # (N, C) (ADD)
                      post_in,
                      G_H,  # d h (N, C)
                      G_MIXED,  # d H' (N, n, C)
                      streams,
                      t,
                      tmask,
                      j,
                      c,
                      tk3,
                      tj,
                      t0,
                      n,
                      C,
                      ADD: tl.constexpr,
                      ACC: tl.constexpr,
                      BT: tl.constexpr, NP: tl.constexpr, NP1: tl.constexpr, BC: tl.constexpr):
        """A pass over the columns for the tokens t: d loss / d A^T[j, s] = G_j . H_s
        (BT, NP1, NP), G_0 the gradient of h, G_j of H'_j, and the streams' sums of squares
        (BT, NP)."""
        g_AT = tl.zeros((BT, NP1, NP), ACC)
        ss = tl.zeros((BT, NP), ACC)
        for c0 in range(0, C, BC):
            cols = c0 + c
            cmask = (cols < C)[None, None, :]
            HT, u = _streams_tile(H, U_IN, post_in, streams, t, tmask, cols, tk3, cmask, C, ADD,
                                  ACC)
            G = _mixing_grad(G_H, G_MIXED, t, j, cols, tj, t0, cmask, n, C, ACC)
            g_AT += tl.sum(G[:, :, None, :] * HT[:, None, :, :], axis=3)
            ss += tl.sum(HT * HT, axis=2)
        return g_AT, ss

    @triton.jit
    def _mhc_connections_bwd(P0,  # alpha (3,)
                             D_XW,  # (N, K), written
                             t,
                             tmask,
                             tk,
                             k,
                             j,
                             p,
                             pmask,
                             e,
                             r,
                             g_AT,
                             g_post,
                             post,
                             perm,
                             w,
                             p_pre,
                             p_post,
                             p_res,
                             h_pre,
                             n,
                             C,
                             K,
                             ACC: tl.constexpr):
        """mHC-lite's connections backward for the tokens t, from d A^T (g_AT) and d post: writes
        d XW (the GEMMs outside take it on to the streams and W) and returns the RMS's share of d H
        per stream (BT, 1) and the tile's sums of the gradients of the bias (pre, post, res) and of
        alpha (e: 0..2)."""
        a_pre, a_post, a_res = tl.load(P0).to(ACC), tl.load(P0 + 1).to(ACC), tl.load(P0 + 2).to(ACC)
        du = tl.sum(tl.where(j[None, :, None] == 0, g_AT, 0.), axis=1) * h_pre * (1 - h_pre)
        dv = g_post * post * (1 - post / 2)
        # d loss / d w_p = sum_j g_AT[j, perm_p(j)]
        g_w = tl.sum(tl.sum(tl.where(perm[None, :, :, None] == k[None, None, None, :],
                                     g_AT[:, None, :, :], 0.), axis=3), axis=2)
        dz = w * (g_w - tl.sum(w * g_w, axis=1)[:, None])
        dtype = D_XW.dtype.element_ty
        tl.store(D_XW + t[:, None] * K + k[None, :], (r[:, None] * a_pre * du).to(dtype), mask=tk)
        tl.store(D_XW + t[:, None] * K + n + k[None, :], (r[:, None] * a_post * dv).to(dtype),
                 mask=tk)
        tl.store(D_XW + t[:, None] * K + 2 * n + p[None, :], (r[:, None] * a_res * dz).to(dtype),
                 mask=tmask[:, None] & pmask[None, :])
        s_pre, s_post = tl.sum(du * p_pre, axis=1), tl.sum(dv * p_post, axis=1)
        s_res = tl.sum(dz * p_res, axis=1)
        corr = (r * r * (a_pre * s_pre + a_post * s_post + a_res * s_res) / (n * C))[:, None]
        d_a = tl.where(e == 0, tl.sum(s_pre, axis=0),
                       tl.where(e == 1, tl.sum(s_post, axis=0),
                                tl.where(e == 2, tl.sum(s_res, axis=0), 0.)))
        # (tokens outside the tile: all zero)
        return corr, tl.sum(du, axis=0), tl.sum(dv, axis=0), tl.sum(dz, axis=0), d_a

    @triton.jit
    def _hc_connections_bwd(P2,  # s_a
                            P3,  # s_b
                            e,
                            r,
                            g_AT,
                            g_post,
                            PT,
                            TT,
                            pb,
                            tb,
                            C,
                            ACC: tl.constexpr):
        """Dynamic HC's connections backward for a tile of tokens, through the tanh: returns d XW
        (its columns 0..n transposed (BT, NP1, NP), and column n + 1 (BT, NP)), the RMS's share of
        d H per stream (BT, NP) and the tile's sums of the gradients of s_a and s_b (e: 0, 1)."""
        s_a, s_b = tl.load(P2).to(ACC), tl.load(P3).to(ACC)
        dPT = s_a * (1 - TT * TT) * g_AT
        dpb = s_b * (1 - tb * tb) * g_post
        corr = r * r * (tl.sum(dPT * PT, axis=1) + dpb * pb) / C
        d_a = tl.where(e == 0, tl.sum(tl.sum(tl.sum(TT * g_AT, axis=2), axis=1), axis=0), 0.)
        d_a += tl.where(e == 1, tl.sum(tl.sum(tb * g_post, axis=1), axis=0), 0.)
        return r[:, None, :] * dPT, r * dpb, corr, d_a

    @triton.jit
    def _streams_grad(H,  # (N, n, C) at `streams` (+ columns)
                      U_IN,  # (N, C) (ADD)
                      post_in,
                      W,  # HC: sublayer i's projection (C, K) (DYNAMIC)
                      G_H,  # d h (N, C)
                      G_MIXED,  # d H' (N, n, C)
                      D_H,  # (N, n, C), written
                      D_U,  # d u (N, C), written (ADD)
                      OUT_H,  # mHC-lite: the streams formed (N, n C), written (ADD)
                      part_w,  # HC: W's gradient (C, K) in the program's part
                      AT,
                      corr,
                      d_xa,
                      d_xb,
                      later,
                      streams,
                      t,
                      tmask,
                      k,
                      j,
                      c,
                      jmask,
                      tk3,
                      tj,
                      t0,
                      n,
                      C,
                      K,
                      LITE: tl.constexpr, DYNAMIC: tl.constexpr, ADD: tl.constexpr,
                      ACC: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr, BC: tl.constexpr):
        """A second pass over the columns for the tokens t: d H_s = sum_j A^T[j, s] G_j - corr_s H_s
        written (+ HC: d XW_s W^T, and W's gradient H^T d XW in this program's part of PART, at
        part_w: written by the program's first tile, added to by its `later` ones). With ADD, d H is
        also the last sublayer's d H', and (HC) its update's backward is here:
        d u = sum_s post_s d H_s written, d post_s = d H_s . u returned (BT, NP). mHC-lite's d H
        lacks its GEMM's share (d XW W^T), so its d u and d post are the kernel's parts of them
        (_mhc_update_bwd and a GEMM outside add the rest); it also writes the streams it formed, for
        the GEMM of its projection's gradient (OUT_H)."""
        d_post_in = tl.zeros((BT, NP), ACC)
        for c0 in range(0, C, BC):
            cols = c0 + c
            cmask = (cols < C)[None, None, :]
            HT, u = _streams_tile(H, U_IN, post_in, streams, t, tmask, cols, tk3, cmask, C, ADD,
                                  ACC)
            G = _mixing_grad(G_H, G_MIXED, t, j, cols, tj, t0, cmask, n, C, ACC)
            dH = tl.sum(AT[:, :, :, None] * G[:, :, None, :], axis=1) - corr[:, :, None] * HT
            # XW = H W per stream: H gets d XW W^T; W gets H^T d XW, in this program's part
            if DYNAMIC:
                # W[c, j], j = 0..n (the width columns)
                at_a = part_w + cols[None, :] * K + j[:, None]
                m_a = jmask[:, None] & (cols < C)[None, :]
                w_a = tl.load(W + cols[None, :] * K + j[:, None], mask=m_a, other=0.).to(ACC)
                dH += tl.sum(d_xa[:, :, :, None] * w_a[None, :, None, :], axis=1)
                # W[c, n + 1] (depth)
                w_b = tl.load(W + cols * K + n + 1, mask=cols < C, other=0.).to(ACC)
                dH += d_xb[:, :, None] * w_b[None, None, :]
                g_a = tl.sum(tl.sum(d_xa[:, :, :, None] * HT[:, None, :, :], axis=2), axis=0)
                g_b = tl.sum(tl.sum(d_xb[:, :, None] * HT, axis=1), axis=0)
                g_a += tl.where(later, tl.load(at_a, mask=m_a, other=0.), 0.)
                g_b += tl.where(later, tl.load(part_w + cols * K + n + 1, mask=cols < C, other=0.),
                                0.)
                tl.store(at_a, g_a, mask=m_a)
                tl.store(part_w + cols * K + n + 1, g_b, mask=cols < C)
            tl.store(D_H + t[:, None, None] * n * C + k[None, :, None] * C + cols[None, None, :],
                     dH.to(D_H.dtype.element_ty), mask=tk3 & cmask)
            if ADD:
                if LITE:
                    tl.store(OUT_H + t[:, None, None] * n * C + k[None, :, None] * C
                             + cols[None, None, :], HT.to(OUT_H.dtype.element_ty), mask=tk3 & cmask)
                d_u = tl.sum(post_in[:, :, None] * dH, axis=1)
                tl.store(D_U + t[:, None] * C + cols[None, :], d_u.to(D_U.dtype.element_ty),
                         mask=tmask[:, None] & (cols < C)[None, :])
                d_post_in += tl.sum(dH * u[:, None, :], axis=2)
        return d_post_in

    @triton.jit
    def _mhc_update_bwd(D_XW,  # (N, K)
                        UW,  # u [W_1 | .. | W_n] (N, n, K)
                        D_UW,  # post^T d XW (N, n, K), written
                        post_in,
                        t,
                        tmask,
                        k,
                        kmask,
                        n,
                        K,
                        ACC: tl.constexpr, KP: tl.constexpr):
        """The share of mHC-lite's update backward that flows through its projection's GEMM, for the
        tokens t: with H = H' + post^T u and d H_s's share d XW W_s^T, d post_s gets d XW . (u W_s)
        (UW = u [W_1 | .. | W_n], the forward's), returned (BT, NP); d u gets
        sum_s post_s d XW W_s^T, a GEMM outside of the (N, n K) products post_s d XW, written to
        D_UW."""
        q = tl.arange(0, KP)
        tq = tmask[:, None] & (q < K)[None, :]
        # (BT, NP, KP) of (N, n, K)
        at = t[:, None, None] * n * K + k[None, :, None] * K + q[None, None, :]
        m3 = tq[:, None, :] & kmask[None, :, None]
        d_xw = tl.load(D_XW + t[:, None] * K + q[None, :], mask=tq, other=0.).to(ACC)
        uw = tl.load(UW + at, mask=m3, other=0.).to(ACC)
        tl.store(D_UW + at, (post_in[:, :, None] * d_xw[:, None, :]).to(D_UW.dtype.element_ty),
                 mask=m3)
        return tl.sum(uw * d_xw[:, None, :], axis=2)

    @triton.jit
    def _stream_parts_store(part,  # the program's partial sums (n_part,)
                            d_AT,
                            d_post,
                            d_pre,
                            d_z,
                            d_a,
                            k,
                            j,
                            p,
                            e,
                            kmask,
                            pmask,
                            m2,
                            n,
                            LITE: tl.constexpr, DYNAMIC: tl.constexpr):
        """A program's partial sums of the parameters' gradients, at `part`: mHC-lite [alpha (3) |
        bias: pre (n), post (n), res (n!)]; HC [width (n, n+1) | depth (n) | s_a, s_b | W (C, K), by
        _streams_grad]."""
        if LITE:
            tl.store(part + e, d_a, mask=e < 3)
            tl.store(part + 3 + k, d_pre, mask=kmask)
            tl.store(part + 3 + n + k, d_post, mask=kmask)
            tl.store(part + 3 + 2 * n + p, d_z, mask=pmask)
        else:
            tl.store(part + k[None, :] * (n + 1) + j[:, None], d_AT, mask=m2)
            tl.store(part + n * (n + 1) + k, d_post, mask=kmask)
            if DYNAMIC:
                tl.store(part + n * (n + 1) + n + e, d_a, mask=e < 2)

    @triton.jit
    def _stream_mix_bwd(H,  # the streams (N, n, C), at (stride_t, stride_k, 1)
                        POST_IN,  # the last sublayer's post (N, n) (ADD)
                        U_IN,  # the last sublayer's update u (N, C) (ADD)
                        UW,  # mHC-lite: u [W_1 | .. | W_n] (N, n, K) (ADD)
                        W,  # HC: the stacked projections (L, C, K) (DYNAMIC)
                        XW,  # HC: (N, n, K) (DYNAMIC); mHC-lite: (N, K)
                        P0,  # HC: width (L, n, n+1); mHC-lite: alpha (L, 3)
                        P1,  # HC: depth (L, n); mHC-lite: bias (L, K)
                        P2,  # HC: s_a (L,); mHC-lite: the permutations (n!, n)
                        P3,  # HC: s_b (L,)
                        G_H,  # d h (N, C)
                        G_MIXED,  # d H' (N, n, C)
                        G_POST,  # d post (N, n)
                        D_H,  # (N, n, C), written
                        D_U,  # d u (N, C), written (ADD)
                        D_POST_IN,  # d post_in (N, n), written (ADD)
                        OUT_H,  # mHC-lite: the streams formed (N, n C), written (ADD)
                        D_UW,  # mHC-lite: post_in^T d XW (N, n, K), written (ADD)
                        D_XW,  # mHC-lite: (N, K), written
                        PART,  # the programs' partial sums (programs, n_part), written
                        i,
                        stride_t,
                        stride_k,
                        N,
                        n,
                        C,
                        K,
                        n_perm,
                        n_part,
                        eps,
                        LITE: tl.constexpr, DYNAMIC: tl.constexpr, ADD: tl.constexpr,
                        ACC: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr, NP1: tl.constexpr,
                        KP: tl.constexpr, PP: tl.constexpr, BC: tl.constexpr):
        # per tile of tokens: d A^T and the RMS in a pass over the columns, the connections again,
        # their backward (mHC-lite's or HC's), and d H in a second pass (with ADD, the last
        # sublayer's update's backward with it: mHC-lite's with its projection's share from d XW);
        # the parameters' gradients summed per program (the helpers are inlined: one kernel, one
        # launch)
        pid, programs = tl.program_id(0), tl.num_programs(0)
        # as in the forward
        P0, P1, P2, P3 = _sublayer_params(P0, P1, P2, P3, i, n, K, LITE, DYNAMIC)
        if DYNAMIC:
            W += i * C * K
        k, j, p, c = tl.arange(0, NP), tl.arange(0, NP1), tl.arange(0, PP), tl.arange(0, BC)
        kmask, jmask, pmask = k < n, j < n + 1, p < n_perm
        m2 = jmask[:, None] & kmask[None, :]
        # each program's sums over its tokens: HC width^T (NP1, NP), depth, s_a, s_b; mHC-lite
        # alpha, bias
        d_AT = tl.zeros((NP1, NP), ACC)
        d_post = tl.zeros((NP,), ACC)
        d_pre = tl.zeros((NP,), ACC)
        d_z = tl.zeros((PP,), ACC)
        e = tl.arange(0, 4)
        d_a = tl.zeros((4,), ACC)  # s_a, s_b (HC) or a_pre, a_post, a_res (mHC-lite)
        # HC: W's gradient (C, K) after the small ones
        part_w = PART + pid * n_part + n * (n + 1) + n + 2
        # each program: every programs-th tile of BT tokens
        for tile in range(pid, tl.cdiv(N, BT), programs):
            # int64 (the interpreter: Python ints)
            t = (pid.to(tl.int64) + (tile - pid)) * BT + tl.arange(0, BT)
            tmask = t < N
            tk = tmask[:, None] & kmask[None, :]
            streams, tk3 = t[:, None, None] * stride_t + k[None, :, None] * stride_k, tk[:, :, None]
            tj = tmask[:, None, None] & (j[None, :, None] >= 1) & jmask[None, :, None]
            t0 = tmask[:, None, None] & (j[None, :, None] == 0)
            g_post = tl.load(G_POST + t[:, None] * n + k[None, :], mask=tk, other=0.).to(ACC)
            post_in = _last_post(POST_IN, t, tk, n, ADD, ACC, BT, NP)
            g_AT, ss = _mixing_grams(H, U_IN, post_in, G_H, G_MIXED, streams, t, tmask, j, c, tk3,
                                     tj, t0, n, C, ADD, ACC, BT, NP, NP1, BC)
            r = _stream_rms(ss, n, C, eps, LITE)
            # (r^2 / D) dP . P per projected row: the RMS's share of d H
            corr = tl.zeros((BT, NP), ACC)
            # HC: d XW (its columns 0..n transposed, and column n + 1)
            d_xa = tl.zeros((BT, NP1, NP), ACC)
            d_xb = tl.zeros((BT, NP), ACC)
            if LITE:
                AT, post, perm, w, p_pre, p_post, p_res, h_pre = _lite_connect(
                    XW, P0, P1, P2, t, tmask, r, n, K, n_perm, ACC, NP, NP1, PP)
                corr_t, pre_t, post_t, z_t, a_t = _mhc_connections_bwd(
                    P0, D_XW, t, tmask, tk, k, j, p, pmask, e, r, g_AT, g_post, post, perm, w,
                    p_pre, p_post, p_res, h_pre, n, C, K, ACC)
                corr += corr_t
                d_pre += pre_t
                d_post += post_t
                d_z += z_t
                d_a += a_t
            else:
                AT, post, PT, TT, pb, tb = _hc_connect(XW, P0, P1, P2, P3, t, tmask, r, n, K,
                                                       DYNAMIC, ACC, BT, NP, NP1)
                d_AT += tl.sum(g_AT, axis=0)
                d_post += tl.sum(g_post, axis=0)
                if DYNAMIC:
                    d_xa, d_xb, corr, a_t = _hc_connections_bwd(P2, P3, e, r, g_AT, g_post, PT, TT,
                                                                pb, tb, C, ACC)
                    d_a += a_t
            # the program's first tile writes its part of W's gradient, later ones add to it
            later = tile > pid
            d_post_in = _streams_grad(H, U_IN, post_in, W, G_H, G_MIXED, D_H, D_U, OUT_H, part_w,
                                      AT, corr, d_xa, d_xb, later, streams, t, tmask, k, j, c,
                                      jmask, tk3, tj, t0, n, C, K, LITE, DYNAMIC, ADD, ACC, BT, NP,
                                      BC)
            if ADD:
                # d XW, written by _mhc_connections_bwd, read back (other threads wrote it)
                if LITE:
                    tl.debug_barrier()
                    d_post_in += _mhc_update_bwd(D_XW, UW, D_UW, post_in, t, tmask, k, kmask, n, K,
                                                 ACC, KP)
                tl.store(D_POST_IN + t[:, None] * n + k[None, :],
                         d_post_in.to(D_POST_IN.dtype.element_ty), mask=tk)
        _stream_parts_store(PART + pid * n_part, d_AT, d_post, d_pre, d_z, d_a, k, j, p, e, kmask,
                            pmask, m2, n, LITE, DYNAMIC)

    @triton.jit
    def _advance_bwd(G,  # d H (N, n, C)
                     U,  # u (N, C)
                     POST,  # post (N, n)
                     D_U,  # (N, C), written
                     D_POST,  # (N, n), written
                     N,
                     n,
                     C,
                     ACC: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr, BC: tl.constexpr):
        """H = H' + post^T u: d u = sum_s post_s G_s, d post_s = G_s . u, per token (a tile of
        BT)."""
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        k, c = tl.arange(0, NP), tl.arange(0, BC)
        tmask, kmask = t < N, k < n
        tk = tmask[:, None] & kmask[None, :]
        post = tl.load(POST + t[:, None] * n + k[None, :], mask=tk, other=0.).to(ACC)
        d_post = tl.zeros((BT, NP), ACC)
        for c0 in range(0, C, BC):
            cols = c0 + c
            cmask = cols < C
            u = tl.load(U + t[:, None] * C + cols[None, :], mask=tmask[:, None] & cmask[None, :],
                        other=0.).to(ACC)
            g = tl.load(G + t[:, None, None] * n * C + k[None, :, None] * C + cols[None, None, :],
                        mask=tk[:, :, None] & cmask[None, None, :], other=0.).to(ACC)
            d_u = tl.sum(post[:, :, None] * g, axis=1)
            tl.store(D_U + t[:, None] * C + cols[None, :], d_u.to(D_U.dtype.element_ty),
                     mask=tmask[:, None] & cmask[None, :])
            d_post += tl.sum(g * u[:, None, :], axis=2)
        tl.store(D_POST + t[:, None] * n + k[None, :], d_post.to(D_POST.dtype.element_ty), mask=tk)


# ----------------------------------------------------------------------------------- the custom ops

def _projection_sizes(XW, W, params, kind):
    """K, the projection's columns (HC's W or mHC-lite's XW; 0 for static HC), and mHC-lite's
    number of permutations n! (1 for HC)."""
    K = 0
    if W is not None:
        K = W.shape[-1]
    elif XW is not None:
        K = XW.shape[-1]
    return K, params[2].shape[0] if kind == MHC_LITE else 1


def _stream_args(H, XW, W, params, kind):
    """The kernels' view of one step's inputs: streams (N, n, C) with a token and a stream stride (a
    stride-0 stream dimension for e's n copies), XW, W, the four parameter pointers, and the
    sizes."""
    n, C = H.shape[-2:]
    if H.stride(-1) != 1:
        H = H.contiguous()
    try:
        H = H.view(-1, n, C)
    except RuntimeError:
        H = H.reshape(-1, n, C)
    P = list(params) + [None] * (4 - len(params))
    K, n_perm = _projection_sizes(XW, W, params, kind)
    blocks = dict(BT=stream_tile(n, C, n_perm, H.shape[0]), NP=next_pow2(n), NP1=next_pow2(n + 1),
                  PP=next_pow2(n_perm), BC=stream_columns(C))
    return (H, (None if XW is None else XW.contiguous()), (None if W is None else W.contiguous()),
            P, (n, C, K, n_perm), blocks)


def _last_update(post_in, u_in):
    """The last sublayer's post and update as the kernels read them (contiguous), or Nones."""
    return (None, None) if post_in is None else (post_in.contiguous(), u_in.contiguous())


@torch.library.custom_op('resroute::stream_mix', mutates_args=())
def _triton_stream_mix(H: Tensor, post_in: Optional[Tensor], u_in: Optional[Tensor],
                       XW: Optional[Tensor], UW: Optional[Tensor], W: Optional[Tensor],
                       params: List[Tensor], i: int, kind: int,
                       replay: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """h (B, T, C), H' (B, T, n, C), post (B, T, n, 1) of sublayer i's HC or mHC-lite step (the
    replay: no h, a tensor of no elements), and XW: HC's (B, T, n, n + 2), which the kernel projects
    when given W, or mHC-lite's (N, K) combined from H' W (XW) and UW (see _combined_projection),
    else a tensor of no elements. params (and HC's W): the stacked parameters (L, ...). The streams:
    H, or given the last sublayer's post_in (B, T, n, 1) and update u_in (B, T, C), H' + post_in^T
    u_in with H the last H'."""
    acc, acc_tl = accumulator(H.dtype)
    H3, XW, W, P, (n, C, K, n_perm), blocks = _stream_args(H, XW, W, params, kind)
    N = H3.shape[0]
    h = H.new_empty((0,) if replay else H.shape[:-2] + (C,))
    mixed = H.new_empty(H.shape)
    # a column: advance adds post u as is
    post = torch.empty(H.shape[:-1] + (1,), device=H.device, dtype=acc)
    projected = torch.empty(_projected_shape(H, XW, UW, W), device=H.device, dtype=acc)
    post_last, u_last = _last_update(post_in, u_in)
    _stream_mix_fwd[(triton.cdiv(N, blocks['BT']),)](
        H=H3,  # (N, n, C)
        POST_IN=post_last,  # (B, T, n, 1) or None
        U_IN=u_last,  # (B, T, C) or None
        UW=UW,  # (N, n K) or None
        W=W,  # (L, C, K) or None
        XW_IN=XW,  # (N, K) or None
        XW=projected if projected.numel() else XW,
        P0=P[0],
        P1=P[1],
        P2=P[2],
        P3=P[3],
        OUT_H=h,  # (B, T, C), or no elements (replay)
        OUT_MIXED=mixed,  # (B, T, n, C)
        OUT_POST=post,  # (B, T, n, 1)
        i=i, stride_t=H3.stride(0), stride_k=H3.stride(1),
        N=N, n=n, C=C, K=K, n_perm=n_perm, eps=RMS_EPS,
        LITE=kind == MHC_LITE, DYNAMIC=kind == HC, PROJECT=W is not None, COMBINE=UW is not None,
        REPLAY=replay, ADD=post_in is not None, ACC=acc_tl, KP=next_pow2(K), **blocks)
    return h, mixed, post, projected


def _projected_shape(H, XW, UW, W):
    """The shape of the XW the forward kernel writes: HC's (..., n, K) given W, mHC-lite's combined
    (N, K) given UW, else none."""
    if W is not None:
        return H.shape[:-1] + (W.shape[-1],)
    if UW is not None:
        return XW.shape
    return (0,)


@_triton_stream_mix.register_fake
def _(H, post_in, u_in, XW, UW, W, params, i, kind, replay):
    acc, C = accumulator(H.dtype)[0], H.shape[-1]
    return (H.new_empty((0,) if replay else H.shape[:-2] + (C,)), H.new_empty(H.shape),
            H.new_empty(H.shape[:-1] + (1,), dtype=acc),
            H.new_empty(_projected_shape(H, XW, UW, W), dtype=acc))


@torch.library.custom_op('resroute::stream_mix_backward', mutates_args=())
def _triton_stream_mix_backward(H: Tensor, post_in: Optional[Tensor], u_in: Optional[Tensor],
                                XW: Optional[Tensor], UW: Optional[Tensor], W: Optional[Tensor],
                                params: List[Tensor], i: int, kind: int, grad_h: Tensor,
                                grad_mixed: Tensor, grad_post: Tensor, low: Optional[torch.dtype]
                                ) -> Tuple[Tensor, List[Tensor], Tensor, List[Tensor]]:
    """d H (HC: whole; mHC-lite: without the projection's GEMM), [d XW] (mHC-lite; else []), each
    program's partial sums of the parameters' gradients ([width | depth | s_a, s_b | W (C, n + 2)]
    or [alpha | bias]), to be summed over programs, and given post_in and u_in (the streams formed
    as in the forward; d H is then d H' of the last sublayer) [d u_in, d post_in], HC's whole,
    mHC-lite's without its GEMM's share of d u_in, followed by mHC-lite's [the streams formed as
    rows (N, n C), in `low` (autocast's dtype) where given, and post_in^T d XW (N, n K) for that
    share], else []. UW: mHC-lite's u_in [W_1 | .. | W_n] of the forward (see
    _combined_projection)."""
    acc, acc_tl = accumulator(H.dtype)
    H3, XW, W, P, (n, C, K, n_perm), blocks = _stream_args(H, XW, W, params, kind)
    N = H3.shape[0]
    d_H = torch.empty(H.shape, device=H.device, dtype=H.dtype)
    d_XW = torch.empty(XW.shape, device=H.device, dtype=acc) if kind == MHC_LITE else None
    last = _last_outputs(H, post_in, u_in, UW, kind, low)
    programs, n_part = _stream_parts(kind, n, C, K, n_perm, N)
    parts = torch.empty((programs, n_part), device=H.device, dtype=acc)
    post_last, u_last = _last_update(post_in, u_in)
    _stream_mix_bwd[(programs,)](
        H=H3,  # (N, n, C)
        POST_IN=post_last,  # (B, T, n, 1) or None
        U_IN=u_last,  # (B, T, C) or None
        UW=None if UW is None else UW.contiguous(),  # (N, n K) or None
        W=W,  # (L, C, K) or None
        XW=XW,  # HC: (B, T, n, K); mHC-lite: (N, K); or None
        P0=P[0],
        P1=P[1],
        P2=P[2],
        P3=P[3],
        G_H=grad_h.contiguous(),  # (B, T, C)
        G_MIXED=grad_mixed.contiguous(),  # (B, T, n, C)
        G_POST=grad_post.contiguous(),  # (B, T, n, 1)
        D_H=d_H,  # (B, T, n, C)
        D_U=last[0],  # d u_in (B, T, C) or None
        D_POST_IN=last[1],  # d post_in (B, T, n, 1) or None
        OUT_H=last[2],  # mHC-lite: the streams formed (N, n C), or None
        D_UW=last[3],  # mHC-lite: post_in^T d XW (N, n K), or None
        D_XW=d_XW,  # (N, K) or None
        PART=parts,  # (programs, n_part)
        i=i, stride_t=H3.stride(0), stride_k=H3.stride(1),
        N=N, n=n, C=C, K=K, n_perm=n_perm, n_part=n_part, eps=RMS_EPS,
        LITE=kind == MHC_LITE, DYNAMIC=kind == HC, ADD=post_in is not None, ACC=acc_tl,
        KP=next_pow2(K), **blocks)
    return d_H, [] if d_XW is None else [d_XW], parts, [t for t in last if t is not None]


@_triton_stream_mix_backward.register_fake
def _(H, post_in, u_in, XW, UW, W, params, i, kind, grad_h, grad_mixed, grad_post, low):
    acc, (n, C), N = accumulator(H.dtype)[0], H.shape[-2:], H.numel() // (H.shape[-2] * H.shape[-1])
    K, n_perm = _projection_sizes(XW, W, params, kind)
    return (H.new_empty(H.shape), [XW.new_empty(XW.shape, dtype=acc)] if kind == MHC_LITE else [],
            H.new_empty(_stream_parts(kind, n, C, K, n_perm, N), dtype=acc),
            [t for t in _last_outputs(H, post_in, u_in, UW, kind, low) if t is not None])


def _stream_parts(kind, n, C, K, n_perm, N):
    """The stream backward's partial sums: (programs, numbers a program), [alpha | bias] of
    mHC-lite, [width | depth | s_a, s_b | W (C, K)] of HC ([width | depth] of static HC)."""
    if kind == MHC_LITE:
        n_part = 3 + 2 * n + n_perm
    elif kind == HC:
        n_part = n * (n + 1) + n + (2 + C * K)
    else:
        n_part = n * (n + 1) + n
    return reduction_programs(-(-N // stream_tile(n, C, n_perm, N))), n_part


def _last_outputs(H, post_in, u_in, UW, kind, low):
    """The stream backward's outputs for the last sublayer's update (see
    _triton_stream_mix_backward): d u_in, d post_in, and mHC-lite's streams formed and
    post_in^T d XW (in u_in's dtype, as its GEMM), or None."""
    if post_in is None:
        return None, None, None, None
    grads = (torch.empty(u_in.shape, device=H.device, dtype=u_in.dtype),
             torch.empty(post_in.shape, device=H.device, dtype=post_in.dtype))
    if kind == MHC_LITE:
        rows = (H.numel() // (H.shape[-2] * H.shape[-1]), H.shape[-2] * H.shape[-1])
        return *grads, torch.empty(rows, device=H.device, dtype=low or H.dtype), torch.empty(
            UW.shape, device=H.device, dtype=u_in.dtype)
    return *grads, None, None


@torch.library.custom_op('resroute::advance_backward', mutates_args=())
def _triton_advance_backward(grad: Tensor, update: Tensor, post: Tensor) -> Tuple[Tensor, Tensor]:
    n, C = grad.shape[-2:]
    N = update.numel() // C
    BT = stream_tile(n, C, 1, N)
    d_update, d_post = torch.empty_like(update), torch.empty_like(post)
    _advance_bwd[(triton.cdiv(N, BT),)](
        G=grad.contiguous(),  # (..., n, C)
        U=update.contiguous(),  # (..., C)
        POST=post.contiguous(),  # (..., n, 1)
        D_U=d_update,
        D_POST=d_post,
        N=N,
        n=n,
        C=C,
        ACC=accumulator(grad.dtype)[1], BT=BT, NP=next_pow2(n), BC=stream_columns(C))
    return d_update, d_post


@_triton_advance_backward.register_fake
def _(grad, update, post):
    return torch.empty_like(update), torch.empty_like(post)


# ------------------------------------------------------------------------------------ the Functions

class TorchStreamMix(torch.autograd.Function):
    """(h, H', post) of sublayer i with a TorchStreamStep, saving no streams: the segment keeps what
    the step saves, from which the backward's replay rebuilds the streams. The step sees the tokens
    flattened (N, ...): its products are plain (batched) matrix products."""

    @staticmethod
    def forward(ctx, H, segment, i, maths, *params):
        # (e's n copies: a stride-0 view, kept as such; the products take a dense copy)
        h, mixed, post, saved = maths(flat_streams(H.contiguous()), i)
        # post.detach(), not the output itself: its grad_fn would hold this ctx, which holds the
        # segment: a cycle through autograd's graph that the garbage collector cannot free (27 MB a
        # step leaked)
        saved = tuple(t.detach() if t is post else t for t in saved)
        segment.saved.append(saved)
        # saved here too, so that autograd checks them for in-place changes and memory accounting
        # sees them
        ctx.save_for_backward(H if i == segment.start else None, *saved)
        device = H.device.type
        ctx.autocast = dict(device_type=device, dtype=torch.get_autocast_dtype(device),
                            enabled=torch.is_autocast_enabled(device))
        ctx.segment, ctx.i, ctx.maths = segment, i, maths
        lead = H.shape[:-2]
        return (h.view(*lead, -1), mixed.view(H.shape),
                post if post.dim() == 1 else post.view(*lead, -1))

    @staticmethod
    def backward(ctx, grad_h, grad_mixed, grad_post):
        _, *saved = ctx.saved_tensors
        H = ctx.segment.streams_at(ctx.i, ctx.autocast)
        n, C = H.shape[-2:]
        with torch.autocast(**ctx.autocast):  # the forward's precision for the products
            grad_H = ctx.maths.backward(
                flat_streams(H), ctx.i, saved, grad_h.reshape(-1, C),
                grad_mixed.reshape(-1, n, C),
                grad_post if grad_post.dim() == 1 else grad_post.reshape(-1, n))
        grads = ctx.maths.take() if ctx.i == 0 else [None] * len(ctx.maths.params)
        return grad_H.view(H.shape), None, None, None, *grads


class Advance(torch.autograd.Function):
    """H' + post^T f(h) (advance), its backward by `backward` (advance_backward, or the kernel's).
    With post_again (a function), post is computed again in the backward instead of saved."""

    @staticmethod
    def forward(ctx, mixed, post, update, backward, post_again=None):
        ctx.save_for_backward(None if post_again else post, update)
        ctx.backward_of, ctx.post_again, ctx.post_shape = backward, post_again, post.shape
        return advance(mixed, post, update)

    @staticmethod
    def backward(ctx, grad):
        post, update = ctx.saved_tensors
        if ctx.post_again:
            post = ctx.post_again().view(ctx.post_shape)
        d_update, d_post = ctx.backward_of(grad, update, post)
        return grad, d_post, d_update, None, None


class StreamParams:
    """The stacked connection parameters (L, ...) of one forward with the Triton kernels, mHC-lite's
    projection rearranged for the update's share, and the parameters' gradients: sublayer i's
    backward sums its programs' partial sums into its row, put in a GradPool,
    and sublayer 0, the last to run backward, stacks the L rows and hands out the parameters'
    gradients as slices of them; the others return None. (Per sublayer one sum, where each
    sublayer's own gradients cost five slices and autograd a stack of L of them per parameter.)"""

    def __init__(self, kind, params, W):
        self.kind, self.params, self.W, self.pool = kind, params, W, GradPool()
        self.W_t = self.W_s = self.W_s_t = None

    def put(self, i, parts):
        self.pool.put(i, (parts.sum(0),))

    def by_stream(self, i):
        """[W_1 | .. | W_n] (C, n K) of mHC-lite's sublayer i, W_s its rows of stream s (the stack
        rearranged once per forward, not once per sublayer): u [W_1 | .. | W_n] projects an update
        u."""
        if self.W_s is None:
            (L, nC, K), n = self.W.shape, self.params[2].shape[1]
            stack = (self.W.detach().view(L, n, nC // n, K).transpose(1, 2)
                     .reshape(L, nC // n, n * K))
            self.W_s = stack, stack.unbind()
        return self.W_s[1][i]

    def by_stream_transposed(self, i):
        """[W_1 | .. | W_n]^T (n K, C) of mHC-lite's sublayer i, which d u's share through the
        projection multiplies (the rearranged stack transposed once per backward, not once per
        sublayer)."""
        if self.W_s_t is None:
            self.by_stream(i)
            self.W_s_t = self.W_s[0].mT.unbind()
        return self.W_s_t[i]

    def transposed(self, i):
        """W_i^T of mHC-lite's sublayer i (the stack transposed once per backward, not once per
        sublayer)."""
        if self.W_t is None:
            self.W_t = self.W.mT.unbind()
        return self.W_t[i]

    def take(self):
        """The gradients of the parameters (and of HC's W): [width | depth | s_a, s_b | W] or
        [alpha | bias]."""
        L = self.params[0].shape[0]
        rows, = self.pool.take_stacked(L)
        self.W_t = self.W_s = self.W_s_t = None
        params = [p for p in self.params + ([self.W] if self.kind == HC else [])
                  if p.is_floating_point()]
        # (mHC-lite's permutations: none)
        grads = rows.split([p.numel() // L for p in params], dim=1)
        # (autograd keeps a contiguous gradient as it is; a slice it would copy in two operators)
        return [(g if g.shape == p.shape else g.view(p.shape)).to(p.dtype).contiguous()
                for g, p in zip(grads, params)]


class TritonStreamMix(torch.autograd.Function):
    """TorchStreamMix's twin with the Triton kernels: (h, H', post) of sublayer i from the streams
    (H, post_in, u_in) (H itself, or the last sublayer's H' + post_in^T u_in: see TritonStreams),
    the projection W (HC: the stacked (L, C, n + 2), or None (static); mHC-lite: sublayer i's) and
    the stacked connection parameters, saving XW (and mHC-lite's u [W_1 | .. | W_n]: a few numbers
    per token) and no streams; the backward rebuilds the streams from the segment, and gives the
    last sublayer's H', post and u their gradients. HC's projection is the kernels' (forward and
    backward); mHC-lite's is GEMMs beside them. The parameters' gradients gather in a
    StreamParams."""

    @staticmethod
    def forward(ctx, H, post_in, u_in, W, segment, i, grads, *params):
        kind = grads.kind
        if kind == MHC_LITE:  # mHC-lite's projection by cuBLAS: XW (N, K) of the rows (N, n C), of
            # H' + post^T u as H' W and u W_s; H' W at the streams' precision (under autocast, a
            # half-precision copy of H' moved more)
            with torch.autocast(H.device.type, enabled=False):
                XW = torch.mm(H.reshape(-1, W.shape[0]), W.to(H.dtype))
            UW = None if u_in is None else torch.mm(u_in.reshape(-1, u_in.shape[-1]),
                                                    grads.by_stream(i))
            h, mixed, post, combined = _triton_stream_mix(H, post_in, u_in, XW, UW, None,
                                                          list(params), i, kind, False)
            XW = XW if UW is None else combined
        else:  # HC's by the kernel (static HC: none)
            h, mixed, post, XW = _triton_stream_mix(H, post_in, u_in, None, None, W, list(params),
                                                    i, kind, False)
            XW, UW = None if W is None else XW, None
        segment.saved.append(XW)  # the replay's kernel computes post again from XW
        start = (H, post_in, u_in) if i == segment.start else (None,) * 3
        # (mHC-lite's UW: d post_in's share through XW)
        ctx.save_for_backward(*start, W, XW, UW, *params)
        device = H.device.type
        ctx.autocast = dict(device_type=device, dtype=torch.get_autocast_dtype(device),
                            enabled=torch.is_autocast_enabled(device))
        ctx.segment, ctx.i, ctx.grads = segment, i, grads
        return h, mixed, post

    @staticmethod
    def backward(ctx, grad_h, grad_mixed, grad_post):
        _, _, _, W, XW, UW, *params = ctx.saved_tensors
        (H, post_in, u_in), kind = ctx.segment.streams_at(ctx.i, ctx.autocast), ctx.grads.kind
        # mHC-lite's streams for W's gradient in autocast's dtype (float32 streams): its product at
        # the precision of autocast's
        low = (ctx.autocast['dtype'] if ctx.autocast['enabled'] and H.dtype == torch.float32
               else None)
        d_H, d_XW, parts, d_last = _triton_stream_mix_backward(H, post_in, u_in, XW, UW,
                                                               W if kind == HC else None, params,
                                                               ctx.i, kind, grad_h, grad_mixed,
                                                               grad_post, low)
        ctx.grads.put(ctx.i, parts)
        d_u, d_post, grad_W = *(d_last[:2] if d_last else (None, None)), None
        # XW = rows W: rows get d_XW W^T, W gets rows^T d_XW (rows: the streams as the kernel formed
        # them)
        if kind == MHC_LITE:
            d_XW = d_XW[0]
            if d_last:
                rows = d_last[2]
            else:
                rows = H.reshape(-1, W.shape[0])  # (e's n copies: a dense copy)
            d_H.view(rows.shape).addmm_(d_XW.to(d_H.dtype),
                                        ctx.grads.transposed(ctx.i).to(d_H.dtype))
            grad_W = (rows.t() @ d_XW.to(rows.dtype)).to(W.dtype)
            if d_last:  # d u's share through XW: sum_s post_s d_XW W_s^T, one GEMM of post^T d_XW
                # (N, n K)
                d_uw = d_last[3]
                d_u.view(-1, d_u.shape[-1]).addmm_(d_uw, ctx.grads.by_stream_transposed(ctx.i).to(
                    d_uw.dtype))
        if ctx.i > 0:
            return d_H, d_post, d_u, grad_W, None, None, None, *[None] * len(params)
        grads = ctx.grads.take()
        if kind == HC:
            grad_W = grads.pop()
        rest = grads + [None] * (len(params) - len(grads))
        return d_H, d_post, d_u, grad_W, None, None, None, *rest


# ------------------------------------------------------------------------------------ the schedules

def hc(module, x, sublayers, backend):
    """HC: the streams of its connections."""
    return streams(module.connections, module, x, sublayers, backend)


def mhc(module, x, sublayers, backend):
    """The mHC family (mHC, mHC-lite, KromHC): the streams of its coefficients."""
    return streams(module.coefficients, module, x, sublayers, backend)


def streams(connections, module, x, sublayers, backend):
    """HC and the mHC family with the streams rebuilt in the backward instead of saved: the
    sublayers are cut into segments of about sqrt(L); a segment keeps its input streams, what each
    step saved for the replay (a few numbers per token) and the updates (which the update's
    backward needs anyway), and the backward rebuilds each segment's streams once. `connections`:
    the class's module of connections. Compiled, compiled_streams runs instead (the compiler plans
    its own memory)."""
    # e copied into n streams, as residuals.copies
    H = x.unsqueeze(-2).expand(*x.shape[:-1], module.n, x.shape[-1])
    if torch.compiler.is_compiling():
        return compiled_streams(module, connections, H, sublayers)
    length = max(1, round(math.sqrt(len(sublayers))))
    # mHC's and KromHC's H_res have no Triton kernel: there the triton backend runs the PyTorch twin
    triton_ok = isinstance(connections, (residuals.HCConnections, residuals.PermutationMixing))
    # the family's one choice of backend
    plan = (TritonStreams if backend == 'triton' and triton_ok else TorchStreams)(connections, H)
    state = plan.start
    for i, f in enumerate(sublayers):
        if i % length == 0:
            segment = StreamSegment(i, state, plan.replay)
        h, mixed, post = plan.mix(state, i, segment)
        update = f(h)
        segment.updates.append(update.detach())
        state = plan.join(mixed, post, update, i, segment)
    return module.readout(plan.last(state))


class TorchStreams:
    """The PyTorch twin's schedule of one forward: the streams as one tensor (start), each
    sublayer's step (mix, by TorchStreamMix), the update (join, by Advance), the replay's step, and
    the streams the readout takes (last)."""

    def __init__(self, connections, H):
        if isinstance(connections, residuals.HCConnections):
            self.maths = HCStep(connections)
        elif isinstance(connections, residuals.PermutationMixing):
            self.maths = MHCLiteStep(connections)
        else:
            self.maths = MHCStep(connections)
        self.start = H

    def mix(self, H, i, segment):
        return TorchStreamMix.apply(H, segment, i, self.maths, *self.maths.params)

    def join(self, mixed, post, u, i, segment):
        post_again = self.maths.post_again(segment.saved[-1], i)
        return Advance.apply(mixed, post, u, advance_backward, post_again)

    def replay(self, H, i, saved, u):
        """The streams after sublayer i, from the streams before it, what its step saved and its
        update."""
        _, mixed, post, _ = self.maths(flat_streams(H), i, saved)
        return advance(mixed, post, u.view(-1, u.shape[-1])).view(H.shape)

    def last(self, H):
        return H


def triton_stream_params(connections):
    """The kind of step and the stacked parameters (L, ...) the kernels read sublayer i's rows of:
    HC [width, depth, s_a, s_b] (static: [width, depth]), mHC-lite [alpha, bias, the permutations
    as stream indices]."""
    if isinstance(connections, residuals.PermutationMixing):
        return MHC_LITE, [connections.alpha, connections.bias,
                          connections.permutations.argmax(-1).to(torch.int32)]
    if connections.dynamic:
        return HC, [connections.width, connections.depth, connections.width_scale,
                    connections.depth_scale]
    return HC_STATIC, [connections.width, connections.depth]


class TritonStreams:
    """As TorchStreams with the kernels, which carry the streams as (H, post, u): the last
    sublayer's H' and post and its update f(h), from which each step's kernels (forward, replay and
    backward) form the streams H' + post^T u as they read them, so that the n streams are never
    written between two sublayers; only the readout's streams are formed outside, by Advance. The
    first sublayer's: (e's n copies, a stride-0 stream dimension, None, None)."""

    def __init__(self, connections, H):
        self.kind, self.params = triton_stream_params(connections)
        self.grads = StreamParams(self.kind, self.params, getattr(connections, 'proj', None))
        # mHC-lite's projections one per sublayer: one backward node gathers their gradients
        self.projections = [self.grads.W] * len(self.params[0])
        if self.kind == MHC_LITE:
            self.projections = connections.proj.unbind()
        self.start = H, None, None

    def mix(self, state, i, segment):
        return TritonStreamMix.apply(*state, self.projections[i], segment, i, self.grads,
                                     *self.params)

    def join(self, mixed, post, u, i, segment):
        return mixed, post, u

    def replay(self, state, i, XW, u):
        _, mixed, post, _ = _triton_stream_mix(*state, XW, None, None, self.params, i, self.kind,
                                               True)
        return mixed, post, u

    def last(self, state):
        if state[1] is None:
            return state[0]
        return Advance.apply(*state, _triton_advance_backward)


def compiled_streams(module, connections, H, sublayers):
    """The class's maths for the compiler from the streams H, with the mixing written as n broadcast
    multiply-adds (inductor fuses them with the update into one loop; A^T H would stay a batched
    GEMM of tiny per-token matrices). The compiler plans the memory."""
    for i, f in enumerate(sublayers):
        if isinstance(connections, residuals.ManifoldCoefficients):
            # the mHC family: A = [H_pre | H_res^T], post = H_post
            h_pre, post, h_res = connections(i, H)
            A = torch.cat([h_pre.unsqueeze(-1), h_res.transpose(-1, -2)], -1)
        else:  # HC: A = [A_m | A_r], post = B
            A, post = connections(i, H)
        # (..., n+1, C): row 0 is h, rows 1..n are H'
        mixed = (A.unsqueeze(-1) * H.unsqueeze(-2)).sum(-3)
        H = advance(mixed[..., 1:, :], post, f(mixed[..., 0, :]))
    return module.readout(H)


# =========================================================================== 4. MGR: the fused step
#
# n streams s_j, started by e and the first n - 1 updates; each later sublayer's update u moves
# every stream by its gate, s_j <- s_j + beta_j (u - s_j), beta from the streams' own RMS-normalised
# scores (competitive: a softmax with a keep logit; independent: sigmoids), and the next sublayer
# reads h = AttnPool(s) (residuals.MultiGateResiduals). One step, per token, with r_j = 1/RMS(s_j)
# and r'_j = 1/RMS(s'_j), g and p the gate's and the pool's query:
#
#     z_j = r_j s_j . g,   beta = softmax([b, z])[1:] (competitive) or sigmoid(z + b)
#     s'_j = s_j + beta_j (u - s_j),   y_j = r'_j s'_j . p,   alpha = softmax(y)
#     h = sum_j alpha_j s'_j
#
# backward, from g_h and the new streams' gradients g'_j:
#
#     dy_j = alpha_j g_h . (s'_j - h)
#     ds'_j = g'_j + alpha_j g_h + dy_j r'_j (p - (y_j r'_j / C) s'_j)
#     du = sum_j beta_j ds'_j,   dbeta_j = ds'_j . (u - s_j)
#     dz: sigmoid's or the softmax's backward (with the keep logit b),   ds_j = (1 - beta_j) ds'_j
#         + dz_j r_j (g - (z_j r_j / C) s_j)
#
# One step does the gates, the update and the next AttnPool in one pass over the streams; its
# backward can rebuild the step's input streams from its output by inverting the update, s_j =
# (s'_j - beta_j u) / (1 - beta_j), so the steps keep one set of streams (MGRStep).

# ---------------------------------------------------------------------------- the PyTorch functions

def _gates(z, bias, competitive):
    """beta (n, N) from scores z (n, N): softmax with a keep logit, or independent sigmoids."""
    if competitive:
        return torch.softmax(torch.cat([bias.expand_as(z[:1]), z]), dim=0)[1:]
    return torch.sigmoid(z + bias)


def _rms_dot(x, query, r=None):
    """r = 1/RMS(x) (unless given) and the score r x.query, per stream and token: x (n, ..., C),
    query (C,) or (1, C) -> (n, ...), (n, ...)."""
    r = rms_inverse(x) if r is None else r
    return r, r * torch.mv(x.reshape(-1, x.shape[-1]), query.reshape(-1)).view(r.shape)


def mgr_step_torch(streams, u, gate_query, gate_bias, pool_query, competitive, keep, rinv=None):
    """The fused step in PyTorch: the gates from the input streams, the lerp, the AttnPool of the
    result. streams (n, *tokens, C), u (*tokens, C) (tokens: (B, T), or (N,)); queries (C,) or
    (1, C) already scaled by 1/sqrt(C); gate_bias (1,); rinv: the streams' 1/RMS if known (the step
    before took it for its AttnPool). Returns new streams, h (*tokens, C), beta and alpha
    (n, *tokens) (float32 for half precision), and the originals of the `keep` largest gates per
    token (indices (keep, *tokens), streams (keep, *tokens, C)) for the inversion, and for the
    backward the scores and 1/RMS of both (gates: the input streams, AttnPool: the new ones;
    (n, *tokens) each)."""
    s, u_wide = upcast(streams), upcast(u)
    r, z = _rms_dot(s, upcast(gate_query), rinv)
    beta = _gates(z, upcast(gate_bias), competitive)
    new = torch.lerp(s, u_wide, beta.unsqueeze(-1))  # s + beta (u - s)
    r2, y = _rms_dot(new, upcast(pool_query))
    alpha = torch.softmax(y, dim=0)
    h = (alpha.unsqueeze(-1) * new).sum(0)  # (einsum would run one tiny matmul per token on CPU)
    index = beta.topk(keep, dim=0).indices
    kept = streams.gather(0, index.unsqueeze(-1).expand(*index.shape, streams.shape[-1]))
    return cast(new, streams.dtype), cast(h, u.dtype), beta, alpha, index, kept, (r, z, r2, y)


def mgr_step_backward_torch(x, u, gate_query, gate_bias, pool_query, beta, alpha, index, kept,
                            grad_new, grad_h, competitive, invert, scores):
    """Backward of mgr_step_torch. x is the step's output streams when `invert` (the inputs are
    rebuilt from them, the kept originals put back), else its input streams (the outputs are
    recomputed); scores: the forward's (r, z, r2, y). Returns the grads of streams, u, gate_query,
    gate_bias, pool_query, and the (rebuilt) input streams."""
    x, u_wide, b = upcast(x), upcast(u), beta.unsqueeze(-1)
    kept_share = 1 - b
    if invert:
        new = x
        s = torch.addcmul(x, b, u_wide, value=-1).div_(kept_share)
        s.scatter_(0, index.unsqueeze(-1).expand(*index.shape, x.shape[-1]), upcast(kept))
    else:
        s = x
        new = torch.lerp(s, u_wide, b)
    (r, z, r2, y), C, grad_h = scores, x.shape[-1], upcast(grad_h)
    # AttnPool: h = sum_j alpha_j s'_j, alpha = softmax(r'_j s'_j.w); in place where a pass is saved
    dy = torch.ops.aten._softmax_backward_data((new * grad_h).sum(-1), alpha, 0, alpha.dtype)
    d_new = torch.addcmul(upcast(grad_new), alpha.unsqueeze(-1), grad_h)
    scaled = dy * r2
    d_new.addcmul_(scaled.unsqueeze(-1), upcast(pool_query)).addcmul_(
        (scaled * r2 * y).unsqueeze(-1), new, value=-1 / C)
    grad_pool = torch.mv(new.reshape(-1, C).T, scaled.reshape(-1)).view_as(pool_query)
    # lerp: s' = s + beta (u - s)
    grad_u = (b * d_new).sum(0)
    d_beta = (d_new * (u_wide - s)).sum(-1)
    d_s = d_new.mul_(kept_share)
    # gates
    if competitive:
        # beta = softmax([b, z])[1:]: d b = sum -p_keep (beta . d_beta), p_keep = 1 - sum beta
        weighted = (beta * d_beta).sum(0)
        dz = beta * (d_beta - weighted)
        grad_bias = torch.dot(beta.sum(0).sub_(1).flatten(), weighted.flatten())
    else:
        dz = torch.ops.aten.sigmoid_backward(d_beta, beta)
        grad_bias = dz.sum()
    scaled = dz * r
    d_s.addcmul_(scaled.unsqueeze(-1), upcast(gate_query)).addcmul_(
        (scaled * r * z).unsqueeze(-1), s, value=-1 / C)
    grad_gate = torch.mv(s.reshape(-1, C).T, scaled.reshape(-1)).view_as(gate_query)
    return (d_s.to(x.dtype), grad_u.to(u.dtype), grad_gate, grad_bias.reshape(1), grad_pool, s)


# ------------------------------------------------------------------------------- the Triton kernels

if triton is not None:
    @triton.jit
    def _mgr_step_fwd(S,      # (n, N, C) the streams
                      U,      # (N, C) the update
                      VG,     # (C,) the gate query
                      VP,     # (C,) the pool query
                      BIAS,   # (1,) the gate bias
                      NEW,    # (n, N, C) out: the new streams
                      H,      # (N, C) out: the new streams' AttnPool
                      BETA,   # (n, N) out, ACC
                      ALPHA,  # (n, N) out, ACC
                      INDEX,  # (keep, N) out, int64
                      KEPT,   # (keep, N, C) out
                      n,
                      N,
                      C,
                      keep,
                      eps,
                      COMPETITIVE: tl.constexpr,
                      ACC: tl.constexpr,
                      BN: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        # a tile of BT tokens: (streams, tokens, channels) blocks, (streams, tokens) gates and
        # weights
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        rows, cols = tl.arange(0, BN), tl.arange(0, BC)
        rmask, tmask, cmask = rows < n, t < N, cols < C
        tc, st = tmask[:, None] & cmask[None, :], rmask[:, None] & tmask[None, :]
        mask = st[:, :, None] & cmask[None, None, :]
        at = rows[:, None, None] * N * C + t[None, :, None] * C + cols[None, None, :]
        s = tl.load(S + at, mask=mask, other=0.).to(ACC)  # the n streams: read once
        u = tl.load(U + t[:, None] * C + cols[None, :], mask=tc, other=0.).to(ACC)
        vg = tl.load(VG + cols, mask=cmask, other=0.).to(ACC)[None, None, :]
        vp = tl.load(VP + cols, mask=cmask, other=0.).to(ACC)[None, None, :]
        b = tl.load(BIAS).to(ACC)
        z = 1 / tl.sqrt(tl.sum(s * s, axis=2) / C + eps) * tl.sum(s * vg, axis=2)
        if COMPETITIVE:  # softmax over [b, z_1..z_n], without the keep entry
            z = tl.where(rmask[:, None], z, float('-inf'))
            top = tl.maximum(tl.max(z, axis=0), b)
            e = tl.exp(z - top[None, :])
            beta = e / (tl.exp(b - top) + tl.sum(e, axis=0))[None, :]
        else:
            beta = tl.where(rmask[:, None], tl.sigmoid(z + b), 0.)
        new = s + beta[:, :, None] * (u[None, :, :] - s)
        tl.store(NEW + at, new.to(NEW.dtype.element_ty), mask=mask)
        y = 1 / tl.sqrt(tl.sum(new * new, axis=2) / C + eps) * tl.sum(new * vp, axis=2)
        y = tl.where(rmask[:, None], y, float('-inf'))
        alpha = tl.exp(y - tl.max(y, axis=0)[None, :])
        alpha = alpha / tl.sum(alpha, axis=0)[None, :]
        tl.store(H + t[:, None] * C + cols[None, :],
                 tl.sum(alpha[:, :, None] * new, axis=0).to(H.dtype.element_ty), mask=tc)
        tl.store(BETA + rows[:, None] * N + t[None, :], beta, mask=st)
        tl.store(ALPHA + rows[:, None] * N + t[None, :], alpha, mask=st)
        left = tl.where(rmask[:, None], beta, -1.)
        for k in range(keep):  # originals of the largest gates, for the inversion
            j = tl.min(tl.where(left == tl.max(left, axis=0)[None, :], rows[:, None], BN), axis=0)
            tl.store(INDEX + k * N + t, j.to(tl.int64), mask=tmask)
            original = tl.sum(tl.where(rows[:, None, None] == j[None, :, None], s, 0.), axis=0)
            tl.store(KEPT + k * N * C + t[:, None] * C + cols[None, :],
                     original.to(KEPT.dtype.element_ty), mask=tc)
            left = tl.where(rows[:, None] == j[None, :], -2., left)

    @triton.jit
    def _mgr_step_bwd(X,        # (n, N, C) the output streams if INVERT, else the input ones
                      U,        # (N, C)
                      VG,       # (C,)
                      VP,       # (C,)
                      BETA,     # (n, N)
                      ALPHA,    # (n, N)
                      INDEX,    # (keep, N)
                      KEPT,     # (keep, N, C)
                      G_NEW,    # (n, N, C)
                      G_H,      # (N, C)
                      D_S,      # (n, N, C) out
                      D_U,      # (N, C) out
                      REBUILT,  # (n, N, C) out, if INVERT
                      D_VG,     # (programs, C) out: partial sums
                      D_VP,     # (programs, C) out: partial sums
                      D_B,      # (programs,) out: partial sums
                      n,
                      N,
                      C,
                      keep,
                      eps,
                      COMPETITIVE: tl.constexpr,
                      INVERT: tl.constexpr,
                      ACC: tl.constexpr,
                      BN: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        pid, programs = tl.program_id(0), tl.num_programs(0)
        rows, cols = tl.arange(0, BN), tl.arange(0, BC)
        rmask, cmask = rows < n, cols < C
        vg = tl.load(VG + cols, mask=cmask, other=0.).to(ACC)[None, None, :]
        vp = tl.load(VP + cols, mask=cmask, other=0.).to(ACC)[None, None, :]
        d_vg = tl.zeros((BC,), ACC)
        d_vp = tl.zeros((BC,), ACC)
        d_b = tl.zeros((BN,), ACC)
        # each program: every programs-th tile of BT tokens
        for tile in range(pid, tl.cdiv(N, BT), programs):
            # int64 (the interpreter: Python ints)
            t = (pid.to(tl.int64) + (tile - pid)) * BT + tl.arange(0, BT)
            tmask = t < N
            tc, st = tmask[:, None] & cmask[None, :], rmask[:, None] & tmask[None, :]
            mask = st[:, :, None] & cmask[None, None, :]
            at = rows[:, None, None] * N * C + t[None, :, None] * C + cols[None, None, :]
            x = tl.load(X + at, mask=mask, other=0.).to(ACC)
            u = tl.load(U + t[:, None] * C + cols[None, :], mask=tc, other=0.).to(ACC)[None, :, :]
            beta = tl.load(BETA + rows[:, None] * N + t[None, :], mask=st, other=0.)
            alpha = tl.load(ALPHA + rows[:, None] * N + t[None, :], mask=st, other=0.)
            if INVERT:
                # rebuild the inputs from the outputs; the largest gates' originals were kept
                new = x
                s = (x - beta[:, :, None] * u) / (1 - beta[:, :, None])
                for k in range(keep):
                    j = tl.load(INDEX + k * N + t, mask=tmask, other=-1)
                    original = tl.load(KEPT + k * N * C + t[:, None] * C + cols[None, :], mask=tc,
                                       other=0.).to(ACC)
                    s = tl.where(rows[:, None, None] == j[None, :, None], original[None, :, :], s)
                tl.store(REBUILT + at, s.to(REBUILT.dtype.element_ty), mask=mask)
            else:
                s = x
                new = s + beta[:, :, None] * (u - s)
            g_h = tl.load(G_H + t[:, None] * C + cols[None, :], mask=tc,
                          other=0.).to(ACC)[None, :, :]
            # AttnPool
            r2 = 1 / tl.sqrt(tl.sum(new * new, axis=2) / C + eps)
            y = r2 * tl.sum(new * vp, axis=2)
            g_alpha = tl.sum(new * g_h, axis=2)
            dy = alpha * (g_alpha - tl.sum(alpha * g_alpha, axis=0)[None, :])
            d_new = (tl.load(G_NEW + at, mask=mask, other=0.).to(ACC) + alpha[:, :, None] * g_h
                     + (dy * r2)[:, :, None] * vp - (dy * r2 * r2 * y / C)[:, :, None] * new)
            d_vp += tl.sum(tl.sum((dy * r2)[:, :, None] * new, axis=1), axis=0)
            # lerp
            tl.store(D_U + t[:, None] * C + cols[None, :],
                     tl.sum(beta[:, :, None] * d_new, axis=0).to(D_U.dtype.element_ty), mask=tc)
            d_beta = tl.sum(d_new * (u - s), axis=2)
            d_s = (1 - beta[:, :, None]) * d_new
            # gates
            if COMPETITIVE:
                weighted = tl.sum(beta * d_beta, axis=0)
                dz = beta * (d_beta - weighted[None, :])
                d_b += tl.where(rows == 0,
                                -tl.sum((1 - tl.sum(beta, axis=0)) * weighted, axis=0), 0.)
            else:
                dz = d_beta * beta * (1 - beta)
                d_b += tl.sum(dz, axis=1)
            r = 1 / tl.sqrt(tl.sum(s * s, axis=2) / C + eps)
            z = r * tl.sum(s * vg, axis=2)
            d_s += (dz * r)[:, :, None] * vg - (dz * r * r * z / C)[:, :, None] * s
            d_vg += tl.sum(tl.sum((dz * r)[:, :, None] * s, axis=1), axis=0)
            tl.store(D_S + at, d_s.to(D_S.dtype.element_ty), mask=mask)
        tl.store(D_VG + pid * C + cols, d_vg, mask=cmask)
        tl.store(D_VP + pid * C + cols, d_vp, mask=cmask)
        tl.store(D_B + pid, tl.sum(d_b, axis=0))


# ----------------------------------------------------------------------------------- the custom ops

@torch.library.custom_op('resroute::mgr_step', mutates_args=())
def triton_mgr_step(streams: Tensor, u: Tensor, gate_query: Tensor, gate_bias: Tensor,
                    pool_query: Tensor, competitive: bool, keep: int
                    ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """mgr_step_torch in Triton, one program per tile of tokens (the tokens' shape as given: no
    view)."""
    streams, u = streams.contiguous(), u.contiguous()
    n, tokens, C = streams.shape[0], u.shape[:-1], u.shape[-1]
    N, (acc, acc_tl) = u.numel() // C, accumulator(streams.dtype)
    new, h = torch.empty_like(streams), torch.empty_like(u)
    beta, alpha = (torch.empty((n, *tokens), device=u.device, dtype=acc) for _ in range(2))
    index = torch.empty((keep, *tokens), device=u.device, dtype=torch.int64)
    kept = streams.new_empty((keep, *tokens, C))
    BT = token_tile(n, C, N)
    _mgr_step_fwd[(triton.cdiv(N, BT),)](
        S=streams,                   # (n, N, C)
        U=u,                         # (N, C)
        VG=gate_query.contiguous(),  # (C,) or (1, C)
        VP=pool_query.contiguous(),  # (C,) or (1, C)
        BIAS=gate_bias,              # (1,)
        NEW=new,                     # (n, N, C)
        H=h,                         # (N, C)
        BETA=beta,                   # (n, N)
        ALPHA=alpha,                 # (n, N)
        INDEX=index,                 # (keep, N)
        KEPT=kept,                   # (keep, N, C)
        n=n,
        N=N,
        C=C,
        keep=keep,
        eps=RMS_EPS,
        COMPETITIVE=competitive, ACC=acc_tl,
        BN=next_pow2(n), BT=BT, BC=next_pow2(C))
    return new, h, beta, alpha, index, kept


@triton_mgr_step.register_fake
def _(streams, u, gate_query, gate_bias, pool_query, competitive, keep):
    n, tokens = streams.shape[0], u.shape[:-1]
    stat = lambda: streams.new_empty((n, *tokens), dtype=accumulator(streams.dtype)[0])
    return (torch.empty_like(streams), torch.empty_like(u), stat(), stat(),
            streams.new_empty((keep, *tokens), dtype=torch.int64),
            streams.new_empty((keep, *u.shape)))


@torch.library.custom_op('resroute::mgr_step_backward', mutates_args=())
def triton_mgr_step_backward(x: Tensor, u: Tensor, gate_query: Tensor, gate_bias: Tensor,
                             pool_query: Tensor, beta: Tensor, alpha: Tensor, index: Tensor,
                             kept: Tensor, grad_new: Tensor, grad_h: Tensor, competitive: bool,
                             invert: bool
                             ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """mgr_step_backward_torch in Triton."""
    x, u = x.contiguous(), u.contiguous()
    n, C = x.shape[0], x.shape[-1]
    N = u.numel() // C
    BT, (acc, acc_tl) = token_tile(n, C, N), accumulator(x.dtype)
    programs = reduction_programs(triton.cdiv(N, BT))
    d_s, d_u = torch.empty_like(x), torch.empty_like(u)
    rebuilt = torch.empty_like(x) if invert else x.new_empty(0)  # only the inversion writes it
    partial = lambda *shape: torch.empty((programs,) + shape, device=x.device, dtype=acc)
    d_vg, d_vp, d_b = partial(C), partial(C), partial()
    _mgr_step_bwd[(programs,)](
        X=x,                            # (n, N, C)
        U=u,                            # (N, C)
        VG=gate_query.contiguous(),     # (C,) or (1, C)
        VP=pool_query.contiguous(),     # (C,) or (1, C)
        BETA=beta,                      # (n, N)
        ALPHA=alpha,                    # (n, N)
        INDEX=index,                    # (keep, N)
        KEPT=kept.contiguous(),         # (keep, N, C)
        G_NEW=grad_new.contiguous(),    # (n, N, C)
        G_H=grad_h.contiguous(),        # (N, C)
        D_S=d_s,                        # (n, N, C)
        D_U=d_u,                        # (N, C)
        REBUILT=rebuilt,                # (n, N, C), or empty
        D_VG=d_vg,                      # (programs, C)
        D_VP=d_vp,                      # (programs, C)
        D_B=d_b,                        # (programs,)
        n=n,
        N=N,
        C=C,
        keep=index.shape[0],
        eps=RMS_EPS,
        COMPETITIVE=competitive, INVERT=invert, ACC=acc_tl,
        BN=next_pow2(n), BT=BT, BC=next_pow2(C))
    return (d_s, d_u, d_vg.sum(0).view(gate_query.shape), d_b.sum().reshape(1),
            d_vp.sum(0).view(pool_query.shape), rebuilt)


@triton_mgr_step_backward.register_fake
def _(x, u, gate_query, gate_bias, pool_query, beta, alpha, index, kept, grad_new, grad_h,
      competitive, invert):
    acc = accumulator(x.dtype)[0]
    return (torch.empty_like(x), torch.empty_like(u), x.new_empty(gate_query.shape, dtype=acc),
            x.new_empty((1,), dtype=acc), x.new_empty(pool_query.shape, dtype=acc),
            torch.empty_like(x) if invert else x.new_empty(0))


def triton_step(streams, u, gate_query, gate_bias, pool_query, competitive, keep, rinv):
    """triton_mgr_step as mgr_step_torch is called: no scores saved (the backward kernel computes
    them again), no rinv read."""
    return (*triton_mgr_step(streams, u, gate_query, gate_bias, pool_query, competitive, keep), ())


def triton_step_backward(*args):
    """triton_mgr_step_backward as mgr_step_backward_torch is called (its last argument, the
    scores, is none)."""
    return triton_mgr_step_backward(*args[:-1])


# the step and its backward, by backend (mgr chooses)
TORCH_STEP = mgr_step_torch, mgr_step_backward_torch


TRITON_STEP = triton_step, triton_step_backward


# -------------------------------------------------------------------- the Function and the schedule

class MGRStep(torch.autograd.Function):
    """One gated MGR sublayer: s_j <- s_j + beta_j (u - s_j), then h = AttnPool(s) for the next
    sublayer, in one pass. Without a tape it saves its input streams. With a `tape` (a dict shared
    by the steps of one forward) the backward inverts the lerp instead: only the last step saves its
    output streams; every step's backward rebuilds its input from its output and leaves it on the
    tape for the step before (backwards run in reverse order, so each finds its output there)."""

    @staticmethod
    def forward(ctx, streams, u, gate_query, gate_bias, pool_query, competitive, fallback_p, tape,
                step, last, step_fns, rinv):
        keep = min(fallback_p, streams.shape[0]) if tape is not None else 0
        args = streams, u, gate_query, gate_bias, pool_query, competitive, keep
        step_forward, _ = step_fns
        new, h, beta, alpha, index, kept, scores = step_forward(*args, rinv)
        if tape is None:
            saved_streams = [streams]
        elif last:
            saved_streams = [new]
        else:
            saved_streams = []
        ctx.save_for_backward(u, gate_query, gate_bias, pool_query, beta, alpha, index, kept,
                              *scores, *saved_streams)
        ctx.competitive, ctx.tape, ctx.step, ctx.step_fns, ctx.n_scores = (
            competitive, tape, step, step_fns, len(scores))
        # the new streams' 1/RMS, the next step's (PyTorch; exact only where the streams keep its
        # precision)
        rinv_new = scores[2] if scores and scores[2].dtype == new.dtype else None
        ctx.mark_non_differentiable(beta, alpha, index, kept,
                                    *[] if rinv_new is None else [rinv_new])
        ctx.set_materialize_grads(False)  # no tensors of zeros made for those
        return new, h, beta, alpha, index, kept, rinv_new

    @staticmethod
    def backward(ctx, grad_new, grad_h, *_):
        u, gate_query, gate_bias, pool_query, beta, alpha, index, kept, *saved = ctx.saved_tensors
        scores, saved = saved[:ctx.n_scores], saved[ctx.n_scores:]
        if grad_new is None:  # (the last step's streams: only its h is read)
            grad_new = u.new_zeros(beta.shape + u.shape[-1:])
        if grad_h is None:
            grad_h = torch.zeros_like(u)
        invert = ctx.tape is not None
        if saved:
            x = saved[0]
        elif ctx.step in ctx.tape:
            x = ctx.tape.pop(ctx.step)
        else:
            raise RuntimeError("MGR's inverting backward must start at the last step (each step "
                               "rebuilds its input from the step after); to backpropagate from an "
                               "inner step use mgr_fallback_p=-1")
        args = (x, u, gate_query, gate_bias, pool_query, beta, alpha, index, kept, grad_new, grad_h,
                ctx.competitive, invert)
        _, step_backward = ctx.step_fns
        d_s, d_u, d_gate, d_bias, d_pool, rebuilt = step_backward(*args, scores)
        if invert:
            ctx.tape[ctx.step - 1] = rebuilt.to(x.dtype)
        return (d_s, d_u, d_gate.to(gate_query.dtype), d_bias.to(gate_bias.dtype),
                d_pool.to(pool_query.dtype), None, None, None, None, None, None, None)


def mgr_step(streams, u, gate_query, gate_bias, pool_query, competitive, fallback_p, tape, step,
             last, step_fns, rinv=None):
    """Fused MGR step: streams (n, B, T, C), u (B, T, C), gate_bias (1,) -> (new streams, h
    (B, T, C), the new streams' 1/RMS for the next step (PyTorch) or None); see MGRStep. step_fns:
    the step and its backward (TORCH_STEP or TRITON_STEP), which take the tokens' shape as it is:
    no views around them. step: the sublayer's index."""
    new, h, *_, rinv = MGRStep.apply(streams, u, gate_query, gate_bias, pool_query, competitive,
                                     fallback_p, tape, step, last, step_fns, rinv)
    return new, h, rinv


def mgr(module, x, sublayers, backend):
    """MGR with the fused step (gates, convex update, next AttnPool). In the accumulation phase the
    streams are a list and each AttnPool is one depth read of them (AttnPool is DepthAttention;
    through a Reads, as the AttnRes family's); they are stacked once, where the gated phase
    begins. The queries are scaled once and split, so that each sublayer takes its own without an
    operator (and its gradient without a full-size zero).
    The inversion's setting p is the module's `fallback_p`, which GPT.set_kernels sets from its
    mgr_fallback_p (1 where unset; only this twin reads it). With p >= 0 in eager mode, the steps'
    backwards invert the lerp, passing the rebuilt streams backwards on a tape local to this
    forward; the originals of the p largest gates per token are kept. The plain step (torch, p = -1)
    is the class's forward."""
    fallback_p = getattr(module, 'fallback_p', 1)
    if backend == 'triton':  # the step's one choice of backend (the AttnPools': reads(backend))
        step_fns = TRITON_STEP
    elif fallback_p < 0:
        return module(x, sublayers)
    else:
        step_fns = TORCH_STEP
    n, gates = module.n, module.gates
    # Python state: eager only
    tape = {} if fallback_p >= 0 and not torch.compiler.is_compiling() else None
    # rows (1, C): the reads' and the steps'
    pool_queries = (module.pool.queries * module.pool.scale).split(1)
    gate_queries, gate_bias = (gates.queries * gates.scale).split(1), gates.bias.split(1)
    # s_1 = e, then a stream per update
    started, streams, rinv, read = [x], None, None, reads(backend)
    h = read.one(pool_queries[0], started, None)
    for i, f in enumerate(sublayers):
        u = f(h)
        if i < n - 1:  # accumulation phase: the update starts a new stream
            started.append(u)
            h = read.one(pool_queries[i + 1], started, None)
        else:
            if streams is None:
                streams = torch.stack(started) if len(started) > 1 else x.unsqueeze(0)
            j = i - (n - 1)
            streams, h, rinv = mgr_step(
                streams, u, gate_queries[j], gate_bias[j], pool_queries[i + 1], gates.competitive,
                fallback_p, tape, i, i == len(sublayers) - 1, step_fns, rinv)
    return h


# ================================================ 5. DenseFormer and MUDD: the states in one buffer
#
# After each layer (DenseFormer: each group of layers), a mix of the states X_0..X_r so far: scalar
# weights for DenseFormer's average, per-token weights of each way for MUDD:
#
#     mix_c = sum_j w_cj X_j;   backward: dw_cj = g_c . X_j,   dX_j += sum_c w_cj g_c
#
# (MUDD: per token, ways c; DenseFormer: one way, the w_j shared by every token). The twins copy
# each state once into one buffer, and each mix is one product over it, in the states' precision
# (float32 under autocast, as the classes' sums: the residual stream stays float32). DenseFormer:
# PyTorch only (both backends), each average one GEMV. MUDD with Triton: each layer's ways one
# kernel forward and one backward (below), which reads the ways' gradients as they come where the
# batched product needs them stacked, and adds into the gradients' rows in the same pass. MUDD's
# weights: the generator's RMSNorm moved past its first projection (RMSProjection).

# ---------------------------------------------------------------------------- the PyTorch functions

class DenseStates:
    """The states X_0..X_R of one forward of a dense method, each copied once into one buffer, so
    that a mix of them is one matrix product instead of a pass per state: state by state (R+1, N, C)
    for DenseFormer's scalar weights (a GEMV), token by token (N, R+1, C) for MUDD's per-token
    weights (a product per token; `fused`: a Triton kernel, triton_mudd_mix). The buffer is in the
    precision of the class's products (the states' and the weights' promoted). Backward: every mix
    adds its states' gradients into a second buffer, again with one product; the first mix to run
    backward (the last one) makes that buffer from its product where it reads every state, and each
    state's first reader (the last to run backward) hands its row over as the state's gradient, a
    view, neither copied nor cleared: the first mix drops the buffer, so that the next backward
    through a retained graph makes a new one."""

    def __init__(self, n_states, x, dtype, per_token, fused=False):
        N, C = x.numel() // x.shape[-1], x.shape[-1]
        self.per_token, self.fused = per_token, fused
        self.values = x.new_empty((N, n_states, C) if per_token else (n_states, N, C), dtype=dtype)
        self.grads, self.count = None, 0

    def rows(self, buffer, index):
        """The states `index` (an int or a slice) of a buffer laid out as the values are."""
        return buffer[:, index] if self.per_token else buffer[index]

    def add(self, X):
        with torch.no_grad():
            self.rows(self.values, self.count).copy_(X.reshape(-1, X.shape[-1]))
        self.count += 1

    def takes_product(self, read):
        """Whether the backward product of a mix reading the rows `read` becomes the gradients'
        buffer: the first mix to run backward, where it reads every state (normally the last mix).
        Otherwise its product is added into the buffer's rows, zeros first where no mix has run
        backward yet (a backward from an inner sublayer)."""
        if self.grads is not None:
            return False
        if self.rows(self.values, read).shape == self.values.shape:
            return True
        self.grads = torch.zeros_like(self.values)
        return False


# ------------------------------------------------------------------- the Triton kernels: MUDD's mix
#
# One program per tile of tokens (token_tile) reads each state once for all the ways: forward, the
# ways' mixes sum_j w_cj X_j, each way its own tensor (one tensor of all four, unbound, would stack
# the ways' gradients in its backward); backward, grad_w_cj = g_c . X_j and dS_j (+)= sum_c w_cj g_c
# from the ways' gradients as they come, each read once. The states and their gradients are rows of
# the buffers, read through their tokens' stride (no copy of the rows a mix reads).

if triton is not None:
    @triton.jit
    def _pick(P0, P1, P2, P3, c: tl.constexpr):
        if c == 0:
            return P0
        elif c == 1:
            return P1
        elif c == 2:
            return P2
        else:
            return P3

    @triton.jit
    def _mudd_tile(J, N, C, stride_t, WAYS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        """This program's tile of BT tokens t: the ways and columns, the masks of (tokens, columns)
        and of the weights (tokens; it broadcasts over the ways), and the offsets of the weights
        (ways, tokens) and of the states' rows (tokens, columns)."""
        t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        ways, cols = tl.arange(0, WAYS), tl.arange(0, BC)
        tmask = t < N
        tc, w_mask = tmask[:, None] & (cols < C)[None, :], tmask[None, :]
        w_at = t[None, :] * WAYS * J + ways[:, None] * J
        s_at = t[:, None] * stride_t + cols[None, :]
        return t, ways, cols, tc, w_mask, w_at, s_at

    @triton.jit
    def _mudd_mix_fwd(W,      # (N, WAYS, J)
                      S,      # (N, J, C), tokens stride_t apart
                      O0,     # (N, C)
                      O1,     # (N, C), or empty past the ways
                      O2,     # (N, C), or empty
                      O3,     # (N, C), or empty
                      J, N, C, stride_t,
                      WAYS: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        # a tile of BT tokens: (ways, tokens, channels) mixes, (ways, tokens) weights
        t, ways, cols, tc, w_mask, w_at, s_at = _mudd_tile(J, N, C, stride_t, WAYS, BT, BC)
        acc = tl.zeros((WAYS, BT, BC), ACC)
        for j in range(J):
            s = tl.load(S + s_at + j * C, mask=tc, other=0.).to(ACC)
            acc += tl.load(W + w_at + j, mask=w_mask, other=0.).to(ACC)[:, :, None] * s[None, :, :]
        for c in tl.static_range(WAYS):
            out = _pick(O0, O1, O2, O3, c)
            way = tl.sum(tl.where(ways[:, None, None] == c, acc, 0.), axis=0)
            tl.store(out + t[:, None] * C + cols[None, :], way.to(out.dtype.element_ty), mask=tc)

    @triton.jit
    def _mudd_mix_bwd(W,      # (N, WAYS, J)
                      S,      # (N, J, C), tokens stride_t apart
                      G0,     # (N, C)
                      G1,     # (N, C), or G0 again past the ways
                      G2,     # (N, C), or G0
                      G3,     # (N, C), or G0
                      DW,     # (N, WAYS, J)
                      DS,     # (N, J, C), tokens ds_stride_t apart
                      J, N, C, stride_t, ds_stride_t,
                      ADD: tl.constexpr, WAYS: tl.constexpr, ACC: tl.constexpr,
                      BT: tl.constexpr, BC: tl.constexpr):
        t, ways, cols, tc, w_mask, w_at, s_at = _mudd_tile(J, N, C, stride_t, WAYS, BT, BC)
        g = tl.zeros((WAYS, BT, BC), ACC)
        for c in tl.static_range(WAYS):  # the ways' gradients, each read once
            g_c = tl.load(_pick(G0, G1, G2, G3, c) + t[:, None] * C + cols[None, :],
                          mask=tc, other=0.).to(ACC)
            g = tl.where(ways[:, None, None] == c, g_c[None, :, :], g)
        for j in range(J):
            s = tl.load(S + s_at + j * C, mask=tc, other=0.).to(ACC)
            tl.store(DW + w_at + j, tl.sum(g * s[None, :, :], axis=2).to(DW.dtype.element_ty),
                     mask=w_mask)
            d = tl.sum(tl.load(W + w_at + j, mask=w_mask, other=0.).to(ACC)[:, :, None] * g, axis=0)
            ds_at = t[:, None] * ds_stride_t + j * C + cols[None, :]
            if ADD:
                d += tl.load(DS + ds_at, mask=tc, other=0.).to(ACC)
            tl.store(DS + ds_at, d.to(DS.dtype.element_ty), mask=tc)


# ----------------------------------------------------------------------------------- the custom ops

@torch.library.custom_op('resroute::mudd_mix', mutates_args=())
def triton_mudd_mix(weights: Tensor, states: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The ways' mixes of weights (N, ways, J) over states (N, J, C), rows of the buffer (its
    tokens' stride as given): a tensor (N, C) a way, then empty tensors up to four (a fixed number
    of outputs, each counted). A PyTorch twin: DenseMix's bmm."""
    N, ways, J = weights.shape
    C = states.shape[-1]
    out = [states.new_empty((N, C) if c < ways else 0) for c in range(4)]
    BT, acc = token_tile(ways, C, N), accumulator(states.dtype)[1]
    _mudd_mix_fwd[(triton.cdiv(N, BT),)](
        W=weights.contiguous(),     # (N, ways, J)
        S=states,                   # (N, J, C), rows of the buffer
        O0=out[0],                  # (N, C)
        O1=out[1],                  # (N, C), or empty past the ways
        O2=out[2],
        O3=out[3],
        J=J,
        N=N,
        C=C,
        stride_t=states.stride(0),
        WAYS=ways, ACC=acc, BT=BT, BC=next_pow2(C))
    return tuple(out)


@triton_mudd_mix.register_fake
def _(weights, states):
    return tuple(states.new_empty((weights.shape[0], states.shape[-1])
                                  if c < weights.shape[1] else 0)
                 for c in range(4))


@torch.library.custom_op('resroute::mudd_mix_backward', mutates_args=('grads',))
def triton_mudd_mix_backward(weights: Tensor, states: Tensor, grad_ways: List[Tensor],
                             grads: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """The weights' gradient (N, ways, J) from the ways' gradients, and the states' w^T g added into
    `grads` (rows of the gradients' buffer, laid out as the states are; then an empty tensor is
    returned), or where it is None written to a new tensor (N, J, C), returned. A PyTorch twin:
    DenseMix's bmm."""
    N, ways, J = weights.shape
    C = states.shape[-1]
    g = [x.contiguous() for x in grad_ways]
    grad_w = torch.empty_like(weights)
    written = states.new_empty(states.shape) if grads is None else states.new_empty(0)
    dS = written if grads is None else grads
    BT, acc = token_tile(ways, C, N), accumulator(states.dtype)[1]
    G = g + g[:1] * (4 - ways)  # four pointers: the first way's again past the ways (not read)
    _mudd_mix_bwd[(triton.cdiv(N, BT),)](
        W=weights.contiguous(),     # (N, ways, J)
        S=states,                   # (N, J, C), rows of the buffer
        G0=G[0],                    # (N, C), the ways' gradients
        G1=G[1],
        G2=G[2],
        G3=G[3],
        DW=grad_w,                  # (N, ways, J)
        DS=dS,                      # (N, J, C)
        J=J,
        N=N,
        C=C,
        stride_t=states.stride(0),
        ds_stride_t=dS.stride(0),
        ADD=grads is not None, WAYS=ways, ACC=acc, BT=BT, BC=next_pow2(C))
    return grad_w, written


@triton_mudd_mix_backward.register_fake
def _(weights, states, grad_ways, grads):
    return torch.empty_like(weights), states.new_empty(states.shape if grads is None else 0)


# ------------------------------------------------------------------------------------ the Functions

class DenseMix(torch.autograd.Function):
    """One mix of the buffer's states `read` (a slice): weights (J,) give sum_j w_j X_j (N, C);
    weights (N, ways, J) give, per token, the ways' mixes (N, ways, C), or (fused) a tuple of the
    ways' (N, C). The autograd inputs are the weights and the states this mix is the first to read
    (`owned`, buffer indices): it returns their gradients."""

    @staticmethod
    def forward(ctx, weights, states, read, owned, last, *owned_states):
        S = states.rows(states.values, read)  # (J, N, C), or (N, J, C) per token
        w = weights.to(S.dtype)
        # the class's multiply-adds run in the buffer's precision
        with torch.autocast(S.device.type, enabled=False):
            if states.fused:
                mixed = triton_mudd_mix(w, S)[:w.shape[1]]
            else:
                mixed = (torch.bmm(w, S) if states.per_token
                         else (w @ S.flatten(1)).view(S.shape[1:]))
        # the last mix saves the buffer (full by then), so that memory accounting sees it
        ctx.save_for_backward(weights, states.values if last else None)
        ctx.states, ctx.read, ctx.owned = states, read, owned
        ctx.owned_like = [(X.shape, X.dtype) for X in owned_states]
        return mixed

    @staticmethod
    def backward(ctx, *grad_mixed):
        weights, _ = ctx.saved_tensors
        states = ctx.states
        S = states.rows(states.values, ctx.read)
        g, w = [g.to(S.dtype) for g in grad_mixed], weights.to(S.dtype)
        first = states.takes_product(ctx.read)
        dS = None if first else states.rows(states.grads, ctx.read)
        with torch.autocast(S.device.type, enabled=False):
            if states.fused:  # grad_w and dS (+)= w^T g in one pass
                grad_w, product = triton_mudd_mix_backward(w, S, g, dS)
            elif states.per_token:  # grad_w = g S^T, dS += w^T g, token by token
                grad_w = torch.bmm(g[0], S.transpose(1, 2))
                # (baddbmm_ into the strided rows loops over tokens)
                product = torch.bmm(w.transpose(1, 2), g[0])
                if not first:
                    dS.add_(product)
            else:
                grad_w, g = S.flatten(1) @ g[0].flatten(), g[0].flatten()
                product = torch.outer(w, g).view(S.shape) if first else dS.flatten(1).addr_(w, g)
        if first:
            states.grads = product
        # complete: every later reader has added its share
        owned = [states.rows(states.grads, j).to(dtype).view(shape)
                 for j, (shape, dtype) in zip(ctx.owned, ctx.owned_like)]
        if 1 in ctx.owned:  # the first mix, the last to run backward
            states.grads = None
        return grad_w.to(weights.dtype), None, None, None, None, *owned


class RMSProjection(torch.autograd.Function):
    """MUDD's first projection in its weights' generator, W (X / RMS(X)) per token, computed as
    r (W X), r = 1/RMS(X): X is read once for r and once by the product (in autocast's dtype, as a
    Linear under autocast takes it), and no normalised copy is written. Backward, with p = W X:
    dX = W^T (r dh) + c X, c = -(dh . p) r^3 / C (one multiply-add beside the product),
    dW = (r dh)^T X."""

    @staticmethod
    def forward(ctx, X, weight):
        device = X.device.type
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else torch.promote_types(X.dtype, weight.dtype))
        r = rms_inverse(X, keepdim=True)
        X_low, W_low = X.to(dtype), weight.to(dtype)
        with torch.autocast(device, enabled=False):
            p = X_low @ W_low.t()
            h = p * r.to(dtype)
        ctx.save_for_backward(X, X_low, W_low, p, r)
        ctx.weight_dtype = weight.dtype
        return h

    @staticmethod
    def backward(ctx, grad_h):
        X, X_low, W_low, p, r = ctx.saved_tensors
        with torch.autocast(X.device.type, enabled=False):
            grad_p = grad_h.to(p.dtype) * r.to(p.dtype)
            c = (grad_h.to(r.dtype) * p.to(r.dtype)).sum(-1, keepdim=True) * r.pow(3) / -X.shape[-1]
            grad_X = torch.addcmul(grad_p @ W_low, X, c).to(X.dtype)
            grad_W = (grad_p.t() @ X_low).to(ctx.weight_dtype)
        return grad_X, grad_W


# ------------------------------------------------------------------------------------ the schedules

def denseformer(module, x, sublayers, backend):
    """DenseFormer with its states in one buffer: each average is one GEMV over the states it reads.
    Compiled, the class's forward (the compiler fuses its multiply-adds)."""
    if torch.compiler.is_compiling():
        return module(x, sublayers)
    group, k, alpha = 2 * module.period, module.dwa.dilation, module.dwa.alpha
    R = len(sublayers) // group
    states = DenseStates(R + 1, x, torch.promote_types(x.dtype, alpha.dtype), per_token=False)
    states.add(x)
    e = x
    for r in range(1, R + 1):
        for f in sublayers[(r - 1) * group:r * group]:
            x = x + f(x)
        states.add(x)
        read = slice(r % k, r + 1, k)
        # X_r, and e where the first average reads it
        first = [(r, x)] + ([(0, e)] if r == k else [])
        x = DenseMix.apply(alpha[r - 1, read], states, read, [j for j, _ in first], r == R,
                           *[X for _, X in first]).view(x.shape)
    return x


def mudd_weights(dense, i, X):
    """The weights (N, ways, i+2) of layer i's ways from its output X_{i+1}, as DynamicDenseWeights
    makes them, with the RMSNorm moved past the first projection (RMSProjection)."""
    w1, act, w2 = dense.generators[i]
    h = act(RMSProjection.apply(X.reshape(-1, X.shape[-1]), w1.weight))
    return w2(h).unflatten(-1, (dense.ways[i], i + 2)) + dense.bias[i]


def mudd(module, x, sublayers, backend):
    """MUDDFormer with its states in one buffer: each layer's ways are one product per token over
    the states. Compiled, the class's forward."""
    if torch.compiler.is_compiling():
        return module(x, sublayers)
    dense, n_layer = module.dense, len(sublayers) // 2
    states = DenseStates(n_layer + 1, x, torch.promote_types(x.dtype, dense.bias[0].dtype),
                         per_token=True, fused=backend == 'triton')
    states.add(x)
    ways, e = (x,), x
    for i, (attn, mlp) in enumerate(zip(sublayers[0::2], sublayers[1::2])):
        y = ways[-1] + attn(*ways[:3])
        X = y + mlp(y)
        states.add(X)
        w = mudd_weights(dense, i, X)  # (N, ways, i+2)
        first = [(0, e), (1, X)] if i == 0 else [(i + 1, X)]
        mixed = DenseMix.apply(w, states, slice(0, i + 2), [j for j, _ in first], i == n_layer - 1,
                               *[X for _, X in first])
        ways = (tuple(way.view(x.shape) for way in mixed) if states.fused
                else mixed.view(*x.shape[:-1], w.shape[1], x.shape[-1]).unbind(-2))
    return ways[0]


# =============================================================================== the twins by class

# the fast twins, by the class of residuals.py whose maths each computes
# (route looks up the exact class)
FAST = {residuals.AttnRes: attnres,
        residuals.BlockAttnRes: block_attnres,
        residuals.DeltaAttnRes: delta_attnres,
        residuals.WAV: wav,
        residuals.HyperConnections: hc,
        residuals.MHC: mhc,
        residuals.MHCLite: mhc,
        residuals.KromHC: mhc,
        residuals.MultiGateResiduals: mgr,
        residuals.DenseFormer: denseformer,
        residuals.MUDDFormer: mudd}
