"""Compress a long prompt's KV cache with a press inside Hugging Face's own ``model.generate`` (kvpress style).

    python examples/compress_generate.py [MODEL]     # MODEL: built-in name (smollm2-135m), model folder or .gguf
"""

from __future__ import annotations

import sys

from kvforge.compat import output_cache
from kvforge.model import load_model
from kvforge.presses import build_press


def main(model_name: str = "smollm2-135m") -> None:
    model, tokenizer = load_model(model_name)
    document = " ".join(f"Line {i}: the harbour master logged ship number {i * 7}." for i in range(20))
    prompt = f"{document}\n\nWhich ship number was logged on line 12?"
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    input_ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=not tokenizer.chat_template).input_ids
    for label, press in (("full cache    ", build_press("full")), ("snapkv at 0.5 ", build_press("snapkv", 0.5))):
        with press(model, tokenizer=tokenizer):  # the prompt's KV is compressed during generate's prefill
            out = model.generate(input_ids, max_new_tokens=16, do_sample=False, return_dict_in_generate=True)
        cache = output_cache(out)  # a kvforge KVCache: model.generate(cache=cache) continues it
        text = tokenizer.decode(out.sequences[0, input_ids.shape[1] :], skip_special_tokens=True)
        print(f"{label}: {cache.num_entries():>7} entries -> {text!r}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
