"""Model families: importing this package registers every family in MODEL_REGISTRY
(models/registry.py); a new family is one module here, imported below."""

from hybridmoe.models import gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe, qwen3_next  # noqa: F401
