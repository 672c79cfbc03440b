"""`PagedKVCache`: per-layer K/V slot tensors over a pool of chunks, plus the CPU swap pool."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import torch

from ferrobatch import _core
from ferrobatch._core import SCRATCH_CHUNK, ZERO_CHUNK
from ferrobatch.cpu.arrays import KERNEL_DTYPES, numpy_view

# chunks before the first allocatable one: the zero chunk (padding reads) and the scratch
# chunk (padding writes), ids of the core's
RESERVED_CHUNKS = max(ZERO_CHUNK, SCRATCH_CHUNK) + 1


#: this build of the core quantizes rows into an int8 cache in one call
_FUSED_INT8 = hasattr(_core, "write_rows_int8")

#: CPU caches from this size on are a mapping of their own, zeroed by the OS on first touch
_LAZY_FROM = 8 << 20


def _zeros(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor; on CPU its pages are zeroed by the OS when first touched.

    `torch.zeros` writes every byte up front (about 0.7 s a GiB, for a cache sized to 4 GiB
    of which a workload may touch a few MiB). A large CPU cache is an anonymous mapping
    (reads as zero), advised *not* to use transparent huge pages: in a virtual machine a
    2 MiB page that no process touched lately costs the hypervisor's backing of the whole
    page at its first touch (measured on a 2-core Intel Xeon VM, 256 MiB: 3.6-3.8 s cold
    with huge pages against 0.13-0.25 s with 4 KiB pages; SmolLM2's 64-request fp32
    workload on a fresh engine: 2.9-3.5 s of system time and 19.5-21.1 s against 0.17-0.23 s
    and 16.6-17.2 s), and a block touches a whole huge page per layer and K/V where it needs
    a few KiB.
    """
    if device.type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    size = torch.empty((), dtype=dtype).element_size()
    nbytes = int(np.prod(shape, dtype=np.int64)) * size
    if nbytes < _LAZY_FROM:
        raw = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
    else:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            try:
                region.madvise(mmap.MADV_NOHUGEPAGE)
            except OSError:  # a kernel without transparent huge pages: 4 KiB pages anyway
                pass
        raw = torch.frombuffer(region, dtype=torch.uint8)  # (keeps `region` alive)
    return raw.view(dtype).view(shape)


class PagedKVCache:
    """K and V slot tensors for every layer, in one device allocation (ARCHITECTURE.md §2).

    `keys[l]` and `values[l]` are `[(num_blocks + 2) * page_size, num_kv_heads, head_dim]`
    views; chunk `c` is slots `c*page_size .. (c+1)*page_size` in every layer. Chunk 0 stays
    zero (padding reads), chunk 1 takes padding writes. The swap pool holds
    `cpu_offload_blocks` chunks (all layers) in CPU memory, pinned when the cache is on CUDA
    (`[2 * num_layers, cpu_offload_blocks, chunk_elements]`, sized by the engine from
    `cpu_offload_space`); `swap` moves chunks between the two, on CUDA on a copy stream.

    `kv_dtype="int8"` (CPU only): `keys[l]` / `values[l]` are int8 and `key_scales[l]` /
    `value_scales[l]` `[slots, num_kv_heads]` fp32 hold one scale per slot and KV head
    (symmetric absmax over head_dim); `write` quantizes a slot once, readers dequantize what
    they read (`read_slots`, `gather_chunks`; the CPU decode kernel reads int8 in place).
    `dtype` stays the compute dtype (what the attention math and gathers use). The scales
    live in a parallel storage with its own swap pool and move with every swap.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        cpu_offload_blocks: int = 0,
        kv_dtype: str = "auto",
    ) -> None:
        if kv_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_dtype must be 'auto' or 'int8', got {kv_dtype!r}")
        if kv_dtype == "int8" and torch.device(device).type != "cpu":
            raise ValueError("an int8 KV cache is CPU only")
        if num_blocks < 1 or num_layers < 1:  # page_size: checked by ContinuousBatchingConfig
            raise ValueError("num_blocks and num_layers must be >= 1")
        if cpu_offload_blocks < 0:
            raise ValueError("cpu_offload_blocks must be >= 0")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.num_chunks = num_blocks + RESERVED_CHUNKS
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_slots = self.num_chunks * page_size
        self.quantized = kv_dtype == "int8"
        self.storage_dtype = torch.int8 if self.quantized else dtype
        # [layer, k/v, slot, head, dim]: one allocation so a swap is one copy for all layers.
        self.storage = _zeros(
            (num_layers, 2, self.num_slots, num_kv_heads, head_dim), self.device,
            self.storage_dtype,
        )
        self.keys: list[torch.Tensor] = [self.storage[i, 0] for i in range(num_layers)]
        self.values: list[torch.Tensor] = [self.storage[i, 1] for i in range(num_layers)]
        # int8: [layer, k/v, slot, head] fp32 scales (zero: the zero chunk reads as zero)
        self.scales: torch.Tensor | None = _zeros(
            (num_layers, 2, self.num_slots, num_kv_heads), self.device, torch.float32
        ) if self.quantized else None
        self.key_scales: list[torch.Tensor] = [] if self.scales is None else \
            [self.scales[i, 0] for i in range(num_layers)]
        self.value_scales: list[torch.Tensor] = [] if self.scales is None else \
            [self.scales[i, 1] for i in range(num_layers)]
        # numpy views (int8, scales) per layer and K/V, made once: the fused write's operands
        self._np_int8 = [((self.keys[i].numpy(), self.key_scales[i].numpy()),
                          (self.values[i].numpy(), self.value_scales[i].numpy()))
                         for i in range(num_layers)] if self.quantized else []
        self._workspaces: list[torch.Tensor | None] = [None, None]
        self.cpu_offload_blocks = cpu_offload_blocks
        self._copy_stream: Any = None  # CUDA: the swaps' copy stream (created on first use)
        self._pending_out: tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.swap_pool: torch.Tensor | None = None
        if cpu_offload_blocks:
            pin = self.device.type == "cuda"
            self.swap_pool = torch.empty(
                num_layers * 2, cpu_offload_blocks, self.chunk_elements,
                dtype=self.storage_dtype, device="cpu", pin_memory=pin,
            )
        self.scale_pool: torch.Tensor | None = None
        if cpu_offload_blocks and self.quantized:
            self.scale_pool = torch.empty(num_layers * 2, cpu_offload_blocks,
                                          page_size * num_kv_heads, dtype=torch.float32)

    def gather_buffers(self, kind: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reusable K and V workspaces of `rows` slots (`kind` 0: decode, 1: prefill).

        Large fresh allocations page-fault on every step on CPU; layers run one after the
        other, so one pair per kind serves every layer.
        """
        buf = self._workspaces[kind]
        if buf is None or buf.shape[1] < rows:
            old = buf.shape[1] if buf is not None else 0
            cap = max(rows, old + old // 4, 256)
            buf = torch.empty(2, cap, self.num_kv_heads, self.head_dim,
                              device=self.device, dtype=self.dtype)
            self._workspaces[kind] = buf
        return buf[0, :rows], buf[1, :rows]

    def gather_chunks(
        self, keys: torch.Tensor, values: torch.Tensor, chunks: torch.Tensor,
        layer: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy whole chunks of one layer's K and V into the decode workspace:
        `[len(chunks) * page_size, num_kv_heads, head_dim]` each, in `dtype` (an int8
        cache's chunks dequantized with layer `layer`'s scales)."""
        n = chunks.shape[0]
        k_out, v_out = self.gather_buffers(0, n * self.page_size)
        if self.quantized:
            assert layer is not None
            slots = (chunks[:, None] * self.page_size
                     + torch.arange(self.page_size, device=chunks.device)).reshape(-1)
            self.read_slots(layer, slots, k_out, v_out)
            return k_out, v_out
        shape = (self.num_chunks, self.chunk_elements)
        torch.index_select(keys.view(shape), 0, chunks, out=k_out.view(n, self.chunk_elements))
        torch.index_select(values.view(shape), 0, chunks, out=v_out.view(n, self.chunk_elements))
        return k_out, v_out

    def read_slots(self, layer: int, slots: torch.Tensor, k_out: torch.Tensor,
                   v_out: torch.Tensor) -> None:
        """Layer `layer`'s K and V at `slots` into `k_out` / `v_out` [len(slots), heads,
        dim] (in their dtype; an int8 cache's slots dequantized: only those slots)."""
        pairs = ((self.keys[layer], k_out, 0), (self.values[layer], v_out, 1))
        for cache, out, kv in pairs:
            if not self.quantized:
                torch.index_select(cache, 0, slots, out=out)
                continue
            assert self.scales is not None
            q = cache.index_select(0, slots)
            s = self.scales[layer, kv].index_select(0, slots)
            torch.mul(q, s.unsqueeze(-1), out=out)

    def write(self, layer: int, slots: torch.Tensor, k_new: torch.Tensor,
              v_new: torch.Tensor) -> None:
        """Quantize the keys and values [T, heads, dim] and write them at `slots` of layer
        `layer` of an int8 cache (symmetric absmax per slot and KV head: scale = max|x| /
        127, elements round(x / scale); an all-zero vector gets scale 0)."""
        assert self.scales is not None
        for cache, new, kv in ((self.keys[layer], k_new, 0), (self.values[layer], v_new, 1)):
            if _fused_write(new, self._np_int8[layer][kv], slots):
                continue
            q, scale = quantize_int8(new)
            cache.index_copy_(0, slots, q)
            self.scales[layer, kv].index_copy_(0, slots, scale)

    @property
    def chunk_elements(self) -> int:
        """Elements of one chunk in one layer's K (or V)."""
        return self.page_size * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_chunk(self) -> int:
        """Bytes of one chunk over all layers, K and V (an int8 cache's scales included)."""
        scales = 4 * self.page_size * self.num_kv_heads if self.quantized else 0
        return self.num_layers * 2 * (self.chunk_elements * self.storage.element_size()
                                      + scales)

    @property
    def nbytes(self) -> int:
        """Bytes held on the device by the cache (an int8 cache's scales included)."""
        scales = 0 if self.scales is None else self.scales.numel() * 4
        return self.storage.numel() * self.storage.element_size() + scales

    def _chunk_view(self) -> torch.Tensor:
        return self.storage.view(self.num_layers * 2, self.num_chunks, self.chunk_elements)

    def _scale_chunk_view(self) -> torch.Tensor:
        assert self.scales is not None
        return self.scales.view(self.num_layers * 2, self.num_chunks,
                                self.page_size * self.num_kv_heads)

    def _index(self, values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
        t = torch.as_tensor(np.asarray(values), dtype=torch.long)
        if device.type == "cuda":
            t = t.pin_memory()  # a non-blocking copy that never waits for the stream
        return t.to(device, non_blocking=True)

    def swap(
        self,
        swap_out: np.ndarray | None = None,
        swap_in: np.ndarray | None = None,
    ) -> None:
        """Run a step's swaps: `swap_out` (device chunk, swap slot) pairs first, then
        `swap_in` (swap slot, device chunk) pairs, each as one batched copy over all layers.

        On CUDA the copies run on a copy stream (see `_swap_cuda`) and everything queued on
        the current stream afterwards (the step's forward) waits for them; on CPU they are
        done when this returns."""
        out_pairs = _pairs(swap_out)
        in_pairs = _pairs(swap_in)
        if not len(out_pairs) and not len(in_pairs):
            return
        if self.swap_pool is None:
            raise RuntimeError("swap requested but the cache has no CPU swap pool")
        if len(out_pairs):
            _check_range(out_pairs[:, 0], RESERVED_CHUNKS, self.num_chunks, "swap_out device chunk")
            _check_range(out_pairs[:, 1], 0, self.cpu_offload_blocks, "swap_out swap slot")
        if len(in_pairs):
            _check_range(in_pairs[:, 0], 0, self.cpu_offload_blocks, "swap_in swap slot")
            _check_range(in_pairs[:, 1], RESERVED_CHUNKS, self.num_chunks, "swap_in device chunk")
        if self.device.type == "cuda":
            self._swap_cuda(out_pairs, in_pairs)
            return
        views = [(self._chunk_view(), self.swap_pool)]
        if self.quantized:  # the scales move with their chunks
            views.append((self._scale_chunk_view(), self.scale_pool))
        for chunks, pool in views:
            assert pool is not None
            if len(out_pairs):
                src = self._index(out_pairs[:, 0], self.device)
                dst = self._index(out_pairs[:, 1], torch.device("cpu"))
                data = chunks.index_select(1, src)
                if data.device.type != "cpu":
                    data = data.to("cpu")
                pool.index_copy_(1, dst, data)
            if len(in_pairs):
                src = self._index(in_pairs[:, 0], torch.device("cpu"))
                dst = self._index(in_pairs[:, 1], self.device)
                data = pool.index_select(1, src)
                if self.device.type != "cpu":
                    data = data.to(self.device)
                chunks.index_copy_(1, dst, data)

    def _swap_cuda(self, out_pairs: np.ndarray, in_pairs: np.ndarray) -> None:
        """The swaps on a copy stream beside the current (compute) stream.

        Order, all on the copy stream: wait for everything queued on the compute stream so
        far (the forwards that wrote the chunks to swap out); gather the swap-out chunks of
        every layer into one device staging tensor; copy the swap-in slots (gathered on the
        host into one pinned staging tensor) up in one copy and scatter them into their
        chunks (after the gather: a chunk freed by a swap-out may receive a swap-in);
        record `ready`, which the compute stream waits for (the forward reads the swapped-in
        chunks and may overwrite the swapped-out ones); then copy the swap-out staging down
        in one copy into pinned host memory, overlapping the forward. That copy lands in the
        pool slots on the host once its event completed: at the next `swap` (before any slot
        is read) or `finish_swaps()`. A pinned staging buffer is never reused before its
        copy ran (torch's caching host allocator records the copy's event)."""
        chunks = self._chunk_view()
        pool = self.swap_pool
        assert pool is not None
        self.finish_swaps()  # the previous swap-out's slots hold their data from here on
        compute = torch.cuda.current_stream(self.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        stream = self._copy_stream
        host_in = None
        if len(in_pairs):
            slots = torch.as_tensor(np.asarray(in_pairs[:, 0]), dtype=torch.long)
            host_in = torch.empty((pool.shape[0], len(slots), pool.shape[2]),
                                  dtype=pool.dtype, pin_memory=True)  # fmt: skip
            torch.index_select(pool, 1, slots, out=host_in)
        with torch.cuda.stream(stream):
            stream.wait_stream(compute)
            staged = None
            if len(out_pairs):
                staged = chunks.index_select(1, self._index(out_pairs[:, 0], self.device))
            if host_in is not None:
                data = host_in.to(self.device, non_blocking=True)
                chunks.index_copy_(1, self._index(in_pairs[:, 1], self.device), data)
            ready = torch.cuda.Event()
            ready.record(stream)
            if staged is not None:
                host_out = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
                host_out.copy_(staged, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
                slots_out = torch.as_tensor(np.asarray(out_pairs[:, 1]), dtype=torch.long)
                self._pending_out = (done, host_out, slots_out, staged)
        compute.wait_event(ready)
        # the cache storage was written on the copy stream: keep the allocator honest
        self.storage.record_stream(stream)

    def finish_swaps(self) -> None:
        """Land the last CUDA swap-out's data in its pool slots (waits for its copy); a
        no-op on CPU, where `swap` finishes everything itself."""
        pending, self._pending_out = self._pending_out, None
        if pending is None:
            return
        done, host_out, slots_out, _staged = pending
        done.synchronize()
        assert self.swap_pool is not None
        self.swap_pool.index_copy_(1, slots_out, host_out)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [..., dim] as symmetric int8 with one fp32 scale per vector: (int8 [..., dim],
    scales [...]); scale = max|x| / 127 (0 for an all-zero vector), elements
    round(x / scale) (half to even)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(xf * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _fused_write(new: torch.Tensor, dst: tuple[np.ndarray, np.ndarray],
                 slots: torch.Tensor) -> bool:
    """`quantize_int8` of the rows `new` [T, heads, dim] into `dst` (one layer's int8 K or V
    and its scales, as numpy views) at `slots`, in one call of the core's `write_rows_int8`
    (the same arithmetic); False, nothing written, where it does not apply (another build,
    device or dtype)."""
    if not _FUSED_INT8 or new.device.type != "cpu" \
            or new.dtype not in KERNEL_DTYPES or slots.dtype != torch.int64:
        return False
    rows = new.reshape(new.shape[0], -1)
    _core.write_rows_int8(numpy_view(rows if rows.is_contiguous() else rows.contiguous()),
                          dst[0], dst[1], slots.contiguous().numpy(),
                          src_dtype=KERNEL_DTYPES[new.dtype], group=new.shape[-1])
    return True


def _pairs(pairs: np.ndarray | None) -> np.ndarray:
    if pairs is None:
        return np.zeros((0, 2), dtype=np.int64)
    arr = np.asarray(pairs)
    if arr.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    return arr.reshape(-1, 2)


def _check_range(values: np.ndarray, lo: int, hi: int, what: str) -> None:
    if values.min() < lo or values.max() >= hi:
        raise ValueError(f"{what} out of range [{lo}, {hi}): {values.tolist()}")
