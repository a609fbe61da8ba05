"""The model side of a node: mlx-lm's model with streaming expert blocks (blocks.py), loaded by
streamed_model.py; generation.py and speculative.py decode with it; core_quantization.py makes the
8-bit core. model_thread.py is the one thread all of their MLX work runs on; memory.py plans the
RAM tier, MLX's buffer cache and wiring from the machine."""
