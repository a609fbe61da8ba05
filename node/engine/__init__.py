"""The model side of a node: mlx-lm's model with streaming expert blocks (blocks.py), loaded by
streamed_model.py, its core held whole or streamed from the SSD (streamed_core.py); generation.py
and speculative.py decode with it; core_quantization.py makes the 8-bit, 4-bit and mixed cores and
core_replacement.py puts them in place crash-safely. model_thread.py is the one thread all of their
MLX work runs on; memory.py plans the core, the context, the RAM tier, MLX's buffer cache and
wiring from the machine, with the sizes model_sizes.py computes from a config."""
