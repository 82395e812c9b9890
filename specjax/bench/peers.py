"""Other implementations measured in the same run, on the same prompt token ids (`--peers`).

* `hf`: HF transformers on PyTorch CPU, `torch.set_num_threads(cores)`, f32, the target loaded
  from the same file as specjax's (a GGUF through `gguf_file=`, or the HF directory): plain
  greedy/sampled `generate`, prompt lookup (`prompt_lookup_num_tokens=K`), and assisted
  generation (`assistant_model=`, constant K) for every `draft[:PATH]` drafter in `--drafters`
  (a distilled draft model, which borrows the target's embedding and head, is first written out
  as a complete HF directory so that transformers can load it).
* `llamacpp`: llama.cpp's Python binding (`llama_cpp`), when importable and the model is a GGUF
  (it then runs the file's own quantised weights): plain and prompt lookup. Otherwise it is
  skipped with one line, not an error: it is an optional comparison (`pip install
  'specjax[peers]'`).

Each peer runs in a process of its own (`peer_process.py`), after specjax's own measurements:
a crash inside torch or llama.cpp then costs only that peer's unfinished rows, reported as such.

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
            m = AutoModelForCausalLM.from_pretrained(
                os.path.dirname(os.path.abspath(source)), gguf_file=os.path.basename(source), dtype=torch.float32
            )
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

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int = 0,
        config: PeerConfig | None = None,
    ) -> list[int]:
        """Generated token ids (the stop token included, as specjax reports them)."""
        import torch

        config = config or PeerConfig("plain", 0, "none")
        inp = torch.tensor([prompt_ids], dtype=torch.long)  # [1, T]
        kw = dict(
            attention_mask=torch.ones_like(inp),
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos_ids or None,
            pad_token_id=self.eos_ids[0] if self.eos_ids else 0,
        )
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
        return out[0, len(prompt_ids) :].tolist()


class LlamaCppPeer:
    """llama.cpp through `llama_cpp.Llama` (GGUF only): plain and prompt-lookup decoding.

    llama-cpp-python (0.3.x) decides at construction whether a context keeps logits for every
    position of a decode (`logits_all`): prompt lookup samples at each drafted position, so it
    needs them, while plain decoding samples only the last one. Setting `draft_model` on a
    context made without them made the sampler read logits that were never computed
    (`GGML_ASSERT(logits != nullptr)`, SIGABRT). So plain decoding runs on a context without
    them (its fastest form) and prompt lookup on a second one made with a draft model, hence
    with them; both map the same file. `n_ctx` must hold the longest prompt plus the new tokens
    plus one step's drafts: a logits-for-all context keeps n_ctx x vocab floats.
    """

    name = "llamacpp"

    def __init__(self, gguf_path: str, eos_ids, threads: int, n_ctx: int = 2048):
        from llama_cpp import Llama

        self.path, self.n_ctx = gguf_path, int(n_ctx)
        self.llm = Llama(
            model_path=gguf_path, n_ctx=self.n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False
        )
        self._lookup = None  # the logits-for-all context, made on first use
        self.eos_ids = {int(e) for e in eos_ids}
        self.threads = threads

    def configs(self, num_drafts: list[int], drafter_specs: list[str]) -> list[PeerConfig]:
        return [PeerConfig("plain", 0, "none")] + [PeerConfig("prompt_lookup", k, "prompt_lookup") for k in num_drafts]

    def _lookup_llm(self, k: int):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        if self._lookup is None:
            self._lookup = Llama(
                model_path=self.path,
                n_ctx=self.n_ctx,
                n_threads=self.threads,
                n_threads_batch=self.threads,
                logits_all=True,
                draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k),
                verbose=False,
            )
        self._lookup.draft_model = LlamaPromptLookupDecoding(num_pred_tokens=k)
        return self._lookup

    def generate(self, prompt_ids, max_new_tokens, temperature=0.0, seed=0, config=None) -> list[int]:
        """Generated token ids (the stop token included, as specjax reports them)."""
        config = config or PeerConfig("plain", 0, "none")
        llm = self._lookup_llm(config.num_draft) if config.method == "prompt_lookup" else self.llm
        llm.set_seed(seed)
        out = []
        # top_k=0, top_p=1, min_p=0: no truncation, as specjax's defaults; temp 0 is greedy
        for tok in llm.generate(
            list(prompt_ids), temp=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True
        ):
            out.append(int(tok))
            if tok in self.eos_ids or len(out) >= max_new_tokens:
                break
        return out


def context_size(suite_ids: dict[str, list[list[int]]], max_new_tokens: int, num_drafts: list[int]) -> int:
    """A llama.cpp context that holds every prompt, its new tokens and one step of drafts."""
    longest = max((len(x) for ids in suite_ids.values() for x in ids), default=0)
    need = longest + max_new_tokens + max(num_drafts or [0]) + 16
    return -(-need // 256) * 256


def plan_peers(names: list[str], model) -> tuple[list[str], dict[str, str]]:
    """The peers that can run, and {name: reason} for optional ones that cannot (llamacpp
    without the package or without a GGUF model): one line each, not an error."""
    run, skipped = [], {}
    for name in names:
        if name == "llamacpp" and importlib.util.find_spec("llama_cpp") is None:
            skipped[name] = "the llama_cpp package is not installed (pip install 'specjax[peers]')"
        elif name == "llamacpp" and not (os.path.isfile(model.source) and _is_gguf(model.source)):
            skipped[name] = f"llama.cpp reads GGUF files; the model is {model.source}"
        else:
            run.append(name)
    return run, skipped


def load_peer(name: str, job: dict):
    """(peer, configs) for a peer name, from a `peer_process` job (see there): the default
    factory of the peer subprocess."""
    threads = job.get("threads") or os.cpu_count() or 1
    if name == "hf":
        target = None
        if any(s.partition(":")[0] == "draft" for s in job["drafters"]):
            import specjax  # a distilled draft model borrows the target's tables

            target = specjax.load_model(job["model_source"], dtype="float32", quiet=True)
        peer = HFPeer.load(job["model_source"], job["eos_ids"], threads)
        return peer, peer.configs(job["num_drafts"], job["drafters"], target)
    if name == "llamacpp":
        peer = LlamaCppPeer(
            job["model_source"],
            job["eos_ids"],
            threads,
            context_size(job["suite_ids"], job["max_new_tokens"], job["num_drafts"]),
        )
        return peer, peer.configs(job["num_drafts"], job["drafters"])
    raise SpecjaxError(f"unknown peer {name!r} (known: {', '.join(KNOWN_PEERS)})")


def peer_prompt_runs(n_configs: int, suite_ids: dict[str, list], n_temperatures: int, repeats: int) -> int:
    """Prompt runs of one peer's `run_peer` (one warm-up per configuration included)."""
    return n_configs * n_temperatures * sum(1 + repeats * len(ids) for ids in suite_ids.values())


def _peer_row(peer, c, label: str, suite: str, temp: float, prompts: int, figures, warm: float) -> dict:
    """One peer configuration's result row from its repeats' (tokens, seconds) `figures`."""
    return {
        "peer": peer.name,
        "method": c.method,
        "drafter": c.drafter,
        "label": label,
        "num_draft": c.num_draft,
        "suite": suite,
        "temperature": temp,
        "batch_size": 1,
        "prompts": prompts,
        "tokens": statistics.median(t for t, _ in figures),
        "tokens_per_second": statistics.median(t / s for t, s in figures),
        "tokens_per_second_repeats": [t / s for t, s in figures],
        "warmup_seconds": warm,
        "threads": peer.threads,
    }


def run_peer(
    peer,
    configs: list[PeerConfig],
    suite_ids: dict[str, list[list[int]]],
    temperatures: list[float],
    max_new_tokens: int,
    repeats: int,
    console,
    progress=None,
    on_rows=None,
) -> list[dict]:
    """Rows of one peer (speedups are added by `report.add_speedups`). `progress` (a
    `progress.BenchProgress`) follows every configuration and prompt; `on_rows(rows)` gets each
    (suite, temperature) group's rows as soon as they are measured."""
    torch = None
    if peer.name == "hf":  # torch's thread count is process-wide: set for the peer, then restored
        import torch

        old_threads = torch.get_num_threads()
        torch.set_num_threads(peer.threads)

    def label(c):
        return "plain" if c.method == "plain" else short_label(c.drafter)

    def stage(what, c, n, group):
        if progress is not None:
            progress.stage(f"{group[0]} T={group[1]:g} {label(c)} K={c.num_draft} ({what})", n, group)

    try:
        rows = []
        if progress is not None:
            progress.begin(peer.name, peer_prompt_runs(len(configs), suite_ids, len(temperatures), repeats))
        for suite, ids in suite_ids.items():
            for temp in temperatures:
                group_key = (suite, temp)
                warm = {}
                for c in configs:
                    stage("warm-up", c, 1, group_key)
                    t0 = time.perf_counter()
                    peer.generate(ids[0], max_new_tokens, temp, 0, c)
                    warm[id(c)] = time.perf_counter() - t0
                    if progress is not None:
                        progress.advance()
                figures = {id(c): [] for c in configs}  # [(tokens, seconds)] per repeat
                for rep_i in range(repeats):
                    for c in configs:
                        stage(f"repeat {rep_i + 1}/{repeats}", c, len(ids), group_key)
                        tokens, secs = 0, 0.0
                        for i, x in enumerate(ids):
                            t0 = time.perf_counter()
                            tokens += len(peer.generate(x, max_new_tokens, temp, i, c))
                            secs += time.perf_counter() - t0
                            if progress is not None:
                                progress.advance()
                        figures[id(c)].append((tokens, secs))
                group = [
                    _peer_row(peer, c, label(c), suite, temp, len(ids), figures[id(c)], warm[id(c)]) for c in configs
                ]
                for row in group:
                    console.log(
                        f"{peer.name} {suite} T={temp:g} {row['label']} K={row['num_draft']}: "
                        f"{row['tokens_per_second']:.1f} tok/s"
                    )
                rows += group
                if on_rows is not None:
                    on_rows(group)
        return rows
    finally:
        if torch is not None:
            torch.set_num_threads(old_threads)
