"""Save and load a model: ``model.safetensors`` plus ``config.json`` in one folder."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import torch

from .lm import ModelConfig, TransformerLM

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def save_model(
    model: TransformerLM,
    path: Union[str, Path],
    *,
    dtype: Optional[torch.dtype] = torch.bfloat16,
    extra: Optional[dict] = None,
) -> Path:
    """Write ``path/model.safetensors`` (weights cast to ``dtype``; None keeps
    them) and ``path/config.json`` (the ModelConfig, plus ``extra`` under
    the key "meta"). Returns the folder."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {
        k: (v.detach().to(dtype) if dtype is not None else v.detach()).cpu().contiguous()
        for k, v in model.state_dict().items()
    }
    save_file(state, str(out / WEIGHTS), metadata={"config": json.dumps(model.cfg.to_dict())})
    doc = {"config": model.cfg.to_dict()}
    if extra:
        doc["meta"] = extra
    (out / CONFIG).write_text(json.dumps(doc, indent=1) + "\n")
    return out


def load_config(path: Union[str, Path]) -> ModelConfig:
    return ModelConfig.from_dict(json.loads((Path(path) / CONFIG).read_text())["config"])


def load_model(
    path: Union[str, Path],
    *,
    device: Union[str, torch.device] = "cpu",
    dtype: torch.dtype = torch.float32,
) -> TransformerLM:
    """Load a folder written by ``save_model``; weights are cast to ``dtype``."""
    from safetensors.torch import load_file

    cfg = load_config(path)
    model = TransformerLM(cfg)
    state = load_file(str(Path(path) / WEIGHTS))
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return model.to(device=device, dtype=dtype).eval()
