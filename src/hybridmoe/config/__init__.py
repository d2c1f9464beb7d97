"""The bottom layer's descriptions: what a checkpoint's architecture is (ModelConfig) and how a
Hugging Face config.json is read into one. Every layer above may import it."""
