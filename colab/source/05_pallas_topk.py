# %% [markdown]
# # The selection kernel: Pallas top-k, its reference, and `lax.top_k`
#
# Every eviction ends with a selection: keep the `budget` highest-priority slots of each
# (batch row, KV head). `flsmem.kernels.topk_mask(scores, k)` returns that selection as a
# boolean mask `[R, N]` over a float32 `[R, N]` array, with one total order that the
# memory relies on:
#
# * larger values rank higher, `+inf` highest; **NaN lowest**, below `-inf`;
# * `-0.0` equals `+0.0`;
# * equal values go to the higher optional int32 `tiebreak` (`evict` passes each slot's
#   birth step, so ties keep the newer item), then to the lower index.
#
# It has two implementations that agree bit for bit, chosen with
# `implementation="pallas" | "xla" | None`:
#
# * `"xla"`: a plain `jnp` reference (a sort on score, tiebreak and index; with
#   `max_dropped`, a `lax.top_k` of the few entries left out). The default on CPU.
# * `"pallas"`: a radix-select kernel. It finds each row's k-th largest key bit by bit
#   with only elementwise operations, row sums and a fixed-trip `fori_loop`, so the same
#   kernel lowers for TPU through Mosaic and for GPU through Triton. The default on
#   accelerators. On a CPU it runs in the Pallas interpreter (`interpret=True`).

# %%
import time

import jax
import jax.numpy as jnp
import numpy as np

from flsmem import policies
from flsmem.kernels import topk_mask, topk_mask_reference

ON_ACCELERATOR = jax.default_backend() in ("gpu", "tpu")
INTERPRET = not ON_ACCELERATOR  # the kernel compiles on GPU/TPU, is interpreted on CPU
# Large: 2048 rows (e.g. 64 sequences x 32 KV heads) of 4096 slots, for an accelerator
# (in the interpreter on a CPU each call takes seconds).
SHAPES = {"small": dict(rows=64, cols=1024, k=100), "large": dict(rows=2048, cols=4096, k=512)}[SIZE]
R, N, TOP = SHAPES["rows"], SHAPES["cols"], SHAPES["k"]
print(f"backend {jax.default_backend()}; Pallas kernel {'interpreted' if INTERPRET else 'compiled'}; {SHAPES}")

# %% [markdown]
# ## Three ways to the same mask
#
# On random scores (no ties) the kernel, the reference and a mask built from
# `lax.top_k`'s indices all agree.

# %%
scores = jax.random.normal(jax.random.key(0), (R, N))
reference = topk_mask_reference(scores, TOP)
kernel = topk_mask(scores, TOP, implementation="pallas", interpret=INTERPRET)
_, index = jax.lax.top_k(scores, TOP)
from_top_k = jnp.zeros((R, N), bool).at[jnp.arange(R)[:, None], index].set(True)
print("kernel == reference:", bool(jnp.array_equal(kernel, reference)))
print("lax.top_k == reference:", bool(jnp.array_equal(from_top_k, reference)))
print("entries kept per row:", set(np.asarray(kernel.sum(axis=1)).tolist()))
assert jnp.array_equal(kernel, reference) and jnp.array_equal(from_top_k, reference)

# %% [markdown]
# ## Where they differ: NaN, signed zeros, ties
#
# `lax.top_k` returns indices in its own order, and that order is not the memory's: see
# where it puts the NaN below. `topk_mask` ranks NaN lowest (a slot whose score went bad
# must not crowd out good ones), treats the two zeros as equal and breaks ties by
# `tiebreak`, then by index. `k` may also differ per row (an int array `[R]`, traced or
# not).

# %%
row = jnp.array([[1.0, jnp.nan, 1.0, -0.0, 0.0, jnp.inf, -jnp.inf, 1.0]])
tiebreak = jnp.array([[0, 0, 0, 0, 0, 0, 0, 9]], jnp.int32)  # favours the last of the three 1.0s
print("scores               ", np.asarray(row[0]).tolist())
print("lax.top_k(3) indices ", np.asarray(jax.lax.top_k(row, 3)[1][0]).tolist())
for name, mask in [
    ("reference, k=3       ", topk_mask_reference(row, 3)),
    ("kernel, k=3          ", topk_mask(row, 3, implementation="pallas", interpret=INTERPRET)),
    ("kernel, k=3, tiebreak", topk_mask(row, 3, tiebreak=tiebreak, implementation="pallas", interpret=INTERPRET)),
]:
    print(name, np.flatnonzero(np.asarray(mask[0])).tolist())
per_row_k = jnp.array([0, 2, 8])
rows = jnp.tile(row, (3, 1))
print("per-row k [0, 2, 8]  ", [np.flatnonzero(m).tolist() for m in np.asarray(
    topk_mask(rows, per_row_k, implementation="pallas", interpret=INTERPRET))])

# %% [markdown]
# ## Timing
#
# The time of one call, after compiling, for each way. On a CPU the Pallas interpreter's
# time says nothing about the kernel on an accelerator; run this notebook with
# `SIZE = "large"` on a GPU or TPU runtime for the compiled kernel.

# %%
def best_time(fn, repeats=3):
    jax.block_until_ready(fn(scores))
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        jax.block_until_ready(fn(scores))
        times.append(time.perf_counter() - begin)
    return min(times)


timings = {
    "pallas kernel" + (" (interpreted)" if INTERPRET else ""): lambda s: topk_mask(s, TOP, implementation="pallas", interpret=INTERPRET),
    "jnp reference (sort)": lambda s: topk_mask(s, TOP, implementation="xla"),
    # Keeping N - TOP leaves TOP out: the eviction case (most slots stay).
    f"jnp reference, keep {N - TOP}, max_dropped={TOP}": lambda s: topk_mask(s, N - TOP, implementation="xla", max_dropped=TOP),
    "lax.top_k (indices only)": jax.jit(lambda s: jax.lax.top_k(s, TOP)[1]),
}
for name, fn in timings.items():
    print(f"{name:44s} {best_time(fn) * 1e3:9.3f} ms   [{R} x {N}]")

# %% [markdown]
# ## Inside the memory
#
# `MemoryConfig(implementation=..., interpret=...)` picks the selection `evict` uses. A
# stream of random attention through `h2o` keeps exactly the same items with either one.

# %%
def kept_after_stream(implementation):
    config = flsmem.MemoryConfig(policy=policies.h2o(recent=8), budget=32, evict_every=8,
                                 implementation=implementation, interpret=INTERPRET and implementation == "pallas")
    memory = flsmem.init(config, 2, 2, {"v": ()})

    def step(memory, t):
        memory = flsmem.write(memory, {"v": jnp.zeros((2, 2))}, position=jnp.full((2,), t))
        logits = jax.random.normal(jax.random.fold_in(jax.random.key(1), t), memory.valid.shape)
        attention = jax.nn.softmax(jnp.where(flsmem.visible(memory), 4.0 * logits, -jnp.inf))
        return flsmem.update(memory, attention), None

    memory, _ = jax.jit(lambda m: jax.lax.scan(step, m, jnp.arange(200)))(memory)
    return np.sort(np.where(np.asarray(memory.valid), np.asarray(memory.position), -1), axis=-1)


same = np.array_equal(kept_after_stream("pallas"), kept_after_stream("xla"))
print("h2o keeps the same items with the Pallas kernel and with the reference:", same)
assert same

# %% [markdown]
# ## Lowering for TPU and GPU without one
#
# `jax.export` lowers a function for another platform, so the kernel's path through
# Mosaic (TPU) and Triton (GPU) can be checked on a CPU. The public `topk_mask` picks its
# implementation from the backend it runs on, so the kernel function itself is exported
# here, as `tests/test_topk.py` does. The lowered module calls the platform's custom
# kernel: `tpu_custom_call` for Mosaic, the Triton custom call for CUDA (Triton IR has no
# stability guarantee, so its export needs an explicit opt-in).

# %%
import functools

from flsmem.kernels.topk import _topk_mask_pallas

arguments = (jax.ShapeDtypeStruct((16, 1000), jnp.float32), jax.ShapeDtypeStruct((16,), jnp.int32))
targets = {
    "tpu": ("tpu", "tpu_custom_call", []),
    "cuda": ("gpu", "__gpu$xla.gpu.triton", [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]),
}
for platform, (backend, custom_call, disabled) in targets.items():
    kernel_fn = functools.partial(_topk_mask_pallas, interpret=False, block_rows=8, backend=backend)
    exported = jax.export.export(jax.jit(kernel_fn), platforms=[platform], disabled_checks=disabled)(*arguments)
    text = exported.mlir_module()
    found = f"custom_call @{custom_call}" in text
    print(f"{platform:5s}: output {exported.out_avals[0]}, module {len(text):,} characters, "
          f"calls {custom_call}: {found}")
    assert found
