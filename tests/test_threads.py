"""Small CPU steps choose their thread team by measuring, and leave torch's setting as it was."""

from __future__ import annotations

import pytest
import torch

from kvforge import Engine, Request
from kvforge.errors import UserError
from kvforge.testing import tiny_model, tiny_tokenizer
from kvforge.threads import PROBE_EVERY, SmallStepThreads, team


def drive(policy: SmallStepThreads, seconds: dict[int, float], steps: int) -> list[int]:
    picked = []
    for _ in range(steps):
        size = policy.pick()
        policy.observe(size, seconds[size] * 2, tokens=2)
        picked.append(size)
    return picked


def test_tries_both_then_keeps_the_faster_and_probes_the_other_less_often_the_more_it_loses():
    policy = SmallStepThreads(max_threads=4)
    picked = drive(policy, {1: 0.01, 4: 0.03}, 200)
    assert picked[:2] == [4, 1]  # the full team first, then one thread
    assert policy.preferred == 1
    probes = [i for i, n in enumerate(picked[2:], start=2) if n == 4]
    assert probes and len(probes) <= 200 // (PROBE_EVERY * 3) + 1  # 3x slower: tried every 48 steps, not every 16
    assert policy.avg[1] == pytest.approx(0.01)  # seconds per token


def test_follows_a_machine_that_changes():
    policy = SmallStepThreads(max_threads=2)
    drive(policy, {1: 0.03, 2: 0.01}, 50)
    assert policy.preferred == 2
    drive(policy, {1: 0.01, 2: 0.05}, 100)  # the cores got busy: the team stalls at its barriers
    assert policy.preferred == 1


def test_a_team_of_one_has_nothing_to_choose():
    policy = SmallStepThreads(max_threads=1)
    assert drive(policy, {1: 0.01}, 20) == [1] * 20
    with pytest.raises(ValueError, match="max_threads"):
        SmallStepThreads(max_threads=0)


def test_team_restores_the_setting_even_on_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), team(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before


def test_engine_decodes_the_same_tokens_and_gives_the_threads_back(monkeypatch):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    request = Request("the quick brown fox", max_new_tokens=12)
    fixed = Engine(model, tok, small_step_threads=None).run(request)
    sizes: list[int] = []
    real_team = team

    def recording(size: int):
        sizes.append(size)
        return real_team(size)

    monkeypatch.setattr("kvforge.threads.team", recording)
    before = torch.get_num_threads()
    engine = Engine(model, tok)
    measured = engine.run(request)
    assert measured.token_ids == fixed.token_ids  # the team size changes the speed, never the tokens
    assert torch.get_num_threads() == before
    assert len(sizes) >= max(len(measured.token_ids), 4)  # every step went through it: the short prompt's and decoding
    if before > 1:
        assert set(sizes) == {1, before} and set(engine.small_step_threads.avg) == {1, before}
    with pytest.raises(UserError, match="small_step_threads"):
        Engine(model, tok, small_step_threads="fast")
