"""The calculator task: seeded problems, the tokens the environment forces, and a checker that pays only
for a calculator-verified answer.

Proven here: a problem is fixed by (seed, group index) and varies with both; its digits and answer are
in 0..9 with answer (a + b) mod 10; the prompt decodes to ``^a+b?`` and the observation to ``=answer``;
``calls_tool`` is true exactly for a response that starts with ``@``; the reward is 1.0 exactly when the
episode called the tool and its final turn starts with the right digit, and 0.0 for every other case.
"""

from __future__ import annotations

import numpy as np
import pytest

from rollout_bus.learn.task import MAX_TURNS, TURN_TOKENS, CalculatorTask, Problem
from rollout_bus.policy.vocab import DIGITS, VOCAB

GROUPS = range(300)


def test_a_problem_is_fixed_by_the_seed_and_the_group_index():
    first, again = CalculatorTask(5), CalculatorTask(5)
    assert [first.problem(g) for g in GROUPS] == [again.problem(g) for g in GROUPS]
    assert [first.problem(g) for g in reversed(GROUPS)] == [first.problem(g) for g in GROUPS][::-1]
    assert first.problem(np.int64(4)) == first.problem(4)


def test_problems_vary_with_the_group_and_with_the_seed():
    problems = [CalculatorTask(5).problem(g) for g in GROUPS]
    assert len(set(problems)) >= 80  # 100 possible (a, b) pairs
    other = [CalculatorTask(6).problem(g) for g in GROUPS]
    assert sum(p != q for p, q in zip(problems, other)) >= len(GROUPS) // 2


def test_digits_and_answers_are_in_zero_to_nine_and_every_answer_occurs():
    problems = [CalculatorTask(11).problem(g) for g in GROUPS]
    for p in problems:
        assert 0 <= p.a <= 9 and 0 <= p.b <= 9
        assert p.answer == (p.a + p.b) % 10
        assert isinstance(p.a, int) and isinstance(p.b, int)
    assert {p.answer for p in problems} == set(range(10))
    assert {p.a for p in problems} == set(range(10)) == {p.b for p in problems}


@pytest.mark.parametrize("a, b, prompt, observation", [
    (3, 5, "^3+5?", "=8"), (9, 9, "^9+9?", "=8"), (0, 0, "^0+0?", "=0"), (7, 3, "^7+3?", "=0"), (1, 8, "^1+8?", "=9"),
])
def test_prompt_and_observation_tokens_decode_to_the_problem_and_its_answer(a, b, prompt, observation):
    problem = Problem(a, b)
    assert problem.text == prompt
    tokens = CalculatorTask.prompt_tokens(problem)
    assert tokens.dtype == np.int64 and VOCAB.decode(tokens) == prompt
    assert tokens.tolist() == [VOCAB.id(c) for c in prompt]
    seen = CalculatorTask.observation_tokens(problem)
    assert seen.dtype == np.int64 and VOCAB.decode(seen) == observation
    assert seen.tolist() == [VOCAB.id(c) for c in observation]


def test_seeded_prompts_decode_to_their_problems():
    task = CalculatorTask(2)
    for g in range(50):
        p = task.problem(g)
        assert VOCAB.decode(task.prompt_tokens(p)) == f"^{p.a}+{p.b}?"
        assert VOCAB.decode(task.observation_tokens(p)) == f"={(p.a + p.b) % 10}"


@pytest.mark.parametrize("text, calls", [
    ("@", True), ("@5", True), ("@$", True), ("", False), ("5@", False), ("$", False), ("=8", False), ("8", False),
])
def test_a_response_calls_the_tool_exactly_when_it_starts_with_the_call_token(text, calls):
    assert CalculatorTask.calls_tool(VOCAB.encode(text)) is calls
    assert CalculatorTask.calls_tool(VOCAB.encode(text).tolist()) is calls


def test_the_reward_is_one_only_for_a_tool_call_and_the_right_digit():
    for a in range(10):
        for b in range(10):
            problem = Problem(a, b)
            for called in (True, False):
                for digit in DIGITS:
                    for tail in ("", "$", "7"):
                        final = VOCAB.encode(digit + tail)
                        expected = 1.0 if called and int(digit) == (a + b) % 10 else 0.0
                        got = CalculatorTask.reward(problem, called, final)
                        assert got == expected and isinstance(got, float), (a, b, called, digit + tail)


@pytest.mark.parametrize("final", ["", "$", "@", "=8", "+8", "?8", "$8"])
def test_a_final_turn_that_does_not_start_with_a_digit_scores_nothing(final):
    problem = Problem(3, 5)
    assert CalculatorTask.reward(problem, True, VOCAB.encode(final)) == 0.0
    assert CalculatorTask.reward(problem, True, VOCAB.encode("8")) == 1.0  # the same problem can pay


def test_turns_are_short_and_there_are_two():
    assert MAX_TURNS == 2
    assert TURN_TOKENS >= 2  # room for a call or a digit followed by the end token
