"""Other implementations measured in the same run, on the same prompt token ids (`--peers`).

* `hf`: HF transformers on PyTorch CPU, `torch.set_num_threads(cores)`, f32, the target loaded
  from the same file as specjax's (a GGUF through `gguf_file=`, or the HF directory): plain
  greedy/sampled `generate`, prompt lookup (`prompt_lookup_num_tokens=K`), and assisted
  generation (`assistant_model=`, constant K) for every `draft[:PATH]` drafter in `--drafters`
  (a distilled draft model, which borrows the target's embedding and head, is first written out
  as a complete HF directory so that transformers can load it).
* `llamacpp`: llama.cpp's Python binding (`llama_cpp`), when importable and the model is a GGUF
  (it then runs the file's own quantised weights): plain and prompt lookup. Otherwise it is
  skipped with one line, not an error: it is an optional comparison.

Prompts are fed as token ids (the chat template applied once, by specjax), so every
implementation sees identical inputs and stops on the same EOS ids. HF's prompt lookup and
assisted generation take one sequence, so peers run at batch size 1. Timing: one untimed warm-up
call per configuration, then `repeats` passes over all prompts, configurations interleaved;
tokens/s = generated tokens / wall seconds of the generate calls (prefill included, as for
specjax); medians over repeats. torch is a test/bench dependency (extra `test`), never imported
by specjax itself.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import statistics
import time

from specjax.bench.report import short_label
from specjax.errors import SpecjaxError

KNOWN_PEERS = ("hf", "llamacpp")


def check_peers(names: list[str]) -> None:
    """Unknown peer names and a missing torch/transformers for `hf` are bad input (exit 2);
    a missing llama_cpp is not (the peer is skipped when the run starts)."""
    for n in names:
        if n not in KNOWN_PEERS:
            raise SpecjaxError(f"unknown peer {n!r} (known: {', '.join(KNOWN_PEERS)})")
    if "hf" in names:
        for pkg in ("torch", "transformers"):
            if importlib.util.find_spec(pkg) is None:
                raise SpecjaxError(f"--peers hf needs {pkg}: pip install 'specjax[test]'")


def _is_gguf(path: str) -> bool:
    if path.endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


@dataclasses.dataclass
class PeerConfig:
    method: str  # "plain" | "prompt_lookup" | "assisted"
    num_draft: int
    drafter: str  # "none" for plain, else the method (assisted: "assisted:PATH")
    extra: object = None  # assisted: the HF assistant model


def load_hf_causal_lm(source: str):
    """HF transformers' own reading of a GGUF file or HF directory, f32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        if os.path.isfile(source) and _is_gguf(source):
            m = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(source)),
                                                     gguf_file=os.path.basename(source), dtype=torch.float32)
        else:
            m = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    except Exception as e:
        raise SpecjaxError(f"hf peer: transformers cannot load {source} ({type(e).__name__}: {e})") from None
    return m.eval()


def load_assistant(path: str, target):
    """The HF model transformers' assisted generation drafts with for the `draft[:PATH]` drafter:
    PATH itself, or for a distilled draft model (the shipped one when PATH is empty) an export
    with the target's embedding and head merged in, written to a temporary directory that is
    removed once loaded."""
    import tempfile

    from specjax.drafters import shipped_path
    from specjax.drafters.draft_model import borrows_target_tables, load_with_target_tables
    from specjax.models.loading.export import save_hf

    path = path or shipped_path("draft")
    if not borrows_target_tables(path):
        return load_hf_causal_lm(path)
    with tempfile.TemporaryDirectory(prefix="specjax-assistant-") as out:
        return load_hf_causal_lm(save_hf(load_with_target_tables(path, target, "float32"), out))


class HFPeer:
    """A HF transformers causal LM behind the peer interface (`configs`, `generate`)."""

    name = "hf"

    def __init__(self, model, eos_ids, threads: int | None = None):
        self.model = model
        self.eos_ids = [int(e) for e in eos_ids]
        self.threads = threads

    @classmethod
    def load(cls, source: str, eos_ids, threads: int | None = None) -> HFPeer:
        return cls(load_hf_causal_lm(source), eos_ids, threads)

    def configs(self, num_drafts: list[int], drafter_specs: list[str], target=None) -> list[PeerConfig]:
        out = [PeerConfig("plain", 0, "none")]
        out += [PeerConfig("prompt_lookup", k, "prompt_lookup") for k in num_drafts]
        for spec in drafter_specs:
            kind, _, path = spec.partition(":")
            if kind == "draft":
                assistant = load_assistant(path, target)
                out += [PeerConfig("assisted", k, f"assisted:{path or 'draft'}", assistant) for k in num_drafts]
        return out

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                 config: PeerConfig | None = None) -> list[int]:
        """Generated token ids (the stop token included, as specjax reports them)."""
        import torch

        config = config or PeerConfig("plain", 0, "none")
        inp = torch.tensor([prompt_ids], dtype=torch.long)  # [1, T]
        kw = dict(attention_mask=torch.ones_like(inp), max_new_tokens=max_new_tokens,
                  eos_token_id=self.eos_ids or None, pad_token_id=self.eos_ids[0] if self.eos_ids else 0)
        if temperature > 0:  # the same law as specjax's: no implicit top-k/top-p
            kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            torch.manual_seed(seed)
        else:
            kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        if config.method == "prompt_lookup":
            kw["prompt_lookup_num_tokens"] = config.num_draft
        elif config.method == "assisted":
            gc = config.extra.generation_config  # a constant K, no early exit: what specjax does
            gc.num_assistant_tokens = config.num_draft
            gc.num_assistant_tokens_schedule = "constant"
            gc.assistant_confidence_threshold = 0.0
            kw["assistant_model"] = config.extra
        with torch.inference_mode():
            out = self.model.generate(inp, **kw)  # [1, T + new]
        return out[0, len(prompt_ids):].tolist()


class LlamaCppPeer:
    """llama.cpp through `llama_cpp.Llama` (GGUF only): plain and prompt-lookup decoding."""

    name = "llamacpp"

    def __init__(self, gguf_path: str, eos_ids, threads: int, n_ctx: int = 4096):
        from llama_cpp import Llama

        self.llm = Llama(model_path=gguf_path, n_ctx=n_ctx, n_threads=threads, verbose=False)
        self.eos_ids = {int(e) for e in eos_ids}
        self.threads = threads

    def configs(self, num_drafts: list[int], drafter_specs: list[str]) -> list[PeerConfig]:
        return [PeerConfig("plain", 0, "none")] + [PeerConfig("prompt_lookup", k, "prompt_lookup") for k in num_drafts]

    def generate(self, prompt_ids, max_new_tokens, temperature=0.0, seed=0, config=None) -> list[int]:
        config = config or PeerConfig("plain", 0, "none")
        if config.method == "prompt_lookup":
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            self.llm.draft_model = LlamaPromptLookupDecoding(num_pred_tokens=config.num_draft)
        else:
            self.llm.draft_model = None
        self.llm.set_seed(seed)
        out = []
        # top_k=0, top_p=1, min_p=0: no truncation, as specjax's defaults; temp 0 is greedy
        for tok in self.llm.generate(prompt_ids, temp=temperature, top_k=0, top_p=1.0, min_p=0.0,
                                     repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if tok in self.eos_ids or len(out) >= max_new_tokens:
                break
        return out


def prepare_peers(names: list[str], model, drafter_specs: list[str], num_drafts: list[int], console,
                  threads: int | None = None) -> tuple[list, dict[str, str]]:
    """Load the requested peers and their assistant models before anything is timed, so a peer
    that cannot load fails the run at once. Returns ([(peer, configs)], {name: skip reason})."""
    threads = threads or os.cpu_count() or 1
    peers, skipped = [], {}
    eos = model.config.eos_token_ids
    for name in names:
        if name == "hf":
            peer = HFPeer.load(model.source, eos, threads)
            peers.append((peer, peer.configs(num_drafts, drafter_specs, model)))
        elif name == "llamacpp":
            if importlib.util.find_spec("llama_cpp") is None:
                skipped[name] = "the llama_cpp package is not installed (pip install llama-cpp-python)"
            elif not (os.path.isfile(model.source) and _is_gguf(model.source)):
                skipped[name] = f"llama.cpp reads GGUF files; the model is {model.source}"
            else:
                try:
                    peer = LlamaCppPeer(model.source, eos, threads)
                    peers.append((peer, peer.configs(num_drafts, drafter_specs)))
                except Exception as e:
                    skipped[name] = f"llama_cpp failed to load {model.source}: {type(e).__name__}: {e}"
        if name in skipped:
            console.log(f"peer {name}: skipped ({skipped[name]})")
    return peers, skipped


def run_peer(peer, configs: list[PeerConfig], suite_ids: dict[str, list[list[int]]], temperatures: list[float],
             max_new_tokens: int, repeats: int, console) -> list[dict]:
    """Rows of one peer (speedups are added by `report.add_speedups`)."""
    torch = None
    if peer.name == "hf":  # torch's thread count is process-wide: set for the peer, then restored
        import torch

        old_threads = torch.get_num_threads()
        torch.set_num_threads(peer.threads)
    try:
        rows = []
        for suite, ids in suite_ids.items():
            for temp in temperatures:
                warm = {}
                for c in configs:
                    t0 = time.perf_counter()
                    peer.generate(ids[0], max_new_tokens, temp, 0, c)
                    warm[id(c)] = time.perf_counter() - t0
                figures = {id(c): [] for c in configs}  # [(tokens, seconds)] per repeat
                for _ in range(repeats):
                    for c in configs:
                        tokens, secs = 0, 0.0
                        for i, x in enumerate(ids):
                            t0 = time.perf_counter()
                            tokens += len(peer.generate(x, max_new_tokens, temp, i, c))
                            secs += time.perf_counter() - t0
                        figures[id(c)].append((tokens, secs))
                for c in configs:
                    f = figures[id(c)]
                    label = "plain" if c.method == "plain" else short_label(c.drafter)
                    row = {
                        "peer": peer.name, "method": c.method, "drafter": c.drafter, "label": label,
                        "num_draft": c.num_draft, "suite": suite, "temperature": temp, "batch_size": 1,
                        "prompts": len(ids), "tokens": statistics.median(t for t, _ in f),
                        "tokens_per_second": statistics.median(t / s for t, s in f),
                        "tokens_per_second_repeats": [t / s for t, s in f],
                        "warmup_seconds": warm[id(c)], "threads": peer.threads,
                    }
                    rows.append(row)
                    console.log(f"{peer.name} {suite} T={temp:g} {label} K={c.num_draft}: "
                                f"{row['tokens_per_second']:.1f} tok/s")
        return rows
    finally:
        if torch is not None:
            torch.set_num_threads(old_threads)


def run_peers(peers: list, suite_ids, temperatures, max_new_tokens, repeats, console,
              skipped: dict[str, str] | None = None) -> list[dict]:
    """peers: `prepare_peers`'s list. Returns every peer's rows, speedups included. An optional
    peer (llamacpp) that fails mid-run is recorded in `skipped`, its rows dropped."""
    from specjax.bench.report import add_speedups

    rows = []
    for peer, configs in peers:
        try:
            rows += run_peer(peer, configs, suite_ids, temperatures, max_new_tokens, repeats, console)
        except Exception as e:
            if peer.name == "hf" or skipped is None:
                raise
            skipped[peer.name] = f"failed while running: {type(e).__name__}: {e}"
            console.log(f"peer {peer.name}: skipped ({skipped[peer.name]})")
    return add_speedups(rows)
