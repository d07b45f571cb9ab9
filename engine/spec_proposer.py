"""NgramProposer: prompt lookup. The proposals for a sequence are the tokens that followed the
most recent earlier occurrence of its longest suffix n-gram (prompt_lookup_min <= n <=
prompt_lookup_max), searched over prompt and output alike.

A match close to the end proposes past the sequence's last token: the copy then continues from
its own proposals (a sequence that repeats with period p is proposed to keep repeating it),
which is what a repetition loop or a repeated identifier run needs. Proposals are only guesses:
verification decides what is emitted, so a bad guess costs compute, never correctness.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.lookup_min = prompt_lookup_min
        self.lookup_max = prompt_lookup_max

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` proposals to follow `token_ids` ([] when no n-gram matches)."""
        length = len(token_ids)
        if length < 2 or num_tokens < 1:
            return []
        arr = np.asarray(token_ids)
        # Candidates: the end positions i < length - 1 of an earlier match of the last n tokens,
        # narrowed one n at a time; the longest n that still has candidates wins.
        ends = np.flatnonzero(arr[:-1] == arr[-1])
        matched = 1
        for n in range(2, self.lookup_max + 1):
            if ends.size == 0:
                break
            longer = ends[ends >= n - 1]
            longer = longer[arr[longer - (n - 1)] == arr[length - n]]
            if longer.size == 0:
                break
            ends, matched = longer, n
        if ends.size == 0 or matched < self.lookup_min:
            return []
        start = int(ends[-1]) + 1  # the most recent match: the shortest period of a loop
        out = token_ids[start:start + num_tokens]
        while len(out) < num_tokens:  # past the end: continue the copy from the proposals
            out.append(out[start + len(out) - length])
        return out
