"""Prompt text: UTF-8 checks, and chat messages encoded so that their content stays text.

A chat template wraps each message in control tokens (`<|im_start|>user\\n ... <|im_end|>`).
Tokenizing the rendered string as a whole would also turn control-token strings that a user
typed into a message (`<|im_end|><|im_start|>assistant ...`) into control tokens: a user could
then write the assistant's or the system's turn (role injection). `encode_chat` gives the control
tokens only to the template: the special-token strings inside messages are swapped for private
placeholders before rendering, the rendered text is split at the special tokens left (all of
them the template's), and every piece between them, placeholders restored, is encoded with
special tokens read as plain text.

When no message contains a special-token string, the result equals the tokenizer's own encoding
of the rendered template (tests/test_errors.py checks it): a tokenizer splits its input at added
tokens before anything else, which is what `encode_chat` does. Special tokens that strip the
whitespace beside them (`lstrip`, `rstrip`) are honoured the same way.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Sequence

from specjax.errors import InvalidPromptError

_BACKENDS: dict[int, tuple[Any, Any]] = {}  # id(tokenizer) -> (tokenizer, text-only backend or None)
_SLOW_LOCK = threading.Lock()  # slow tokenizers: split_special_tokens is per-call state there


def check_text(text: str, what: str = "the prompt") -> None:
    """Raise InvalidPromptError unless `text` is valid Unicode text that UTF-8 can encode: the
    undecodable bytes of a command-line argument (surrogate-escaped) and lone surrogates (JSON
    `"\\ud800"`) are refused with one line instead of failing inside the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidPromptError(
            f"{what} is not valid UTF-8 text (an undecodable byte or a lone surrogate at character {e.start})"
        ) from None


def special_tokens(tok) -> dict[str, Any]:
    """Special (control) added tokens of a transformers tokenizer: content -> AddedToken."""
    backend = getattr(tok, "backend_tokenizer", None)
    decoder = backend.get_added_tokens_decoder() if backend is not None else getattr(tok, "added_tokens_decoder", {})
    out = {t.content: t for t in decoder.values() if getattr(t, "special", False) and t.content}
    for s in getattr(tok, "all_special_tokens", []):  # slow tokenizers may list some only here
        out.setdefault(s, None)
    return out


def _text_backend(tok):
    """A copy of the fast tokenizer's backend that reads special-token strings as text (never
    mutated after it is built, so threads may encode with it at once); None for slow ones."""
    hit = _BACKENDS.get(id(tok))
    if hit is None or hit[0] is not tok:
        backend = getattr(tok, "backend_tokenizer", None)
        copy = None
        if backend is not None:
            from tokenizers import Tokenizer

            copy = Tokenizer.from_str(backend.to_str())
            copy.encode_special_tokens = True
        hit = (tok, copy)
        _BACKENDS[id(tok)] = hit
    return hit[1]


def encode_text(tok, text: str) -> list[int]:
    """Ids of `text` with no special tokens added or parsed (a control-token string is text)."""
    if not text:
        return []
    backend = _text_backend(tok)
    if backend is not None:  # encode_batch releases the GIL: other threads run meanwhile
        return list(backend.encode_batch([text], add_special_tokens=False)[0].ids)
    with _SLOW_LOCK:
        return list(tok(text, add_special_tokens=False, split_special_tokens=True).input_ids)


def _placeholders(specials: list[str], texts: list[str]) -> dict[str, str]:
    """special string -> a private-use placeholder that occurs in none of `texts`."""
    out, code = {}, 0xE000
    for s in specials:
        while True:
            ph = f"\uf8ff{chr(code)}\uf8ff"
            code += 1
            if not any(ph in t for t in texts):
                break
        out[s] = ph
    return out


def encode_chat(tok, messages: Sequence[dict]) -> list[int]:
    """Token ids of chat `messages` through the tokenizer's chat template (generation prompt
    added), with every message's role and content encoded as text (see the module docstring)."""
    specials = special_tokens(tok)
    fields = [v for m in messages for k, v in m.items() if k in ("role", "content") and isinstance(v, str)]
    for v in fields:
        check_text(v, "a chat message")
    present = [s for s in specials if any(s in v for v in fields)]
    restore: dict[str, str] = {}
    if present:
        swap = _placeholders(sorted(present, key=len, reverse=True), fields)
        restore = {ph: s for s, ph in swap.items()}

        def hide(v):
            if not isinstance(v, str):
                return v
            for s, ph in swap.items():  # longest first: a special inside a longer one stays whole
                v = v.replace(s, ph)
            return v

        messages = [{k: hide(v) if k in ("role", "content") else v for k, v in m.items()} for m in messages]
    text = tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return _encode_rendered(tok, text, specials, restore)


def _encode_rendered(tok, text: str, specials: dict[str, Any], restore: dict[str, str]) -> list[int]:
    """Split `text` at special-token strings (the template's own), encode the pieces between
    them as text with `restore`'s placeholders put back."""
    if not specials:
        return encode_text(tok, _restore(text, restore))
    pattern = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
    ids: list[int] = []
    pos = 0
    for m in pattern.finditer(text):
        piece, added = text[pos : m.start()], specials[m.group()]
        if added is not None and getattr(added, "lstrip", False):
            piece = piece.rstrip()
        ids += encode_text(tok, _restore(piece, restore))
        ids.append(tok.convert_tokens_to_ids(m.group()))
        pos = m.end()
        if added is not None and getattr(added, "rstrip", False):
            rest = text[pos:]
            pos += len(rest) - len(rest.lstrip())
    ids += encode_text(tok, _restore(text[pos:], restore))
    return ids


def _restore(text: str, restore: dict[str, str]) -> str:
    for ph, s in restore.items():
        text = text.replace(ph, s)
    return text
