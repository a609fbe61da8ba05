"""The Hugging Face Hub side: strict range reads (client.py), pull (pull.py), safetensors headers
and the expert index that maps each expert to its byte ranges (expert_index.py), and where pulled
models live (local_models.py)."""
