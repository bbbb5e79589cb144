"""Multi-turn engine routes: EngineTurn lists in routes_from_engine, and RolloutTurns' bookkeeping."""

import numpy as np
import pytest
import torch

from trl_moe_replay.rollouts.turns import RolloutTurns
from trl_moe_replay.routing import EngineTurn, RouteAlignmentError, routes_from_engine
from trl_moe_replay.routing.codec import encode_routed_experts

from tests.helpers import no_route


L, K, E = 3, 2, 64


def turn_rows(prompt_length, completion_length, start=0, turn=0):
    """Rows a turn's engine returns for positions start .. p + c - 2; ids encode (position, layer, turn)."""
    q = np.arange(start, prompt_length + completion_length - 1)[:, None, None]
    layer = np.arange(L)[None, :, None]
    slot = np.arange(K)[None, None, :]
    return ((q * 5 + layer * 3 + turn * 17 + slot * 29) % E).astype(np.uint8)


def expected_id(position, layer, turn, slot=0):
    return (position * 5 + layer * 3 + turn * 17 + slot * 29) % E


def align(samples, prompt_lengths, completion_lengths, prompt_width, completion_width, **kwargs):
    return routes_from_engine(
        samples,
        prompt_lengths=prompt_lengths,
        completion_lengths=completion_lengths,
        prompt_width=prompt_width,
        completion_width=completion_width,
        num_layers=L,
        top_k=K,
        num_experts=E,
        **kwargs,
    )


def test_every_position_keeps_the_route_of_the_first_turn_that_forwarded_it():
    # prompt 4; turn 0 generates 3 (a tool call); a 2-token tool result; turn 1 (prompt 9) generates 4 more
    p, c = 4, 3 + 2 + 4
    turns = [EngineTurn(turn_rows(4, 3, turn=0), 4, 3), EngineTurn(turn_rows(9, 4, turn=1), 9, 4)]
    out = align([turns], [p], [c], prompt_width=6, completion_width=10)
    base = 6 - p  # column of position 0
    assert no_route(out[0, :base]).all()
    for position in range(p + c - 1):
        first = 0 if position < 4 + 3 - 1 else 1  # turn 0 forwarded positions 0..5; 6 (its last token) on: turn 1
        assert out[0, base + position, 2, 0] == expected_id(position, 2, first), position
    assert no_route(out[0, base + p + c - 1 :]).all()  # the final token and the padding


def test_a_turn_without_rows_leaves_a_gap_that_a_later_prefill_fills_and_ids_of_gaps_are_minus_one():
    turns = [EngineTurn(None, 4, 3), EngineTurn(turn_rows(9, 2, start=3, turn=1), 9, 2, prompt_start=3)]
    out = align([turns], [4], [7], prompt_width=4, completion_width=7)
    assert no_route(out[0, :3]).all()  # positions 0..2: no turn routed them (turn 1 skipped them)
    assert [int(out[0, q, 0, 0]) for q in range(3, 10)] == [expected_id(q, 0, 1) for q in range(3, 10)]
    assert no_route(out[0, 10]).all()


def test_rows_sent_despite_a_requested_prompt_start_are_taken_from_position_zero():
    # the engine ignored routed_experts_prompt_start=5 and sent all rows (an older vLLM)
    turns = [EngineTurn(turn_rows(3, 2, turn=0), 3, 2), EngineTurn(turn_rows(6, 2, turn=1), 6, 2, prompt_start=5)]
    out = align([turns], [3], [5], prompt_width=3, completion_width=5)
    assert [int(out[0, q, 1, 1]) for q in range(7)] == [expected_id(q, 1, 0 if q < 4 else 1, 1) for q in range(7)]


def test_a_truncated_final_sequence_uses_only_the_rows_it_still_has():
    # the last turn generated 6 tokens; TRL kept 2 of them (max_completion_length)
    turns = [EngineTurn(turn_rows(3, 2, turn=0), 3, 2), EngineTurn(turn_rows(6, 6, turn=1), 6, 6)]
    out = align([turns], [3], [3 + 2], prompt_width=3, completion_width=6)
    assert no_route(out[0, 7]).all() and out[0, 6, 0, 0] == expected_id(6, 0, 1)


def test_a_malformed_turn_falls_back_alone_and_is_reported_with_its_sample_and_turn():
    bad = turn_rows(8, 2, turn=1)[:-1]  # one row short
    samples = [
        [EngineTurn(encode_routed_experts(turn_rows(4, 3, turn=0)), 4, 3), EngineTurn(bad, 8, 2)],
        [EngineTurn(turn_rows(2, 3, turn=2), 2, 3)],
    ]
    errors = []
    out = align(samples, [4, 2], [6, 3], prompt_width=4, completion_width=6, on_error=errors.append)
    assert [(error.sample, "turn 1" in str(error)) for error in errors] == [(0, True)]
    assert [int(out[0, q, 0, 0]) for q in range(6)] == [expected_id(q, 0, 0) for q in range(6)]
    assert no_route(out[0, 6:]).all()  # turn 1's positions: the trainer's own routing
    assert out[1, 2, 0, 0] == expected_id(0, 0, 2)
    with pytest.raises(RouteAlignmentError, match=r"sample 0: .*\(turn 1\)"):
        align(samples, [4, 2], [6, 3], prompt_width=4, completion_width=6)


@pytest.mark.parametrize(
    ("turns", "message"),
    [
        ([EngineTurn(None, 5, 3)], "first turn's prompt must be the sample's"),
        ([EngineTurn(None, 4, 3), EngineTurn(None, 12, 1)], "a later one's a prefix of its sequence"),
        ([EngineTurn(None, 4, 3), "rows"], "must be an EngineTurn"),
    ],
)
def test_turns_that_cannot_belong_to_the_sample_raise(turns, message):
    with pytest.raises(RouteAlignmentError, match=message):
        align([turns], [4], [6], prompt_width=4, completion_width=6, on_error=lambda error: None)


def test_single_turn_rows_and_turn_lists_mix_in_one_batch():
    samples = [turn_rows(3, 4), [EngineTurn(turn_rows(3, 4), 3, 4)], None]
    out = align(samples, [3, 3, 3], [4, 4, 4], prompt_width=3, completion_width=4)
    assert torch.equal(out[0], out[1]) and no_route(out[2]).all()


# ---------------------------------------------------------------------------------------------- RolloutTurns
def test_later_turn_prompts_are_matched_to_samples_by_prefix_in_order():
    turns = RolloutTurns([[1, 2], [1, 2], [3]], [[5, 6], [5, 6], [7]], rows=None)
    # samples 0 and 1 are identical so far: the first later prompt goes to 0, the next one to 1 (TRL's order)
    assert turns.match([[1, 2, 5, 6, 9], [1, 2, 5, 6, 9], [3, 7, 8]]) == [0, 1, 2]
    assert turns.match([[3, 7, 9]]) == [2]
    assert turns.match([[4, 4], [3, 7, 1]]) == [None, 2]  # no sample continues [4, 4]


def test_a_prompt_that_fits_two_samples_of_which_one_stopped_goes_to_neither_and_is_counted():
    # samples 0 and 1 wrote the same tool call; only one goes on (TRL dropped the other's tool result): the tokens
    # cannot say which, so the turn falls back (its positions use the trainer's routing) instead of going to sample 0
    turns = RolloutTurns([[1, 2], [1, 2], [3]], [[5, 6], [5, 6], [7]], rows=None)
    assert turns.match([[1, 2, 5, 6, 9], [3, 7, 8]]) == [None, 2]
    assert (turns.ambiguous, turns.unmatched) == (1, 0)
    # a sample whose sequence is a prefix of another's: the longer one's continuation fits both, but the order
    # leaves one choice when the shorter one goes on too
    turns = RolloutTurns([[1], [1]], [[2], [2, 3]], rows=None)
    assert turns.match([[1, 2, 8], [1, 2, 3, 9]]) == [0, 1]
    assert turns.match([[1, 2, 3, 9]]) == [None] and turns.ambiguous == 1


def test_the_tool_loops_samples_decide_where_they_fit_the_prompts():
    turns = RolloutTurns([[1, 2], [1, 2], [3]], [[5, 6], [5, 6], [7]], rows=[turn_rows(2, 2)] * 3)
    later = [[1, 2, 5, 6, 9]]
    assert turns.match(later, owners=[1]) == [1] and turns.ambiguous == 0
    turns.add_turn(later, [[4]], rows=[turn_rows(5, 1, turn=1)], samples=[1])
    assert [len(t) for t in turns.turns] == [1, 2, 1]  # sample 1's turn, not sample 0's
    # owners that do not fit the prompts (not a prefix, out of range, out of order) are not taken: the tokens decide
    assert turns.match([[3, 7, 8]], owners=[0]) == [2]
    assert turns.match([[3, 7, 8]], owners=[7]) == [2]
    assert turns.match([[1, 2, 5, 6, 0], [3, 7, 1]], owners=[2, 0]) == [0, 2]


def test_add_turn_records_rows_per_sample_and_drops_unmatched_prompts():
    turns = RolloutTurns([[1, 2], [3, 4]], [[5], [6, 7]], rows=[turn_rows(2, 1), turn_rows(2, 2)])
    turns.add_turn([[3, 4, 6, 7, 9], [8, 8]], [[1, 1], [2]], rows=[turn_rows(5, 2), turn_rows(2, 1)])
    assert [len(t) for t in turns.turns] == [1, 2] and turns.unmatched == 1
    assert (turns.turns[1][1].prompt_length, turns.turns[1][1].completion_length) == (5, 2)
    # the sample's sequence moved on: a next turn continues [3, 4, 6, 7, 9, 1, 1]
    assert turns.match([[3, 4, 6, 7, 9, 1, 1, 0]]) == [1]


def test_held_positions_is_what_every_given_sample_already_has_routes_for():
    turns = RolloutTurns([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], rows=[turn_rows(3, 2), None])
    assert turns.held_positions([0]) == 3 + 2 - 1  # the last generated token was never forwarded
    assert turns.held_positions([0, 1]) == 0  # sample 1's first turn brought no rows
    turns.add_turn([[1, 2, 3, 5, 6, 0]], [[1, 1, 1]], rows=[turn_rows(6, 3, start=4)], prompt_start=4)
    assert turns.held_positions([0]) == 6 + 3 - 1
    assert turns.held_positions([None]) is None and turns.held_positions([]) is None  # no bound
