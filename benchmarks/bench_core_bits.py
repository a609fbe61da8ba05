"""Every core format against BF16, beside mlx-lm's own `convert -q` of the whole model, in one run.

For the trained demo model (a tiny Kimi K3, mxfp4 experts) and two registry architectures
(expertmesh/devtools/tiny/registry.py: Qwen3-MoE and Mixtral, BF16 experts, random weights), each
served from a local Hub and pulled once, it compares on held-out text (the demo's validation
docstrings, never trained on; the same text in each model's own tokenizer):

    bf16, 8bit, 4bit, mixed_*   the core as `pull --core-bits/--core-quant` stores it and `run`
                                runs it (experts streamed in their upstream precision)
    mlx_lm_8bit, mlx_lm_4bit,   mlx-lm's own `convert -q --q-bits N` (or `--quant-predicate
    mlx_lm_mixed_*              RECIPE`) of the whole model, experts included: what a user would
                                otherwise run, loaded with `mlx_lm.load`

and for each: the core's resident bytes (parameters outside the routed experts), the whole model's
bytes, top-1 agreement of the next-token argmax with BF16, mean and p95 KL(p_bf16 || p) over every
position, and perplexity. Where the model computes in float32 on this CPU (BF16 experts: MLX's CPU
gather_mm), mlx-lm's conversions are computed in float32 too, so only the weights differ.

Tiny models are far more sensitive to quantisation than large ones (a 64-wide layer has few
weights per group to average errors over, and no redundancy): the figures compare formats with
each other on the same model; they do not predict a large model's loss.

    python benchmarks/bench_core_bits.py [--windows 8] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny import registry
from expertmesh.devtools.tiny.demo_model import DEMO_DIR, HELDOUT_FILE, make_demo_model, windows
from expertmesh.devtools.tiny.demo_model import REPO_ID as DEMO_REPO
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.core_quantization import RECIPES, quantize_core, recipe_bits
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub import local_models
from expertmesh.node.hub.pull import pull

OURS = [("bf16", 16, None), ("8bit", 8, None), ("4bit", 4, None), *[(r, recipe_bits(r), r) for r in RECIPES]]
MLX_LM = [("mlx_lm_8bit", 8, None), ("mlx_lm_4bit", 4, None), *[(f"mlx_lm_{r}", None, r) for r in RECIPES]]
REGISTRY = ("qwen3_moe", "mixtral")
_EXPERTS = ("switch_mlp", ".experts.")


def _log_probs(model, x: mx.array) -> mx.array:
    logits = model(x)[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _measure(model, batch: mx.array, reference: list[mx.array] | None) -> tuple[dict, list[mx.array]]:
    """Loss over `batch`, and against `reference` (BF16's log-probs) agreement and KL per position."""
    nll, agree, kls, out = 0.0, 0, [], []
    positions = 0
    for i in range(batch.shape[0]):
        x, y = batch[i : i + 1, :-1], batch[i, 1:]
        lp = _log_probs(model, x)
        mx.eval(lp)
        out.append(lp)
        nll += -mx.take_along_axis(lp, y[:, None], axis=-1).sum().item()
        positions += y.shape[0]
        if reference is not None:
            ref = reference[i]
            agree += (mx.argmax(ref, -1) == mx.argmax(lp, -1)).sum().item()
            kls.append(np.array((mx.exp(ref) * (ref - lp)).sum(-1)))
    doc = {"positions": positions, "perplexity": float(np.exp(nll / positions)), "mean_loss": nll / positions}
    if reference is not None:
        kl = np.concatenate(kls)
        doc.update(top1_agreement=agree / positions, kl_mean=float(kl.mean()), kl_p95=float(np.percentile(kl, 95)))
    return doc, out


def _core_bytes(model) -> int:
    return sum(v.nbytes for k, v in tree_flatten(model.parameters()) if not any(e in k for e in _EXPERTS))


def _model(name: str, repo_dir: Path, repo_id: str, work: Path, n_windows: int) -> list[dict]:
    """Every config of one model, BF16 first (the reference)."""
    bf16_home = work / "home-bf16"
    pull(repo_id, home=bf16_home, progress=False)
    text = (DEMO_DIR / HELDOUT_FILE).read_text()
    rows, reference, dense = [], None, None
    for config, bits, recipe in OURS:
        home = work / f"home-{config}"
        if bits != 16:
            shutil.copytree(bf16_home, home)
            quantize_core(local_models.find_pulled(home, repo_id), bits, recipe)
        sm = open_model(
            repo_id, home=bf16_home if bits == 16 else home, store=StoreConfig(ram_budget="100%", fill=False)
        )
        try:
            batch = windows(sm.tokenizer.encode(text))[:n_windows]
            dense = sm.codec.dense_dtype
            doc, lps = _measure(sm.model, batch, reference)
            if reference is None:
                reference = lps
                doc.update(top1_agreement=1.0, kl_mean=0.0, kl_p95=0.0)
            core = sm.core_bytes  # as stored and as a Mac holds it (this CPU may compute a BF16 core in float32)
            rows.append(
                {"model": name, "name": config, "core_bytes": core, "model_bytes": core + sm.index.expert_bytes, **doc}
            )
        finally:
            sm.close()
    for config, bits, recipe in MLX_LM:
        out = work / config
        mlx_lm.convert(str(repo_dir), str(out), quantize=True, q_bits=bits, quant_predicate=recipe)
        model, tokenizer = mlx_lm.load(str(out))
        whole = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        row = {"model": name, "name": config, "core_bytes": _core_bytes(model), "model_bytes": whole}
        if dense is not None:
            model.set_dtype(dense)  # compute as expertmesh computes this model here: only the weights differ
        batch = windows(tokenizer.encode(text))[:n_windows]
        try:
            doc, _ = _measure(model, batch, reference)
        except (ValueError, RuntimeError) as e:  # a conversion mlx-lm makes but cannot run: reported, not hidden
            doc = {"error": f"{type(e).__name__}: {e}", "top1_agreement": None, "kl_mean": None, "kl_p95": None,
                   "perplexity": None}  # fmt: skip
        rows.append({**row, **doc})
        del model
    return rows


def _noise_floor(repo_id: str, home: Path, n_windows: int) -> float:
    """Top-1 agreement of the BF16 core with itself computed in float32: what BF16 alone moves."""
    sm = open_model(repo_id, home=home, store=StoreConfig(ram_budget="100%", fill=False))
    try:
        batch = windows(sm.tokenizer.encode((DEMO_DIR / HELDOUT_FILE).read_text()))[:n_windows]
        _, bf16 = _measure(sm.model, batch, None)
        sm.model.set_dtype(mx.float32)
        doc, _ = _measure(sm.model, batch, bf16)
        return doc["top1_agreement"]
    finally:
        sm.close()


def run(n_windows: int, archs: tuple[str, ...] = REGISTRY) -> dict:
    work = Path(tempfile.mkdtemp(prefix="expertmesh-corebits-"))
    try:
        hub_dir = work / "hub"
        make_demo_model(hub_dir / DEMO_REPO)
        for arch in archs:
            (hub_dir / "registry" / arch).mkdir(parents=True)
            registry.build(hub_dir / "registry" / arch, arch)
        configs, floors = [], {}
        with HubServer(hub_dir) as hub, hub_client.using_endpoint(hub.url):
            models = [("demo", hub_dir / DEMO_REPO, DEMO_REPO)]
            models += [(arch, hub_dir / "registry" / arch, f"registry/{arch}") for arch in archs]
            for name, repo_dir, repo_id in models:
                configs += _model(name, repo_dir, repo_id, work / name, n_windows)
            floors["demo"] = _noise_floor(DEMO_REPO, work / "demo" / "home-bf16", n_windows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"windows": n_windows, "configs": configs, "top1_bf16_vs_float32": floors, "load": os.getloadavg()}


def print_table(doc: dict) -> None:
    print(
        f"{'model':<10} {'config':<18} {'core B':>10} {'model B':>10} {'top-1':>7} {'KL mean':>9} {'KL p95':>9} {'ppl':>8}"
    )
    for c in doc["configs"]:
        if c.get("error"):
            print(f"{c['model']:<10} {c['name']:<18} {c['core_bytes']:>10} {c['model_bytes']:>10}  fails: {c['error']}")
            continue
        print(
            f"{c['model']:<10} {c['name']:<18} {c['core_bytes']:>10} {c['model_bytes']:>10} "
            f"{c['top1_agreement']:>7.2%} {c['kl_mean']:>9.5f} {c['kl_p95']:>9.5f} {c['perplexity']:>8.3f}"
        )
    by = {(c["model"], c["name"]): c for c in doc["configs"]}
    for model in dict.fromkeys(c["model"] for c in doc["configs"]):
        ours, theirs, mixed = by[model, "4bit"], by[model, "mlx_lm_4bit"], by[model, "mixed_4_6"]
        print(
            f"{model}: 4-bit core KL {ours['kl_mean']:.5f} vs mlx-lm's 4-bit model {theirs['kl_mean']:.5f} "
            f"({'no worse' if ours['kl_mean'] <= theirs['kl_mean'] else 'WORSE'}); mixed_4_6 {mixed['kl_mean']:.5f} "
            f"({'lower' if mixed['kl_mean'] < ours['kl_mean'] else 'NOT lower'} than uniform 4-bit)"
        )
    for model, floor in doc["top1_bf16_vs_float32"].items():
        print(f"{model}: noise floor, the BF16 core in float32 against bf16: top-1 {floor:.2%}")
    print("tiny models are far more sensitive to quantisation than large ones: compare formats, not models")
    print(f"load average: {', '.join(f'{x:.2f}' for x in doc['load'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=8, help="128-token held-out windows per model (default 8)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    doc = run(args.windows)
    print_table(doc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
