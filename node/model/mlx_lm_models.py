"""mlx-lm's model classes: the one place expertmesh reaches into mlx-lm's private API.

mlx-lm owns the architectures. It maps a config to its `Model` and `ModelArgs` classes in
`mlx_lm.utils._get_classes` (the default of `load_model`'s public `get_model_classes` hook), which
is private: pyproject.toml bounds mlx-lm above for it, and everything here goes through
`model_classes`, so a new mlx-lm that renames it breaks one function, with a clear message.

It also answers, from mlx-lm itself, what the expert index and the registry test ask of it:
which model modules can build routed experts (`expert_modules`), a model built without computing
a weight (`build_model`), and where its expert blocks are (`expert_blocks`).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import pkgutil
import re
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import mlx_lm.models
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from expertmesh.node.errors import UnsupportedModelError

_get_classes: Callable[[dict], tuple[Any, Any]] | None
try:
    from mlx_lm.utils import _get_classes
except ImportError:  # pragma: no cover - only with an mlx-lm beyond the bound in pyproject.toml
    _get_classes = None


def model_classes(config: dict) -> tuple[Any, Any]:
    """The (Model, ModelArgs) classes mlx-lm builds for `config`.

    Raises:
        ValueError: mlx-lm has no such architecture (its own message).
        UnsupportedModelError: this mlx-lm no longer exposes the lookup expertmesh relies on.
    """
    if _get_classes is None:
        raise UnsupportedModelError(
            f"mlx-lm {mlx_lm.__version__} has no mlx_lm.utils._get_classes: install the mlx-lm version "
            "pyproject.toml allows"
        )
    return _get_classes(config)


def check_supported(config: dict, repo_id: str) -> str:
    """The config's model type, if mlx-lm can build it (asked before anything large is downloaded).

    Raises:
        UnsupportedModelError: no `model_type`, or one this mlx-lm does not implement.
    """
    model_type = config.get("model_type")
    if not model_type:
        raise UnsupportedModelError(f"{repo_id}: config.json has no model_type")
    try:
        model_classes(config)
    except ValueError:
        raise UnsupportedModelError(
            f"{repo_id}: architecture {model_type!r} is not implemented by mlx-lm {mlx_lm.__version__}"
        ) from None
    return model_type


# -- which architectures have routed experts -----------------------------------------------------

_EXPERT_CLASS_RE = re.compile(r"\bSwitch(?:GLU|MLP)\b")


@functools.cache
def expert_modules() -> dict[str, str]:
    """Every model module of the installed mlx-lm that can build routed experts -> the expert
    block class it names (`SwitchGLU` or `SwitchMLP`; a module that only reuses another's
    layers names that module's).

    Read from the modules' source (a module that names `SwitchGLU`, or imports one that does),
    so nothing is imported and the list follows mlx-lm as it grows.
    """
    sources: dict[str, str] = {}
    for info in pkgutil.iter_modules(mlx_lm.models.__path__):
        spec = importlib.util.find_spec(f"mlx_lm.models.{info.name}")
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        with open(spec.origin, encoding="utf-8") as f:
            sources[info.name] = f.read()
    imports: dict[str, set[str]] = {}
    for name, src in sources.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(a.name for a in node.names)
        imports[name] = deps - {name}
    direct = {}
    for name, src in sources.items():
        if name == "switch_layers":
            continue
        found = sorted(set(_EXPERT_CLASS_RE.findall(src)) - {"SwitchLinear"})
        if found:
            direct[name] = "/".join(found)
    result = dict(direct)
    changed = True
    while changed:  # a module importing an expert module builds its experts too
        changed = False
        for name, deps in imports.items():
            if name not in result and name != "switch_layers":
                via = sorted(d for d in deps if d in result)
                if via:
                    result[name] = result[via[0]]
                    changed = True
    return dict(sorted(result.items()))


def module_name(config: dict) -> str:
    """The mlx-lm model module that implements `config` (after mlx-lm's own remapping)."""
    model_class, _ = model_classes(config)
    return model_class.__module__.rsplit(".", 1)[-1]


def build_model(config: dict) -> nn.Module:
    """mlx-lm's model for `config`, with its freshly initialised (lazy, never evaluated) weights.

    Used to trace sanitize and to find the expert blocks: nothing is computed, so even a model
    of a trillion parameters costs only its module tree. MLX's global random state is restored,
    so building one never changes what a seeded generation samples.
    """
    config = dict(config)
    if "quantization_config" not in config and "quantization_config" in config.get("text_config", {}):
        config["quantization_config"] = config["text_config"]["quantization_config"]  # as load_model does
    model_class, args_class = model_classes(config)
    hi, lo = cast(list[int], cast(list[mx.array], mx.random.state)[0].tolist())
    try:
        return model_class(args_class.from_dict(config))
    finally:
        mx.random.seed((hi << 32) | lo)  # a key is the seed's two 32-bit words


# The projections of each kind of mlx-lm expert block, in the order they compute.
BLOCK_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "SwitchGLU": ("gate_proj", "up_proj", "down_proj"),  # down(act(up(x), gate(x)))
    "SwitchMLP": ("fc1", "fc2"),  # fc2(act(fc1(x))), no gate: phixtral, nemotron_h
}


def expert_blocks(model: nn.Module) -> dict[str, str]:
    """Module path -> `SwitchGLU` or `SwitchMLP`, for every routed-expert block of `model`."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, SwitchGLU):
            out[path] = "SwitchGLU"
        elif isinstance(module, SwitchMLP):
            out[path] = "SwitchMLP"
    return out


def layer_number(path: str) -> int | None:
    """The decoder layer a module path is in: the number after `layers.` (`model.layers.3.mlp`),
    else the path's first number (phixtral's `transformer.h.0.moe`); None outside any layer."""
    parts = path.split(".")
    for i, part in enumerate(parts[1:], 1):
        if part.isdigit() and parts[i - 1] == "layers":
            return int(part)
    return next((int(p) for p in parts if p.isdigit()), None)


def flat_parameters(module: nn.Module) -> dict[str, mx.array]:
    """The module's parameters by their dotted names, as mlx-lm saves and loads them."""
    return dict(cast(list[tuple[str, mx.array]], tree_flatten(module.parameters())))


def tree_arrays(tree: object) -> list[mx.array]:
    """Every MLX array in a tree of lists, tuples and dicts (a cache's state, a call's arguments)."""
    # tree_flatten's return type names both of its forms; without a dict to fill it is the list
    pairs = cast(list[tuple[str, object]], tree_flatten(tree))
    return [a for _, a in pairs if isinstance(a, mx.array)]


def top_k_of(config: dict) -> int | None:
    """The experts a token routes to, under the names mlx-lm's architectures use."""
    cfg = config.get("text_config", config)
    for key in ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "top_k", "n_activated_experts"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    return None
