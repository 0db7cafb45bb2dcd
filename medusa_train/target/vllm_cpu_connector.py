"""vLLM's ExampleHiddenStatesConnector for its CPU build: the stock connector copies each request's states off the
device on a CUDA stream into pinned memory, which a CPU-only torch lacks; this one reads them from the cache and
writes the file synchronously (same file, same lock protocol). Imported by vLLM's workers only
(`kv_connector_module_path`, set by `medusa_train.target.vllm_extract` when no GPU is present)."""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Written:
    """What the stock connector's CUDA event says once the copy is done: here, at once."""

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size, dtype=torch.long)[None, :] + blocks[:, None] * self._block_size)
        states = extract_from_kv_cache(self._kv_cache, slots.flatten(), pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the reader waiting on the file
        self._req_copy_events[pending.req_id] = _Written()
