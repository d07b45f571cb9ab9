"""Engine: add requests, step, get outputs. One step reads

    schedule -> move blocks (swap/copy) -> run the model -> sample -> update

The scheduler decides what runs and owns every sequence's lifecycle (Scheduler.update: computed
tokens, appended tokens, ends, frees); the engine moves blocks, runs the model, samples, and
hands out outputs.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from engine.attention.selector import select_backend
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import init_offsets
from engine.grammar import grammar_of
from engine.kv_cache import KVCache, bytes_per_block, num_device_blocks
from engine.model_runner import ModelRunner
from engine.models.loader import (
    DTYPES,
    load_config,
    load_eos_ids,
    load_model,
    load_tokenizer,
    max_positions,
    resolve_dtype,
)
from engine.outputs import RequestOutput, request_output
from engine.sampler import Sampler, plain_greedy
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.spec_decode import Speculator
from engine.spec_draft import DraftModel
from engine.step_sampler import StepSampler
from engine.stop_checker import StopChecker
from engine.structured_outputs import StructuredOutputs
from engine.tokenizer import byte_table, fast_decoder, fast_encoder, prompt_token_ids


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        hf_config = load_config(config.model)
        config = self.config = replace(config, dtype=resolve_dtype(config.dtype, hf_config,
                                                                   self.device))
        limit = max_positions(hf_config)
        window = getattr(hf_config, "sliding_window", None)
        if window and getattr(hf_config, "use_sliding_window", True):
            limit = min(limit, int(window))  # full attention is exact only inside the window
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit "
                             f"of {limit} positions")
        self.max_model_len = config.max_model_len or limit
        self.tokenizer = load_tokenizer(config.model)
        self.decoder = fast_decoder(self.tokenizer)
        self._encode = fast_encoder(self.tokenizer)
        self.byte_table = byte_table(self.tokenizer, self.decoder)
        self.delta_outputs = config.output_kind == "delta"
        self.model = load_model(config.model, hf_config, config.dtype, self.device, limit)
        self.vocab_size = int(hf_config.vocab_size)
        self.eos_token_ids = load_eos_ids(hf_config, self.tokenizer, config.model)
        backend = select_backend(config, self.device, self.model.head_dim)  # type: ignore
        spec = config.speculative
        draft = None if spec is None or spec.model is None else DraftModel(
            spec.model, config, self.vocab_size, self.tokenizer, self.max_model_len, self.device)
        block_bytes = bytes_per_block(self.model.num_layers, config.block_size,  # type: ignore
                                      self.model.num_kv_heads, self.model.head_dim,  # type: ignore
                                      DTYPES[config.dtype]) + (draft.block_bytes if draft else 0)
        num_blocks = num_device_blocks(config, block_bytes, self.device)
        if num_blocks < 1:
            raise ValueError("no memory left for the KV cache; lower the model size or raise "
                             "gpu_memory_utilization / kv_cache_memory")
        num_host = config.swap_space_bytes // block_bytes
        self.block_manager = BlockManager(num_blocks, num_host, config.block_size,
                                          config.watermark, config.enable_prefix_caching)
        self.kv_cache = KVCache(self.model.num_layers, num_blocks, num_host,  # type: ignore
                                config.block_size, self.model.num_kv_heads,  # type: ignore
                                self.model.head_dim, DTYPES[config.dtype],  # type: ignore
                                self.device, backend)
        self._seq_ids = itertools.count()
        checker = StopChecker(self.eos_token_ids, self.max_model_len, self.decoder,
                              self.byte_table, config.stream_text)
        self.scheduler = Scheduler(config, self.block_manager, checker, self._seq_ids)
        self.runner = ModelRunner(self.model, backend, self.block_manager, self.device)
        # Masks overlap the model where a core is free while it runs: a device's host, or a
        # CPU worker with a core its torch threads leave over (a thread more than cores would
        # stall their OpenMP barriers).
        spare = len(os.sched_getaffinity(0)) > torch.get_num_threads()
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                            self.device.type,
                                            overlap=self.device.type != "cpu" or spare)
        self.step_sampler = StepSampler(Sampler(self.vocab_size), self.structured,
                                        self.eos_token_ids, self.vocab_size,
                                        self.max_model_len)
        if draft is not None:
            draft.attach(self.kv_cache, self.block_manager, num_blocks, num_host)
        self.speculator = None if spec is None else Speculator(
            spec, self.step_sampler.sampler, self.eos_token_ids, self.max_model_len, draft)
        self._groups: dict[str, SequenceGroup] = {}
        self._rejected: list[SequenceGroup] = []
        self._seed_rng = random.Random(config.seed)
        self.counters = {"num_steps": 0, "num_generated_tokens": 0}

    # -- public API ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, priority: int = 0) -> None:
        """Queue a request. `priority` (lower is sooner) needs scheduling_policy="priority"."""
        params = params or SamplingParams()
        if self.speculator is not None:
            self.speculator.check(params)
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} needs scheduling_policy='priority' (the "
                             "engine runs 'fcfs')")
        token_ids = prompt_token_ids(prompt, self._encode, self.vocab_size)
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            out_of_vocab = [t for t in ids if t >= self.vocab_size]
            if out_of_vocab:  # (never sampled; banning or biasing it would index past)
                raise ValueError(f"{name} holds {out_of_vocab[0]}, outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        so = params.structured_outputs
        grammar = grammar_of(so) if so is not None else None  # (a ValueError names the fault)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(next(self._seq_ids), 0, token_ids, len(token_ids))
        init_offsets(seq)
        group = SequenceGroup(request_id, params, [seq], seed, priority=priority)
        group.plain_greedy = plain_greedy(params)
        self._groups[request_id] = group
        if len(token_ids) >= self.max_model_len:
            self._reject(group, f"the prompt has {len(token_ids)} tokens but max_model_len is "
                                f"{self.max_model_len}: it leaves no room to generate; shorten it")
            return
        width = params.best_of or params.n
        if width > self.config.max_num_seqs:  # it could never be scheduled: say so, don't wait
            what = "the beam width (best_of)" if params.use_beam_search else "best_of"
            self._reject(group, f"the request runs {width} sequences ({what}) but max_num_seqs "
                                f"is {self.config.max_num_seqs}; lower n/best_of or raise "
                                "max_num_seqs")
            return
        if params.use_beam_search and width > self.config.max_num_batched_tokens:
            self._reject(group, f"beam search advances its {width} beams together, one token "
                                f"each per step, but max_num_batched_tokens is "
                                f"{self.config.max_num_batched_tokens}; lower best_of or raise "
                                "max_num_batched_tokens")
            return
        if grammar is not None and not self.structured.start(group, grammar):
            return  # compiling: a later step schedules it (_admit_compiled)
        self.scheduler.add(group)

    def abort(self, request_id: str) -> bool:
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        self.scheduler.abort(request_id)
        self.structured.release(group)
        self._rejected = [g for g in self._rejected if g is not group]
        return True

    def abort_all(self) -> None:
        """Drop every request and start over with empty queues and every KV block free; the
        model and the cache tensors stay. Safe whatever state a failed step() left behind
        (abort() trusts the scheduler's queues and block tables, which a step that raised
        half-way may have left inconsistent)."""
        self._groups.clear()
        self._rejected = []
        self.structured.clear()
        self.scheduler.reset()

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    def num_unfinished(self) -> int:
        return len(self._groups)

    def step(self, finished_only: bool = False,
             on_forward: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One engine step. Returns an output for every request that progressed (or, with
        `finished_only`, for those that finished: the offline LLM needs no partial outputs).
        With delta outputs, a request that progressed without anything new to hand out (a
        prefill chunk, text held back) has no output this step. `on_forward` is called once
        the model has run, before sampling (the worker sends its next read there)."""
        if self.structured.pending:
            self._admit_compiled()
        spec, sc = self.speculator, self.scheduler
        proposals = spec.propose(sc.running, sc.num_unfinished()) if spec else None
        sched = sc.schedule(proposals)
        self._move_blocks(sched)
        batch = self.runner.order(sched.scheduled)
        if batch:
            if spec and proposals:  # (none: a step as without speculation)
                spec.fill(batch)
            logits = self._run(batch)
            if on_forward is not None:
                on_forward()
            sampled = spec.sample(batch, logits, self.step_sampler) if spec and proposals \
                else self.step_sampler(batch, logits)
            for group in self.scheduler.update(sched, sampled):
                self._release(group)
            self.counters["num_steps"] += 1
            self.counters["num_generated_tokens"] += sampled.num_generated
        return self._outputs(batch, sched.finished, finished_only)

    def stats(self) -> dict[str, Any]:
        bm, sc = self.block_manager, self.scheduler
        total = bm.num_total_blocks
        return {
            "num_total_blocks": total, "num_free_blocks": bm.num_free_blocks,
            "num_host_blocks": bm.host.num_blocks, "num_free_host_blocks": bm.host.num_free,
            "kv_usage": (total - bm.num_free_blocks) / total,
            "num_running": len(sc.running), "num_waiting": len(sc.waiting),
            "num_swapped": len(sc.swapped),
            "num_preemptions": sc.counters["num_recompute_preemptions"]
            + sc.counters["num_swap_outs"],
            "num_cached_blocks": bm.num_cached_blocks,  # prefix cache: blocks it can hit
            "num_evictable_blocks": bm.num_evictable_blocks,  # (of those, unheld: free)
            "prefix_cache_hit_rate": sc.counters["num_cached_tokens"]
            / max(sc.counters["num_prompt_tokens"], 1),
            "num_compiling": self.structured.num_pending,  # waiting for their grammar
            **sc.counters, **self.counters, **self.structured.counters,
            **(self.speculator.stats() if self.speculator else {}),
        }

    # -- the step's parts ------------------------------------------------------------------------
    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled join the scheduler; a failed or late compile ends
        its request. With nothing else to run, wait for a compile rather than spin."""
        sc = self.scheduler
        ready, failed = self.structured.poll(wait=not (sc.running or sc.waiting or sc.swapped))
        for group in ready:
            sc.add(group)
        for group, message in failed:
            self._reject(group, message)

    def _move_blocks(self, sched: SchedulerOutput) -> None:
        assert not (sched.blocks_to_swap_in and sched.blocks_to_swap_out)
        self.kv_cache.swap_out(sched.blocks_to_swap_out)
        self.kv_cache.swap_in(sched.blocks_to_swap_in)
        self.kv_cache.copy(sched.blocks_to_copy)

    def _run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """The model over `batch`: the logits of its sampling rows. Grammar masks are made
        meanwhile where a core is left over."""
        if self.structured.overlap and self.structured.active:
            self.structured.prefetch([(item.group, item.seq) for item in batch
                                      if item.do_sample and item.group.params
                                      .structured_outputs is not None])
        logits = self.runner.execute(batch, self.kv_cache.device_cache)
        self.structured.wait()
        return logits

    def _outputs(self, batch: list[ScheduledSeq], finished: list[SequenceGroup],
                 finished_only: bool) -> list[RequestOutput]:
        """An output per request of `batch` that has one to give, and per request that ended
        without running (`finished` by the scheduler, or refused)."""
        outputs: dict[str, RequestOutput] = {}
        delta = self.delta_outputs
        for group in dict.fromkeys(item.group for item in batch):  # (a group's seqs, once)
            if not finished_only or group.status is SequenceStatus.FINISHED:
                out = request_output(group, delta)  # (None: nothing new to hand out)
                if out is not None:
                    outputs[group.request_id] = out
        now = time.monotonic()
        for group in finished + self._rejected:
            if group.status is not SequenceStatus.FINISHED:  # (refused: never scheduled)
                group.status, group.finished_time = SequenceStatus.FINISHED, now
            self._release(group)
            out = request_output(group, delta)
            assert out is not None  # (a finished request always has an output)
            outputs[group.request_id] = out
        self._rejected = []
        return list(outputs.values())

    def _release(self, group: SequenceGroup) -> None:
        """What the engine holds of a request that ended: its grammar state, its id."""
        if group.params.structured_outputs is not None:
            self.structured.release(group)
        self._groups.pop(group.request_id, None)

    # -- helpers ---------------------------------------------------------------------------------
    def _reject(self, group: SequenceGroup, message: str) -> None:
        for seq in group.seqs:
            seq.finish_reason = "error"
        group.error = message
        self._rejected.append(group)
