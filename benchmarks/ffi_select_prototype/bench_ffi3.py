import ctypes, time, sys
import numpy as np, jax, jax.numpy as jnp
import os
from gbn_jax import _select as S
lib = ctypes.cdll.LoadLibrary(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'libkth3.so'))
jax.ffi.register_ffi_target('gbn_kth_smallest', jax.ffi.pycapsule(lib.GbnKthSmallest), platform='cpu')
def kth_ffi(x, k, axis):
    rows, _, kept = S._to_rows(x, axis, None)
    kk = S._prepare_k(k, kept)
    keys = jax.ffi.ffi_call('gbn_kth_smallest', jax.ShapeDtypeStruct(kk.shape, jnp.int32))(rows, kk)
    return S._key_to_output(keys).reshape(kept)
rng = np.random.default_rng(0)
# correctness
for kind in ('normal', 'relu', 'halves', 'denorm'):
    x = rng.standard_normal((64, 16, 16, 8)).astype(np.float32)
    if kind == 'relu': x = np.maximum(x, 0)
    if kind == 'halves': x = np.round(x * 2) / 2
    if kind == 'denorm': x = rng.choice(np.float32([-3e-39, -1e-45, -0.0, 0.0, 1e-45, 5e-39, 1.0]), size=x.shape)
    n = 64*16*16
    for k in (1, n//4, n//2, n):
        got = np.asarray(jax.jit(lambda x: kth_ffi(x, k, (0,1,2)))(x))
        want = np.sort(x.reshape(-1, 8), 0)[k-1]; want[want == 0] = 0.0
        assert np.array_equal(got.view(np.int32), want.view(np.int32)), (kind, k)
print('ffi correct')
shapes = [((256,32,32,16),(0,1,2)), ((1024,32,32,16),(0,1,2)), ((1000,8,8,50),(0,1,2)), ((512,256),(0,))]
for shape, ax in shapes:
    x = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    n = int(np.prod([shape[a] for a in ax])); k = (n + 1)//2
    fns = {'meanvar': jax.jit(lambda x: (x.mean(ax), x.var(ax))), 'ffi': jax.jit(lambda x: kth_ffi(x, k, ax)),
           'default': jax.jit(lambda x: S.kth_smallest(x, k, ax))}
    for f in fns.values(): jax.block_until_ready(f(x))
    times = {kk: [] for kk in fns}
    for r in range(11):
        for name, f in fns.items():
            t0 = time.perf_counter(); jax.block_until_ready(f(x)); times[name].append(time.perf_counter() - t0)
    mv = np.median(times['meanvar'])
    print(shape, ' '.join(f'{kk} {np.median(v)*1e3:.2f}ms ({np.median(v)/mv:.2f}x)' for kk, v in times.items()))
