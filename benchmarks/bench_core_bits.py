"""The 8-bit core against the BF16 core on the trained demo model, side by side in one run.

Serves the demo model from a local Hub, pulls it twice (`--core-bits 16` and `--core-bits 8`),
opens both as `run` does and measures:
  - resident core bytes (the parameters in memory; experts are streamed and not counted) and the
    bytes stored on disk, 8-bit over BF16;
  - the noise floor of that agreement: the same BF16 core computed in float32 against bf16;
  - quality on held-out docstrings (never trained on): top-1 agreement of the next-token argmax and
    mean KL(p_bf16 || p_8bit) over every position of `--windows` windows of 128 tokens (>= 512
    positions), plus each core's mean next-token loss.
Targets (issue 7): bytes <= 0.55x, top-1 >= 98 %.

    python benchmarks/bench_core_bits.py [--windows 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny.demo_model import DEMO_DIR, HELDOUT_FILE, REPO_ID, make_demo_model, windows
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.core_quantization import core_parameter_bytes, pull_with_core_bits
from expertmesh.node.hub import client as hub_client

MARGIN = 0.05  # a "clear" position: BF16's top token leads the second by this much probability


def _stored_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("model*.safetensors"))


def run(n_windows: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="expertmesh-corebits-"))
    try:
        make_demo_model(work / "hub" / REPO_ID)
        with HubServer(work / "hub") as hub, hub_client.using_endpoint(hub.url):
            models = {}
            for bits in (16, 8):
                r = pull_with_core_bits(REPO_ID, home=work / f"h{bits}", progress=False, core_bits=bits)
                models[bits] = (
                    open_model(REPO_ID, home=work / f"h{bits}", store=StoreConfig(ram_budget="100%")),
                    r,
                )
            f32 = open_model(REPO_ID, home=work / "h16", store=StoreConfig(ram_budget="100%"))
            f32.model.set_dtype(mx.float32)  # the noise floor: the same BF16 weights computed in float32
            tok = models[16][0].tokenizer
            text = (DEMO_DIR / HELDOUT_FILE).read_text()
            batch = windows(tok.encode(text))[:n_windows]
            inputs, targets = batch[:, :-1], batch[:, 1:]
            agree = kl_sum = floor = clear = clear_agree = 0.0
            loss = {16: 0.0, 8: 0.0}
            positions = 0
            for i in range(inputs.shape[0]):
                x = inputs[i : i + 1]
                lp = {}
                for bits, (sm, _) in models.items():
                    logits = sm.model(x)[0].astype(mx.float32)
                    lp[bits] = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                    loss[bits] += -mx.take_along_axis(lp[bits], targets[i][:, None], axis=-1).sum().item()
                agree += (mx.argmax(lp[16], -1) == mx.argmax(lp[8], -1)).sum().item()
                top2 = mx.sort(mx.exp(lp[16]), axis=-1)[:, -2:]
                sure = (top2[:, 1] - top2[:, 0]) >= MARGIN
                clear += sure.sum().item()
                clear_agree += (sure & (mx.argmax(lp[16], -1) == mx.argmax(lp[8], -1))).sum().item()
                floor += (mx.argmax(lp[16], -1) == mx.argmax(f32.model(x)[0], -1)).sum().item()
                kl_sum += (mx.exp(lp[16]) * (lp[16] - lp[8])).sum().item()
                positions += x.shape[1]
            doc = {"model": REPO_ID, "positions": positions}
            for bits, (sm, r) in models.items():
                doc[f"core{bits}"] = {
                    "resident_core_bytes": core_parameter_bytes(sm.model),
                    "stored_core_bytes": _stored_bytes(sm.path),
                    "marker_core_bytes": r.core_bytes,
                    "mean_loss": loss[bits] / positions,
                }
                sm.close()
            doc["resident_ratio"] = doc["core8"]["resident_core_bytes"] / doc["core16"]["resident_core_bytes"]
            doc["stored_ratio"] = doc["core8"]["stored_core_bytes"] / doc["core16"]["stored_core_bytes"]
            f32.close()
            doc["top1_agreement"] = agree / positions
            doc["top1_bf16_vs_float32"] = floor / positions
            doc["clear_positions"] = int(clear)
            doc["top1_agreement_clear"] = clear_agree / max(1, clear)
            doc["mean_kl_nats"] = kl_sum / positions
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return doc


def print_table(d: dict) -> None:
    c16, c8 = d["core16"], d["core8"]
    print(f"{d['model']}: {d['positions']} held-out positions")
    print(f"{'core':<6} {'resident B':>11} {'stored B':>10} {'mean loss':>9}")
    for name, c in (("bf16", c16), ("8-bit", c8)):
        print(f"{name:<6} {c['resident_core_bytes']:>11} {c['stored_core_bytes']:>10} {c['mean_loss']:>9.4f}")
    print(
        f"8-bit / bf16: resident {d['resident_ratio']:.3f}x, stored {d['stored_ratio']:.3f}x (target <= 0.55x); "
        f"top-1 agreement {d['top1_agreement']:.2%} (target >= 98%); mean KL {d['mean_kl_nats']:.5f} nats"
    )
    print(
        f"where BF16's top token leads the second by >= {MARGIN} in probability ({d['clear_positions']} "
        f"positions): top-1 agreement {d['top1_agreement_clear']:.2%}"
    )
    print(
        f"noise floor: the BF16 core computed in float32 agrees with itself in bf16 on {d['top1_bf16_vs_float32']:.2%}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=8, help="128-token held-out windows (default 8: 1024 positions)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    doc = run(args.windows)
    print_table(doc)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
