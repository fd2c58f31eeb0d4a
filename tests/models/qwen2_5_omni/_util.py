"""Helpers shared by the Qwen2.5-Omni tests."""

import numpy as np


def to_torch(inputs: dict) -> dict:
    import torch

    out = {}
    for k, v in inputs.items():
        if isinstance(v, np.ndarray):
            v = torch.tensor(v)
            if k == "video_second_per_grid":
                v = v.float()
        out[k] = v
    return out


def prompt(media: str, question: str = "What do you see and hear?") -> str:
    return (f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{media}{question}"
            "<|im_end|>\n<|im_start|>assistant\n")
