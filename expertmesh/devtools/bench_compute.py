"""`expertmesh bench --compute`: what a GPU would pay per decode token, beside mlx-lm on the same weights.

On Apple Silicon the cost of a MoE layer is in its dispatches and host syncs more than in its
maths, so this bench counts them on any machine from MLX's own graph (devtools/graph_counts.py):
kernels per decode token (graph nodes that launch work, each `mx.fast` op once), syncs per token
(with every expert resident, and streaming with a RAM tier for a quarter of them), host-side
Python seconds per token (the MLX thread's own CPU time: MLX computes on threads of its own), CPU
seconds per token (the process's), and the bytes the RAM tier copied per token (slot writes, and
whole stacks a write could not update in place), all beside `mlx_lm.stream_generate` on the same
repo, with the greedy tokens compared. Counting costs time, so the seconds come from other runs,
taken in turns with mlx-lm's (`repeats` each, the median kept). Beside the seconds, the Python
calls per decode token on the MLX thread (functions and builtins entered): on this shared host the
seconds of a few-millisecond token move with the load, the calls do not, so a change in the host's
per-token work shows in them whatever the machine is doing.

Shapes, made with the tiny makers (expertmesh/devtools/tiny/):
    k3_depth     Kimi K3's depth: 92 MoE layers of 64 mxfp4 experts, top-16, small widths
    qwen3_depth  Qwen3-30B-A3B's depth: 48 layers of 128 experts, top-8 (BF16 experts)
    demo         the trained demo model
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

SHAPES = ("k3_depth", "qwen3_depth", "demo")
PROMPT = "The experts of every layer of the model"
RAM_ALL = "4GB"  # far more than any shape's experts: every expert resident
STREAMING_SHARE = 0.25  # the streaming run's RAM tier holds a quarter of the experts


def _make(shape: str, out: Path) -> str:
    """Write `shape`'s repo under the Hub folder `out`; returns its repo id."""
    if shape == "k3_depth":
        from expertmesh.devtools.tiny import k3_proportions

        p = k3_proportions.Proportions(moe_layers=92, experts=64, top_k=16, latent=128, intermediate=128, hidden=128)
        k3_proportions.build(out / "bench/k3_depth", 0, p)
        return "bench/k3_depth"
    if shape == "qwen3_depth":
        from expertmesh.devtools.tiny import qwen3_moe

        (out / "bench/qwen3_depth").mkdir(parents=True)
        qwen3_moe.build_shaped(out / "bench/qwen3_depth", 0, layers=48, experts=128, top_k=8)
        return "bench/qwen3_depth"
    if shape == "demo":
        from expertmesh.devtools.tiny.demo_model import REPO_ID, make_demo_model

        make_demo_model(out / REPO_ID)
        return REPO_ID
    raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")


def _warm_ram(sm) -> None:
    """Every expert of every layer into the RAM tier's slots, as a block places them."""
    from expertmesh.node.engine.model_thread import model_thread

    per_layer: dict[int, list[int]] = {}
    for layer, e in sm.index.experts:
        per_layer.setdefault(layer, []).append(e)
    for layer, experts in sorted(per_layer.items()):
        for group in sm.store.layer_groups(layer, experts, routed=[]):
            model_thread().call(_place, group)


def _place(group) -> None:
    with group.placed():
        pass


class _Tokens:
    """Per decode token: wall, process CPU and the MLX thread's own CPU time (the host's Python:
    MLX computes on threads of its own), and counters, sampled as each token arrives."""

    def __init__(self, read: Callable[[], dict]):
        self.read = read
        self.host_clock = time.pthread_getcpuclockid(_run_on_mlx_thread(threading.get_ident))
        self.samples: list[dict] = []

    def tick(self) -> None:
        self.samples.append(
            {
                "wall": time.perf_counter(),
                "cpu": time.process_time(),
                "host": time.clock_gettime(self.host_clock),
                **self.read(),
            }
        )

    def per_token(self, key: str) -> float:
        """The mean over decode tokens (after the first: its time is the prefill's)."""
        if len(self.samples) < 2:
            return 0.0
        return (self.samples[-1][key] - self.samples[0][key]) / (len(self.samples) - 1)


def _ours(sm, ids: list[int], tokens: int, on_token: Callable[[], None]) -> list[int]:
    from expertmesh.node.engine.generation import Generator, SamplingSettings

    out = []
    for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=tokens)):
        out.append(t.id)
        on_token()
    return out


def _mlx_lm(model, tokenizer, ids: list[int], tokens: int, on_token: Callable[[], None]) -> list[int]:
    """`mlx_lm.stream_generate`, greedy, as a user calls it (detokenizing, like ours); the
    end-of-sequence token, which ours does not hand out, left out."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    out = []
    for r in mlx_lm.stream_generate(model, tokenizer, mx.array(ids), max_tokens=tokens, sampler=make_sampler(0.0)):
        if r.finish_reason != "stop":
            out.append(r.token)
        on_token()
    return out


def _run_on_mlx_thread(fn: Callable, *args):
    from expertmesh.node.engine.model_thread import model_thread

    return model_thread().call(fn, *args)


@contextlib.contextmanager
def _passes_of(model) -> Iterator[list[int]]:
    """Forward passes of `model` (calls of mlx-lm's model object, ours and mlx-lm's alike) while
    inside: `[n]`."""
    cls = type(model)
    call = cls.__call__
    count = [0]

    def counted(self, *args, **kwargs):
        if self is model:
            count[0] += 1
        return call(self, *args, **kwargs)

    cls.__call__ = counted
    try:
        yield count
    finally:
        cls.__call__ = call


def _counted(generate: Callable[[Callable[[], None]], list[int]], extra: Callable[[], dict], model) -> dict:
    """Kernels per decode pass, syncs (and what `extra` reads) per decode token of one generation,
    and its tokens.

    Kernels are counted per pass of `model`, not per token handed out: a generator that builds
    the next pass before handing out a token (mlx-lm's, and ours with every expert resident) has
    counted a different number of passes by its first and last tokens than one that does not."""
    from expertmesh.devtools.graph_counts import GraphCounter

    with GraphCounter() as counts, _passes_of(model) as passes:
        tokens = _Tokens(
            lambda: {"kernels": counts.fast_adjusted_kernels, "passes": passes[0], "syncs": counts.syncs, **extra()}
        )
        out = generate(tokens.tick)
        first, end = tokens.samples[0], {"kernels": counts.fast_adjusted_kernels, "passes": passes[0]}
    per_pass = (end["kernels"] - first["kernels"]) / max(1, end["passes"] - first["passes"])
    keys = [k for k in first if k not in ("wall", "cpu", "host", "kernels", "passes")]
    return {"tokens": out, "kernels": per_pass, **{k: tokens.per_token(k) for k in keys}}


def _timed(runs: dict[str, Callable[[Callable[[], None]], list[int]]], repeats: int) -> dict[str, dict]:
    """Wall, CPU and host seconds per decode token of each of `runs`, taken in turns `repeats`
    times without the counting's own cost; the median of each, and the run's last tokens."""
    seen: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": [], "host": []} for name in runs}
    made: dict[str, list[int]] = {}
    for _ in range(repeats):
        for name, generate in runs.items():
            tokens = _Tokens(dict)
            made[name] = generate(tokens.tick)
            for key, values in seen[name].items():
                values.append(tokens.per_token(key))
    return {
        name: {**{f"{k}_s": statistics.median(v) for k, v in got.items()}, "tokens": made[name]}
        for name, got in seen.items()
    }


def _python_calls(generate: Callable[[Callable[[], None]], list[int]]) -> float:
    """Python calls (functions and builtins entered) on the MLX thread per decode token of one
    generation: what the host runs per token, counted rather than timed. Ours hands each token from
    the MLX thread to its caller, so the thread's turn-taking is counted too; mlx-lm's generation
    runs in one turn, its count taken in it (two calls a token: the sample's own)."""
    count = [0]

    def counter(frame, event: str, arg) -> None:
        if event == "call" or event == "c_call":
            count[0] += 1

    samples: list[int] = []
    _run_on_mlx_thread(sys.setprofile, counter)  # the MLX thread's own: other threads go uncounted
    try:
        generate(lambda: samples.append(count[0]))
    finally:
        _run_on_mlx_thread(sys.setprofile, None)
    return (samples[-1] - samples[0]) / (len(samples) - 1) if len(samples) > 1 else 0.0


def _copied(sm) -> Callable[[], dict]:
    """Bytes the RAM tier copied so far: one expert per slot write, a whole stack per buffer that moved."""
    ram = sm.store.ram
    slot_bytes = ram.pool(sm.blocks[0].layer).layout.nbytes
    state: dict = {"buffers": {}, "stack_copies": 0}

    def read() -> dict:
        buffers = _run_on_mlx_thread(ram.stack_buffers)
        for key, (where, nbytes) in buffers.items():
            if key in state["buffers"] and state["buffers"][key][0] != where:
                state["stack_copies"] += nbytes
        state["buffers"] = buffers
        return {"copied": ram.slot_writes * slot_bytes + state["stack_copies"]}

    return read


@contextlib.contextmanager
def served(shape: str, tmp: Path, progress: Callable[[str], None] = lambda m: None) -> Iterator[tuple[str, Path, Path]]:
    """`shape`'s repo made under `tmp`, served by a local Hub and pulled: (repo id, its folder, the
    home it was pulled into), while inside."""
    from expertmesh.devtools.local_hub import HubServer
    from expertmesh.node.hub import client as hub_client
    from expertmesh.node.hub.pull import pull

    hub_dir, home = tmp / "hub", tmp / "home"
    t0 = time.perf_counter()
    repo_id = _make(shape, hub_dir)
    progress(f"{shape}: made {repo_id} in {time.perf_counter() - t0:.0f} s")
    with HubServer(hub_dir) as hub, hub_client.using_endpoint(hub.url):
        pull(repo_id, home=home, progress=False)
        yield repo_id, hub_dir / repo_id, home


@contextlib.contextmanager
def resident(repo_id: str, repo_dir: Path, home: Path) -> Iterator[tuple]:
    """(our model with every expert in a RAM slot, mlx-lm's model of the same repo, its tokenizer,
    the prompt's ids), while inside; mlx-lm's runs in the dtype ours runs dense experts in."""
    import mlx_lm

    from expertmesh.assembly import open_model
    from expertmesh.node.config import StoreConfig

    ref, tokenizer = _run_on_mlx_thread(mlx_lm.load, str(repo_dir))
    sm = open_model(repo_id, home=home, store=StoreConfig(ram_budget=RAM_ALL, prefetch=False, fill=False))
    try:
        if sm.codec.dense_dtype is not None:  # dense experts on a CPU run in float32: so must mlx-lm
            _run_on_mlx_thread(ref.set_dtype, sm.codec.dense_dtype)
        _warm_ram(sm)
        if not sm.all_resident():
            raise RuntimeError(f"{repo_id}: the RAM tier did not take every expert")
        yield sm, ref, tokenizer, tokenizer.encode(PROMPT)
    finally:
        sm.close()


def run(
    shapes: tuple[str, ...] = SHAPES,
    tokens: int = 24,
    repeats: int = 3,
    progress: Callable[[str], None] = lambda m: None,
) -> dict:
    """Every shape measured side by side with mlx-lm; the JSON document `--json` writes."""
    import mlx.core as mx

    doc: dict = {"tokens": tokens, "repeats": repeats, "prompt": PROMPT, "shapes": []}
    with tempfile.TemporaryDirectory(prefix="expertmesh-bench-compute-") as tmp:
        for shape in shapes:
            with served(shape, Path(tmp), progress) as (repo_id, repo_dir, home):
                entry = _shape(shape, repo_id, repo_dir, home, tokens, repeats, progress)
            doc["shapes"].append(entry)
            progress(
                f"{shape}: kernels {entry['kernels_per_token']} vs mlx-lm {entry['mlx_lm_kernels_per_token']}, "
                f"CPU {entry['cpu_s_per_token']:.4f} vs {entry['mlx_lm_cpu_s_per_token']:.4f} s/token"
            )
            mx.clear_cache()
    return doc


def _shape(
    shape: str, repo_id: str, repo_dir: Path, home: Path, tokens: int, repeats: int, progress: Callable[[str], None]
) -> dict:
    from expertmesh.assembly import open_model
    from expertmesh.node.config import StoreConfig

    with resident(repo_id, repo_dir, home) as (sm, ref, tokenizer, ids):
        progress(f"{shape}: every expert resident; measuring")

        def theirs(tick: Callable[[], None]) -> list[int]:
            return _run_on_mlx_thread(_mlx_lm, ref, tokenizer, ids, tokens, tick)

        def ours(tick: Callable[[], None]) -> list[int]:
            return _ours(sm, ids, tokens, tick)

        resident_counts = _counted(ours, _copied(sm), sm.model)
        reference = _counted(theirs, dict, ref)
        times = _timed({"ours": ours, "mlx_lm": theirs}, repeats)
        calls = {"ours": _python_calls(ours), "mlx_lm": _python_calls(theirs)}
        experts, moe_layers = len(sm.index.experts), len(sm.blocks)
        slot_bytes = sm.store.ram.pool(sm.blocks[0].layer).layout.nbytes
    # streaming: a RAM tier for a quarter of the experts, the rest read from the disk
    share = str(int(STREAMING_SHARE * experts * slot_bytes))
    sm = open_model(repo_id, home=home, store=StoreConfig(ram_budget=share, prefetch=True, fill=False))
    try:
        streaming = _counted(lambda tick: _ours(sm, ids, tokens, tick), _copied(sm), sm.model)
    finally:
        sm.close()
    return {
        "name": shape,
        "moe_layers": moe_layers,
        "kernels_per_token": round(resident_counts["kernels"], 1),
        "mlx_lm_kernels_per_token": round(reference["kernels"], 1),
        "syncs_per_token_resident": round(resident_counts["syncs"], 2),
        "syncs_per_token_streaming": round(streaming["syncs"], 2),
        "mlx_lm_syncs_per_token": round(reference["syncs"], 2),
        "host_s_per_token": round(times["ours"]["host_s"], 5),
        "mlx_lm_host_s_per_token": round(times["mlx_lm"]["host_s"], 5),
        "python_calls_per_token": round(calls["ours"], 1),
        "mlx_lm_python_calls_per_token": round(calls["mlx_lm"], 1),
        "cpu_s_per_token": round(times["ours"]["cpu_s"], 5),
        "mlx_lm_cpu_s_per_token": round(times["mlx_lm"]["cpu_s"], 5),
        "wall_s_per_token": round(times["ours"]["wall_s"], 5),
        "mlx_lm_wall_s_per_token": round(times["mlx_lm"]["wall_s"], 5),
        "copied_bytes_per_token": round(resident_counts["copied"]),
        "kernels_per_token_streaming": round(streaming["kernels"], 1),
        "copied_bytes_per_token_streaming": round(streaming["copied"]),
        "tokens_equal_mlx_lm": resident_counts["tokens"] == reference["tokens"] == streaming["tokens"],
    }


def print_table(doc: dict, out: Callable[[str], None] = print) -> None:
    rows = [
        ("kernels / decode token", "kernels_per_token", "mlx_lm_kernels_per_token", "{:.0f}"),
        ("syncs / token (resident)", "syncs_per_token_resident", "mlx_lm_syncs_per_token", "{:.2f}"),
        ("syncs / token (streaming)", "syncs_per_token_streaming", None, "{:.2f}"),
        ("host Python s / token", "host_s_per_token", "mlx_lm_host_s_per_token", "{:.4f}"),
        ("host Python calls / token", "python_calls_per_token", "mlx_lm_python_calls_per_token", "{:.0f}"),
        ("CPU s / token", "cpu_s_per_token", "mlx_lm_cpu_s_per_token", "{:.4f}"),
        ("wall s / token", "wall_s_per_token", "mlx_lm_wall_s_per_token", "{:.4f}"),
        ("bytes copied / token", "copied_bytes_per_token", None, "{:.0f}"),
    ]
    for shape in doc["shapes"]:
        out(
            f"{shape['name']} ({shape['moe_layers']} MoE layers), tokens equal to mlx-lm: {shape['tokens_equal_mlx_lm']}"
        )
        out(f"  {'':28}{'expertmesh':>14}{'mlx-lm':>14}{'ratio':>8}")
        for label, mine, theirs, fmt in rows:
            a = shape[mine]
            b = shape[theirs] if theirs else None
            ratio = f"{a / b:.2f}" if b else ""
            out(f"  {label:28}{fmt.format(a):>14}{fmt.format(b) if b is not None else '':>14}{ratio:>8}")
