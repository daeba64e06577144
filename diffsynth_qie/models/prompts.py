"""A prompt's length in tokens, and the limit every command applies to it (``--max_prompt_tokens``), for any
model family: the tokenizer is the pipeline's own, or its processor's (Qwen-Image-2.1)."""
from __future__ import annotations

from .presets import DEFAULT_MAX_PROMPT_TOKENS


def prompt_token_count(pipe, prompt: str) -> int:
    """Tokens of ``prompt`` alone (the template and image tokens not counted)."""
    # Qwen-Image-2.1's processor holds its tokenizer; Qwen-Image-Edit loads one beside the processor
    tokenizer = getattr(pipe, "tokenizer", None) or getattr(getattr(pipe, "processor", None), "tokenizer", None)
    if tokenizer is None:
        raise ValueError("the pipeline has no tokenizer loaded; load it with components including 'text_encoder'")
    return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def check_prompt_length(pipe, prompt: str, max_tokens: int | None = DEFAULT_MAX_PROMPT_TOKENS) -> int:
    """The prompt's token count; ``ValueError`` when it exceeds ``max_tokens`` (None: no limit)."""
    n = prompt_token_count(pipe, prompt)
    if max_tokens is not None and n > max_tokens:
        shown = prompt[:60] + ("..." if len(prompt) > 60 else "")
        raise ValueError(f"prompt {shown!r} has {n} tokens ({len(prompt)} characters), more than the limit of "
                         f"{max_tokens}; shorten it or raise --max_prompt_tokens")
    return n
