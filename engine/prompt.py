"""A prompt as the model sees it: text tokenised (plain, or rendered by the model's chat template with an optional
system turn) or token ids taken as they are, refused when it is empty or can never fit the model's context."""
from __future__ import annotations

from engine.errors import InputError


def prompt_ids(model, prompt_or_ids, *, chat: bool = False, system: str | None = None,
               allow_special: bool = False) -> list[int]:
    if isinstance(prompt_or_ids, str):
        if not prompt_or_ids.strip():
            raise InputError("the prompt is empty")
        # Refused before tokenizing: the tokenizer holds the GIL, so a few MB of text would stall every thread
        # of a server for seconds, and text this long could never fit the context anyway.
        longest = model.context_length * model.tokenizer.max_token_chars
        text_chars = len(prompt_or_ids) + len(system or "")
        if text_chars > longest:
            raise InputError(f"the prompt is {text_chars:,} characters long; the model's context "
                             f"({model.context_length:,} tokens of at most {model.tokenizer.max_token_chars} "
                             f"characters each) can never hold more than {longest:,}")
        if chat:
            msgs = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt_or_ids}]
            ids = model.tokenizer.encode_chat(msgs, add_generation_prompt=True,
                                              allow_special_in_content=allow_special)
        else:
            ids = model.tokenizer.encode(prompt_or_ids, allow_special=allow_special)
    else:
        ids = [int(i) for i in prompt_or_ids]
    if not ids:
        raise InputError("the prompt is empty (no tokens)")
    if len(ids) >= model.context_length:
        raise InputError(f"the prompt has {len(ids)} tokens; the model's context is {model.context_length} "
                         "tokens and at least one must be left to generate")
    return ids
