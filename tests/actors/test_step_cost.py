"""The measured cost of a decode row (actors/scheduler/step_cost.py): the line through the recent
steps, nothing read from steps that all had the same rows, and the rows a slack allows."""
from __future__ import annotations

import pytest

from actors.scheduler.step_cost import StepCost


def test_the_line_through_steps_of_several_row_counts():
    cost = StepCost()
    for rows in (1, 4, 8, 16) * 5:
        cost.observe(rows, 0.02 + 0.005 * rows)
    fixed, per_row = cost.line()
    assert fixed == pytest.approx(0.02) and per_row == pytest.approx(0.005)


def test_steps_all_of_one_row_count_tell_nothing_and_a_free_row_sets_no_limit():
    cost = StepCost()
    for _ in range(50):
        cost.observe(8, 0.1)
    assert cost.line() is None and cost.rows_within(8, 0.1) is None
    flat = StepCost()   # a GPU's decode step: the weights' read, whatever the rows
    for rows in (1, 8, 32, 64) * 4:
        flat.observe(rows, 0.01)
    assert flat.rows_within(8, 0.1) is None


def test_rows_within_the_slack():
    cost = StepCost()
    for rows in (2, 10) * 10:
        cost.observe(rows, 0.01 + 0.01 * rows)   # a step of 8 rows: 90 ms; a row: 10 ms
    assert cost.rows_within(8, 0.1) == 0          # 9 ms of slack is less than a row
    assert cost.rows_within(8, 0.25) == 2         # 22.5 ms: two rows
    assert cost.rows_within(8, 0.0) == 0


def test_the_line_follows_the_machine_when_its_speed_changes():
    cost = StepCost()
    for rows in (1, 8) * 50:
        cost.observe(rows, 0.01 * rows)
    for rows in (1, 8) * 200:   # the machine got twice as slow a row (another process took a core)
        cost.observe(rows, 0.02 * rows)
    assert cost.line()[1] == pytest.approx(0.02, rel=0.01)


def test_empty_and_failed_steps_are_not_observed():
    cost = StepCost()
    cost.observe(0, 0.5)
    cost.observe(4, 0.0)
    assert cost.line() is None
