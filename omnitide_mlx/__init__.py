"""omnitide-mlx: streaming omni-modal LLM inference on MLX with OmniPick retention and OmniPage paging."""

__version__ = "0.1.0"
