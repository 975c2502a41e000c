"""Save and load a model: ``model.safetensors`` plus ``config.json`` in one folder."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import torch

from .._checks import as_device, as_dtype, describe
from .lm import ModelConfig, TransformerLM

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def check_model_dir(path, name: str = "path") -> Path:
    """The folder ``path`` when it holds a saved model, else ValueError."""
    if not isinstance(path, (str, Path)):
        raise ValueError(f"{name}: expected a folder path (str or Path), got {describe(path)}")
    folder = Path(path)
    missing = [f for f in (CONFIG, WEIGHTS) if not (folder / f).is_file()]
    if missing:
        raise ValueError(f"{name}: expected a model folder holding {CONFIG} and {WEIGHTS}, "
                         f"but {str(folder)!r} lacks {' and '.join(missing)}")
    return folder

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

    if not isinstance(model, TransformerLM):
        raise ValueError(f"model: expected a TransformerLM, got {describe(model)}")
    if dtype is not None:
        as_dtype(dtype, "dtype", FLOAT_DTYPES)
    if not isinstance(path, (str, Path)):
        raise ValueError(f"path: expected a folder path (str or Path), got {describe(path)}")
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
    """The ModelConfig saved in the folder ``path``."""
    return ModelConfig.from_dict(json.loads((check_model_dir(path) / CONFIG).read_text())["config"])


def load_model(
    path: Union[str, Path],
    *,
    device: Union[str, torch.device] = "cpu",
    dtype: torch.dtype = torch.float32,
) -> TransformerLM:
    """Load a folder written by ``save_model``; weights are cast to ``dtype``
    (a float dtype) and moved to ``device`` ("cpu", "cuda", ...). ValueError
    naming the argument for a folder without a model or a bad dtype/device."""
    from safetensors.torch import load_file

    as_dtype(dtype, "dtype", FLOAT_DTYPES)
    device = as_device(device, "device")
    cfg = load_config(path)
    model = TransformerLM(cfg)
    state = load_file(str(Path(path) / WEIGHTS))
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return model.to(device=device, dtype=dtype).eval()
