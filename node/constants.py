"""Every environment variable of expertmesh, read in one place, and the defaults that users set
with flags or that several modules share.

huggingface_hub reads `HF_ENDPOINT`, `HF_TOKEN` and `HF_HUB_OFFLINE` itself (node/hub/client.py
asks it, at call time); everything of expertmesh's own is read here, so the rest of the code never
touches `os.environ`. A tuning value that one module alone uses lives in that module, beside the
code it tunes, stated once; why each default is what it is lives beside it, and the figures that
chose it in docs/benchmarks.md.
"""

from __future__ import annotations

import os
from pathlib import Path


def expertmesh_home() -> Path:
    """Where pulled cores, expert caches and node state live (`EXPERTMESH_HOME`)."""
    return Path(os.environ.get("EXPERTMESH_HOME", "~/.cache/expertmesh")).expanduser()


# Files of a model repo that belong to the core besides its tensors.
CORE_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "*.tiktoken",
    "tiktoken.model",
    "model.safetensors.index.json",
)

# Range requests in flight while pulling a core: a home link gives each connection a fraction of
# its bandwidth (12.5 of 100 MB/s is typical), so it takes about 8 to fill it.
PULL_CONCURRENCY = 8
# Ranges larger than this are split, so progress and resume are fine-grained.
MAX_RANGE_BYTES = 64 * 1024 * 1024
# Free space that `pull` leaves on the disk beyond the core itself.
DISK_HEADROOM_BYTES = 1 * 1024**3
# The largest gRPC message a node sends or accepts, on its server and on its channels alike: a
# FetchExpert chunk is 1 MiB, a ComputeExperts call's rows RPC_MAX_CALL_ROW_BYTES; a message far
# larger is a bad client, and the bound keeps what one call can make a node hold small.
RPC_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
# The rows one ComputeExperts call carries each way at most (household/remote_experts.py splits a
# peer's rows, an expert's too, into calls no larger): well under the message limit, which also
# carries the expert ids, shapes and the answer's figures.
RPC_MAX_CALL_ROW_BYTES = 3 * 1024 * 1024
HTTP_TIMEOUT_S = 30.0
HTTP_MAX_RETRIES = 8
# Slow Hub connections (node/hub/speed.py), as curl's --speed-limit/--speed-time: a response whose
# bytes arrive slower than HUB_MIN_BYTES_PER_S, averaged over HUB_SPEED_WINDOW_S, is given up and
# the rest asked again on another connection (a retry), when the node's other connections do far
# better or all of them are below it too: a connection slow only because it shares a full link is
# kept. A timeout only catches silence, so a degraded CDN edge dripping a few bytes a second would
# otherwise hold a fetch for good. The floor is 1/200 of a home link's per-connection share
# (12.5 MB/s): only a broken edge is below it alone. The window outlasts a few TCP
# retransmissions; it also bounds a wait for any single read, since silence is below every floor.
HUB_MIN_BYTES_PER_S = 64 * 1024
HUB_SPEED_WINDOW_S = 10.0
# The time one fetch from the Hub tier (an expert's pieces, or a run of adjacent experts, with all
# their retries) may spend beyond what its bytes earn at HUB_MIN_BYTES_PER_S as they arrive (so a
# slow, full link never ends a fetch that keeps receiving), counted from its first request; then
# it fails with one error, and a failed run's experts are not asked for again one by one. A read
# in progress when it passes ends within one more read timeout (min(HTTP_TIMEOUT_S,
# HUB_SPEED_WINDOW_S)), so a Hub that stalls fails a fetch within 120 + 10 = 130 s of its first
# request, and one that drips within 130 s plus its bytes' time at the floor.
HUB_FETCH_DEADLINE_S = 120.0

# The Hub tier (node/store/tiers/hub.py); each default was chosen by a benchmark whose command
# and figures are in docs/benchmarks.md.
HUB_CONNECTIONS = 12  # range requests in flight at once: half again the home link's per-connection shares
# ...at first: the count grows while more connections carry more (store/tiers/hub_connections.py),
# up to this: enough to fill a home link through the slowest per-connection share a CDN is known to
# give, first bytes included (docs/benchmarks.md, "A CDN that caps each connection")
HUB_MAX_CONNECTIONS = 32
HUB_PIECES_PER_EXPERT = 4  # separate requests one expert is split into, at most
HUB_MIN_PIECE_BYTES = 2 * 1024 * 1024  # at 12.5 MB/s a piece then outlasts a 50 ms first byte
# Expert range requests in flight per layer (the distinct experts of a layer fetch together).
EXPERT_FETCH_CONCURRENCY = 8
# Default budgets: RAM from the memory left after the core, disk from the free space.
DEFAULT_RAM_BUDGET = "50%"  # of physical memory not taken by the core
DEFAULT_DISK_BUDGET = "50%"  # of the free space where the expert cache lives
MIN_RAM_BUDGET_BYTES = 64 * 1024**2
# What a node process takes before its core and its experts: the interpreter, MLX, transformers,
# the tokenizer, expertmesh, its threads (the memory plan counts it). Measured on Linux (x86-64,
# MLX on the CPU): 0.13 GB resident after opening a K3-proportioned model, less its core
# (benchmarks/bench_prompt_memory.py; docs/benchmarks.md, issue 46's third session). Not
# measured on a Mac, where Metal's libraries add to it: rounded up to a quarter GB.
PROCESS_BASELINE_BYTES = 256 * 1024**2
# Experts' bytes the disk tier holds queued for its writer at most (store/tiers/disk.py)
DISK_WRITE_BEHIND_EXPERTS = 2
# tokens a conversation may hold unless `--max-context` says otherwise: the memory plan counts its KV
# cache / linear-attention state, and a model's own maximum (a million tokens for K3) would not fit a Mac
DEFAULT_MAX_CONTEXT = 32768
# the states of earlier prompts a full node keeps for the next request sharing a prefix
# (node/engine/prefix_cache.py): a few conversations' worth at a home's context lengths
DEFAULT_PREFIX_CACHE = "1GB"
# long prompt prefixes (1,024 tokens or more) kept on disk across restarts, under the home's `prefixes/`
DEFAULT_PREFIX_DISK_BUDGET = "4GB"

# `expertmesh bench`: emulated link seconds per K3 second; below 0.1 the emulated Hub's own CPU,
# not the link, bounds the bench on 2 cores (docs/benchmarks.md, benchmarks/bench_time_scale.py).
BENCH_TIME_SCALE = 0.2

# The most tokens one request may ask to generate, at the node and at the API alike.
MAX_TOKENS_LIMIT = 32768

# Kimi K3's shape (../shared/DESIGN.md §1; the expert size is the upstream bytes of one routed
# expert), for what is computed or emulated at K3's size: memory plans, link and LAN emulation.
K3_MOE_LAYERS = 92
K3_EXPERTS_PER_LAYER = 896
K3_TOP_K = 16
K3_EXPERT_BYTES = 17_547_264
K3_HIDDEN = 7168

# The built-in demo model (expertmesh/devtools/tiny/demo_model.py), served by `expertmesh demo` from a local Hub.
DEMO_REPO = "expertmesh/demo-kimi-k3"
# Its draft model for `--speculate draft` (expertmesh/devtools/tiny/draft/), published next to it.
DEMO_DRAFT_REPO = "expertmesh/demo-kimi-k3-draft"


def household_secret() -> str | None:
    """The household secret from `EXPERTMESH_SECRET`, if set (else `serve` keeps one in the home)."""
    return os.environ.get("EXPERTMESH_SECRET") or None


def household_tls_ca() -> str | None:
    """Where the household's TLS certificate is, from `EXPERTMESH_TLS_CA` (rpc/tls.py reads it)."""
    return os.environ.get("EXPERTMESH_TLS_CA") or None


SECRET_FILENAME = "secret"  # in EXPERTMESH_HOME, owner-only
DEFAULT_NODE_PORT = 7433
# The version of proto/expertmesh/v1 this node speaks, in Info, in its proof and in its zeroconf
# advertisement; nodes of another version are not joined (household/membership.py says why).
# 2: calls carry a credential made with the secret, not the secret itself (node/rpc/auth.py).
# 3: the credential names its call's method, and a node accepts each one once (v2 credentials).
PROTOCOL_VERSION = 3

# Trailing metadata of a refused Generate call saying why, for a caller to act on without reading
# the message (the API answers OpenAI's `context_length_exceeded` code from it).
REASON_METADATA_KEY = "expertmesh-reason"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
