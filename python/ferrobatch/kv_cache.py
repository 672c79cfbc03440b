"""`PagedKVCache`: per-layer K/V slot tensors over a pool of chunks, plus the CPU swap pool."""

from __future__ import annotations

import numpy as np
import torch

ZERO_CHUNK = 0
SCRATCH_CHUNK = 1
RESERVED_CHUNKS = 2


class PagedKVCache:
    """K and V slot tensors for every layer, in one device allocation (ARCHITECTURE.md §2).

    `keys[l]` and `values[l]` are `[(num_blocks + 2) * page_size, num_kv_heads, head_dim]`
    views; chunk `c` is slots `c*page_size .. (c+1)*page_size` in every layer. Chunk 0 stays
    zero (padding reads), chunk 1 takes padding writes. The swap pool holds
    `cpu_offload_blocks` chunks (all layers) in CPU memory, pinned when the cache is on CUDA.
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
    ) -> None:
        if num_blocks < 1 or page_size < 1 or num_layers < 1:
            raise ValueError("num_blocks, page_size and num_layers must be >= 1")
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
        # [layer, k/v, slot, head, dim]: one allocation so a swap is one copy for all layers.
        self.storage = torch.zeros(
            num_layers, 2, self.num_slots, num_kv_heads, head_dim, device=self.device, dtype=dtype
        )
        self.keys: list[torch.Tensor] = [self.storage[i, 0] for i in range(num_layers)]
        self.values: list[torch.Tensor] = [self.storage[i, 1] for i in range(num_layers)]
        self._workspaces: list[torch.Tensor | None] = [None, None]
        self.cpu_offload_blocks = cpu_offload_blocks
        self.swap_pool: torch.Tensor | None = None
        if cpu_offload_blocks:
            pin = self.device.type == "cuda"
            self.swap_pool = torch.empty(
                num_layers * 2, cpu_offload_blocks, self.chunk_elements,
                dtype=dtype, device="cpu", pin_memory=pin,
            )

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
        self, keys: torch.Tensor, values: torch.Tensor, chunks: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy whole chunks of one layer's K and V into the decode workspace:
        `[len(chunks) * page_size, num_kv_heads, head_dim]` each."""
        n = chunks.shape[0]
        k_out, v_out = self.gather_buffers(0, n * self.page_size)
        shape = (self.num_chunks, self.chunk_elements)
        torch.index_select(keys.view(shape), 0, chunks, out=k_out.view(n, self.chunk_elements))
        torch.index_select(values.view(shape), 0, chunks, out=v_out.view(n, self.chunk_elements))
        return k_out, v_out

    @property
    def chunk_elements(self) -> int:
        """Elements of one chunk in one layer's K (or V)."""
        return self.page_size * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_chunk(self) -> int:
        """Bytes of one chunk over all layers, K and V."""
        return self.num_layers * 2 * self.chunk_elements * self.storage.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes held on the device by the cache."""
        return self.storage.numel() * self.storage.element_size()

    def _chunk_view(self) -> torch.Tensor:
        return self.storage.view(self.num_layers * 2, self.num_chunks, self.chunk_elements)

    def _index(self, values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values), dtype=torch.long).to(device, non_blocking=True)

    def swap(
        self,
        swap_out: np.ndarray | None = None,
        swap_in: np.ndarray | None = None,
    ) -> None:
        """Run a step's swaps: `swap_out` (device chunk, swap slot) pairs first, then
        `swap_in` (swap slot, device chunk) pairs, each as one batched copy over all layers."""
        out_pairs = _pairs(swap_out)
        in_pairs = _pairs(swap_in)
        if not len(out_pairs) and not len(in_pairs):
            return
        if self.swap_pool is None:
            raise RuntimeError("swap requested but the cache has no CPU swap pool")
        chunks = self._chunk_view()
        pool = self.swap_pool
        if len(out_pairs):
            _check_range(out_pairs[:, 0], RESERVED_CHUNKS, self.num_chunks, "swap_out device chunk")
            _check_range(out_pairs[:, 1], 0, self.cpu_offload_blocks, "swap_out swap slot")
            src = self._index(out_pairs[:, 0], self.device)
            dst = self._index(out_pairs[:, 1], torch.device("cpu"))
            data = chunks.index_select(1, src)
            if data.device.type != "cpu":
                data = data.to("cpu")
            pool.index_copy_(1, dst, data)
        if len(in_pairs):
            _check_range(in_pairs[:, 0], 0, self.cpu_offload_blocks, "swap_in swap slot")
            _check_range(in_pairs[:, 1], RESERVED_CHUNKS, self.num_chunks, "swap_in device chunk")
            src = self._index(in_pairs[:, 0], torch.device("cpu"))
            dst = self._index(in_pairs[:, 1], self.device)
            data = pool.index_select(1, src)
            if self.device.type != "cpu":
                data = data.pin_memory().to(self.device, non_blocking=True)
            chunks.index_copy_(1, dst, data)


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
