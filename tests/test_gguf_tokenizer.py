"""The torch-free GGUF tokenizer (`specjax.models.loading.gguf_tokenizer`) against transformers'
own GGUF tokenizer (which needs torch): the same ids, decoded text and chat-template output on a
few hundred strings from the real datasets and hand-made edge cases; a SentencePiece file and a
Qwen2-split byte-level file written here with the `gguf` writer; the default model loaded in a
process where `import torch` fails; and the conversion cache's damage and permission paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from specjax.models.loading import gguf as gguf_loader
from specjax.models.loading.gguf_tokenizer import tokenizer_from_gguf

EDGE = [
    "",
    " ",
    "  ",
    "\t",
    "\n",
    "\n\n\n",
    "   leading",
    "trailing   ",
    "a  b   c    d",
    "tabs\tand\ttabs",
    "line\r\nbreaks\rmixed\n",
    "x" * 300,
    "1234567890",
    "3.14159e-10",
    "  12  345 ",
    "don't I'll we've",
    "héllo wörld",
    "日本語のテキスト",
    "Привет, мир",
    "مرحبا",
    "emoji 🤖🚀👍🏽 ok",
    "zero\u200bwidth",
    "combining e\u0301",
    "\u00a0nbsp",
    "\ufeffbom",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more",
    "<|im_start",
    "<repo_name>x<file_sep>y",
    "def f(x):\n    return x ** 2\n",
    "    indented\n        twice\n",
    "if (a && b) { c(); }",
    "SELECT * FROM t WHERE a = 'b';",
    "<html><body>hi</body></html>",
    "http://example.com/a?b=c&d=e",
    "a@b.co",
    "$$\\frac{1}{2}$$",
    "~!@#$%^&*()_+`-=[]{}|;':\",./<>?",
]


def _corpus() -> list[str]:
    """~400 strings: the edge cases, HumanEval code, MT-bench and ShareGPT texts (cut to 600 chars)."""
    from specjax import datasets

    texts = list(EDGE)
    texts += [str(t) for t in datasets.humaneval_raw()[:120]]
    texts += [c[0]["content"] for c in datasets.mtbench()]
    texts += [c[0]["content"] for c in datasets.sharegpt(limit=160)]
    return [t[:600] for t in texts]


@pytest.fixture(scope="module")
def tokenizers(default_gguf_path):
    """(ours, transformers') tokenizers of the default GGUF file."""
    from transformers import AutoTokenizer

    ours = tokenizer_from_gguf(gguf_loader.open_reader(default_gguf_path), default_gguf_path)
    ref = AutoTokenizer.from_pretrained(
        os.path.dirname(default_gguf_path), gguf_file=os.path.basename(default_gguf_path)
    )
    return ours, ref


def test_same_ids_and_text_as_transformers_on_the_default_model(tokenizers):
    ours, ref = tokenizers
    corpus = _corpus()
    assert len(corpus) >= 350
    for s in corpus:
        ids = ref(s).input_ids
        assert ours(s).input_ids == ids, s
        assert ours.decode(ids) == ref.decode(ids), s
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), s
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "eos_token_id", "pad_token_id"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert len(ours) == len(ref) and ours.all_special_ids == ref.all_special_ids


def test_same_chat_template_output_as_transformers(tokenizers):
    from specjax import datasets

    ours, ref = tokenizers
    assert ours.chat_template == ref.chat_template
    convs = datasets.mtbench()[:20] + datasets.sharegpt(limit=20)
    convs.append([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi  there\n"}])
    for conv in convs:
        for gen in (True, False):
            a = ours.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            assert a == ref.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            assert ours(a).input_ids == ref(a).input_ids


def _write_gguf(path, model, tokens, types, scores=None, merges=None, pre=None):
    """A tiny Llama GGUF whose metadata describes the given tokenizer (one small tensor)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(model)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _compare_file(path, texts):
    from transformers import AutoTokenizer

    ours = tokenizer_from_gguf(gguf_loader.open_reader(path), path)
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for s in texts:
        ids = ref(s).input_ids
        assert ours(s).input_ids == ids, s
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), s
    return ours


def test_sentencepiece_gguf_without_merges_matches_transformers(tmp_path):
    """llama-type (SentencePiece BPE) vocabulary with byte fallback, merges derived from scores,
    BOS added, a user-defined token kept whole."""
    pieces = [
        "▁",
        "e",
        "t",
        "a",
        "h",
        "l",
        "o",
        "▁t",
        "he",
        "▁the",
        "ll",
        "llo",
        "▁he",
        "▁hello",
        "w",
        "r",
        "d",
        "▁w",
        "or",
        "▁wor",
        "ld",
        "▁world",
        "x",
        "▁x",
        "<tool>",
    ]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 1) + [4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    path = _write_gguf(tmp_path / "spm.gguf", "llama", tokens, types, scores)
    ours = _compare_file(path, EDGE + ["hello world", " the hello", "<tool>hello</s>", "the world  hello"])
    assert ours("hello").input_ids[0] == 1  # BOS, as llama.cpp adds it to SentencePiece vocabularies


def test_byte_level_gguf_with_qwen2_split_matches_transformers(tmp_path, default_gguf_path):
    """gpt2-type vocabulary with `tokenizer.ggml.pre = qwen2` (digits split one by one)."""
    reader = gguf_loader.open_reader(default_gguf_path)
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    merges = list(reader.fields["tokenizer.ggml.merges"].contents())
    path = _write_gguf(tmp_path / "qwen.gguf", "gpt2", tokens, types, merges=merges, pre="qwen2")
    ours = _compare_file(path, EDGE + ["12345 67", "a1b22c333"])
    assert len(ours("12345").input_ids) == 5


def test_unsupported_tokenizer_model_is_one_clear_error(tmp_path):
    from specjax import ModelLoadError

    path = _write_gguf(tmp_path / "rwkv.gguf", "rwkv", ["a", "b", "c"], [1, 1, 1])
    with pytest.raises(ModelLoadError, match="unsupported GGUF tokenizer model 'rwkv'"):
        tokenizer_from_gguf(gguf_loader.open_reader(path), path)


NO_TORCH = r"""
import json, sys
class NoTorch:  # wraps every finder: torch is not found, as on a machine without it
    def __init__(self, inner):
        self.inner = inner
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            return None
        return self.inner.find_spec(name, path, target)
    def __getattr__(self, attr):
        return getattr(self.inner, attr)
sys.meta_path[:] = [NoTorch(f) for f in sys.meta_path]
try:
    import torch
    raise SystemExit("torch is still importable")
except ModuleNotFoundError:
    pass
import specjax
texts = json.load(open(sys.argv[1]))
m = specjax.load_model(quiet=True)
again = specjax.load_model(quiet=True)  # the second load comes from the cache entry
out = {"ids": [m.tokenizer(t).input_ids for t in texts],
       "cached": [again.tokenizer(t).input_ids for t in texts],
       "chat": m.tokenizer.apply_chat_template([{"role": "user", "content": texts[0]}], add_generation_prompt=True,
                                               tokenize=False),
       "torch": "torch" in sys.modules}
json.dump(out, open(sys.argv[2], "w"))
"""


def test_default_model_loads_where_torch_cannot_be_imported(tmp_path, tokenizers):
    """A cold cache and `import torch` failing: the model loads, twice (convert, then cache), with
    the same ids as transformers' torch-built tokenizer."""
    _, ref = tokenizers
    texts = _corpus()[::4]
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    env = {**os.environ, "SPECJAX_CACHE": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(
        [sys.executable, "-c", NO_TORCH, str(tmp_path / "texts.json"), str(tmp_path / "out.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["torch"] is False
    want = [ref(t).input_ids for t in texts]
    assert out["ids"] == want and out["cached"] == want
    chat = ref.apply_chat_template([{"role": "user", "content": texts[0]}], add_generation_prompt=True, tokenize=False)
    assert out["chat"] == chat


def test_damaged_cache_entry_is_rebuilt_with_one_line(default_model, tmp_path, monkeypatch, capsys):
    """A truncated cached params file is reported in one line and converted again, not an error
    on every later run."""
    import glob

    import specjax
    from specjax.models.loading import CACHE_FORMAT

    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    specjax.load_model(quiet=True)
    (entry,) = glob.glob(str(tmp_path / f"gguf-v{CACHE_FORMAT}-*"))
    params = os.path.join(entry, "params.safetensors")
    size = os.path.getsize(params)
    with open(params, "r+b") as fh:
        fh.truncate(size // 3)
    capsys.readouterr()
    m = specjax.load_model(quiet=True)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unreadable" in err and "converting again" in err
    assert os.path.getsize(params) == size
    assert np.array_equal(np.asarray(m.params["embed"][...]), np.asarray(default_model.params["embed"][...]))


def test_unwritable_cache_converts_in_memory_with_one_line(default_model, tmp_path, monkeypatch, capsys):
    """SPECJAX_CACHE that cannot be created (its parent is a file: unwritable even for root): one
    line on stderr, and the model still loads."""
    import specjax

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SPECJAX_CACHE", str(blocker / "cache"))
    capsys.readouterr()
    m = specjax.load_model(quiet=True)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not writable" in err and "in memory" in err
    assert m.tokenizer("hi").input_ids == default_model.tokenizer("hi").input_ids
    assert blocker.read_text() == "not a folder"
