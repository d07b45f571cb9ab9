"""StopChecker: appends a sampled token to its sequence and decides whether the sequence ends.

A sequence ends on one of its stop token ids, on EOS (unless ignore_eos), on a stop string, at
max_tokens, or at max_model_len; min_tokens holds off the first three until enough tokens exist
(or the grammar is complete). Text is decoded incrementally when it streams or stop strings need
it, else once when the sequence ends. Without a decoder (token ids only) there is no text.
"""

from __future__ import annotations

from typing import Any

from engine.detokenizer import decode_delta, decode_output, find_stop
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceGroup
from engine.tokenizer import ByteTable


class StopChecker:
    def __init__(self, eos_token_ids: set[int], max_model_len: int, decoder: Any = None,
                 byte_table: ByteTable | None = None, stream_text: bool = False) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.decoder = decoder
        self.byte_table = byte_table
        self.stream_text = stream_text and decoder is not None

    def append(self, group: SequenceGroup, seq: Sequence, token: int, logprob: float | None,
               top: dict[int, float] | None, grammar_done: bool = False) -> bool:
        """Append `token` to `seq`; True when `seq` ends with it (its finish_reason set)."""
        params = group.params
        ids = seq.token_ids
        ids.append(token)
        num_out = len(ids) - seq.num_prompt_tokens
        if logprob is None:
            seq.cumulative_logprob = None
        elif seq.cumulative_logprob is not None:
            seq.cumulative_logprob += logprob
        if top is not None:
            seq.output_logprobs.append(top)
        can_stop = num_out >= params.min_tokens or grammar_done
        if can_stop and params.stop_token_ids and token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif can_stop and not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        else:
            stop = None
            if self.stream_text or (params.stop and self.decoder is not None):
                delta = decode_delta(self.decoder, seq, params.skip_special_tokens,
                                     self.byte_table)
                if delta:
                    seq.output_text += delta
                    if params.stop and can_stop:
                        stop = find_stop(seq, delta, params)
            if stop is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop
            elif params.max_tokens is not None and num_out >= params.max_tokens:
                seq.finish_reason = "length"
            elif len(ids) >= self.max_model_len:
                seq.finish_reason = "length"
            else:
                return False
        self.final_text(seq, params)
        return True

    def final_text(self, seq: Sequence, params: SamplingParams) -> None:
        """The text of a sequence that just finished (idempotent)."""
        if self.decoder is None or isinstance(seq.stop_reason, str) \
                or not seq.num_output_tokens:
            return  # find_stop cut the text at the stop string; or there is no output
        # The EOS or stop token that ended it is text only with include_stop_str_in_output
        # (vLLM's rule); decoding to there also flushes bytes held back for a character that
        # will now never complete. Text decoded once (not streamed) is decoded here.
        num = seq.num_output_tokens
        if seq.finish_reason == "stop" and not params.include_stop_str_in_output:
            num -= 1
        if not (self.stream_text or params.stop) \
                or seq.read_offset < seq.num_prompt_tokens + num:
            seq.output_text = decode_output(self.decoder, seq, num, params.skip_special_tokens)

    def hypothesis_text(self, seq: Sequence, params: SamplingParams) -> None:
        """The text of a finished beam-search hypothesis: every output token, its last too."""
        if self.decoder is not None:
            seq.output_text = decode_output(self.decoder, seq, seq.num_output_tokens,
                                            params.skip_special_tokens)
