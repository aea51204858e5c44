"""Shared by the tests that run a real in-process vLLM CPU engine (tiny random Llama, character tokenizer)."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

TEXT = (Path(__file__).resolve().parents[1] / "src/kvforge/data/haystack_gutenberg/moby_dick_excerpt.txt").read_text()
PROMPT = TEXT[:700]  # 700 tokens with the character tokenizer: two whole 256-token store blocks


def run(
    model_dir: Path, prompts: list[str | list[int]], store: str | None, params: list[dict | None] | None = None,
    max_tokens: int = 8, logprobs: int = 0, **extra: object,
) -> list[dict]:  # fmt: skip
    """Start an engine (with the connector on ``store``, or without one), answer greedily, stop it; ``params``: each
    prompt's ``kv_transfer_params``."""
    from vllm import LLM, SamplingParams

    kwargs = {}
    if store is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVForgeConnector",
            "kv_connector_module_path": "kvforge.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": store, **extra},
        }
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=2048, enforce_eager=True, seed=0, **kwargs)
    try:
        inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
        sampling = [
            SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=logprobs,
                           extra_args={"kv_transfer_params": q} if q else None)
            for q in (params or [None] * len(prompts))
        ]  # fmt: skip
        outs = llm.generate(inputs, sampling, use_tqdm=False)
        return [
            {
                "prompt_ids": list(o.prompt_token_ids),
                "cached": o.num_cached_tokens,
                "tokens": list(o.outputs[0].token_ids),
                "logprobs": chosen_logprobs(o.outputs[0]),
                "top": [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs],
                "kv_transfer_params": o.kv_transfer_params,
            }
            for o in outs
        ]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def chosen_logprobs(completion) -> list[float]:
    return [lps[t].logprob for lps, t in zip(completion.logprobs, completion.token_ids, strict=True)]


def assert_same_answer(warm: dict, cold: dict, tol: float = 1e-4) -> None:
    assert warm["tokens"] == cold["tokens"]
    torch.testing.assert_close(torch.tensor(warm["logprobs"]), torch.tensor(cold["logprobs"]), rtol=0, atol=tol)
