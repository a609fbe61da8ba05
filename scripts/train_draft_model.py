"""Train the demo model's draft model: a tiny dense Llama distilled from it, for `--speculate draft`.

Speculative decoding needs a draft model with the big model's tokenizer that is much cheaper per
token. Nothing else has the demo's 1024-token vocabulary, so this trains one: mlx-lm's own
`llama` (dense, no MoE, no KDA state: the cheapest thing mlx-lm runs), taught to predict what the
demo model predicts. The loss is KL(demo || draft) of the next-token distributions on the demo's
own training windows (the same docstrings, tokenizer and windows, by the demo script's functions);
agreeing with the demo, not with the text, is what gets a draft accepted. Run once; it writes the
folder `expertmesh/devtools/tiny/demo_model.py` publishes as the draft repo into expertmesh/devtools/tiny/draft/:

    config.json, model.safetensors    mlx-lm's llama, bf16, tied embeddings
    tokenizer.json, tokenizer_config.json   the demo's, byte for byte
    PROVENANCE.md                     command, data, seeds, steps, losses, agreement, wall time

The teacher is the demo's Hub repo as mlx-lm loads it (mxfp4 experts), cast to float32: the
streamed model's bf16 core without bf16's rounding, and faster on a CPU. Its log-probabilities are computed for a batch's windows the
first time they are drawn and kept (float16) for the next epoch: one teacher pass per window.
The defaults take the demo's own 900 batches in the demo's order (the same seed and windows), at
a size where a drafted token costs a fraction of the demo's: 2 layers of 96, under 1 MB in bf16.

    python scripts/train_draft_model.py                          # the real run (~11 minutes on 2 CPU cores)
    python scripts/train_draft_model.py --steps 20 --out /tmp/x  # a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import train_demo_model as demo_data  # a script's own folder is on sys.path
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from tokenizers import Tokenizer

from expertmesh.devtools.tiny import demo_model
from expertmesh.devtools.tiny.common import write_json
from expertmesh.node.model.mlx_lm_models import model_classes


def draft_config(hidden: int, layers: int, intermediate: int, heads: int) -> dict:
    """mlx-lm's `llama` config of the draft; tied embeddings keep it small (vocab x hidden once)."""
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,  # the tokenizer's model_max_length
        "vocab_size": demo_model.VOCAB_SIZE,
        "tie_word_embeddings": True,
    }


def load_teacher(tmp: Path) -> nn.Module:
    """The demo model as `expertmesh` serves it (its Hub repo), loaded by mlx-lm, in float32."""
    import mlx_lm

    model, _ = mlx_lm.load(str(demo_model.make_demo_model(tmp / "demo")))
    model.set_dtype(mx.float32)  # MLX's CPU runs float32 matmuls about 2x faster than bf16 ones here
    model.eval()
    return model


class TeacherCache:
    """The teacher's next-token log-probabilities per training window, computed on first use."""

    def __init__(self, teacher: nn.Module, windows: mx.array):
        self.teacher, self.windows = teacher, windows
        n, width = windows.shape
        # np.zeros maps untouched pages lazily: a smoke run holds only the windows it drew
        self.logprobs = np.zeros((n, width - 1, demo_model.VOCAB_SIZE), dtype=np.float16)
        self.have = np.zeros(n, dtype=bool)
        self.seconds = 0.0

    def get(self, idx: np.ndarray) -> mx.array:
        missing = np.unique(idx[~self.have[idx]])
        if missing.size:
            t0 = time.time()
            lp = nn.log_softmax(self.teacher(self.windows[mx.array(missing)][:, :-1]).astype(mx.float32), axis=-1)
            self.logprobs[missing] = np.array(lp.astype(mx.float16))
            self.have[missing] = True
            self.seconds += time.time() - t0
        return mx.array(self.logprobs[idx]).astype(mx.float32)


def kl_divergence(logits: mx.array, teacher_logprobs: mx.array) -> mx.array:
    """Mean over positions of KL(teacher || draft), in nats."""
    logq = logits.astype(mx.float32)
    logq = logq - mx.logsumexp(logq, axis=-1, keepdims=True)
    return (mx.exp(teacher_logprobs) * (teacher_logprobs - logq)).sum(axis=-1).mean()


def compare(draft: nn.Module, teacher: nn.Module, batch: mx.array, chunk: int = 8) -> dict:
    """Draft against teacher on `batch`'s windows, each position given the true text before it.

    Returns the mean KL(teacher || draft), the share of positions where both argmaxes agree
    (what a greedy draft needs to be accepted) and each model's cross-entropy to the text.
    """
    kl = agree = ce_draft = ce_teacher = 0.0
    count = 0
    for i in range(0, batch.shape[0], chunk):
        b = batch[i : i + chunk]
        x, y = b[:, :-1], b[:, 1:]
        lp = nn.log_softmax(teacher(x).astype(mx.float32), axis=-1)
        logits = draft(x).astype(mx.float32)
        n = y.size
        kl += kl_divergence(logits, lp).item() * n
        agree += (mx.argmax(logits, axis=-1) == mx.argmax(lp, axis=-1)).sum().item()
        ce_draft += nn.losses.cross_entropy(logits, y, reduction="sum").item()
        ce_teacher += -mx.take_along_axis(lp, y[..., None], axis=-1).sum().item()
        count += n
    return {
        "kl": kl / count,
        "agreement": agree / count,
        "ce_draft": ce_draft / count,
        "ce_teacher": ce_teacher / count,
        "positions": count,
    }


def ms_per_token(model: nn.Module, tokens: int = 64) -> float:
    """One-token forward passes with a cache, as ModelDraft drafts (after an 8-token prompt)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(8)[None], cache=cache))
    t0 = time.perf_counter()
    for i in range(tokens):
        mx.eval(model(mx.array([[i + 8]]), cache=cache))
    return (time.perf_counter() - t0) / tokens * 1000


def save_folder(out: Path, model: nn.Module, cfg: dict) -> None:
    """What mlx_lm.load needs: config, bf16 weights by mlx-lm's names, the demo's tokenizer."""
    params = {k: v.astype(mx.bfloat16) for k, v in sorted(tree_flatten(model.parameters()))}
    mx.save_safetensors(str(out / "model.safetensors"), params, metadata={"format": "mlx"})
    write_json(out / "config.json", cfg)
    for name in demo_model.TOKENIZER_FILES:
        shutil.copyfile(demo_model.DEMO_DIR / name, out / name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=demo_model.DRAFT_DIR)
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=96)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--val-every", type=int, default=150)
    args = ap.parse_args(argv)
    t0 = time.time()
    seq = demo_model.SEQ_LEN
    args.out.mkdir(parents=True, exist_ok=True)

    # the demo's data, by its own functions; its committed tokenizer, not a retrained one
    files = demo_data.source_files()
    train_docs, val_docs = demo_data.corpus(files)
    corpus_sha = hashlib.sha256(
        (demo_data.EOT.join(train_docs) + "\0" + demo_data.EOT.join(val_docs)).encode()
    ).hexdigest()
    if corpus_sha not in (demo_model.DEMO_DIR / "PROVENANCE.md").read_text():
        raise SystemExit(
            f"the extracted docstrings (sha256 {corpus_sha}) are not the demo model's: "
            f"another Python in {demo_data.STDLIB}?"
        )
    tok = Tokenizer.from_file(str(demo_model.DEMO_DIR / "tokenizer.json"))
    train_ids, val_ids = demo_data.encode(tok, train_docs), demo_data.encode(tok, val_docs)
    windows = demo_model.windows(train_ids, seq)
    held_docs = (demo_model.DEMO_DIR / demo_model.HELDOUT_FILE).read_text(encoding="utf-8").split(demo_data.EOT)[:-1]
    held_ids = demo_data.encode(tok, held_docs)
    heldout = demo_model.windows(held_ids, seq)
    val = demo_model.windows(val_ids[len(held_ids) :], seq)[:48]  # the demo's validation windows
    print(
        f"{len(files)} files (sha256 of the text {corpus_sha[:12]}, the demo's): {windows.shape[0]} training "
        f"windows, {val.shape[0]} validation, {heldout.shape[0]} held out",
        flush=True,
    )

    rng = np.random.default_rng(args.seed)
    order = np.concatenate(
        [rng.permutation(windows.shape[0]) for _ in range(math.ceil(args.steps * args.batch / windows.shape[0]))]
    )
    epochs = args.steps * args.batch / windows.shape[0]

    with tempfile.TemporaryDirectory() as tmp:
        teacher = load_teacher(Path(tmp))
    cache = TeacherCache(teacher, windows)

    cfg = draft_config(args.hidden, args.layers, args.intermediate, args.heads)
    model_class, args_class = model_classes(cfg)
    mx.random.seed(args.seed)
    model = model_class(args_class.from_dict(cfg))
    model.train()
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    decay_steps = max(1, args.steps - args.warmup)
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(args.lr / args.warmup, args.lr, args.warmup),
            optim.cosine_decay(args.lr, decay_steps, args.lr * 0.1),
        ],
        [args.warmup],
    )
    optimizer = optim.MultiOptimizer(
        [
            optim.AdamW(schedule, betas=[0.9, 0.95], weight_decay=args.weight_decay),
            optim.AdamW(schedule, betas=[0.9, 0.95], weight_decay=0.0),
        ],
        [lambda path, w: w.ndim >= 2],  # decay matrices, not norms
    )

    def loss_fn(m: nn.Module, x: mx.array, teacher_logprobs: mx.array) -> mx.array:
        return kl_divergence(m(x), teacher_logprobs)

    loss_and_grad = nn.value_and_grad(model, loss_fn)

    print(
        f"draft: llama, {n_params} parameters; {args.steps} steps of {args.batch}x{seq} tokens = {epochs:.2f} epochs",
        flush=True,
    )
    history, t_train, recent = [], time.time(), []
    for step in range(1, args.steps + 1):
        idx = order[(step - 1) * args.batch : step * args.batch]
        target = cache.get(idx)
        loss, grads = loss_and_grad(model, windows[mx.array(idx)][:, :-1], target)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        mx.eval(loss, model.parameters(), optimizer.state)
        recent.append(loss.item())
        if step % args.log_every == 0 or step == args.steps:
            el = time.time() - t_train
            print(
                f"step {step:4d}/{args.steps}  KL {np.mean(recent):.3f}  lr {schedule(step).item():.2e}  "
                f"{el:.0f}s ({el / step:.2f}s/step, teacher {cache.seconds:.0f}s)",
                flush=True,
            )
            history.append((step, float(np.mean(recent))))
            recent = []
        if step % args.val_every == 0 and step != args.steps:
            model.eval()
            v = compare(model, teacher, val)
            model.train()
            print(f"           val KL {v['kl']:.3f}, top-1 agreement {v['agreement']:.1%}", flush=True)
    train_time = time.time() - t_train
    model.eval()
    save_folder(args.out, model, cfg)

    # measured on what was saved, as ModelDraft loads it (bf16)
    import mlx_lm

    draft, draft_tok = mlx_lm.load(str(args.out))
    assert draft_tok.get_vocab() == tok.get_vocab(), "the draft folder's tokenizer is not the demo's"
    final_train = compare(draft, teacher, windows[mx.array(order[:48])])  # 48 windows it trained on
    final_val = compare(draft, teacher, val)
    held = compare(draft, teacher, heldout)
    with tempfile.TemporaryDirectory() as tmp:
        demo_bf16, _ = mlx_lm.load(str(demo_model.make_demo_model(Path(tmp) / "demo")))
    speed = {"draft": ms_per_token(draft), "demo": ms_per_token(demo_bf16)}
    weight_bytes = (args.out / "model.safetensors").stat().st_size
    wall = time.time() - t0
    print(
        f"trained in {train_time:.0f}s (teacher {cache.seconds:.0f}s); held-out KL {held['kl']:.3f}, "
        f"top-1 agreement {held['agreement']:.1%}; {weight_bytes} bytes; "
        f"{speed['draft']:.1f} ms/token vs the demo's {speed['demo']:.1f}; wall time {wall:.0f}s",
        flush=True,
    )

    cmd = "python scripts/train_draft_model.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    rows = [
        ("48 training windows", final_train),
        ("validation (48 windows)", final_val),
        (f"heldout.txt ({heldout.shape[0]} windows)", held),
    ]
    table = "\n".join(
        f"| {name} | {r['kl']:.3f} | {r['agreement']:.1%} | {r['ce_draft']:.3f} | {r['ce_teacher']:.3f} |"
        for name, r in rows
    )
    provenance = f"""# Provenance of the demo's draft model

Trained by `{cmd}` (run from the project root), once, on
{datetime.date.today().isoformat()}, on {platform.machine()} / {os.cpu_count()} CPU cores, mlx {mx.__version__}
(CPU), in {wall / 60:.1f} minutes of wall time ({train_time / 60:.1f} of them training, of which
{cache.seconds / 60:.1f} running the teacher).

## Data and licence

The demo model's training data, extracted by the demo's own functions (`scripts/train_demo_model.py`,
imported): docstrings of the Python 3.11 standard library, **PSF License Version 2**; see
`expertmesh/devtools/tiny/demo/PROVENANCE.md` for sources, exclusions and PSF's notice, retained as the licence asks:
"Copyright (c) 2001, 2002, 2003, 2004, 2005, 2006, 2007, 2008, 2009, 2010, 2011, 2012, 2013, 2014,
2015, 2016, 2017, 2018, 2019, 2020, 2021, 2022, 2023 Python Software Foundation; All Rights Reserved".
sha256 of the extracted text: `{corpus_sha}` (checked equal to the demo's). The same
{windows.shape[0]} training windows of {seq} tokens, the same validation windows, and `heldout.txt`, never trained on.
No text labels are used: the targets are the demo model's predictions.

## Tokenizer

The demo's, byte for byte (`tokenizer.json`, `tokenizer_config.json`):
`ModelDraft.load` refuses a draft whose vocabulary differs.

## Model and training

mlx-lm's `llama` ({n_params} parameters, {weight_bytes} bytes of bf16 weights): hidden {cfg["hidden_size"]},
{cfg["num_hidden_layers"]} layers, {cfg["num_attention_heads"]} heads, MLP {cfg["intermediate_size"]}, vocabulary {cfg["vocab_size"]},
tied embeddings. mlx-lm's own initialisers with `mx.random.seed({args.seed})`; trained in float32, saved in bf16.
Teacher: the demo's Hub repo (`make_demo_model`) loaded by `mlx_lm.load`, in float32.
Loss: KL(teacher || draft) of the next-token distributions, every position, temperature 1; the
teacher's log-probabilities kept in float16 after a window's first use.
{args.steps} steps of {args.batch} x {seq} tokens ({epochs:.2f} epochs, shuffled with
`numpy.random.default_rng({args.seed})`, one permutation per epoch). AdamW (betas 0.9, 0.95; weight
decay {args.weight_decay} on matrices, 0 on norms), LR {args.lr} with a linear warmup of {args.warmup} steps then cosine
decay to {args.lr * 0.1:g}; gradient norm clipped at 1.0.

## Results

Of the saved folder (bf16, loaded by `mlx_lm.load`) against the teacher, each position given the
true text before it. Agreement: the share of positions where the draft's and the demo's argmax
are the same token (what a greedy draft needs to be accepted).

| | KL(demo ‖ draft) | top-1 agreement | draft's loss | demo's loss |
|---|---|---|---|---|
{table}

Uniform loss: {math.log(demo_model.VOCAB_SIZE):.3f} nats/token. Distillation loss (KL, mean over each
{args.log_every} steps): {", ".join(f"{s}: {loss:.2f}" for s, loss in history)}.

Cost per drafted token (one-token passes with a cache, as `ModelDraft` drafts; mlx-lm loads, bf16,
this machine): draft {speed["draft"]:.1f} ms, the demo model {speed["demo"]:.1f} ms.
"""
    (args.out / "PROVENANCE.md").write_text(provenance)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
