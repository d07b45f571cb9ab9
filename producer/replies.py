"""What a client sees of a reply stream that may hold several attempts of one job.

Rules (the reply reader's, producer/reply_reader.py, under Job, AsyncJob and the gateway):
- events of an attempt older than the newest seen are dropped (a superseded worker's leftovers);
- each (sequence index, position) is delivered once across attempts: a replay's tokens that were
  already delivered are swallowed and only the new suffix is yielded;
- if a replay diverges from what was delivered (it should not: greedy and seeded sampling are
  deterministic), a `restart` event comes first and the new attempt's tokens follow from pos 0;
- text of a streamed sequence that only the done event carries comes first as a tokens chunk
  without tokens, so the streamed text adds up to the done text;
- the first terminal event (done or error) of the newest attempt ends the stream.
"""

from __future__ import annotations

from producer.events import (
    ClientEvent,
    DoneEvent,
    Event,
    RestartEvent,
    TerminalEvent,
    TokensEvent,
    restart_event,
    tokens_event,
)


class ReplyDeduper:
    fast_path = True  # in-step chunks skip the general rules (the tests run both and compare)

    def __init__(self) -> None:
        self.attempt = 0
        self.finished = False
        self.terminal: TerminalEvent | None = None
        self._delivered: dict[int, tuple[list[int], str]] = {}  # what the caller has seen
        self._current: dict[int, tuple[list[int], str]] = {}  # what the newest attempt produced

    def feed(self, event: Event) -> list[ClientEvent]:
        """One raw event in, the events to hand to the caller out (possibly none)."""
        if self.finished or event["attempt"] < self.attempt:
            return []
        if event["attempt"] > self.attempt:
            self.attempt = event["attempt"]
            self._current = {}
        if event["type"] == "tokens":
            return self._tokens(event)
        out: list[ClientEvent] = []
        if event["type"] == "done":
            if self._diverged_outputs(event):
                out.append(self._restart("the final output differs from the tokens already "
                                         "streamed"))
            out += self._text_tails(event)
        if event["type"] == "done" or event["type"] == "error":
            self.finished = True
            self.terminal = event
        out.append(event)
        return out

    def _tokens(self, event: TokensEvent) -> list[ClientEvent]:
        index, pos = event["index"], event["pos"]
        state = self._current.get(index)
        if self.fast_path and state is not None and state is self._delivered.get(index) \
                and pos == len(state[0]) and event["token_ids"]:
            # The common case, in O(new tokens): the next chunk of what was delivered so far.
            state[0].extend(event["token_ids"])
            self._current[index] = self._delivered[index] = (state[0], state[1] + event["text"])
            chunk = self._chunk(event, index, pos, event["token_ids"], event["text"])
            if "logprobs" in event:
                chunk["logprobs"] = event["logprobs"][len(event["logprobs"])
                                                      - len(chunk["token_ids"]):]
            return [chunk]
        cur_ids, cur_text = self._current.get(index, ([], ""))
        done_ids, done_text = self._delivered.get(index, ([], ""))
        if pos < len(cur_ids):
            return []  # a retried write of this attempt
        if pos > len(cur_ids):  # a gap (Redis lost writes): trust what was delivered before it
            if pos > len(done_ids):
                cur_ids, cur_text = list(done_ids) + [-1] * (pos - len(done_ids)), done_text
            else:
                cur_ids, cur_text = list(done_ids[:pos]), done_text
        cur_ids = cur_ids + list(event["token_ids"])
        cur_text = cur_text + event["text"]
        self._current[index] = (cur_ids, cur_text)
        common = min(len(cur_ids), len(done_ids))
        if cur_ids[:common] != done_ids[:common]:
            out: list[ClientEvent] = [
                self._restart(f"attempt {self.attempt} diverged from the streamed tokens")]
            for i, (ids, text) in sorted(self._current.items()):
                out.append(self._chunk(event, i, 0, ids, text))
                self._delivered[i] = (ids, text)
            return out
        if len(cur_ids) <= len(done_ids):
            return []
        new_text = cur_text[len(done_text):] if cur_text.startswith(done_text) else event["text"]
        chunk = self._chunk(event, index, len(done_ids), cur_ids[len(done_ids):], new_text)
        if "logprobs" in event:
            chunk["logprobs"] = event["logprobs"][len(event["logprobs"]) - len(chunk["token_ids"]):]
        self._delivered[index] = self._current[index]  # the same state: in step again
        return [chunk]

    def _text_tails(self, done: DoneEvent) -> list[TokensEvent]:
        """A streamed sequence's text that no tokens event carried (the worker holds back text
        a stop string may still cut; a request the engine ends itself releases it only in the
        done event): one last chunk without tokens, so the streamed text adds up to the done
        text."""
        tails = []
        for out in done["outputs"]:
            index = out["index"]
            if index not in self._delivered:
                continue  # never streamed: the done event has it whole
            ids, text = self._delivered[index]
            if len(out["text"]) > len(text) and out["text"].startswith(text):
                tails.append(self._chunk(done, index, len(ids), [], out["text"][len(text):]))
                self._delivered[index] = (ids, out["text"])
        return tails

    def _diverged_outputs(self, done: DoneEvent) -> bool:
        for out in done["outputs"]:
            done_ids = self._delivered.get(out["index"], ([], ""))[0]
            common = min(len(done_ids), len(out["token_ids"]))
            if out["token_ids"][:common] != done_ids[:common]:
                return True
        return False

    def _restart(self, reason: str) -> RestartEvent:
        self._delivered = {}
        return restart_event(self.attempt, reason)

    def _chunk(self, event: TokensEvent | DoneEvent, index: int, pos: int, ids: list[int],
               text: str) -> TokensEvent:
        return tokens_event(event["attempt"], index, pos, list(ids), text)
