"""What exact speculation costs: one target forward + logits verifying W = 1 / 4 / 8 / 16 tokens
after a 300-token context (and the commit of all W: a recurrent target's states after them),
per dtype, with and without exact mode (`blockdraft.models.exact`),
in bf16 exact mode with the eager step and with the fused native step (`models.native_step`,
where this CPU runs it), medians over interleaved rounds; and where the fused step's time goes
(its products, the LM head, the rest). docs/exactness.md shows the table.

    python benchmarks/exact_cost.py measure --out bench-results/exact-cost-NAME [--rounds 3]
        [--target DIR] [--dtypes bfloat16]
    python benchmarks/exact_cost.py table bench-results/exact-cost-NAME --doc docs/exactness.md
    python benchmarks/exact_cost.py random-target DIR [--shape qwen3.5-0.8b]

`random-target` writes a target folder of a public model's shapes with random weights (and the
default target's tokenizer): what a step costs depends on the shapes, not on the values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import doctable  # noqa: E402

WIDTHS = (1, 4, 8, 16)
# (dtype, exact mode, step): "eager" turns the fused step off, "auto" keeps what exact mode chose
CONFIGS = (
    ("float32", False, "auto"),
    ("float32", True, "auto"),
    ("bfloat16", False, "auto"),
    ("bfloat16", True, "eager"),
    ("bfloat16", True, "auto"),
)


# public models' shapes (their config.json's text part), for `random-target`
SHAPES = {
    "qwen3.5-0.8b": dict(
        model_type="qwen3_5_text",
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],  # repeated over the layers
        tie_word_embeddings=True,
        partial_rotary_factor=0.25,
        rope_theta=10000000,
        max_position_embeddings=4096,
    )
}


def random_target(args) -> None:
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from blockdraft.models.default import default_target_dir

    shape = dict(SHAPES[args.shape])
    shape["layer_types"] = (shape["layer_types"] * shape["num_hidden_layers"])[: shape["num_hidden_layers"]]
    cfg = AutoConfig.for_model(**shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(args.dir)
    for f in default_target_dir().glob("tokenizer*"):
        shutil.copy(f, args.dir)
    print(f"{args.dir}: a random {args.shape} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters)")


def config_name(dt: str, ex: bool, step: str) -> str:
    return f"{dt} {'exact' if ex else 'fastest'}" + (", eager step" if step == "eager" else "")


def load(target, dt: str, ex: bool, step: str):
    from blockdraft import Engine

    e = Engine.load(target, dtype=getattr(torch, dt), exact=ex, use_draft=False)
    if step == "eager" and e.target.native_step is not None:
        e.target.native_step = None
        e.target.exactness = {**e.target.exactness, "step": "eager: turned off"}
    return e


def parts(e, widths, repeats: int) -> dict:
    """Median ms of the fused step's products alone at each width: every layer weight by W rows
    through the native kernel on the step's packed copies, and the LM head through its exact kernel."""
    from blockdraft.models import native

    packed = [p for p in e.target.native_step.weights() if p.dim() == 4]  # [N/32, K/2, 32, 2] (`native.pack`)
    out = {}
    for w in widths:
        xs = {2 * p.shape[1]: torch.randn(w, 2 * p.shape[1]).to(torch.bfloat16) for p in packed}
        head = torch.randn(w, e.target.config.hidden_size).to(torch.bfloat16)
        layers, lm = [], []
        for i in range(repeats + 1):
            t = time.perf_counter()
            for pack in packed:
                native.module().linear_packed(xs[2 * pack.shape[1]], pack, None, 32 * pack.shape[0])
            t1 = time.perf_counter()
            e.target.logits(head)
            if i:
                layers.append(t1 - t)
                lm.append(time.perf_counter() - t1)
        out[f"products {w}"] = round(statistics.median(layers) * 1e3, 3)
        out[f"lm head {w}"] = round(statistics.median(lm) * 1e3, 3)
    return out


def measure(args) -> None:
    from blockdraft.machine import cpu_name
    from blockdraft.machine import cpu_flags
    from blockdraft.precision import bf16_speedup

    engines = {c: load(args.target, *c) for c in CONFIGS if c[0] in args.dtypes}
    context = 300
    times: dict[str, list[float]] = {}
    caches = {}
    with torch.inference_mode():
        for key, e in engines.items():
            caches[key] = e.target.new_cache(1, context + 32)
            e.target(torch.zeros(1, context, dtype=torch.long), torch.arange(context)[None], caches[key])
            e.target.commit(caches[key], slice(None), torch.tensor([context]))
            if not e.target.attention_chunk:  # the fastest kernels measure and pack on first use
                e.target.warm_up(16)
        fused = {}
        bandwidths = []  # the machine's read bandwidth moves with its neighbours: sampled every round
        for _ in range(args.rounds):  # interleaved, so that drift hits every configuration alike
            bandwidths.append(read_bandwidth())
            for (dt, ex, step), e in engines.items():
                for w in WIDTHS:
                    toks = torch.randint(0, e.target.config.vocab_size, (1, w))
                    pos = torch.arange(context, context + w)[None]
                    for i in range(args.repeats + 1):
                        t = time.perf_counter()
                        h, _ = e.target(toks, pos, caches[(dt, ex, step)])
                        e.target.logits(h).argmax(-1)
                        # every token kept (a recurrent target's worst case: its states after all W)
                        e.target.commit(caches[(dt, ex, step)], slice(None), torch.tensor([context + w]))
                        if i:
                            times.setdefault(f"{config_name(dt, ex, step)} {w}", []).append(time.perf_counter() - t)
                if e.target.native_step is not None:
                    for k, v in parts(e, WIDTHS, args.repeats).items():
                        fused.setdefault(k, []).append(v)
    bandwidth = statistics.median(bandwidths)
    floor = {dt: round(weight_bytes(e.target) / bandwidth * 1e3, 3) for (dt, ex, _), e in engines.items() if ex}
    out = {
        "machine": {
            "processor": cpu_name(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "flags": cpu_flags(),
            "bf16_speedup": bf16_speedup(),
            "read_gb_per_s": round(bandwidth / 1e9, 1),
            "read_gb_per_s_rounds": [round(b / 1e9, 1) for b in bandwidths],
        },
        "target": engines[next(iter(engines))].target.config.model_type
        + ("" if args.target is None else f" ({args.target})"),
        "commit": True,  # each timed forward commits its W tokens (results before 2026-12-07 did not)
        "floor_ms": floor,
        "kernels": {
            config_name(*c): (getattr(e.target, "exactness", None) or {}).get("kernels", {}) for c, e in engines.items()
        },
        "steps": {config_name(*c): e.precision()["step"] for c, e in engines.items()},
        "fused_parts_ms": {k: statistics.median(v) for k, v in fused.items()},
        "context": context,
        "command": " ".join(sys.argv),
        "median_ms": {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()},
        "exactness": {config_name(*c): e.precision()["exact"] for c, e in engines.items()},
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(out, indent=1))
    print(table_of(out))


def read_bandwidth(gib: float = 1.0, runs: int = 5) -> float:
    """Bytes per second this machine reads, summing a 1 GiB tensor on every thread (median)."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times)


def weight_bytes(model) -> int:
    """Bytes of the weights a plain step reads once (each tensor once: a tied LM head is the embedding)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def table_of(res: dict) -> str:
    m = res["machine"]
    ms = res["median_ms"]
    lines = [
        f"{m['processor']}, {m['threads']} threads, torch {m['torch']}, CPU flags: "
        f"{', '.join(m['flags']) or 'no amx_bf16 / avx512_bf16'} (a 16-row bf16 product at "
        f"{m['bf16_speedup']:.2f}x fp32's speed); target{' ' + res['target'] if 'target' in res else ''} forward + "
        f"logits{' (+ commit)' if res.get('commit') else ''} after {res['context']} tokens, ms (median), and in plain "
        "steps of the same configuration",
        "",
        "| configuration | step | bit-exact | " + " | ".join(f"W = {w}" for w in WIDTHS) + " |",
        "|---|---|---|" + "---|" * len(WIDTHS),
    ]
    steps = res.get("steps", {})
    for name, exact in res["exactness"].items():
        one = ms[f"{name} 1"]
        cells = [f"{ms[f'{name} {w}']:.1f}" + ("" if w == 1 else f" ({ms[f'{name} {w}'] / one:.2f})") for w in WIDTHS]
        step = "fused" if steps.get(name) == "native" else "eager"
        lines.append(
            f"| {name.removesuffix(', eager step')} | {step} | {'yes' if exact else 'no'} | " + " | ".join(cells) + " |"
        )
    if res.get("floor_ms"):
        spread = m.get("read_gb_per_s_rounds")
        spread = f", {min(spread)} to {max(spread)} over the rounds" if spread else ""
        lines += [
            "",
            f"Reading the weights once at the measured {m['read_gb_per_s']} GB/s (summing 1 GiB, median"
            f"{spread}): "
            + ", ".join(
                f"{ms_:.1f} ms in {dt} (a plain exact step is {ms[f'{dt} exact 1'] / ms_:.1f}x that)"
                for dt, ms_ in res["floor_ms"].items()
            )
            + ". Exact kernels: "
            + "; ".join(f"{k}: " + ", ".join(f"{n} {c}" for n, c in v.items()) for k, v in res["kernels"].items() if v)
            + ".",
        ]
    fused = res.get("fused_parts_ms")
    name = next((n for n, s in steps.items() if s == "native"), None)
    if fused and name:
        lines += [
            "",
            "Where the fused step's time goes, ms (median): its layers' products alone (each weight by "
            "W rows through the native kernel from its packed copy, one call each), the LM head, and the rest "
            "(norms, rotary, attention, activations, the call; less the products' own call overhead)",
            "",
            "| part | " + " | ".join(f"W = {w}" for w in WIDTHS) + " |",
            "|---|" + "---|" * len(WIDTHS),
        ]
        rows = {
            "layer products": [fused[f"products {w}"] for w in WIDTHS],
            "LM head": [fused[f"lm head {w}"] for w in WIDTHS],
        }
        rows["the rest"] = [
            ms[f"{name} {w}"] - rows["layer products"][i] - rows["LM head"][i] for i, w in enumerate(WIDTHS)
        ]
        rows["whole step"] = [ms[f"{name} {w}"] for w in WIDTHS]
        lines += [f"| {k} | " + " | ".join(f"{v:.1f}" for v in vals) + " |" for k, vals in rows.items()]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "table":
        return doctable.main(
            __doc__,
            "exact-cost",
            lambda a: table_of(json.loads((a.results / "results.json").read_text())),
            argv=argv[1:],
            results=(None, "a results folder of `exact_cost.py measure`"),
        )
    if argv and argv[0] == "random-target":
        ap = argparse.ArgumentParser(description="a target folder of a public model's shapes, random weights")
        ap.add_argument("dir")
        ap.add_argument("--shape", choices=list(SHAPES), default="qwen3.5-0.8b")
        random_target(ap.parse_args(argv[1:]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["measure"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--target", help="a target folder (default: the default target)")
    dtypes = ["float32", "bfloat16"]
    ap.add_argument("--dtypes", nargs="+", default=dtypes, choices=dtypes, help="the dtypes to run")
    measure(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
