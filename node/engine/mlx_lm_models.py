"""Which model architectures expertmesh can run: those mlx-lm implements.

mlx-lm owns the architectures; we only ask it, once, before anything large is downloaded.
"""

from __future__ import annotations

import mlx_lm
from mlx_lm.utils import _get_classes

from expertmesh.node.errors import UnsupportedModelError


def check_supported(config: dict, repo_id: str) -> str:
    """The config's model type, if mlx-lm can build it.

    Raises:
        UnsupportedModelError: no `model_type`, or one this mlx-lm does not implement.
    """
    model_type = config.get("model_type")
    if not model_type:
        raise UnsupportedModelError(f"{repo_id}: config.json has no model_type")
    try:
        _get_classes(config)
    except ValueError:
        raise UnsupportedModelError(
            f"{repo_id}: architecture {model_type!r} is not implemented by mlx-lm {mlx_lm.__version__}"
        ) from None
    return model_type
