"""What a model's experts are, and how their bytes become arrays: the bottom layer of a node.

    expert_index.py        each (layer, expert) -> its byte ranges in the upstream shards
    expert_trace.py        which upstream tensors make each expert, learnt from mlx-lm's `sanitize`
    safetensors_format.py  safetensors headers: dtypes, shapes, offsets
    mlx_lm_models.py       the mlx-lm classes of an architecture and its expert blocks
    codec.py               an expert's upstream bytes -> the arrays the kernels take

Nothing here moves bytes over a network or keeps them: the Hub client (hub/) and the store (store/)
sit above and use it.
"""
