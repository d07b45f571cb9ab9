"""Worker isolation's decisions (worker/isolation.py), without a worker or an engine: the
groups suspects re-run in, the culprit, when the engine is to blame, which re-runs stream."""

from __future__ import annotations

import itertools

from worker.isolation import MAX_STREAK, Failure, Isolation


def bisect(jobs: list[str], culprits: set[str]) -> tuple[list[list[str]], list[str]]:
    """Run an isolation to its end, a group failing when it holds a culprit: (the groups run,
    in order; the culprits convicted, in order)."""
    isolation, held, steps = Isolation(), list(jobs), 0
    runs: list[list[str]] = []
    convicted: list[str] = []
    failure = isolation.failed(held, steps)  # the step that raised ran every job
    while True:
        assert not failure.broken
        if failure.culprit is not None:
            convicted.append(failure.culprit)
            held.remove(failure.culprit)
        group = isolation.next_group()
        if group is None:
            return runs, convicted
        runs.append(group)
        if culprits & set(group):
            failure = isolation.failed(held, steps)
        else:
            steps += 1
            held = [job for job in held if job not in group]
            failure = Failure()


def test_a_failing_group_is_halved_until_the_culprit_fails_alone() -> None:
    runs, convicted = bisect(list("abcdef"), {"e"})
    assert runs == [list("abc"), list("def"), list("de"), ["d"], ["e"], ["f"]]
    assert convicted == ["e"]


def test_every_culprit_is_found_within_2k_minus_1_group_runs() -> None:
    for k in range(1, 9):
        jobs = [f"j{i}" for i in range(k)]
        for size in (1, 2):
            for culprits in itertools.combinations(jobs, min(size, k)):
                runs, convicted = bisect(jobs, set(culprits))
                assert sorted(convicted) == sorted(culprits)
                assert len(runs) <= 2 * k - 1


def test_a_lone_suspect_is_the_culprit_at_once() -> None:
    isolation = Isolation()
    isolation.behind["a"] = {0: 2}
    assert isolation.failed(["a"], 7) == Failure(culprit="a")
    assert (isolation.next_group(), isolation.behind) == (None, {})


def test_waiting_groups_are_not_suspects_of_a_later_failure() -> None:
    isolation = Isolation()
    isolation.failed(list("abcd"), 0)
    assert isolation.next_group() == list("ab")  # "cd" waits outside the engine
    assert isolation.failed(list("abcd"), 0) == Failure()
    assert list(isolation.groups) == [["a"], ["b"], list("cd")]
    assert isolation.num_waiting == 4


def test_the_engine_is_blamed_after_a_long_streak_of_failures_with_no_step_between() -> None:
    isolation = Isolation()
    verdicts = [isolation.failed(list("abcd"), 5) for _ in range(MAX_STREAK + 1)]
    assert not any(v.broken for v in verdicts[:MAX_STREAK]) and verdicts[-1].broken
    other = Isolation()
    # A successful step between two failures starts the streak over.
    assert not any(other.failed(list("abcd"), steps).broken for steps in range(2 * MAX_STREAK))
    assert other.streak == 1


def test_a_rerun_of_the_same_tokens_streams_again_once_it_caught_up_with_its_client() -> None:
    isolation = Isolation()
    assert isolation.rerun("a", {0: 3, 1: 2}, same_tokens=True)  # held back
    assert isolation.caught_up({"a": {0: 3, 1: 1}}) == []
    assert isolation.caught_up({"a": {0: 3, 1: 2}}) == ["a"]
    assert isolation.behind == {}
    assert isolation.rerun("a", {0: 1}, same_tokens=True)  # a second failure: back again
    assert isolation.behind == {"a": {0: 1}}


def test_a_rerun_whose_tokens_may_differ_never_streams_again() -> None:
    isolation = Isolation()
    assert isolation.rerun("a", {0: 3}, same_tokens=False)
    assert isolation.caught_up({"a": {0: 50}}) == []
    assert isolation.behind == {"a": None}
    assert isolation.caught_up({}) == [] and isolation.behind == {}  # it ended


def test_a_rerun_whose_client_has_nothing_streams_as_before() -> None:
    isolation = Isolation()
    assert not isolation.rerun("a", {}, same_tokens=True)
    assert isolation.behind == {}


def test_settling_forgets_the_reruns_that_ended() -> None:
    isolation = Isolation()
    isolation.rerun("a", {0: 1}, same_tokens=True)
    isolation.rerun("b", {0: 1}, same_tokens=False)
    isolation.settle({"b": object()})
    assert isolation.behind == {"b": None}
