"""Engine: prompt encoding, QA split, stop strings, EOS, press/no-press plumbing, length checks."""

from __future__ import annotations

import pytest
import torch

from kvforge.decode import SamplingParams, sample, trim_at_stop
from kvforge.engine import Engine, TextStream
from kvforge.errors import UserError
from kvforge.testing import tiny_model, tiny_tokenizer


@pytest.fixture()
def engine():
    return Engine(tiny_model("llama"), tiny_tokenizer(), chunk_size=16)


def test_encode_qa_splits_one_prompt(engine):
    ctx, q = engine.encode_qa("some long context here", "what?", system="be brief", answer_prefix="A:")
    whole = engine.tokenizer(
        engine.tokenizer.apply_chat_template(
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "some long context here\n\nwhat?"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        + "A:",
        add_special_tokens=False,
    ).input_ids
    assert ctx + q == whole
    assert engine.tokenizer.decode(q).startswith("what?")
    assert engine.tokenizer.decode(ctx).endswith("some long context here\n\n")


def test_answer_query_agnostic_without_press_equals_query_aware(engine):
    a = engine.answer("the quick brown fox jumps", "who jumps?", max_new_tokens=8, query_aware=True)
    b = engine.answer("the quick brown fox jumps", "who jumps?", max_new_tokens=8, query_aware=False)
    assert a.token_ids == b.token_ids and a.prompt_tokens == b.prompt_tokens


def test_generate_reports_timings_and_bytes(engine):
    gen = engine.generate("hello", max_new_tokens=5)
    assert len(gen.token_ids) <= 5 and gen.ttft_s > 0 and gen.cache_bytes > 0
    assert gen.prompt_tokens == len(engine.encode_chat("hello"))


def test_stop_string_and_eos(engine):
    gen = engine.generate("hello", max_new_tokens=30)
    text = gen.text
    if len(text) >= 3:
        stop = text[1:3]
        stopped = engine.generate("hello", max_new_tokens=30, stop=[stop])
        assert stopped.finish_reason == "stop" and stop not in stopped.text
        assert stopped.text == trim_at_stop(text, [stop])
    engine.eos_token_ids = [gen.token_ids[0]]
    assert engine.generate("hello", max_new_tokens=30).token_ids == []


def test_length_and_argument_errors(engine):
    with pytest.raises(UserError, match="exceeds the model's context"):
        engine.generate("x" * 3000, max_new_tokens=10)
    with pytest.raises(UserError):
        SamplingParams(top_p=0.0)
    with pytest.raises(UserError):
        Engine(engine.model, engine.tokenizer, chunk_size=0)


def test_sample_respects_top_k_and_top_p():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, SamplingParams(temperature=1.0, top_k=2), g)[0]) for _ in range(200)}
    assert draws <= {0, 1} and len(draws) == 2
    draws = {int(sample(logits, SamplingParams(temperature=1.0, top_p=0.5), g)[0]) for _ in range(50)}
    assert draws == {0}
    assert int(sample(logits, SamplingParams())[0]) == 0


def test_text_stream_reassembles_text(engine):
    pieces: list[str] = []
    stream = TextStream(engine.tokenizer, pieces.append)
    gen = engine.generate("hi", max_new_tokens=12, on_token=stream)
    assert "".join(pieces) == gen.text
