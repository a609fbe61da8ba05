"""The Hugging Face Hub as a transport: strict range reads (client.py), pull (pull.py) and where
pulled models live (local_models.py). What the bytes mean is node/model/'s."""
