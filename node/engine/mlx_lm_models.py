"""mlx-lm's model classes: the one place expertmesh reaches into mlx-lm's private API.

mlx-lm owns the architectures. It maps a config to its `Model` and `ModelArgs` classes in
`mlx_lm.utils._get_classes` (the default of `load_model`'s public `get_model_classes` hook), which
is private: pyproject.toml bounds mlx-lm above for it, and everything here goes through
`model_classes`, so a new mlx-lm that renames it breaks one function, with a clear message.
"""

from __future__ import annotations

import mlx_lm

from expertmesh.node.errors import UnsupportedModelError

try:
    from mlx_lm.utils import _get_classes
except ImportError:  # pragma: no cover - only with an mlx-lm beyond the bound in pyproject.toml
    _get_classes = None


def model_classes(config: dict) -> tuple[type, type]:
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
