"""The tokenizer a GGUF file describes, built from its metadata with `tokenizers` alone.

A GGUF carries no `tokenizer.json`: llama.cpp stores the vocabulary, merges, token types, special
token ids and chat template as `tokenizer.*` metadata. transformers can rebuild a tokenizer from
them only where torch is importable; this module needs the `gguf` reader and `tokenizers`, and
gives the same token ids as transformers' own GGUF tokenizer (tests/test_gguf_tokenizer.py checks
that on hundreds of strings where torch is present).

Two tokenizer models cover the Llama and Qwen families:
- `gpt2` (`tokenizer.ggml.model`): byte-level BPE, its text split by the regex its
  `tokenizer.ggml.pre` names (GPT-2's own where the name is not one of `PRE_SPLITS`);
- `llama`: SentencePiece BPE with byte fallback and the `▁` word-boundary mark; merges from the
  file, or derived from the vocabulary's scores where the file has none.

Tokens typed CONTROL become special tokens (matched whole, skipped by `decode(...,
skip_special_tokens=True)`); USER_DEFINED ones become added tokens that are not special.
"""

from __future__ import annotations

from typing import Any

from specjax.errors import ModelLoadError

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

# How `tokenizer.ggml.pre` says a byte-level vocabulary splits its text before merging. Files
# whose name is absent here use GPT-2's split (the ByteLevel pre-tokenizer's own regex).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _fields(reader) -> dict[str, Any]:
    """Every `tokenizer.*` metadata value of a `gguf.GGUFReader`, by key."""
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values (byte-level BPE's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelling[b] = chr(b)
        else:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by a scored vocabulary: every split (left, right) of a
    piece whose halves are both pieces is a merge ranked by the whole piece's score (higher first;
    ties: shorter left half, then shorter right half, then vocabulary order of the halves)."""
    index = {t: i for i, t in enumerate(tokens)}
    found = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in index and piece[i:] in index]
        local.sort(key=lambda lr: (index[lr[0]], index[lr[1]]))
        found.extend((score, lr) for lr in local)
    # a stable sort on (score, len(left), len(right)), all descending, as SentencePiece ranks them
    found.sort(key=lambda s_lr: (s_lr[0], len(s_lr[1][0]), len(s_lr[1][1])), reverse=True)
    return [lr for _, lr in found]


def _byte_level(meta: dict, tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {}
    for i, t in enumerate(tokens):  # a token spelled outside the byte alphabet is re-spelled bytewise
        vocab[t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))] = i
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    split = PRE_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok, alphabet


def _sentencepiece(meta: dict, tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = _merges_from_scores(tokens, list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    return tok, None


def tokenizer_from_gguf(reader, path: str):
    """A `transformers.PreTrainedTokenizerFast` for the GGUF file `path` (opened as `reader`):
    vocabulary, merges, special tokens, BOS/EOS/UNK/PAD and chat template from its metadata.
    Raises ModelLoadError for a tokenizer model other than `gpt2` or `llama`, or missing tokens."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    meta = _fields(reader)
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{path}: GGUF metadata has no tokenizer.ggml.tokens")
    kind = meta.get("tokenizer.ggml.model")
    builders = {"gpt2": _byte_level, "llama": _sentencepiece}
    if kind not in builders:
        raise ModelLoadError(f"{path}: unsupported GGUF tokenizer model {kind!r} (supported: {', '.join(builders)})")
    tok, alphabet = builders[kind](meta, tokens)

    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    # A CONTROL token outside a byte-level alphabet is a converter's mislabel; its id stays a token.
    control = [t for t, ty in zip(tokens, types) if ty == CONTROL and (alphabet is None or set(t) <= alphabet)]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    vocab = tok.get_vocab()
    tok.add_tokens(
        [
            AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types)
            if ty == USER_DEFINED and t in vocab
        ]
    )

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    if add_bos and bos is not None:
        single, pair = f"{bos}:0 $A:0", f"{bos}:0 $A:0 {bos}:1 $B:1"
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=[(bos, vocab[bos])])
    else:
        tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
