"""The attention backend contract and the paged KV cache layout both backends share.

Cache layout (one tensor for the whole model, allocated by engine/kv_cache.py):

    cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]   (contiguous)

cache[layer, 0] is the key cache and cache[layer, 1] the value cache of that layer, each a
contiguous [num_blocks, block_size, num_kv_heads, head_size] view. Token `t` of a sequence lives
in physical block `block_table[t // block_size]`, row `t % block_size`; its flat slot is
`block * block_size + t % block_size`.

A batch is flat: the new tokens of all scheduled sequences, concatenated. Sequence i owns query rows
query_start_loc[i] : query_start_loc[i+1]; its context after this step is seq_lens[i] tokens, so
its queries sit at positions seq_lens[i] - q_len_i ... seq_lens[i] - 1 and each attends causally
to every cached key at a position <= its own. Keys at positions >= seq_lens[i] (the stale tail of
the last block) are never read into the result.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from itertools import accumulate

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = do not write
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    num_decode_seqs: int  # the first num_decode_seqs sequences have exactly one query each
    seq_lens_list: list[int]  # host copies, for backends that loop on the host
    query_lens_list: list[int]
    _prefills: PrefillPlan | None = field(default=None, repr=False, compare=False)

    def prefills(self) -> PrefillPlan:
        """How this step's prefill sequences split, worked out once for all layers."""
        if self._prefills is None:
            starts = [0, *accumulate(self.query_lens_list)]
            plan = PrefillPlan(starts, [], {})
            for i in range(self.num_decode_seqs, len(self.seq_lens_list)):
                if self.query_lens_list[i] == self.seq_lens_list[i]:
                    plan.fresh.setdefault(self.query_lens_list[i], []).append(i)
                else:
                    plan.chunks.append(i)
            for length, seqs in plan.fresh.items():
                first = starts[seqs[0]]
                if seqs[-1] - seqs[0] == len(seqs) - 1:  # consecutive prompts: one run of rows
                    plan.fresh_rows[length] = slice(first, first + length * len(seqs))
                else:  # each prompt's rows, prompts in order: [seqs, length] flattened
                    rows = (torch.tensor([starts[i] for i in seqs])[:, None]
                            + torch.arange(length)).view(-1)
                    plan.fresh_rows[length] = _to_device(rows, self.slot_mapping.device)
            self._prefills = plan
        return self._prefills


@dataclass
class PrefillPlan:
    starts: list[int]  # query row where each sequence starts (host copy of query_start_loc)
    chunks: list[int]  # sequences with cached context before this step's tokens
    fresh: dict[int, list[int]]  # length -> whole prompts of that length (no cached context)
    # Their query rows: a slice when the prompts are consecutive in the batch (no gather).
    fresh_rows: dict[int, torch.Tensor | slice] = field(default_factory=dict)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """On CUDA a non-blocking copy from pinned memory: the step's host work never waits for the
    device (its one sync is the sampler reading the sampled ids)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class AttentionBackend(ABC):
    """Paged attention over the cache layout above. All methods run on the cache's device."""

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """reshape_and_cache: key/value [num_tokens, num_kv_heads, head_size] into their slots."""

    @abstractmethod
    def forward(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None) -> torch.Tensor:
        """query [num_tokens, num_heads, head_size] -> output of the same shape. `key` and
        `value` are this step's new keys/values, rows aligned with `query` (already written to
        the cache); a backend may use them for sequences with no cached context."""

    def swap_blocks(self, src_cache: torch.Tensor, dst_cache: torch.Tensor, src: torch.Tensor,
                     dst: torch.Tensor) -> None:
        """Swap: dst_cache[:, :, dst[i]] = src_cache[:, :, src[i]] between the device cache and
        host swap space, all layers, K and V: one gather and one scatter for all blocks."""
        gathered = src_cache.index_select(2, src.to(src_cache.device))
        dst_cache.index_copy_(2, dst.to(dst_cache.device), gathered.to(dst_cache.device))

    @abstractmethod
    def copy_blocks(self, cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write: cache[:, :, dst[i]] = cache[:, :, src[i]] for every layer, K and V."""
