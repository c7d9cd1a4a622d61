import sys, time, os, shutil
sys.path.insert(0, "bench")
import mlx.core as mx
import gpu_attention_grid as g
print("sanitizer:", shutil.which("compute-sanitizer"), os.path.exists("/usr/local/cuda/bin/compute-sanitizer"), flush=True)
t0 = time.time()
schemes = sys.argv[1]
rc = g.main(["--schemes", schemes] + sys.argv[2:])
print("grid rc", rc, "secs", round(time.time() - t0, 1), flush=True)
# a fresh op of another kind after the grid, then SDPA as in the failing benchmark
x = mx.random.normal((64 << 20,), key=mx.random.key(0))
mx.eval(x + 0); mx.synchronize()
q = mx.random.normal((8, 32, 1, 128)).astype(mx.float16)
k = mx.random.normal((8, 8, 1024, 128)).astype(mx.float16)
v = mx.random.normal((8, 8, 1024, 128)).astype(mx.float16)
o = mx.fast.scaled_dot_product_attention(q, k, v, scale=128 ** -0.5)
mx.eval(o); mx.synchronize()
print("post-grid ops clean", o.shape, flush=True)
