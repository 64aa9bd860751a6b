"""PromptLoader: seeded epochs, `requeue` (spike_recovery's `data: reshuffle`) and a state that
resumes exactly, requeued rows included. No Ray."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from hybridflow.data.loader import PromptLoader, reshuffle

ROWS = list(range(22))  # 5 whole batches of 4 an epoch; the ragged 2 are dropped


def draws(loader: PromptLoader, n: int) -> list[list[int]]:
    return [loader.next_rows() for _ in range(n)]


def test_epochs_are_seeded_permutations_without_the_ragged_tail():
    first = draws(PromptLoader(ROWS, 4, seed=3), 10)
    assert first == draws(PromptLoader(ROWS, 4, seed=3), 10)
    for epoch in (first[:5], first[5:]):
        rows = [r for batch in epoch for r in batch]
        assert len(rows) == len(set(rows)) == 20
    assert first[:5] != first[5:]  # a new order each epoch


def test_requeue_draws_the_rows_again_in_a_new_order_within_the_epoch():
    plain, loader = PromptLoader(ROWS, 4, seed=0), PromptLoader(ROWS, 4, seed=0, remember_batches=3)
    untouched = draws(plain, 5)
    before = draws(loader, 3)
    assert before == untouched[:3]
    assert loader.requeue(2) == 8
    after = draws(loader, 4)  # the 2 batches left of the epoch, plus the 2 put back
    assert all(len(batch) == 4 for batch in after)
    seen = Counter(r for batch in before[:1] + after for r in batch)
    assert seen == Counter(r for batch in untouched for r in batch)  # every row of the epoch once more...
    assert sorted(r for batch in after for r in batch) == sorted(r for batch in before[1:] + untouched[3:]
                                                                   for r in batch)
    assert after[:2] != before[1:]  # ...but not the same batches in the same sequence
    assert loader.next_rows() == plain.next_rows()  # then the next epoch, as without the requeue


def test_requeue_asks_for_no_more_than_it_remembers():
    loader = PromptLoader(ROWS, 4, seed=0, remember_batches=2)
    draws(loader, 3)
    with pytest.raises(ValueError, match="remember_batches=2.*>= 3"):
        loader.requeue(3)
    with pytest.raises(ValueError, match="remember_batches=0"):
        PromptLoader(ROWS, 4, seed=0).requeue(1)


def test_state_resumes_exactly_after_a_requeue_and_can_requeue_again():
    loader = PromptLoader(ROWS, 4, seed=1, remember_batches=3)
    draws(loader, 4)
    loader.requeue(2)
    loader.next_rows()  # mid-way through the requeued order
    state = json.loads(json.dumps(loader.state_dict()))  # what a checkpoint stores
    resumed = PromptLoader(ROWS, 4, seed=1, remember_batches=3)
    resumed.load_state_dict(state)
    assert resumed.requeue(2) == loader.requeue(2) == 8  # the remembered draws came along too
    assert draws(resumed, 9) == draws(loader, 9)  # through the end of the epoch and into the next


def test_a_state_saved_before_requeue_existed_still_loads():
    loader = PromptLoader(ROWS, 4, seed=0)
    draws(loader, 7)
    resumed = PromptLoader(ROWS, 4, seed=0)
    resumed.load_state_dict({"epoch": loader.epoch, "index": loader.index})
    assert draws(resumed, 6) == draws(loader, 6)


def test_reshuffle_is_a_seeded_permutation():
    out = reshuffle(list(range(10)), seed=5, salt=1)
    assert sorted(out) == list(range(10)) and out == reshuffle(list(range(10)), seed=5, salt=1)
    assert out != reshuffle(list(range(10)), seed=5, salt=2)


def test_draws_remembered_before_they_carried_steps_still_requeue():
    loader = PromptLoader(ROWS, 4, seed=0, remember_batches=3)
    drawn = draws(loader, 2)
    state = loader.state_dict()
    state["recent"] = [rows for rows in (d["rows"] for d in state["recent"])]  # the older checkpoint format
    resumed = PromptLoader(ROWS, 4, seed=0, remember_batches=3)
    resumed.load_state_dict(state)
    assert list(resumed.recent) == [(None, d) for d in drawn]
    assert resumed.requeue(1, through_step=5) == 4  # a draw without a step is never taken for one drawn ahead
