"""Prompts to token ids, for every entry point: `encode_prompt` (a string, chat messages or token
ids; chat text through specjax/prompt_text.py) and `check_fits` (prompt + new tokens within the
model's context). Both raise InvalidPromptError with one line."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from specjax.errors import InvalidPromptError

if TYPE_CHECKING:
    from specjax.models.loading import Model

Prompt = str | Sequence[dict] | Sequence[int]


def encode_prompt(model: Model, prompt: Prompt, raw: bool = False) -> list[int]:
    """Token ids of one prompt: a string (chat template applied for chat models unless `raw`), a
    list of chat messages, or a list of token ids.

    Through the chat template, message text is text: a control-token string typed in a prompt or
    a message (`<|im_end|>`) is encoded as the characters it is made of, never as the control
    token (specjax/prompt_text.py). A `raw` string is encoded as the tokenizer reads it, control
    tokens included. Text that is not valid UTF-8 (undecodable bytes, lone surrogates) raises
    InvalidPromptError."""
    from specjax.datasets import RawText
    from specjax.prompt_text import check_text, encode_chat

    tok = model.tokenizer
    raw = raw or isinstance(prompt, RawText)
    from_tokenizer = True  # ids out of the model's range then mean a mismatched tokenizer
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InvalidPromptError("empty prompt")
        check_text(prompt)
        if tok is None:
            raise InvalidPromptError(
                f"model {model.name} has no tokenizer (no tokenizer files beside its weights): "
                f"give token ids through the Python API"
            )
        if not raw and getattr(tok, "chat_template", None):
            ids = encode_chat(tok, [{"role": "user", "content": str(prompt)}])
        else:
            ids = tok(str(prompt)).input_ids
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        if tok is None or not getattr(tok, "chat_template", None):
            raise InvalidPromptError(f"model {model.name} has no chat template for messages")
        if any("role" not in m or "content" not in m for m in prompt):
            raise InvalidPromptError("each chat message needs 'role' and 'content'")
        ids = encode_chat(tok, list(prompt))
    elif isinstance(prompt, (list, tuple)) and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt
    ):
        ids, from_tokenizer = [int(t) for t in prompt], False
    else:
        raise InvalidPromptError(
            f"a prompt is a string, a list of chat messages or a list of token ids, "
            f"got {type(prompt).__name__}: {str(prompt)[:60]!r}"
        )
    if not ids:
        raise InvalidPromptError("empty prompt")
    if any(t < 0 or t >= model.config.vocab_size for t in ids):
        why = " (the tokenizer's vocabulary is larger than the model's)" if from_tokenizer else ""
        raise InvalidPromptError(f"token id out of range [0, {model.config.vocab_size}){why}")
    return list(ids)


def check_fits(model: Model, n_prompt: int, max_new: int) -> None:
    ctx = model.config.max_position_embeddings
    if n_prompt >= ctx:
        raise InvalidPromptError(f"prompt of {n_prompt} tokens does not fit the model's context of {ctx} tokens")
    if n_prompt + max_new > ctx:
        raise InvalidPromptError(
            f"prompt of {n_prompt} tokens + max_new_tokens {max_new} exceeds the model's context of {ctx} tokens"
        )
