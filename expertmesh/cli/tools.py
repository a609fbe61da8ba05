"""`hub`, `tiny-model`, `bench`, `replay` and `lab`: a local Hub, test models and measurements."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from expertmesh.cli import arguments
from expertmesh.node import constants
from expertmesh.node.config import RAM_POLICIES
from expertmesh.node.errors import ExpertmeshError
from expertmesh.node.sizes import format_size

TINY_ARCHS = ("kimi_k3", "deepseek_v3", "qwen3_moe", "mlx_qwen3_moe")


def add_commands(sub) -> None:
    p = sub.add_parser("hub", help="serve a folder of model repos over the Hugging Face Hub protocol")
    p.add_argument("dir", help="folder holding NAMESPACE/NAME/ repo folders")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=arguments.port, default=0, help="0 picks a free port")
    from expertmesh.devtools.local_hub import add_knob_arguments

    add_knob_arguments(p)
    p.set_defaults(func=hub)

    p = sub.add_parser("tiny-model", help="write a tiny MoE repo in an upstream layout (tests, demos)")
    p.add_argument("out", help="folder to write the repo into (replaced)")
    p.add_argument(
        "--arch",
        required=True,
        choices=TINY_ARCHS,
        help="the upstream layout: Moonshot's K3, Kimi-K2-Thinking, Qwen3-MoE, or an mlx_lm.convert output",
    )
    p.add_argument("--seed", type=int, default=0, help="random weights' seed: the same seed, the same repo (default 0)")
    p.set_defaults(func=tiny_model)

    p = sub.add_parser("bench", help="naive, cold, warm-disk, warm-RAM and mlx-lm side by side on an emulated link")
    p.add_argument(
        "--model",
        default="demo",
        help="demo (the trained demo model), tiny-ARCH, wide-kimi_k3 (a wider random K3), or k3-proportions "
        "(17.5 MB experts, the Hub in its own process, no time scale: see expertmesh/devtools/bench_k3.py) "
        "(default %(default)s)",
    )
    p.add_argument(
        "--per-connection-bandwidth",
        default="12.5MB,25MB,100MB",
        metavar="B[,B...]",
        help="k3-proportions: the per-connection caps to run at, on a 100 MB/s link (default %(default)s)",
    )
    p.add_argument(
        "--kernel-link",
        action="store_true",
        help="k3-proportions: the Hub and the workers in network namespaces, the 100 MB/s link a tbf qdisc "
        "(needs root, ip and tc; the per-connection cap and first-byte delay stay the hub's knobs)",
    )
    p.add_argument(
        "--configs",
        metavar="NAME[,NAME...]",
        help="k3-proportions: which configurations to run, in order (default: cold, fair_naive, "
        "deltafin_like, k3_replay, warm_disk, warm_disk_floor, mlx_lm; also k3_replay_fixed and cold_fixed, "
        "with the Hub's connection count fixed at its start)",
    )
    p.add_argument(
        "--prompt-experts",
        action="store_true",
        help="what an approximate prompt (run --prompt-experts) saves and costs on the trained demo model: "
        "expert bytes and TTFT against the exact prompt, KL and greedy agreement over 64 decoded tokens, "
        "perplexity, beside the 4-bit core's KL (devtools/bench_prompt_experts.py; prompts of 128 tokens "
        "unless --prompt-lengths says)",
    )
    p.add_argument(
        "--prompts",
        type=arguments.positive_int,
        default=3,
        metavar="N",
        help="--prompt-experts: held-out prompts per length, each in every mode (default %(default)s)",
    )
    p.add_argument(
        "--prompt-lengths",
        default="16,128,1024,4096",
        metavar="N[,N...]",
        help="--configs prompt: the prompt lengths in tokens, each cold and with its experts on disk "
        "(default %(default)s; see expertmesh/devtools/bench_prompt.py)",
    )
    p.add_argument(
        "--prefill",
        choices=("both", "layer_major", "token_major"),
        default="both",
        help="--configs prompt: the prefill orders to run; token_major (mlx-lm's chunk by chunk, the "
        "comparison) runs only for a prompt longer than one prefill chunk (default %(default)s)",
    )
    p.add_argument(
        "--experts-per-layer",
        type=arguments.positive_int,
        help="k3-proportions: routed experts per MoE layer (default 64; K3 has 896, and a decode token misses "
        "nearly all of its 16 only when a layer has many more than a prompt touches)",
    )
    p.add_argument(
        "--moe-layers", type=arguments.positive_int, help="k3-proportions: MoE layers of the made repo (default 3)"
    )
    p.add_argument(
        "--router",
        choices=("balanced", "raw"),
        help="k3-proportions: balanced (default: selection biases even out the experts' load, as K3's training "
        "does) or raw (the random router, which keeps choosing the same experts)",
    )
    p.add_argument("--tokens", type=arguments.positive_int, help="tokens per prompt (default 24; k3-proportions: 4)")
    p.add_argument(
        "--naive-tokens",
        type=arguments.whole_number,
        default=8,
        help="tokens of the slow naive run, on the first prompt (0 skips it; default %(default)s)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=constants.BENCH_TIME_SCALE,
        help="emulated link seconds per K3 second (default %(default)s)",
    )
    p.add_argument(
        "--ram-fraction",
        type=arguments.probability,
        default=0.25,
        help="RAM budget as a fraction of all experts (default %(default)s)",
    )
    p.add_argument(
        "--hub-connections",
        type=arguments.positive_int,
        default=constants.HUB_CONNECTIONS,
        metavar="N",
        help="range requests in flight to the Hub in cold and warm_disk (default %(default)s)",
    )
    p.add_argument(
        "--compute",
        action="store_true",
        help="instead: kernels, syncs, host and CPU seconds, host Python calls and bytes copied per decode token "
        "beside mlx-lm, for the k3_depth, qwen3_depth and demo shapes (see expertmesh/devtools/bench_compute.py)",
    )
    p.add_argument(
        "--shapes",
        metavar="NAME[,NAME...]",
        help="--compute: which shapes, in order (default: k3_depth,qwen3_depth,demo)",
    )
    p.add_argument(
        "--baseline",
        metavar="FILE",
        help="k3-proportions: run the shape recorded in FILE (e.g. benchmarks/fetch_path_baseline.json) and "
        "compare the fetch path's CPU per GB and useful link with it; exit 1 when one is beyond its tolerance",
    )
    p.add_argument(
        "--record-baseline",
        metavar="FILE",
        help="k3-proportions: write this run's CPU per GB and useful link, with its shape, as a baseline to FILE",
    )
    p.add_argument(
        "--conversation",
        action="store_true",
        help="instead: a chat, an agent loop over a long system prompt and that prompt after a restart, with the "
        "prefix cache on and off side by side: tokens fed, expert bytes and TTFT per turn, and each turn's new "
        "tokens alone (see expertmesh/devtools/bench_conversation.py; k3-proportions: 2 x 384 experts unless "
        "--moe-layers/--experts-per-layer say)",
    )
    p.add_argument(
        "--turns", type=arguments.positive_int, default=6, help="--conversation: the chat's turns (default %(default)s)"
    )
    p.add_argument(
        "--steps",
        type=arguments.whole_number,
        default=12,
        help="--conversation: the agent loop's steps (0 leaves out the agent and the restart; default %(default)s)",
    )
    p.add_argument(
        "--system-tokens",
        type=arguments.positive_int,
        default=1500,
        help="--conversation: the agent's system prompt, in tokens (about; default %(default)s)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.set_defaults(func=bench)

    p = sub.add_parser("replay", help="hit rates of each RAM policy and of the offline optimum on a trace")
    p.add_argument("trace", help="a file written by `run --trace`")
    p.add_argument(
        "--budgets", default="10%,25%,50%", help="experts RAM holds: counts or %% of all experts (default %(default)s)"
    )
    p.add_argument("--policies", help=f"comma-separated, from {', '.join(RAM_POLICIES)} (default: all)")
    p.set_defaults(func=replay)

    p = sub.add_parser(
        "lab",
        help="a household of real processes in network namespaces on tbf-shaped links: alone, fetching and "
        "remote execution side by side, and the projection to Kimi K3 (see docs/lab.md)",
    )
    p.add_argument("--nodes", type=arguments.positive_int, default=4, help="node processes (default %(default)s)")
    p.add_argument("--layers", type=arguments.positive_int, default=2, help="MoE layers (default %(default)s)")
    p.add_argument("--experts", type=arguments.positive_int, default=32, help="experts per layer (default %(default)s)")
    p.add_argument("--top-k", type=arguments.positive_int, default=16, help="experts per token (default %(default)s)")
    p.add_argument("--tokens", type=arguments.positive_int, default=6, help="tokens per prompt (default %(default)s)")
    p.add_argument(
        "--prompt-tokens",
        type=arguments.positive_int,
        default=128,
        help="the prompt_* scenarios' prompt, in tokens (default %(default)s)",
    )
    p.add_argument("--lan", default="118MB", help="each node's NIC, bytes/s each way (default %(default)s: 1 GbE)")
    p.add_argument("--hub-bandwidth", default="100MB", help="the Hub's link, bytes/s (default %(default)s)")
    p.add_argument(
        "--hub-ttfb", type=float, default=0.075, help="seconds to the Hub's first byte (default %(default)s)"
    )
    p.add_argument(
        "--scenarios",
        default="alone_cold,alone_warm_disk,fetch_from_owners,remote,remote_node_dies,remote_node_joins,"
        "prompt_fetch_from_owners,prompt_remote",
        help="which to run, in order (default %(default)s)",
    )
    p.add_argument("--loopback", action="store_true", help="do not use network namespaces even as root")
    p.add_argument("--metal-compute-s", type=float, help="projection input: seconds of one expert on Metal")
    p.add_argument("--ssd-bytes-per-s", type=float, help="projection input: a Mac's SSD read bandwidth")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.set_defaults(func=lab)


def hub(args: argparse.Namespace) -> int:
    from expertmesh.devtools.local_hub import knobs_from_args, serve_forever_cli, server_options_from_args

    root = Path(args.dir)
    if not root.is_dir():  # it would serve an empty Hub, and every pull would say "no such repository"
        raise ExpertmeshError(f"{root} is not a folder: give the folder that holds NAMESPACE/NAME/ repo folders")
    serve_forever_cli(root, args.host, args.port, knobs_from_args(args), **server_options_from_args(args))
    return 0


def tiny_model(args: argparse.Namespace) -> int:
    from expertmesh.devtools.tiny import make_tiny_model

    out = make_tiny_model(Path(args.out), args.arch, args.seed)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote tiny {args.arch} (seed {args.seed}) to {out}: {format_size(size)}")
    return 0


def bench(args: argparse.Namespace) -> int:
    from expertmesh.devtools.bench import print_table, run_bench, write_json

    if args.compute:
        return _bench_compute(args)
    if args.conversation:
        return _bench_conversation(args)
    if args.configs and args.configs.strip() == "prompt":
        return _bench_prompt(args)
    if args.prompt_experts:
        return _bench_prompt_experts(args)
    if args.model == "k3-proportions":
        return _bench_k3(args)
    doc = run_bench(
        model=args.model,
        tokens=args.tokens or 24,
        time_scale=args.time_scale,
        ram_fraction=args.ram_fraction,
        naive_tokens=args.naive_tokens,
        hub_connections=args.hub_connections,
        progress=lambda m: print(m, file=sys.stderr),
    )
    print_table(doc)
    if args.json:
        write_json(doc, Path(args.json))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _names(flag: str, value: str, known: tuple[str, ...]) -> tuple[str, ...]:
    """A comma-separated list of `known` names from `flag`, in its order; raises ExpertmeshError
    naming the unknown ones (or an empty list) and the choices."""
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ExpertmeshError(f"{flag}: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(known)}")
    return names


def _bench_conversation(args: argparse.Namespace) -> int:
    """`--conversation`: the prefix cache on and off, turn by turn (devtools/bench_conversation.py)."""
    from expertmesh.devtools import bench_conversation
    from expertmesh.devtools.tiny import k3_proportions

    shape = {"experts": args.experts_per_layer or 384, "moe_layers": args.moe_layers or 2, "router": args.router}
    doc = bench_conversation.run(
        args.model,
        turns=args.turns,
        steps=args.steps,
        system=args.system_tokens,
        reply=args.tokens or 12,
        proportions=k3_proportions.Proportions(**{k: v for k, v in shape.items() if v is not None}),
        progress=lambda m: print(m, file=sys.stderr),
    )
    bench_conversation.print_table(doc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _bench_compute(args: argparse.Namespace) -> int:
    from expertmesh.devtools import bench_compute

    shapes = _names("--shapes", args.shapes, bench_compute.SHAPES) if args.shapes else bench_compute.SHAPES
    doc = bench_compute.run(shapes, tokens=args.tokens or 24, progress=lambda m: print(m, file=sys.stderr))
    bench_compute.print_table(doc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _bench_prompt(args: argparse.Namespace) -> int:
    """`--configs prompt`: each prompt length's first token against its floor (devtools/bench_prompt.py)."""
    from expertmesh.devtools import bench_prompt
    from expertmesh.devtools.tiny import k3_proportions
    from expertmesh.node.sizes import parse_size

    try:
        lengths = tuple(int(n) for n in args.prompt_lengths.split(",") if n.strip())
        caps = args.per_connection_bandwidth
        # the decode sweep's default list: the prompt's targets are at 25 MB/s a connection
        cap = 25e6 if caps == "12.5MB,25MB,100MB" else float(parse_size(caps.split(",")[0]))
    except ValueError as e:
        raise ExpertmeshError(f"--prompt-lengths or --per-connection-bandwidth: {e}") from None
    if not lengths or min(lengths) < 2:
        raise ExpertmeshError("--prompt-lengths: one or more lengths of at least 2 tokens")
    # K3's regime by default: 384 experts a layer, as the cold decode figures use
    shape = {"experts": args.experts_per_layer or 384, "moe_layers": args.moe_layers, "router": args.router}
    doc = bench_prompt.run(
        args.model,
        lengths,
        prefills=bench_prompt.PREFILLS if args.prefill == "both" else (args.prefill,),
        per_connection=cap,
        proportions=k3_proportions.Proportions(**{k: v for k, v in shape.items() if v is not None}),
        progress=lambda m: print(m, file=sys.stderr),
    )
    bench_prompt.print_table(doc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _bench_prompt_experts(args: argparse.Namespace) -> int:
    """`--prompt-experts`: each approximate prompt mode against the exact prompt (devtools/bench_prompt_experts.py)."""
    from expertmesh.devtools import bench_prompt_experts

    given = args.prompt_lengths != "16,128,1024,4096"
    try:
        lengths = tuple(int(n) for n in args.prompt_lengths.split(",") if n.strip()) if given else (128,)
    except ValueError as e:
        raise ExpertmeshError(f"--prompt-lengths: {e}") from None
    if not lengths or min(lengths) < 2:
        raise ExpertmeshError("--prompt-lengths: one or more lengths of at least 2 tokens")
    doc = bench_prompt_experts.run(lengths, prompts=args.prompts)
    if args.model == "k3-proportions":  # its bytes and TTFT, beside the demo's quality figures
        progress = lambda m: print(m, file=sys.stderr)  # noqa: E731
        doc["rows"] += bench_prompt_experts.run_k3(doc["rows"], prompt_tokens=min(lengths), progress=progress)
        doc["not_measured"] = "k3-proportions quality (its rows carry the demo's for the same mode)"
    bench_prompt_experts.print_table(doc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _bench_k3(args: argparse.Namespace) -> int:
    from expertmesh.devtools import bench_k3, fetch_baseline
    from expertmesh.devtools.tiny import k3_proportions
    from expertmesh.node.sizes import parse_size

    baseline = None
    if args.baseline:
        try:
            shape, baseline = fetch_baseline.load(Path(args.baseline))
        except fetch_baseline.BaselineError as e:
            raise ExpertmeshError(f"--baseline: {e}") from None
        unknown = [c for c in shape.configs if c not in bench_k3.ALL_CONFIGS]
        if unknown:
            raise ExpertmeshError(f"--baseline: {args.baseline} names configurations this bench lacks: {unknown}")
        print(f"running the shape of {args.baseline} (its configs, caps, repo and tokens)", file=sys.stderr)
    else:
        try:
            caps = [float(parse_size(c)) for c in args.per_connection_bandwidth.split(",")]
        except ValueError as e:
            raise ExpertmeshError(f"--per-connection-bandwidth: {e}") from None
        configs = _names("--configs", args.configs, bench_k3.ALL_CONFIGS) if args.configs else bench_k3.CONFIGS
        given = {"experts": args.experts_per_layer, "moe_layers": args.moe_layers, "router": args.router}
        made = k3_proportions.Proportions(**{k: v for k, v in given.items() if v is not None})
        shape = fetch_baseline.Shape(made.experts, made.moe_layers, made.router, configs, tuple(caps), args.tokens or 4)
    proportions = k3_proportions.Proportions(experts=shape.experts, moe_layers=shape.moe_layers, router=shape.router)
    if proportions.top_k > proportions.experts:
        raise ExpertmeshError(f"--experts-per-layer: at least the {proportions.top_k} experts a token uses")
    doc = bench_k3.run(
        list(shape.per_connection),
        tokens=shape.tokens,
        configs=shape.configs,
        proportions=proportions,
        progress=lambda m: print(m, file=sys.stderr),
        kernel_link=args.kernel_link,
    )
    bench_k3.print_table(doc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    if args.record_baseline:
        fetch_baseline.record(doc, shape, Path(args.record_baseline))
        print(f"wrote the baseline {args.record_baseline}", file=sys.stderr)
    if baseline is not None:
        return 0 if fetch_baseline.print_comparison(fetch_baseline.compare(doc, baseline), baseline) else 1
    return 0


def _slots(budgets: str, total: int) -> list[int]:
    """`10%,25%` or `40,80` as numbers of experts."""
    slots = []
    for b in budgets.split(","):
        b = b.strip()
        try:
            n = round(total * float(b[:-1]) / 100) if b.endswith("%") else int(b)
        except ValueError:
            n = -1
        if n < 0:
            raise ExpertmeshError(f"--budgets: {b!r} is neither a count of experts nor a percentage")
        slots.append(n)
    return slots


def replay(args: argparse.Namespace) -> int:
    from expertmesh.node.observability.routing_trace import read_trace
    from expertmesh.node.observability.routing_trace import replay as replay_trace

    try:
        trace = read_trace(Path(args.trace))
    except (OSError, ValueError) as e:
        raise ExpertmeshError(str(e)) from None
    slots = _slots(args.budgets, trace.total_experts)
    accesses = len(trace.accesses())
    print(
        f"{trace.repo} @ {trace.commit[:12]}: {trace.passes} passes, {accesses} expert uses, "
        f"{trace.total_experts} experts in {len(trace.experts_per_layer)} MoE layers"
    )
    table = replay_trace(trace, slots, args.policies.split(",") if args.policies else None)
    print(f"{'RAM hit rate':<14}" + "".join(f"{n:>8} ({100 * n / trace.total_experts:.0f}%)" for n in slots))
    for name, rates in table.items():
        print(f"{name:<14}" + "".join(f"{rates[n]:>14.3f}" for n in slots))
    return 0


def lab(args: argparse.Namespace) -> int:
    from expertmesh.devtools.lab.household import OPTIONAL_SCENARIOS, SCENARIOS, Lab, LabConfig, print_table
    from expertmesh.node.sizes import parse_size

    scenarios = _names("--scenarios", args.scenarios, SCENARIOS + OPTIONAL_SCENARIOS)
    try:
        lan, hub_bw = float(parse_size(args.lan)), float(parse_size(args.hub_bandwidth))
    except ValueError as e:
        raise ExpertmeshError(f"--lan/--hub-bandwidth: {e}") from None
    inputs = {}
    if args.metal_compute_s is not None:
        inputs["metal_compute_s"] = args.metal_compute_s
    if args.ssd_bytes_per_s is not None:
        inputs["ssd_bytes_per_s"] = args.ssd_bytes_per_s
    config = LabConfig(
        nodes=args.nodes,
        moe_layers=args.layers,
        experts=args.experts,
        top_k=args.top_k,
        tokens=args.tokens,
        prompt_tokens=args.prompt_tokens,
        lan_bytes_per_s=lan,
        hub_bytes_per_s=hub_bw,
        hub_ttfb_s=args.hub_ttfb,
        scenarios=scenarios,
        namespaces=False if args.loopback else None,
        projection_inputs=inputs,
    )
    doc = Lab(config, progress=lambda m: print(m, file=sys.stderr, flush=True)).run()
    print_table(doc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
