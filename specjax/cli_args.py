"""The `specjax` command line's arguments: one parser per subcommand, the flag groups they share,
and the checks that turn flags into settings before anything loads (`specjax/cli.py` runs them).

`build_parser(commands)` takes each subcommand's handler (`cli.COMMANDS`), so that this module
needs nothing from cli.py.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

from specjax.errors import InvalidSamplingError, SpecjaxError


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage too by default)
        # main() prints "specjax: error: "; a subcommand's parser names its subcommand
        sub = self.prog.removeprefix("specjax").strip()
        raise SpecjaxError(f"{sub}: {message}" if sub else message)


def add_tree_args(p, serving: bool = False) -> None:
    """`--tree-topk`, `--tree-depth`; `serving`: defaults from the serving config, and
    `--ks` counts a tree's nodes."""
    p.add_argument(
        "--tree-topk",
        type=int,
        default=None if serving else 1,
        help="k > 1: draft a token tree of "
        "--num-draft nodes (--ks under serve) (EAGLE-2 dynamic tree: the k best children of the best "
        "nodes per level; eagle3, draft, mtp; ngram: its k best matches' continuations), verified in "
        "one pass; 1 (default): a chain",
    )
    p.add_argument(
        "--tree-depth",
        type=int,
        default=None if serving else 0,
        help="levels of the tree, the most drafts one step accepts (default: min(--num-draft, 5))",
    )


def check_draft_args(a) -> None:
    """`--num-draft`, `--tree-topk`, `--tree-depth` in range (one line each), before the model loads."""
    from specjax.policy.batch import parse_num_draft

    parse_num_draft(a.num_draft)  # K >= 0, auto or auto:N1,N2,...
    if a.tree_topk < 1 or a.tree_depth < 0:
        raise InvalidSamplingError(f"--tree-topk must be >= 1 and --tree-depth >= 0, got {a.tree_topk}, {a.tree_depth}")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file, HF checkpoint dir, or hub id in the local HF cache "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="parameter dtype (default: float32 on CPU, bfloat16 on GPU/TPU)",
    )


def drafter_specs(sep: str) -> str:
    """The drafter specs `--drafter` takes, from the drafter registry."""
    from specjax.drafters import KNOWN

    return sep.join(KNOWN)


def add_sampling_args(p: argparse.ArgumentParser, job_seed: bool = False) -> None:
    """`job_seed`: --seed is a batch job's seed (default 0, so a rerun reproduces the job) rather
    than every prompt's (default: a fresh one per prompt)."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (1 = off)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt (default: 128)")
    if job_seed:
        p.add_argument(
            "--seed",
            type=int,
            default=0,
            help="job seed in [0, 2**32): a row without its own seed "
            "draws from a seed derived from it and the row's input line (default: 0)",
        )
    else:
        p.add_argument(
            "--seed",
            type=int,
            default=None,
            help="seed of sampled decoding, in [0, 2**32); every "
            "prompt draws from its own stream of it (default: a fresh random seed per prompt)",
        )


def sampling_from_args(a):
    from specjax.sampling import SamplingParams

    try:
        return SamplingParams(
            temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, max_new_tokens=a.max_new_tokens, seed=a.seed
        )
    except InvalidSamplingError as e:  # "top_p must be ..." -> "--top-p must be ...": name the flag
        field, rest = str(e).split(" ", 1)
        raise InvalidSamplingError(f"--{field.replace('_', '-')} {rest}") from None


def add_serving_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", default="ngram", help=f"{drafter_specs(' | ')} (mtp: serves at the largest K and 0)")
    p.add_argument("--config", default=None, help="serving config YAML, e.g. configs/serving-policy.yaml")
    p.add_argument(
        "--policy",
        default=None,
        choices=["rules", "always", "never", "schedule"],
        help="how K is chosen (default: the config's, rules)",
    )
    p.add_argument("--buckets", default=None, help="running-batch buckets, e.g. 1,2,4,8")
    p.add_argument("--ks", default=None, help="K values the policy may use, e.g. 0,1,2,3 (all compiled ahead)")
    p.add_argument("--chunk-steps", type=int, default=None, help="steps per compiled chunk")
    p.add_argument("--max-seq-len", type=int, default=None, help="prompt + max_tokens per request")
    p.add_argument("--default-class", default=None, choices=["interactive", "batch"])
    p.add_argument(
        "--api-key-class",
        action="append",
        metavar="KEY=CLASS",
        help="latency class of requests with this API key (repeatable)",
    )
    p.add_argument("--step-costs", default=None, help="JSON of seconds per step by bucket and K (skips timing)")
    add_compile_cache_arg(p)
    add_tree_args(p, serving=True)


def add_compile_cache_arg(p) -> None:
    p.add_argument(
        "--compile-cache", default=None, help="XLA compilation cache dir (default: $SPECJAX_CACHE/xla; 'none' disables)"
    )


def ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise SpecjaxError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 0:
        raise SpecjaxError(f"{flag} takes comma-separated integers >= 0, got {text!r}")
    return vals


def add_generate_parser(sub, fn) -> None:
    """`specjax generate PROMPT...`."""
    g = sub.add_parser("generate", help="generate replies to prompts")
    add_model_args(g)
    add_sampling_args(g)
    g.add_argument("--drafter", default="none", help=drafter_specs(" | "))
    g.add_argument(
        "--num-draft",
        default="0",
        help="K, draft tokens per step (tree nodes with --tree-topk), at "
        "most 64 (default 0: the drafter's own, ngram 15, draft and eagle3 5, mtp its module count); auto "
        "or auto:N1,N2,...: the fastest of these K measured on the prompts (default candidates 1,3,5, "
        "trees 4,8,16,32)",
    )
    g.add_argument(
        "--spec-policy",
        choices=("auto", "always"),
        default="auto",
        help="auto (default): each "
        "prompt verifies drafts only while its measured acceptance pays for a verify step on this "
        "machine, else takes plain steps and probes again later; always: verify every proposal",
    )
    add_tree_args(g)
    g.add_argument("--json", action="store_true", help="one JSON object per prompt, one per line")
    g.add_argument(
        "--compare-plain",
        action="store_true",
        help="also decode the prompts without the drafter and print the speedup measured in this run",
    )
    g.add_argument(
        "--raw",
        action="store_true",
        help="do not apply the chat template: the prompt is fed as "
        "the tokenizer reads it, control-token strings (<|im_end|>) included; without --raw a "
        "prompt is text, its control-token strings encoded as plain characters",
    )
    g.add_argument("prompts", nargs="*", metavar="PROMPT")
    g.set_defaults(fn=fn)


def add_bench_parser(sub, fn) -> None:
    """`specjax bench [SUITE]`."""
    b = sub.add_parser("bench", help="benchmarks: `plain` (the target alone), prompt suites, or --preset")
    b.add_argument(
        "suites",
        nargs="?",
        default=None,
        help="plain | comma-separated suites: humaneval, humaneval-raw (code completion, no chat "
        "template), mtbench, sharegpt (default: humaneval)",
    )
    add_model_args(b)
    b.add_argument("--prompts", dest="prompts_file", default=None, help="a JSONL file of prompts (prompt or messages)")
    b.add_argument("--limit", type=int, default=None, help="use the first N prompts of each suite")
    b.add_argument(
        "--drafters",
        default="ngram",
        help=f"comma-separated drafter specs: {drafter_specs(', ')} (plain decoding is always run)",
    )
    b.add_argument("--num-draft", default="3,5", help="comma-separated K values")
    b.add_argument(
        "--spec-policy",
        default="always",
        help="comma-separated subset of always, auto: each drafter "
        "configuration is measured under each; always (default): verify every proposal; auto: the "
        "per-row fallback of `specjax generate` (rows take plain steps while verifying does not pay)",
    )
    b.add_argument(
        "--trees",
        default="chain",
        help="comma-separated proposal shapes: chain, or KxD, a dynamic "
        "token tree of --num-draft nodes, K children per expanded node over D levels (e.g. chain,4x5; "
        "trees are skipped for drafters that draft chains only)",
    )
    b.add_argument("--batch-sizes", default="1", help="comma-separated batch sizes")
    b.add_argument("--temperature", default="0", help="comma-separated temperatures")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--repeats", type=int, default=3)
    add_bench_output_args(b)
    b.set_defaults(fn=fn)


def add_bench_output_args(b) -> None:
    """`specjax bench`: peers, the `plain` suite's table, where figures go, and --preset."""
    b.add_argument(
        "--peers",
        default="",
        help="comma-separated: hf (transformers, needs torch), llamacpp (skipped "
        "if llama_cpp is not installed: pip install 'specjax[peers]'); each runs in its own process",
    )
    b.add_argument(
        "--peer-threads",
        type=int,
        default=None,
        help="CPU threads of each peer (default: all cores; "
        "on a busy machine fewer threads than cores can be much faster)",
    )
    b.add_argument("--prompt-len", type=int, default=128, help="plain: prompt length in tokens")
    b.add_argument("--forward-t", default="1,2,4,8,16", help="plain: token counts T for the forward-cost table")
    b.add_argument("--json-out", default=None, help="write every figure to this JSON file (and plots next to it)")
    b.add_argument("--plots-dir", default=None, help="write the PNG plots here (default: next to --json-out)")
    b.add_argument(
        "--preset",
        default=None,
        choices=["h200", "cpu-smoke"],
        help="accelerator measurements (specjax/bench/accel.py): h200 fits one 10-minute GPU run, "
        "cpu-smoke is a seconds-long reduced form",
    )
    b.add_argument(
        "--mal-from",
        default=None,
        help="--preset: take MALs for the projected speedups from this "
        "`specjax bench --json-out` file (default: assumed MALs, labelled as such)",
    )
    b.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="--preset: seconds before remaining parts are skipped (default: the preset's)",
    )


def add_batch_parser(sub, fn) -> None:
    """`specjax batch`."""
    j = sub.add_parser("batch", help="a resumable batch job: JSONL of prompts in, JSONL of results out")
    j.add_argument(
        "--input",
        default=None,
        help='JSONL rows {"id", "prompt" | "messages"} with optional temperature, top_k, top_p, max_new_tokens, seed',
    )
    j.add_argument(
        "--suite",
        default=None,
        help="instead of --input: a packaged suite (humaneval, humaneval-raw, mtbench, sharegpt)",
    )
    j.add_argument("--limit", type=int, default=None, help="only the first N rows of the input or suite")
    j.add_argument("--output", required=True, help="results JSONL (appended; rerun the same command to resume)")
    add_model_args(j)
    add_sampling_args(j, job_seed=True)
    j.add_argument("--drafter", default="none", help=drafter_specs(" | "))
    j.add_argument(
        "--num-draft",
        default="0",
        help="K, draft tokens per step (tree nodes with --tree-topk); "
        "auto or auto:N1,N2,...: per batch size, the fastest of these K measured on its first batch "
        "(--spec-policy auto; default candidates 1,3,5, trees 4,8,16,32)",
    )
    add_tree_args(j)
    j.add_argument(
        "--spec-policy",
        default="auto",
        help="auto: each row verifies only while its acceptance pays "
        "for a verify step at the step costs measured on each batch shape's first batch (kept in "
        "OUTPUT.policy.json for resumes); always: verify every step; N: speculate only in batches of "
        "at most N rows",
    )
    j.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="rows per batch (default: 16 for the batch latency class, 1 for interactive)",
    )
    j.add_argument("--latency-class", default="batch", choices=["batch", "interactive"])
    j.add_argument("--raw", action="store_true", help='do not apply the chat template to "prompt" strings')
    add_batch_run_args(j)
    j.set_defaults(fn=fn)


def add_batch_run_args(j) -> None:
    """`specjax batch`: devices, processes and their merge, the progress bar, the compile cache."""
    j.add_argument(
        "--mesh",
        default=None,
        help="local device mesh, e.g. data=4 or data=2,model=2 (default: every local device on data)",
    )
    j.add_argument(
        "--coordinator",
        default=None,
        help="HOST:PORT of process 0 for jax.distributed.initialize, "
        "or auto (TPU pods, SLURM, MPI); default: $JAX_COORDINATOR_ADDRESS if set",
    )
    j.add_argument(
        "--num-processes",
        type=int,
        default=None,
        help="processes sharing the input (row i goes to "
        "process i %% N); without --coordinator, runs process --process-id alone (restarts)",
    )
    j.add_argument("--process-id", type=int, default=None)
    j.add_argument("--merge", action="store_true", help="only merge the complete parts of --output")
    j.add_argument(
        "--merge-wait",
        type=float,
        default=600.0,
        help="process 0 stops waiting for the other parts when none has grown for this many seconds",
    )
    j.add_argument(
        "--stay-connected",
        action="store_true",
        help="keep jax.distributed (and its health "
        "checks, which stop every process when one dies) after the rendezvous",
    )
    j.add_argument("--no-progress", action="store_true", help="no progress bar (the summary is still printed)")
    add_compile_cache_arg(j)


def add_serve_parser(sub, fn) -> None:
    """`specjax serve`."""
    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching and throttled speculation")
    add_model_args(v)
    add_serving_args(v)
    v.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's name)")
    v.add_argument("--save-step-costs", default=None, help="write the warm-up's step costs to this JSON file")
    v.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    v.set_defaults(fn=fn)


def add_serve_bench_parser(sub, fn) -> None:
    """`specjax serve-bench`."""
    sb = sub.add_parser("serve-bench", help="offered-load sweep: speculation always on / always off / serving rules")
    add_model_args(sb)
    add_serving_args(sb)
    sb.add_argument("--loads", default="1,2,4,8", help="concurrent clients per load point")
    sb.add_argument("--modes", default="always,never,rules", help="subset of always,never,rules")
    sb.add_argument("--requests", type=int, default=16, help="requests per load point and mode")
    sb.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each mode per load point, interleaved "
        "(tok/s is their median; their spread is reported as the noise)",
    )
    sb.add_argument("--max-tokens", type=int, default=64)
    sb.add_argument(
        "--suites",
        default="humaneval,mtbench",
        help="prompt suites (batch class takes the first, interactive the second)",
    )
    sb.add_argument("--interactive-share", type=float, default=0.5, help="fraction of clients that are interactive")
    sb.add_argument("--seed", type=int, default=0)
    sb.add_argument("--json-out", default=None)
    sb.set_defaults(fn=fn)


def add_train_parser(sub, fn) -> None:
    """`specjax train`."""
    t = sub.add_parser("train", help="train a drafter for the target (train/: data, features, Optax, Orbax)")
    t.add_argument(
        "args",
        nargs="*",
        metavar="[DRAFTER] [KEY=VALUE ...]",
        help="eagle3 | mtp | draft (overrides the recipe's `drafter`), then recipe overrides, e.g. optim.steps=200",
    )
    t.add_argument("--config", default=None, help="a recipe YAML, e.g. configs/eagle3-smollm2.yaml")
    t.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop after this many training steps (resume later by rerunning the same command)",
    )
    t.add_argument(
        "--replies-only",
        action="store_true",
        help="only add the recipe's missing target replies to "
        "data.replies_dir (no features, no training): grows the corpus in parts",
    )
    t.add_argument(
        "--calibrate",
        default=None,
        metavar="DIR",
        help="dspark: fit the confidence head's per-slot temperatures of the trained drafter in DIR on "
        "the recipe's held-out replies and write them into DIR/config.json (no training)",
    )
    t.set_defaults(fn=fn)


def add_lower_parser(sub, fn) -> None:
    """`specjax lower`."""
    w = sub.add_parser(
        "lower",
        help="export prefill and the decode loop for TPU/GPU from this host (abstract "
        "weights at a published model's shapes): OK or the first error, custom calls, host callbacks",
    )
    w.add_argument("--platforms", default="tpu,cuda", help="comma-separated: tpu, cuda, rocm, cpu (default: tpu,cuda)")
    w.add_argument("--shape", default="llama-8b", help="llama-8b (default), llama-1b or smollm2-135m")
    w.add_argument("--drafter", default="none,ngram,draft,mtp,eagle3", help="comma-separated drafters (default: all)")
    w.add_argument("--num-draft", type=int, default=7)
    w.add_argument("--batch-size", type=int, default=8)
    w.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    w.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="> 0 lowers the sampled accept too (the rejection kernel); 0: greedy only",
    )
    w.add_argument("--json", default=None, help="also write the report here")
    w.set_defaults(fn=fn)


def add_export_parser(sub, fn) -> None:
    """`specjax export DRAFTER`."""
    x = sub.add_parser(
        "export",
        help="write a drafter in a format vLLM / SGLang load: eagle3 -> eagle "
        "(EAGLE/SpecForge) | speculators (vLLM); draft -> hf; dflash -> zlab; dspark -> speculators | specforge",
    )
    x.add_argument(
        "drafter",
        help="as --drafter takes it: eagle3 (the shipped one), eagle3:DIR, draft, draft:DIR, dflash, dspark, ...:DIR",
    )
    x.add_argument("--format", required=True, choices=["eagle", "speculators", "hf", "zlab", "specforge"])
    x.add_argument("--out", required=True, help="a new or empty directory")
    x.add_argument("--model", default=None, help="the drafter's target (default: the embedded SmolLM2-135M-Instruct)")
    x.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    x.add_argument(
        "--verifier",
        default=None,
        help="speculators: the target's hub id or path written into the "
        "checkpoint (default: --model when it is an HF directory; the default model's hub id)",
    )
    x.set_defaults(fn=fn)


def build_parser(commands: Mapping[str, Callable[[argparse.Namespace], int]]) -> ArgumentParser:
    """The `specjax` parser; `commands`: subcommand name -> its handler (set as the parsed `fn`)."""
    p = ArgumentParser(prog="specjax", description="Lossless speculative decoding in JAX.")
    sub = p.add_subparsers(dest="command", parser_class=ArgumentParser)
    add_generate_parser(sub, commands["generate"])
    add_bench_parser(sub, commands["bench"])
    add_batch_parser(sub, commands["batch"])
    add_serve_parser(sub, commands["serve"])
    add_serve_bench_parser(sub, commands["serve-bench"])
    add_train_parser(sub, commands["train"])
    add_lower_parser(sub, commands["lower"])
    add_export_parser(sub, commands["export"])
    p.command_names = list(sub.choices)
    return p
