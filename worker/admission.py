"""Admission: how many entries to read, and turning one entry into an engine request or a reason.

Capacity: a worker never holds more pending entries than it has sequence slots
(max_num_seqs - entries held, counting those whose terminal write is still in flight), and reads
nothing while the engine has requests waiting for KV blocks or has no free block left.

Bad input never stops the worker: every failure here becomes a Rejection, answered with an error
event on the job's reply stream when the id is valid, and dead-lettered when it is not.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from engine.grammar import grammar_of
from engine.sampling_params import SamplingParams
from producer.limits import check_limits
from producer.protocol import JobSpec, Keys, ProtocolError, attempt_base, decode_job_entry
from worker.config import WorkerConfig
from worker.jobs import ActiveJob
from worker.token_text import TokenTexts

_SPECIAL_TOKEN_ALLOWANCE = 4
log = logging.getLogger("genq.worker")


@dataclass(slots=True)
class Rejection:
    entry_id: str
    deliveries: int
    attempt: int
    reply_key: str | None  # None: no valid id, so no reply stream: dead-letter only
    code: str
    message: str
    dead: bool  # also dead-letter it (no reply key, or over max_attempts)
    raw_job: bytes | None
    idem_key: str | None = None  # the job id's idempotency key (None: no valid id)


@dataclass(slots=True)
class Admitted:
    job: ActiveJob
    prompt: str | list[int]
    params: SamplingParams


def free_capacity(max_num_seqs: int, num_held: int, stats: dict[str, Any]) -> int:
    if stats.get("num_waiting", 0) > 0 or stats.get("num_free_blocks", 1) <= 0:
        return 0
    return max(0, min(max_num_seqs - num_held, int(stats.get("num_free_blocks", max_num_seqs))))


class Admission:
    def __init__(self, cfg: WorkerConfig, keys: Keys, tokenizer: Any, max_model_len: int,
                 vocab_size: int | None = None) -> None:
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.keys = keys
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)  # logprobs' token strings
        # (a prompt must leave room for one generated token: the engine refuses one that fills
        # the context, and that refusal is the job's fault, not the engine's)
        self.max_model_len = max_model_len
        given = cfg.limits.max_prompt_tokens
        self.max_prompt_tokens = min(given or max_model_len - 1, max_model_len - 1)
        self._cap_is_the_models = given is None or given >= max_model_len

    def admit(self, entry_id: str, fields: dict[bytes, bytes], deliveries: int,
              now: float | None = None) -> Admitted | Rejection:
        now = time.time() if now is None else now
        raw_job = fields.get(b"job")
        try:
            spec, base = decode_job_entry(fields, self.cfg.limits.max_job_bytes)
        except ProtocolError as exc:
            reply = self.keys.reply(exc.job_id) if exc.job_id else None
            # (the attempt the client counts: a handed-back job's entry carries its base)
            base = attempt_base(fields) or 0
            return Rejection(entry_id, deliveries, base + deliveries, reply, exc.code,
                             exc.message,
                             dead=reply is None or deliveries > self.cfg.max_attempts,
                             raw_job=raw_job,
                             idem_key=self.keys.idem(exc.job_id) if exc.job_id else None)
        except Exception as exc:  # a decoder bug must not crash every worker that reads it
            log.exception("decoding job entry %s failed", entry_id)
            return Rejection(entry_id, deliveries, deliveries, None, "malformed",
                             f"the job entry could not be decoded: {type(exc).__name__}: "
                             f"{exc}"[:300], dead=True, raw_job=raw_job)
        attempt = base + deliveries

        def reject(code: str, message: str, dead: bool = False) -> Rejection:
            return Rejection(entry_id, deliveries, attempt, self.keys.reply(spec.id), code,
                             message, dead, raw_job, self.keys.idem(spec.id))

        if deliveries > self.cfg.max_attempts:
            return reject("max_attempts", f"the job was delivered {deliveries} times (limit "
                          f"{self.cfg.max_attempts}); it may crash workers", dead=True)
        if spec.model != self.cfg.served_model_name:
            return reject("unknown_model", f"model {spec.model!r} is not served here (this "
                          f"stream's worker serves {self.cfg.served_model_name!r})")
        if spec.deadline is not None and spec.deadline <= now:
            late = now - spec.deadline
            return reject("deadline_exceeded", f"the job's deadline passed {late:.3f} s before "
                          "a worker could start it")
        try:
            check_limits(spec, self.cfg.limits)
            prompt = self._prompt(spec)
            if spec.fit_context:
                self._check_context(spec, prompt)
        except ProtocolError as exc:
            return reject(exc.code, exc.message)
        except Exception as exc:  # e.g. the tokenizer on some text
            log.exception("job %s: preparing its prompt failed", spec.id)
            return reject("invalid_prompt", f"the prompt could not be prepared: "
                          f"{type(exc).__name__}: {exc}"[:300])
        try:
            params = SamplingParams.from_dict(self._params(spec))
        except Exception as exc:  # ValueError with the engine's reason, or worse
            return reject("invalid_params", str(exc) or type(exc).__name__)
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            outside = [t for t in ids
                       if self.vocab_size is not None and not 0 <= t < self.vocab_size]
            if outside:  # (the engine refuses them too, but as a prompt error)
                return reject("invalid_params", f"{name} holds {outside[0]}, outside the "
                              f"vocabulary [0, {self.vocab_size})")
        if params.structured_outputs is not None:
            try:  # (checked once per distinct grammar; the engine compiles it off its step)
                grammar_of(params.structured_outputs)
            except Exception as exc:  # ValueError naming the fault, or the library's own
                return reject("invalid_params", str(exc) or type(exc).__name__)
        job = ActiveJob(entry_id=entry_id, deliveries=deliveries, attempt=attempt, spec=spec,
                        fields=dict(fields), reply_key=self.keys.reply(spec.id),
                        stream_tokens=spec.stream and not params.use_beam_search
                        and params.best_of == params.n,
                        token_texts=self.token_texts if params.logprobs is not None else None,
                        stream_interval=self.cfg.stream_interval)
        return Admitted(job, prompt, params)

    def _params(self, spec: JobSpec) -> dict[str, Any]:
        params = dict(spec.params)
        if "max_tokens" in params and params["max_tokens"] is None:
            # None: no limit of the job's own (OpenAI's chat default): the cap, and the engine
            # stops at the model's context ("length") if that comes first. (Absent: 16.)
            params["max_tokens"] = self.cfg.limits.max_tokens
        if params.get("seed") is None and spec.seed is not None:
            params["seed"] = spec.seed
        return params

    def _check_context(self, spec: JobSpec, prompt: str | list[int]) -> None:
        """A job that asks (fit_context): the prompt plus its max_tokens (absent: 16) must fit
        the context, or it is refused in OpenAI's and vLLM's words rather than cut short.
        max_tokens None (a chat's default) means "to the context" and always fits."""
        max_tokens = spec.params.get("max_tokens", 16)
        if not isinstance(max_tokens, int):
            return
        if isinstance(prompt, str):
            # (byte-level tokenizers: at most a token per byte; tokenize only near the limit)
            if len(prompt.encode()) + _SPECIAL_TOKEN_ALLOWANCE + max_tokens <= self.max_model_len:
                return
            num_tokens = len(self.tokenizer.encode(prompt))
        else:
            num_tokens = len(prompt)
        if num_tokens + max_tokens > self.max_model_len:
            raise ProtocolError(
                "context_length_exceeded", f"This model's maximum context length is "
                f"{self.max_model_len} tokens. However, you requested {num_tokens + max_tokens} "
                f"tokens ({num_tokens} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.", spec.id)

    def _chat_token_ids(self, spec: JobSpec) -> list[int]:
        """The model's chat template over the messages, with the assistant's turn opened. Token
        ids, not text: the template already holds BOS, and the engine adds none to ids."""
        assert spec.messages is not None
        if not getattr(self.tokenizer, "chat_template", None):
            raise ProtocolError("no_chat_template", f"the model served as "
                                f"{self.cfg.served_model_name!r} has no chat template (its "
                                "tokenizer_config.json sets no 'chat_template'), so it cannot "
                                "take chat messages: send a prompt instead (/v1/completions), "
                                "or serve a model whose tokenizer has a chat template", spec.id)
        try:
            ids: Any = self.tokenizer.apply_chat_template(
                spec.messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as exc:  # the template may raise (e.g. a role it does not accept)
            raise ProtocolError("chat_template_error", "the model's chat template rejected "
                                f"the messages: {type(exc).__name__}: {exc}"[:500],
                                spec.id) from None
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], list):
            ids = ids[0]  # a batch of one
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise ProtocolError("chat_template_error", "the model's chat template gave "
                                f"{type(ids).__name__} {str(ids)[:80]!r}, not a non-empty list "
                                "of token ids", spec.id)
        return [int(t) for t in ids]

    def _prompt(self, spec: JobSpec) -> str | list[int]:
        if spec.messages is not None:
            prompt: str | list[int] = self._chat_token_ids(spec)
            num_tokens = len(prompt)
        elif spec.prompt_token_ids is not None:
            num_tokens = len(spec.prompt_token_ids)
            prompt = list(spec.prompt_token_ids)
        else:
            assert spec.prompt is not None
            prompt = spec.prompt
            # Byte-level tokenizers give at most one token per byte (+ BOS/EOS): a short prompt
            # cannot be over the cap, and tokenizing it here would double the engine's work.
            num_bytes = len(prompt.encode())
            short = num_bytes + _SPECIAL_TOKEN_ALLOWANCE <= self.max_prompt_tokens
            num_tokens = num_bytes if short else len(self.tokenizer.encode(prompt))
        if num_tokens > self.max_prompt_tokens:
            why = f" (max_model_len {self.max_model_len} leaves room for one generated token)" \
                if self._cap_is_the_models else ""
            raise ProtocolError("limit_exceeded", f"prompt has {num_tokens} tokens, over the "
                                f"cap of {self.max_prompt_tokens}{why}", spec.id)
        return prompt
