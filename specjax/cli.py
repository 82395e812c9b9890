"""The `specjax` command line: generate, bench.

Errors caused by the user print one line on stderr and exit with code 2; internal failures print
one line and exit with code 1 (set SPECJAX_DEBUG=1 for the traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from specjax.errors import InvalidSamplingError, SpecjaxError

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 1


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage too by default)
        raise SpecjaxError(f"{self.prog}: {message}")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file, HF checkpoint dir, or hub id in the local HF cache "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="parameter dtype (default: float32 on CPU, bfloat16 on GPU/TPU)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (1 = off)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)


def sampling_from_args(a):
    from specjax.sampling import SamplingParams

    return SamplingParams(
        temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, max_new_tokens=a.max_new_tokens, seed=a.seed
    )


def cmd_generate(a) -> int:
    import specjax

    if not a.prompts:
        raise SpecjaxError("generate: give at least one PROMPT")
    sampling = sampling_from_args(a)
    if a.num_draft < 0:
        raise InvalidSamplingError(f"--num-draft must be >= 0, got {a.num_draft}")
    model = specjax.load_model(a.model, dtype=a.dtype)
    results = specjax.generate(
        a.prompts, model=model, sampling=sampling, drafter=a.drafter, num_draft=a.num_draft, raw=a.raw
    )
    for r in results:
        if a.json:
            print(json.dumps(r.to_dict()), flush=True)
        else:
            print(r.text, flush=True)
            s = r.stats
            print(
                f"[{len(r.token_ids)} tokens, {s.tokens_per_second:.1f} tok/s, drafter {s.drafter}, "
                f"MAL {s.mean_accepted_length:.2f}]",
                file=sys.stderr,
            )
    return 0


def cmd_bench(a) -> int:
    suites = [x for x in a.suites.split(",") if x] if a.suites else []
    if a.prompts_file:
        suites.append("file")
    if suites == ["plain"]:
        from specjax.bench.plain import run_plain_bench

        run_plain_bench(
            model_path=a.model, dtype=a.dtype, batch_sizes=ints(a.batch_sizes, "--batch-sizes"),
            max_new_tokens=a.max_new_tokens, prompt_len=a.prompt_len,
            forward_ts=ints(a.forward_t, "--forward-t"), repeats=a.repeats, json_out=a.json_out,
        )
        return 0
    import specjax
    from specjax import datasets
    from specjax.bench.speculative import dump, print_table, run_speculative_bench

    prompts = {}
    for s in suites:
        if s == "file":
            prompts["file"] = datasets.load_jsonl_prompts(a.prompts_file)[: a.limit]
        elif s == "plain":
            raise SpecjaxError("bench: 'plain' cannot be combined with other suites")
        else:
            prompts[s] = datasets.load_suite(s, a.limit)
    temps = [float(x) for x in a.temperature.split(",")]
    for t in temps:
        if t < 0:
            raise InvalidSamplingError(f"temperature must be >= 0, got {t}")
    model = specjax.load_model(a.model, dtype=a.dtype)
    drafters = [d for d in a.drafters.split(",") if d]
    from specjax.drafters import make_drafter

    for d in drafters:  # fail fast on unknown names, before anything runs
        make_drafter(d, 1, model) if d != "none" else None
    report = run_speculative_bench(
        model, prompts, drafters, ints(a.num_draft, "--num-draft"), ints(a.batch_sizes, "--batch-sizes"),
        temps, a.max_new_tokens, a.repeats,
    )
    print_table(report)
    if a.json_out:
        dump(report, a.json_out)
    return 0


def ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise SpecjaxError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 0:
        raise SpecjaxError(f"{flag} takes comma-separated integers >= 0, got {text!r}")
    return vals


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="specjax", description="Lossless speculative decoding in JAX.")
    sub = p.add_subparsers(dest="command", parser_class=ArgumentParser)

    g = sub.add_parser("generate", help="generate replies to prompts")
    add_model_args(g)
    add_sampling_args(g)
    g.add_argument("--drafter", default="none", help="none | ngram | draft:PATH | mtp[:PATH] | eagle3[:PATH]")
    g.add_argument("--num-draft", type=int, default=0, help="K, draft tokens per step")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt, one per line")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("prompts", nargs="*", metavar="PROMPT")
    g.set_defaults(fn=cmd_generate)

    b = sub.add_parser("bench", help="benchmarks: `plain` (the target alone) or prompt suites")
    b.add_argument("suites", nargs="?", default="humaneval",
                   help="plain | comma-separated suites: humaneval, mtbench, sharegpt")
    add_model_args(b)
    b.add_argument("--prompts", dest="prompts_file", default=None, help="a JSONL file of prompts (prompt or messages)")
    b.add_argument("--limit", type=int, default=None, help="use the first N prompts of each suite")
    b.add_argument("--drafters", default="ngram", help="comma-separated: ngram, draft:PATH, ... (plain is always run)")
    b.add_argument("--num-draft", default="3,5", help="comma-separated K values")
    b.add_argument("--batch-sizes", default="1", help="comma-separated batch sizes")
    b.add_argument("--temperature", default="0", help="comma-separated temperatures")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--prompt-len", type=int, default=128, help="plain: prompt length in tokens")
    b.add_argument("--forward-t", default="1,2,4,8,16", help="plain: token counts T for the forward-cost table")
    b.add_argument("--json-out", default=None, help="write every figure to this JSON file")
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = build_parser()
    try:
        a = parser.parse_args(argv)
        if not getattr(a, "fn", None):
            parser.print_help()
            return EXIT_BAD_INPUT
        return a.fn(a)
    except SpecjaxError as e:
        print(f"specjax: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("specjax: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # internal failure: one line unless debugging
        if os.environ.get("SPECJAX_DEBUG"):
            raise
        print(f"specjax: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
