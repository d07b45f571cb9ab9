"""DraftModel: speculative proposals from a small model with the target's vocabulary.

The draft shares the target's block tables and block size and keeps its own KV tensors (a
KVCache of its own layers that follows the target's: every swap-out, swap-in and copy-on-write
the scheduler asks for moves the draft's blocks too). So allocation, forks, preemption and the
trimming of rejected slots need nothing of their own: the draft writes only slots the target's
table holds this step (the sequence's tokens, and the positions its proposals take).

Per sequence the draft remembers how far its cache is filled. A step proposes k tokens in k
greedy passes: the first runs what the draft has not seen yet (after a preemption, a fork or a
rejection, from where its cache stops being valid) up to the sequence's last token; each later
pass runs the previous proposal. Greedy proposals are enough: verification keeps exactness.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention.selector import select_backend
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.kv_cache import KVCache, bytes_per_block
from engine.model_runner import ModelRunner
from engine.models.loader import DTYPES, load_config, load_model, load_tokenizer, max_positions
from engine.scheduler_output import ScheduledSeq
from engine.sequence import Sequence


class DraftModel:
    def __init__(self, model_dir: str, config: EngineConfig, target_vocab_size: int,
                 target_tokenizer: Any, max_model_len: int, device: torch.device) -> None:
        hf_config = load_config(model_dir)
        vocab = int(hf_config.vocab_size)
        if vocab != target_vocab_size or \
                load_tokenizer(model_dir).get_vocab() != target_tokenizer.get_vocab():
            raise ValueError(f"the draft model {model_dir!r} has another vocabulary than the "
                             f"target ({vocab} vs {target_vocab_size} ids, or other tokens): a "
                             "draft must share the target's tokenizer")
        limit = max_positions(hf_config)
        if limit < max_model_len:
            raise ValueError(f"the draft model {model_dir!r} has {limit} positions but "
                             f"max_model_len is {max_model_len}: lower max_model_len or use "
                             "a draft with as many positions as the target")
        self.model = load_model(model_dir, hf_config, config.dtype, device, limit)
        self.config = config
        self.device = device
        self.block_bytes = bytes_per_block(self.model.num_layers, config.block_size,  # type: ignore
                                           self.model.num_kv_heads,  # type: ignore
                                           self.model.head_dim, DTYPES[config.dtype])  # type: ignore
        self.computed: dict[int, tuple[int, int]] = {}  # seq_id -> (filled, num_preemptions)

    def attach(self, target_cache: KVCache, block_manager: BlockManager, num_blocks: int,
               num_host_blocks: int) -> None:
        """Give the draft its cache (following `target_cache`'s moves) and its runner."""
        model, config = self.model, self.config
        backend = select_backend(config, self.device, model.head_dim)  # type: ignore
        self.kv_cache = KVCache(model.num_layers, num_blocks, num_host_blocks,  # type: ignore
                                config.block_size, model.num_kv_heads,  # type: ignore
                                model.head_dim, DTYPES[config.dtype], self.device,  # type: ignore
                                backend)
        target_cache.followers.append(self.kv_cache)
        self.block_manager = block_manager
        self.runner = ModelRunner(model, backend, block_manager, self.device)

    @torch.inference_mode()
    def propose(self, items: list[ScheduledSeq]) -> None:
        """Fill each item's spec_token_ids (placeholders: the scheduler chose how many) with
        the draft's greedy tokens."""
        computed = self.computed
        pending: list[tuple[ScheduledSeq, list[int], list[int]]] = []  # (item, ids, proposals)
        first = []
        for item in items:
            seq, group = item.seq, item.group
            filled, preemptions = computed.get(seq.seq_id, (0, group.num_preemptions))
            if preemptions != group.num_preemptions:
                filled = 0  # (recomputed or swapped: start over; a swap kept it, but cheaply)
            filled = min(filled, seq.num_computed_tokens)  # (rejected proposals' slots)
            ids = seq.token_ids
            first.append(ScheduledSeq(group, _view(seq, ids, filled), len(ids) - filled, True))
            pending.append((item, ids, []))
        batch = first
        while batch:
            tokens = self._greedy(batch)
            nxt = []
            for (item, ids, out), token in zip(pending, tokens):
                out.append(token)
                if len(out) < len(item.spec_token_ids or ()):
                    seq = item.seq
                    # (the copy is the draft's input only: the sequence keeps its tokens)
                    full = ids + out
                    nxt.append((item, ids, out,
                                ScheduledSeq(item.group, _view(seq, full, len(full) - 1), 1,
                                             True)))
                else:
                    item.spec_token_ids = out
                    computed[item.seq.seq_id] = (len(ids) + len(out) - 1,
                                                 item.group.num_preemptions)
            pending = [(i, d, o) for i, d, o, _ in nxt]
            batch = [s for *_, s in nxt]
        if len(computed) > 2 * len(self.block_manager.tables) + 64:  # forget ended sequences
            live = self.block_manager.tables
            self.computed = {k: v for k, v in computed.items() if k in live}

    def _greedy(self, batch: list[ScheduledSeq]) -> list[int]:
        """The draft's argmax after each of `batch`, in `batch` order."""
        ordered = self.runner.order(batch)
        logits = self.runner.execute(ordered, self.kv_cache.device_cache)
        tokens = logits.argmax(dim=-1).tolist()
        position = {id(s): r for r, s in enumerate(ordered)}
        return [tokens[position[id(s)]] for s in batch]


def _view(seq: Sequence, token_ids: list[int], filled: int) -> Sequence:
    """What the draft's runner reads of `seq`: its table (by seq_id), `token_ids`, and
    `filled` tokens already in the draft's cache."""
    return Sequence(seq.seq_id, seq.index, token_ids, seq.num_prompt_tokens, filled)
