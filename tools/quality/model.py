"""The trained yardstick on disk: its weights (safetensors) and what built them (JSON).

``data/yardstick.safetensors`` is shipped in the repository (about 2 MB); ``data/yardstick.json``
holds the model's shape, the training spec, the sha256 of the weights' bytes, the figures of the
run that wrote them and the command that rebuilds them. ``load`` refuses weights whose sha256
differs from the JSON's (a damaged or half-written file, or weights from another run).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tools.common import CliError
from tools.quality.train import ModelSpec, TrainSpec

DATA_DIR = Path(__file__).resolve().parent / "data"
WEIGHTS, META = "yardstick.safetensors", "yardstick.json"
REBUILD = "python -m tools.cli.main quality train"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save(model: Any, model_spec: ModelSpec, spec: TrainSpec, figures: dict[str, Any],
         out: Path = DATA_DIR) -> str:
    """Write the weights and their JSON into ``out``; returns the weights' sha256."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    tmp = out / (WEIGHTS + ".tmp")
    save_file(state, str(tmp))
    digest = sha256(tmp)
    tmp.replace(out / WEIGHTS)
    meta = {"model": model_spec.__dict__, "train": spec.to_dict(), "sha256": digest, "figures": figures,
            "rebuild": REBUILD}
    (out / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return digest


def read_meta(where: Path = DATA_DIR) -> dict[str, Any]:
    try:
        return json.loads((where / META).read_text())
    except (OSError, ValueError) as exc:
        raise CliError(f"no usable yardstick in {where} ({exc}): rebuild it with `{REBUILD}`") from None


def load(where: Path = DATA_DIR) -> Any:
    """The yardstick ``LlamaForCausalLM`` in eval mode (float32), its sha256 checked."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    meta = read_meta(where)
    path = where / WEIGHTS
    try:
        digest = sha256(path)
    except OSError as exc:
        raise CliError(f"cannot read the yardstick's weights ({exc}): rebuild them with `{REBUILD}`") from None
    if digest != meta["sha256"]:
        raise CliError(f"{path} has sha256 {digest}, {META} says {meta['sha256']}: rebuild with `{REBUILD}`")
    torch.manual_seed(0)  # the constructor's random init, overwritten below
    model: Any = LlamaForCausalLM(ModelSpec(**meta["model"]).config())
    model.load_state_dict(load_file(str(path)))
    model.eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model
