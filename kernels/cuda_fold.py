"""The split merge folded into the tensor-core pass: one kernel per attention call.

Each block of the split pass writes its partial softmax (o_part, ml_part) and then counts
its arrival on a counter of its (b, h_kv, row tile). The block that arrives last holds the
only complete view: it reads every split's partial back (from L2), merges them as the
merge kernel did (``cuda_source.merge_body``), applies the sink logits of gpt-oss, undoes
the rotation of TurboQuant values, and writes the output rows in the queries' dtype. It
then puts the counter back to 0, so the counters are zero between calls and need no
clearing launch.

Worked example: B=8, 32 query heads over 8 KV heads, D=128, T=32K: 64 (b, h) pairs x 12
splits; per pair, the 12th block to finish merges 4 rows x 128 d from 12 partials. Before
this, the same call launched a merge kernel after the pass (and a rotation and a cast after
that for turbo values): 2 to 4 kernels, now 1.

The counters live in a ring (``Arrivals``): each call takes the next ``need`` of them
(B * H_kv * row tiles), passed to the kernel as a slice of the ring (a view: no copy, no
launch). Two calls share counters only if they are ``CALLS_APART`` calls apart, so that
calls MLX may run concurrently (independent kernels of one CUDA graph, which holds at most
a few hundred nodes) never count on the same counters.
"""

from __future__ import annotations

import mlx.core as mx

CALLS_APART = 256  # calls between two uses of one counter (MLX graphs hold 100-ish nodes)
MAX_NEED = 1 << 14  # counters one call may take (B * H_kv * row tiles); larger: merge kernel

# A device function of the tensor-core pass's header, called once after the partial writes
# (``FOLD_CALL``). Not inlined: in the kernel's own body it changed how ptxas allocated the
# walk (affine4: 158 -> 168 registers, 841 -> 889 instructions in the main loop).
FOLD_HEADER = r"""
namespace kvf {
// The split merge, folded in: count this block's arrival; the last of its (bh, row tile)
// merges every split's partial. The fence makes this block's partial visible on the
// device before its arrival is counted; the last block reads partials through L2 (__ldcg).
template <typename ACT, int NR, int NWP, int D>
__device__ __noinline__ void fold_merge(const float* o_part, const float* ml_part, ACT* out,
    const int* arrivals, const float* sinks, const float* vpi, float* o_s, int R, int L, int Hkv) {
  __shared__ bool last;
  __shared__ float f_base[8 * NR], f_l[8 * NR];
  __threadfence();
  __syncthreads();
  const int splits = gridDim.y, bh = blockIdx.z, row0 = blockIdx.x * 8 * NR, rows = R * L;
  if (threadIdx.x == 0) {
    int* arrived = const_cast<int*>(arrivals) + (int64_t)bh * gridDim.x + blockIdx.x;
    last = atomicAdd(arrived, 1) == splits - 1;
    if (last) atomicExch(arrived, 0);  // zero again for the next call on this slot
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nrow = min(8 * NR, rows - row0);
  const int64_t all_rows = (int64_t)gridDim.z * rows;  // rows of one split's partial
  for (int r = warp; r < nrow; r += NWP) {  // per row: max and sum over the splits
    const int64_t rr = (int64_t)bh * rows + row0 + r;
    const float sink = sinks ? sinks[bh % Hkv * R + (row0 + r) / L] : -INFINITY;
    float M = -INFINITY, l = 0.f;
    for (int s = lane; s < splits; s += 32) M = fmaxf(M, __ldcg(ml_part + (s * all_rows + rr) * 2));
#pragma unroll
    for (int k = 16; k; k >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, k));
    M = fmaxf(M, sink);
    const float base = M == -INFINITY ? 0.f : M;
    for (int s = lane; s < splits; s += 32) {
      const float* ml = ml_part + (s * all_rows + rr) * 2;
      l = fmaf(__expf(__ldcg(ml) - base), __ldcg(ml + 1), l);
    }
#pragma unroll
    for (int k = 16; k; k >>= 1) l += __shfl_xor_sync(0xffffffffu, l, k);
    if (lane == 0) { f_base[r] = base; f_l[r] = l + (sink == -INFINITY ? 0.f : __expf(sink - base)); }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nrow * D; i += NWP * 32) {
    const int r = i / D, d = i % D;
    const int64_t rr = (int64_t)bh * rows + row0 + r;
    float acc = 0.f;
    for (int s = 0; s < splits; ++s)
      acc = fmaf(__expf(__ldcg(ml_part + (s * all_rows + rr) * 2) - f_base[r]),
                 __ldcg(o_part + (s * all_rows + rr) * D + d), acc);
    if (vpi) o_s[r * D + d] = acc / f_l[r];
    else out[rr * D + d] = static_cast<ACT>(acc / f_l[r]);
  }
  if (!vpi) return;
  __syncthreads();  // values were summed in their rotated basis: out = acc . Pi, in f32
  for (int i = threadIdx.x; i < nrow * D; i += NWP * 32) {
    const int r = i / D, d = i % D;
    float acc = 0.f;
    for (int e = 0; e < D; ++e) acc = fmaf(o_s[r * D + e], vpi[e * D + d], acc);
    out[((int64_t)bh * rows + row0 + r) * D + d] = static_cast<ACT>(acc);
  }
}
}  // namespace kvf
"""


def fold_call(sinks: bool, rotate: bool) -> str:
    """The kernel body's call of ``fold_merge`` for a call with or without sink logits
    (input ``sinks`` (H_q,) f32) and the values' rotation to undo (input ``vpi`` (D, D) f32).

        >>> fold_call(True, False)
        '  kvf::fold_merge<ACT, NR, NWP, D>(o_part, ml_part, out, arrivals, sinks, nullptr, o_s, R, L, Hkv);\\n'
    """
    return (f"  kvf::fold_merge<ACT, NR, NWP, D>(o_part, ml_part, out, arrivals, "
            f"{'sinks' if sinks else 'nullptr'}, {'vpi' if rotate else 'nullptr'}, o_s, R, L, Hkv);\n")


class Arrivals:
    """A ring of int32 arrival counters, zero between calls; ``take(n)`` gives the next n.

        >>> ring = Arrivals()
        >>> a, b = ring.take(64), ring.take(64)
        >>> a.shape, b.shape, ring.size, ring.pos
        ((64,), (64,), 16384, 128)
        >>> ring.take(MAX_NEED + 1) is None
        True
    """

    def __init__(self):
        self.counters: mx.array | None = None
        self.size = self.pos = 0

    def take(self, need: int) -> mx.array | None:
        if need > MAX_NEED:
            return None
        if need * CALLS_APART > self.size:  # a new, larger ring: the old one's calls keep it alive
            self.size = max(1 << 14, 1 << (need * CALLS_APART - 1).bit_length())
            self.counters, self.pos = mx.zeros((self.size,), mx.int32), 0
            mx.eval(self.counters)
        if self.pos + need > self.size:
            self.pos = 0
        view = self.counters[self.pos:self.pos + need]
        self.pos += need
        return view


ARRIVALS = Arrivals()
