"""The `specjax` command line: generate, bench, batch, serve, serve-bench, train, lower, export.

One `cmd_*` handler per subcommand (`COMMANDS`); the flags, their parsers and the checks on them
are in `specjax/cli_args.py`.

Errors caused by the user print one line on stderr and exit with code 2; internal failures print
one line and exit with code 1 (set SPECJAX_DEBUG=1 for the traceback).
"""

from __future__ import annotations

import json
import os
import sys

from specjax.cli_args import build_parser, check_draft_args, ints, sampling_from_args
from specjax.errors import InvalidSamplingError, SpecjaxError

EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 1


def cmd_generate(a) -> int:
    import specjax
    from specjax.prompt_text import check_text

    if not a.prompts:
        raise SpecjaxError("generate: give at least one PROMPT")
    for i, p in enumerate(a.prompts):  # before the model loads
        check_text(p, f"PROMPT {i + 1}" if len(a.prompts) > 1 else "the prompt")
    sampling = sampling_from_args(a)
    check_draft_args(a)
    model = specjax.load_model(a.model, dtype=a.dtype)
    results = specjax.generate(
        a.prompts,
        model=model,
        sampling=sampling,
        drafter=a.drafter,
        num_draft=a.num_draft,
        raw=a.raw,
        spec_policy=a.spec_policy,
        tree_topk=a.tree_topk,
        tree_depth=a.tree_depth,
    )
    for i, r in enumerate(results):
        if a.json:
            print(json.dumps(r.to_dict()), flush=True)
        else:
            print(("\n" if i else "") + r.text, flush=True)  # a blank line between replies
            s = r.stats
            acc = "" if s.acceptance_rate is None else f", acceptance {s.acceptance_rate:.2f}"
            share = f", verified {s.verified_steps}/{s.steps} steps ({s.spec_policy})" if s.num_draft else ""
            if s.tree != "chain":
                share += f", {s.off_chain_steps} beat the top-1 chain"
            print(
                f"[{len(r.token_ids)} tokens, {s.tokens_per_second:.1f} tok/s, drafter {s.drafter} "
                f"K={s.num_draft}, MAL {s.mean_accepted_length:.2f}{acc}{share}]",
                file=sys.stderr,
            )
    if a.compare_plain:
        if a.drafter in (None, "none"):
            print("[--compare-plain: no --drafter given, nothing to compare]", file=sys.stderr)
        else:
            _compare_with_plain(specjax, model, a, sampling, results)
    return 0


def _compare_with_plain(specjax, model, a, sampling, results) -> None:
    """Same prompts, plain decoding, same process: the speedup the drafter gave (compile excluded
    from both), and for greedy decoding whether the outputs are token-identical (they must be)."""
    plain = specjax.generate(a.prompts, model=model, sampling=sampling, raw=a.raw)
    tps = lambda rs: (
        sum(len(r.token_ids) for r in rs)
        / sum(  # noqa: E731
            r.stats.prefill_seconds + r.stats.decode_seconds for r in rs
        )
    )
    line = f"plain decoding, same prompts: {tps(plain):.1f} tok/s; speedup {tps(results) / tps(plain):.2f}x"
    if sampling.temperature == 0:
        same = all(p.token_ids == r.token_ids for p, r in zip(plain, results))
        line += ", greedy output " + ("identical" if same else "DIFFERENT (a bug: please report it)")
    print(f"[{line}]", file=sys.stderr)


def check_json_out(path: str | None) -> None:
    """Fail before measuring, not after, on a --json-out that cannot be written."""
    if not path:
        return
    if os.path.isdir(path):
        raise SpecjaxError(f"--json-out {path}: is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise SpecjaxError(f"--json-out {path}: cannot create {parent}: {e.strerror or e}") from None
    from specjax.files import check_file_writable

    check_file_writable(path, f"--json-out {path}")


def cmd_bench(a) -> int:
    check_json_out(a.json_out)
    if a.limit is not None and a.limit < 1:
        raise SpecjaxError(f"--limit must be >= 1, got {a.limit}")
    if a.preset:
        return _bench_preset(a)
    suites = [x for x in (a.suites or ("" if a.prompts_file else "humaneval")).split(",") if x]
    if a.prompts_file:
        suites.append("file")
    if suites == ["plain"]:
        return _bench_plain(a)
    # Everything the user can get wrong is checked before the target loads and anything runs.
    s = _bench_settings(a)
    prompts = _bench_prompts(a, suites)
    import specjax
    from specjax.bench.speculative import bench_suites

    model = specjax.load_model(a.model, dtype=a.dtype)
    bench_suites(
        model,
        prompts,
        s["drafters"],
        s["num_drafts"],
        s["batch_sizes"],
        s["temps"],
        a.max_new_tokens,
        a.repeats,
        peers=s["peers"],
        json_out=a.json_out,
        plots_dir=a.plots_dir,
        peer_threads=a.peer_threads,
        spec_policies=s["spec_policies"],
        trees=s["trees"],
    )
    return 0


def _bench_preset(a) -> int:
    """`bench --preset`: the accelerator measurements (specjax/bench/accel.py)."""
    if a.suites or a.prompts_file:
        raise SpecjaxError("bench: --preset runs its own measurements; drop SUITE/--prompts")
    from specjax.bench.accel import run_preset

    run_preset(
        a.preset,
        model_path=a.model,
        dtype=a.dtype,
        mal_from=a.mal_from,
        json_out=a.json_out,
        time_budget=a.time_budget,
    )
    return 0


def _bench_plain(a) -> int:
    """`bench plain`: the target alone (specjax/bench/plain.py)."""
    from specjax.bench.plain import run_plain_bench

    run_plain_bench(
        model_path=a.model,
        dtype=a.dtype,
        batch_sizes=ints(a.batch_sizes, "--batch-sizes"),
        max_new_tokens=a.max_new_tokens,
        prompt_len=a.prompt_len,
        forward_ts=ints(a.forward_t, "--forward-t"),
        repeats=a.repeats,
        json_out=a.json_out,
    )
    return 0


def _bench_settings(a) -> dict:
    """The suite benchmark's flags, checked (one line each): drafters, num_drafts, batch_sizes,
    temps, peers, spec_policies, trees."""
    from specjax.bench import peers
    from specjax.bench.speculative import check_drafter_names, parse_tree

    drafters = [d.strip() for d in a.drafters.split(",") if d.strip()]
    check_drafter_names(drafters)
    policies = list(dict.fromkeys(p.strip() for p in a.spec_policy.split(",") if p.strip()))
    if not policies or any(p not in ("always", "auto") for p in policies):
        raise SpecjaxError(f"--spec-policy takes a comma-separated subset of always, auto, got {a.spec_policy!r}")
    peer_names = [p.strip() for p in (a.peers or "").split(",") if p.strip()]
    peers.check_peers(peer_names)
    if a.peer_threads is not None and a.peer_threads < 1:
        raise SpecjaxError(f"--peer-threads must be >= 1, got {a.peer_threads}")
    num_drafts = ints(a.num_draft, "--num-draft")
    trees = list(dict.fromkeys(t.strip().lower() for t in a.trees.split(",") if t.strip())) or ["chain"]
    for t in trees:
        parse_tree(t)
    batch_sizes = ints(a.batch_sizes, "--batch-sizes")
    if min(num_drafts) < 1 or min(batch_sizes) < 1:
        raise SpecjaxError("--num-draft and --batch-sizes take integers >= 1")
    if a.repeats < 1 or a.max_new_tokens < 1:
        raise InvalidSamplingError("--repeats and --max-new-tokens must be >= 1")
    try:
        temps = [float(x) for x in a.temperature.split(",") if x]
    except ValueError:
        raise SpecjaxError(f"--temperature takes comma-separated numbers, got {a.temperature!r}") from None
    if not temps or min(temps) < 0:
        raise InvalidSamplingError(f"temperatures must be >= 0, got {a.temperature!r}")
    return dict(
        drafters=drafters,
        num_drafts=num_drafts,
        batch_sizes=batch_sizes,
        temps=temps,
        peers=peer_names,
        spec_policies=policies,
        trees=trees,
    )


def _bench_prompts(a, suites: list[str]) -> dict:
    """Suite name -> its prompts (`file`: --prompts), each suite non-empty."""
    from specjax import datasets

    prompts = {}
    for s in suites:
        if s == "file":
            prompts["file"] = datasets.load_jsonl_prompts(a.prompts_file)[: a.limit]
        elif s == "plain":
            raise SpecjaxError("bench: 'plain' cannot be combined with other suites")
        else:
            prompts[s] = datasets.load_suite(s, a.limit)
        if not prompts[s]:
            raise SpecjaxError(f"bench: suite {s!r} has no prompts")
    return prompts


def cmd_batch(a) -> int:
    """`specjax batch`: a resumable job over a JSONL file (specjax/batch/)."""
    from specjax.batch import parts
    from specjax.batch.config import BatchConfig
    from specjax.batch.files import check_merge_paths, check_paths
    from specjax.batch.job import run_batch
    from specjax.runtime import compile_cache

    if a.merge:
        if a.num_processes is None:
            raise SpecjaxError("batch --merge needs --num-processes N")
        check_merge_paths(a.output, a.num_processes)
        rows = parts.merge_parts(a.output, a.num_processes)
        print(f"specjax batch: merged {a.num_processes} parts: {rows} rows in {a.output}", file=sys.stderr)
        return 0
    check_draft_args(a)
    if a.limit is not None and a.limit < 1:
        raise SpecjaxError(f"--limit must be >= 1, got {a.limit}")
    cfg = BatchConfig(
        output=a.output,
        input=a.input,
        suite=a.suite,
        limit=a.limit,
        model=a.model,
        dtype=a.dtype,
        drafter=a.drafter,
        num_draft=a.num_draft,
        tree_topk=a.tree_topk,
        tree_depth=a.tree_depth,
        spec_policy=a.spec_policy,
        sampling=sampling_from_args(a),
        batch_size=a.batch_size,
        latency_class=a.latency_class,
        raw=a.raw,
        mesh=a.mesh,
        merge_wait=a.merge_wait,
        progress=not a.no_progress,
        num_processes=a.num_processes or 1,
        process_id=a.process_id or 0,
    )
    check_paths(cfg)  # before the rendezvous and the model load
    compile_cache.persist(a.compile_cache)
    if a.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS"):
        cfg.process_id, cfg.num_processes = parts.init_distributed(
            a.coordinator, a.num_processes, a.process_id, stay_connected=a.stay_connected
        )
    elif (a.num_processes is None) != (a.process_id is None):
        raise SpecjaxError("batch: give --num-processes and --process-id together (or --coordinator)")
    run_batch(cfg)
    return 0


def _serving_config(a):
    """The serving config: `--config` YAML, then the flags that were given."""
    from specjax.server.config import load_config

    keys = {}
    for item in a.api_key_class or []:
        key, eq, cls = item.partition("=")
        if not eq or not key:
            raise SpecjaxError(f"--api-key-class takes KEY=CLASS, got {item!r}")
        keys[key] = cls
    cfg = load_config(
        a.config,
        policy=a.policy,
        buckets=ints(a.buckets, "--buckets") if a.buckets else None,
        ks=ints(a.ks, "--ks") if a.ks else None,
        chunk_steps=a.chunk_steps,
        max_seq_len=a.max_seq_len,
        default_class=a.default_class,
        step_costs=a.step_costs,
        tree_topk=a.tree_topk,
        tree_depth=a.tree_depth,
    )
    cfg.api_keys.update(keys)
    return cfg.validate()


def cmd_serve(a) -> int:
    """`specjax serve`: the OpenAI-compatible server (specjax/server/)."""
    import logging

    from specjax.files import check_file_writable
    from specjax.runtime import compile_cache
    from specjax.server import app, scheduler

    cfg = _serving_config(a)
    if a.save_step_costs:  # before the model loads and warms up
        check_file_writable(a.save_step_costs, "--save-step-costs")
    logging.basicConfig(level=logging.INFO, format="specjax serve: %(message)s")
    compile_cache.persist(a.compile_cache)
    import specjax

    model = specjax.load_model(a.model, dtype=a.dtype)
    if model.tokenizer is None:
        raise SpecjaxError(f"model {model.name} has no tokenizer; the server needs one")
    say = lambda msg: print(f"specjax serve: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"warming up {model.name}: drafter {a.drafter}, K in {cfg.ks}, batch buckets {cfg.buckets} ...")
    sched = scheduler.build_scheduler(model, a.drafter, cfg, log=say)
    if a.save_step_costs:
        with open(a.save_step_costs, "w") as fh:
            json.dump({"step_costs": sched.costs.to_dict(), "source": sched.costs.source}, fh, indent=1)
    sched.start()
    name = a.served_model_name or model.name
    say(f"serving {name!r} on http://{a.host}:{a.port} (policy {cfg.policy})")
    try:
        app.run(sched, model, name, a.host, a.port, log_level=a.log_level)
    finally:
        sched.stop()
    return 0


def cmd_serve_bench(a) -> int:
    """`specjax serve-bench`: offered-load sweep of the serving rules (specjax/bench/loadbench.py)."""
    from specjax.bench import loadbench
    from specjax.runtime import compile_cache

    cfg = _serving_config(a)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in loadbench.MODES]
    if bad or not modes:
        raise SpecjaxError(f"--modes takes a comma-separated subset of {', '.join(loadbench.MODES)}, got {a.modes!r}")
    loads = ints(a.loads, "--loads")
    if min(loads) < 1 or a.requests < 1 or a.max_tokens < 1 or a.repeats < 1:
        raise SpecjaxError("--loads, --requests, --max-tokens and --repeats take integers >= 1")
    compile_cache.persist(a.compile_cache)
    import specjax

    model = specjax.load_model(a.model, dtype=a.dtype)
    loadbench.run_sweep(
        model,
        a.drafter,
        cfg,
        loads=loads,
        modes=modes,
        requests_per_load=a.requests,
        max_tokens=a.max_tokens,
        suites=a.suites,
        interactive_share=a.interactive_share,
        json_out=a.json_out,
        seed=a.seed,
        repeats=a.repeats,
    )
    return 0


def cmd_train(a) -> int:
    from train.cli import main as train_main

    return train_main(a)


def cmd_lower(a) -> int:
    from specjax.bench.lower import run

    split = lambda x: [v.strip() for v in x.split(",") if v.strip()]
    rows, good = run(split(a.platforms), a.shape, split(a.drafter), a.num_draft, a.batch_size, a.dtype, a.temperature)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0 if good else EXIT_INTERNAL


def cmd_export(a) -> int:
    from specjax.drafters.export import export_drafter

    print(export_drafter(a.drafter, a.format, a.out, a.model, a.dtype, a.verifier))
    return 0


COMMANDS = {
    "generate": cmd_generate,
    "bench": cmd_bench,
    "batch": cmd_batch,
    "serve": cmd_serve,
    "serve-bench": cmd_serve_bench,
    "train": cmd_train,
    "lower": cmd_lower,
    "export": cmd_export,
}


def one_line(message: str) -> str:
    """`message` with every character that is not printable (newlines and other line breaks a
    user's argument or file can carry, control characters, lone surrogates) escaped, so that an
    error stays one line on stderr."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in message)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    parser = build_parser(COMMANDS)
    try:
        a, extra = parser.parse_known_args(argv)
        if extra and getattr(a, "command", None) == "train":  # KEY=VALUE overrides after --config
            a.args += [x for x in extra if not x.startswith("-")]
            extra = [x for x in extra if x.startswith("-")]
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if not getattr(a, "fn", None):  # the help on stdout, the error as every other one
            parser.print_help()
            raise SpecjaxError("give a command: " + ", ".join(parser.command_names))
        return a.fn(a)
    except SpecjaxError as e:
        print(f"specjax: error: {one_line(str(e))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("specjax: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # internal failure: one line unless debugging
        if os.environ.get("SPECJAX_DEBUG"):
            raise
        print(f"specjax: internal error: {type(e).__name__}: {one_line(str(e))}", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
