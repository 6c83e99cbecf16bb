"""
The helpers the families share: the Triton import (None where it is not installed), cast, the
routing's RMS, the tiles and programs of the kernels, a few host numbers on the device, the
precision a kernel accumulates in, and GradPool (the gradients several backwards give one tensor).
"""
import functools

import torch

from residuals import RMS_EPS

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels are optional: everything runs with kernels=torch
    triton = tl = None


def cast(x, dtype):
    """x in dtype, a new tensor or x itself. An autograd.Function's forward returns outputs through
    this, never through a no-op x.to(dtype), and updates nothing in place: either makes torch 2.11's
    compiler drop the Function's backward, and every gradient comes out zero (2.13 is fine)."""
    return x if x.dtype == dtype else x.to(dtype)


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
