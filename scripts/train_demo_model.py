"""Train the demo model: a tiny Kimi K3 (mlx-lm's own architecture) on Python stdlib docstrings.

Run once; it writes what `expertmesh/devtools/tiny/demo_model.py` needs into expertmesh/devtools/tiny/demo/:

    weights.safetensors    trained parameters, mlx-lm names (bf16; A_log, dt_bias, bias in f32)
    tokenizer.json         byte-level BPE trained on the same text (tokenizer_config.json: ChatML)
    heldout.txt            a slice of the validation docstrings (never trained on), for checks
    SOURCES.txt            every source file: sha256, size, path
    PROVENANCE.md          sources and licence, command, seeds, steps, losses, wall time, date

Everything is deterministic: a fixed file list and order, fixed seeds, fixed data order and
a fixed number of steps. The router gets no load-balancing loss (we want the skew).

    python scripts/train_demo_model.py             # the real run (~22 minutes on 2 CPU cores)
    python scripts/train_demo_model.py --steps 20 --out /tmp/x   # a smoke run
"""

from __future__ import annotations

import argparse
import ast
import datetime
import hashlib
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from expertmesh.devtools.tiny import demo_model
from expertmesh.devtools.tiny.tokenizer import save_tokenizer, train_tokenizer
from expertmesh.node.model.mlx_lm_models import model_classes

STDLIB = Path("/usr/lib/python3.11")
# Not PSF-licensed, per /usr/share/doc/python3.11/copyright ("Files with other licenses"), or not
# part of the standard library proper (tests, third-party packages, build files, a Debian addition).
_EXCLUDE = re.compile(
    r"(^|/)(test|tests|idle_test|site-packages|dist-packages|__pycache__|config-3\.11-[^/]*)/"
    r"|^(logging|multiprocessing|sqlite3|async[^/]*)(/|\.py$)"
    r"|^(tarfile|turtle|_distutils_system_mod)\.py$"
)
EOT = "<|endoftext|>"
VAL_EVERY = 20  # every 20th source file (sorted by path) is validation, never trained on
HELDOUT_TOKENS = 2600  # how much validation text to commit as heldout.txt


def source_files(root: Path = STDLIB) -> list[Path]:
    files = sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix())
    return [p for p in files if not _EXCLUDE.search(p.relative_to(root).as_posix())]


def _drop_doctests(doc: str) -> str:
    """Remove interactive examples: a `>>>` line and what follows it up to a blank line."""
    out, in_example = [], False
    for line in doc.splitlines():
        if line.lstrip().startswith(">>>"):
            in_example = True
        elif not line.strip():
            in_example = False
        if not in_example:
            out.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


def docstrings(path: Path) -> list[str]:
    """The module, class and function docstrings of one file, in source order, cleaned."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    nodes = [
        n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    docs = []
    for n in nodes:
        d = ast.get_docstring(n, clean=True)
        if d and EOT not in d:
            d = _drop_doctests(d)
            if sum(c.isalpha() for c in d) >= 10:
                docs.append(d)
    return docs


def corpus(files: list[Path]) -> tuple[list[str], list[str]]:
    """(train docs, validation docs): every VAL_EVERY-th file goes to validation.

    A docstring seen before (boilerplate such as "Return self.") is dropped, so no validation
    docstring is also a training one.
    """
    train, val, seen = [], [], set()
    for i, p in enumerate(files):
        for d in docstrings(p):
            if d not in seen:
                seen.add(d)
                (val if i % VAL_EVERY == VAL_EVERY // 2 else train).append(d)
    return train, val


def encode(tok, docs: list[str]) -> list[int]:
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids += enc.ids + [eot]
    return ids


def save_weights(path: Path, model: nn.Module) -> None:
    keep_f32 = ("e_score_correction_bias", "A_log", "dt_bias")
    params = {k.removeprefix("language_model."): v for k, v in tree_flatten(model.parameters())}
    params = {k: v.astype(mx.float32 if k.endswith(keep_f32) else mx.bfloat16) for k, v in sorted(params.items())}
    mx.save_safetensors(str(path), params, metadata={"format": "mlx"})


def check_repo(out: Path, val: mx.array, heldout: mx.array) -> dict:
    """Build the Hub repo from what was saved, load it with mlx-lm and measure it."""
    import mlx_lm

    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"  # what make_demo_model writes, from `out` (which may not be DEMO_DIR)
        repo.mkdir()
        demo_model.write_repo(repo, demo_model.load_params(out), out)
        size = sum(p.stat().st_size for p in repo.iterdir())
        model, tok = mlx_lm.load(str(repo))
        counts = demo_model.expert_counts(model, heldout)
        return {
            "repo_bytes": size,
            "val_loss_repo": demo_model.mean_loss(model, val),
            "heldout_loss_repo": demo_model.mean_loss(model, heldout),
            "top_quarter_share": {i: demo_model.top_quarter_share(c) for i, c in counts.items()},
            "routed_tokens": int(heldout[:, :-1].size),
            "sample": mlx_lm.generate(model, tok, "The ", max_tokens=40),
            "sample2": mlx_lm.generate(model, tok, "Return the", max_tokens=40),
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=demo_model.DEMO_DIR)
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--batch", type=int, default=8)
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

    files = source_files()
    train_docs, val_docs = corpus(files)
    print(
        f"{len(files)} files: {len(train_docs)} train docstrings ({sum(map(len, train_docs))} chars), "
        f"{len(val_docs)} validation ({sum(map(len, val_docs))} chars)",
        flush=True,
    )
    tok = train_tokenizer(train_docs, demo_model.VOCAB_SIZE)
    assert tok.get_vocab_size() == demo_model.VOCAB_SIZE, tok.get_vocab_size()
    save_tokenizer(args.out, tok)
    train_ids, val_ids = encode(tok, train_docs), encode(tok, val_docs)
    print(
        f"tokens: {len(train_ids)} train, {len(val_ids)} validation "
        f"({sum(map(len, train_docs)) / len(train_ids):.2f} chars/token)",
        flush=True,
    )

    # heldout.txt: whole validation docstrings from the start of the validation stream
    held, n = [], 0
    for d in val_docs:
        held.append(d)
        n += len(tok.encode(d).ids) + 1
        if n >= HELDOUT_TOKENS:
            break
    (args.out / demo_model.HELDOUT_FILE).write_text(EOT.join(held) + EOT, encoding="utf-8")
    heldout = demo_model.windows(encode(tok, held), seq)
    # validation: windows after the held-out part, so the two do not overlap
    val = demo_model.windows(val_ids[n:], seq)[:48]

    sources = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.stat().st_size:>7}  {p}" for p in files]
    (args.out / "SOURCES.txt").write_text("\n".join(sources) + "\n")
    corpus_sha = hashlib.sha256((EOT.join(train_docs) + "\0" + EOT.join(val_docs)).encode()).hexdigest()

    windows = demo_model.windows(train_ids, seq)
    rng = np.random.default_rng(args.seed)
    order = np.concatenate(
        [rng.permutation(windows.shape[0]) for _ in range(math.ceil(args.steps * args.batch / windows.shape[0]))]
    )
    epochs = args.steps * args.batch / windows.shape[0]

    cfg = demo_model.config()
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
        [lambda path, w: w.ndim >= 2],  # decay matrices, not norms, biases or A_log
    )

    def loss_fn(m: nn.Module, x: mx.array, y: mx.array) -> mx.array:
        return nn.losses.cross_entropy(m(x), y, reduction="mean")

    loss_and_grad = nn.value_and_grad(model, loss_fn)

    def evaluate(batch: mx.array) -> float:
        model.eval()
        loss = demo_model.mean_loss(model, batch)
        model.train()
        return loss

    print(
        f"{n_params} parameters; {args.steps} steps of {args.batch}x{seq} tokens "
        f"= {epochs:.2f} epochs of {windows.shape[0]} windows",
        flush=True,
    )
    history, t_train, recent = [], time.time(), []
    for step in range(1, args.steps + 1):
        batch = windows[mx.array(order[(step - 1) * args.batch : step * args.batch])]
        loss, grads = loss_and_grad(model, batch[:, :-1], batch[:, 1:])
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        mx.eval(loss, model.parameters(), optimizer.state)
        recent.append(loss.item())
        if step % args.log_every == 0 or step == args.steps:
            el = time.time() - t_train
            print(
                f"step {step:4d}/{args.steps}  loss {np.mean(recent):.3f}  lr {schedule(step).item():.2e}  "
                f"{el:.0f}s ({el / step:.2f}s/step)",
                flush=True,
            )
            history.append((step, float(np.mean(recent))))
            recent = []
        if step % args.val_every == 0 and step != args.steps:
            print(f"           val loss {evaluate(val):.3f}", flush=True)
    train_time = time.time() - t_train
    model.eval()
    final_train = demo_model.mean_loss(model, windows[mx.array(order[:48])])  # 48 windows it trained on
    final_val = demo_model.mean_loss(model, val)
    print(
        f"trained in {train_time:.0f}s: train loss {final_train:.3f}, val loss {final_val:.3f} "
        f"(uniform {math.log(demo_model.VOCAB_SIZE):.3f})",
        flush=True,
    )
    save_weights(args.out / demo_model.WEIGHTS_FILE, model)

    check = check_repo(args.out, val, heldout)
    wall = time.time() - t0
    shares = check["top_quarter_share"]
    print(
        f"repo ({check['repo_bytes']} bytes, mxfp4 experts): val loss {check['val_loss_repo']:.3f}, "
        f"held-out loss {check['heldout_loss_repo']:.3f}",
        flush=True,
    )
    print("top-25% experts' share of uses per MoE layer: " + ", ".join(f"{i}: {s:.3f}" for i, s in shares.items()))
    print(f"sample 'The ': {check['sample']!r}\nsample 'Return the': {check['sample2']!r}\nwall time {wall:.0f}s")

    cmd = "python scripts/train_demo_model.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    mean_share = float(np.mean(list(shares.values())))
    text_cfg = cfg["text_config"]
    provenance = f"""# Provenance of the demo model

Trained by `{cmd}` (run from the project root), once, on
{datetime.date.today().isoformat()}, on {platform.machine()} / {os.cpu_count()} CPU cores, mlx {mx.__version__}
(CPU), in {wall / 60:.1f} minutes of wall time ({train_time / 60:.1f} of them training).

## Data and licence

Docstrings (module, class, function) of the Python 3.11 standard library as Debian 12 installs
it in `{STDLIB}` (packages libpython3.11-minimal and libpython3.11-stdlib 3.11.2-6+deb12u6),
extracted with `ast.get_docstring`, interactive `>>>` examples removed. Licence: **PSF License
Version 2** (`{STDLIB}/LICENSE.txt`, `/usr/share/doc/python3.11/copyright`). The files that
Debian's copyright file lists under other licences (`logging/`, `multiprocessing/`, `sqlite3/`,
`async*`, `tarfile.py`, `turtle.py`) are excluded, as are test folders, third-party packages and
Debian's `_distutils_system_mod.py`. PSF's notice, retained as the licence asks: "Copyright (c)
2001, 2002, 2003, 2004, 2005, 2006, 2007, 2008, 2009, 2010, 2011, 2012, 2013, 2014, 2015, 2016,
2017, 2018, 2019, 2020, 2021, 2022, 2023 Python Software Foundation; All Rights Reserved".

- Docstrings repeated verbatim are kept once (the first). {len(files)} files, listed with sha256 and
  size in `SOURCES.txt`, sorted by path; every {VAL_EVERY}th (index % {VAL_EVERY} == {VAL_EVERY // 2}) is validation and never trained on.
- {len(train_docs)} training docstrings ({sum(map(len, train_docs))} characters, {len(train_ids)} tokens),
  {len(val_docs)} validation docstrings ({len(val_ids)} tokens); sha256 of the extracted text
  (train and validation joined by `<|endoftext|>`, then NUL): `{corpus_sha}`.
- `heldout.txt`: the first validation docstrings ({heldout.shape[0]} windows of {seq} tokens); the
  validation loss below uses the {val.shape[0]} windows after it.

## Tokenizer

Byte-level BPE (`node.tiny.tokenizer.train_tokenizer`, HF tokenizers), vocabulary
{demo_model.VOCAB_SIZE} with the special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`,
trained on the training docstrings; `tokenizer_config.json` as the fixtures' (ChatML, EOS `<|im_end|>`).
Documents are separated by `<|endoftext|>` in training.

## Model and training

mlx-lm's `kimi_k3` ({n_params} parameters), config `node.tiny.demo_model.config()`: the fixture's
(`node.tiny.kimi_k3.config()`) with vocab_size {demo_model.VOCAB_SIZE}: hidden {text_cfg["hidden_size"]},
{text_cfg["num_hidden_layers"]} layers (KDA and MLA, layer 0 dense), {text_cfg["num_experts"]} routed experts
per MoE layer, top-{text_cfg["num_experts_per_token"]}, {text_cfg["num_shared_experts"]} shared experts, latent
MoE {text_cfg["routed_expert_hidden_size"]}. mlx-lm's own initialisers with `mx.random.seed({args.seed})`.
Float32, experts as mlx-lm's SwitchGLU, no load-balancing loss.
{args.steps} steps of {args.batch} x {seq} tokens ({epochs:.2f} epochs of {windows.shape[0]} non-overlapping
windows, shuffled with `numpy.random.default_rng({args.seed})`, one permutation per epoch). AdamW
(betas 0.9, 0.95; weight decay {args.weight_decay} on matrices, 0 elsewhere), LR {args.lr} with a linear
warmup of {args.warmup} steps then cosine decay to {args.lr * 0.1:g}; gradient norm clipped at 1.0.

## Results

| | loss (nats/token) |
|---|---|
| uniform (log {demo_model.VOCAB_SIZE}) | {math.log(demo_model.VOCAB_SIZE):.3f} |
| train, final (48 training windows, float32) | {final_train:.3f} |
| validation, final (float32) | {final_val:.3f} |
| validation, Hub repo (mxfp4 experts, bf16 core) | {check["val_loss_repo"]:.3f} |
| heldout.txt, Hub repo | {check["heldout_loss_repo"]:.3f} |

Training loss (mean over each {args.log_every} steps): {", ".join(f"{s}: {loss:.2f}" for s, loss in history)}.

Routing skew of the Hub repo over the {check["routed_tokens"]} tokens of `heldout.txt`: the share of
expert uses that go to the most-used 25% of experts (uniform: 0.25), per MoE layer:
{", ".join(f"layer {i}: {s:.3f}" for i, s in shares.items())}; mean {mean_share:.3f}.

Greedy samples from the Hub repo (`mlx_lm.generate(model, tok, prompt, max_tokens=40)`):

- `The ` → {json.dumps(check["sample"])}
- `Return the` → {json.dumps(check["sample2"])}
"""
    (args.out / "PROVENANCE.md").write_text(provenance)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
