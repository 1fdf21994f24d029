"""A model on disk as a folder: its ModelConfig as JSON (config.json) and its weights as safetensors
(model.safetensors), so `zoo.load(folder)` rebuilds the model without knowing the flags that made it.

`save` writes the two files in place; a caller that must never leave a torn folder (the trainer) saves into a
temporary folder and renames it. `load` reads safetensors only (never pickled code) and reports every way the folder
can be wrong (missing, not a folder, a file absent or damaged, weights that do not fit the config) as one ValueError.
"""
import dataclasses
import json
from pathlib import Path

from safetensors.torch import save_model

from zoo import checks
from zoo.config import MixerSpec, ModelConfig
from zoo.model import DecoderLM
from zoo.weights import fitted_state, read_state_dict

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))
REQUIRED_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.default is dataclasses.MISSING)


def config_to_json(config: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(config), indent=2) + "\n"


def config_from_json(text: str, where: str = "config") -> ModelConfig:
    """The ModelConfig a config_to_json text holds; `where` names the source in an error."""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is damaged (not JSON: {error.msg})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{where} holds a JSON {type(fields).__name__}, not a ModelConfig object")
    unknown = sorted(set(fields) - set(CONFIG_FIELDS))
    missing = [name for name in REQUIRED_FIELDS if name not in fields]
    if unknown or missing:
        raise ValueError(f"{where} is not a ModelConfig: " + "; ".join(
            f"{label} {names}" for label, names in (("unknown fields", unknown), ("missing fields", missing)) if names)
            + f" (its fields: {', '.join(CONFIG_FIELDS)})")
    layers = fields["layers"]
    if not isinstance(layers, list) or not all(isinstance(layer, dict) and set(layer) == {"kind", "params"}
                                                for layer in layers):
        raise ValueError(f"{where}: layers must be a list of {{\"kind\": ..., \"params\": {{...}}}} objects, got {layers!r}")
    try:
        return ModelConfig(**{**fields, "layers": [MixerSpec(layer["kind"], layer["params"]) for layer in layers]})
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def save(model: DecoderLM, path) -> Path:
    """Write model's config and weights into the folder `path` (made if needed); returns the folder."""
    if not isinstance(model, DecoderLM):
        raise ValueError(f"zoo.save takes a zoo model (zoo.DecoderLM, from zoo.build or zoo.load), got "
                         f"{type(model).__name__}")
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"checkpoint folder {str(folder)!r} exists and is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(config_to_json(model.config))
    save_model(model, str(folder / WEIGHTS_FILE))  # a tied head is stored once; load fills its twin
    return folder


def check_checkpoint_folder(path) -> Path:
    """The path is a folder holding both files (checked before anything is built from it)."""
    folder = Path(path)
    if not folder.exists():
        raise ValueError(f"checkpoint folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise ValueError(f"checkpoint {str(folder)!r} is not a folder (zoo.save writes a folder holding "
                         f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    absent = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (folder / name).is_file()]
    inner = folder / "checkpoint"  # a `zoo train` output folder keeps its newest model there
    if absent and (inner / CONFIG_FILE).is_file():
        return check_checkpoint_folder(inner)
    if absent:
        raise ValueError(f"checkpoint folder {str(folder)!r} has no {' and no '.join(absent)} (zoo.save writes "
                         f"{CONFIG_FILE} and {WEIGHTS_FILE}; zoo train an output folder whose checkpoint/ holds them)")
    return folder


def load_config(path) -> ModelConfig:
    """The ModelConfig of a saved model, without building it."""
    file = check_checkpoint_folder(path) / CONFIG_FILE
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{file} is damaged (not UTF-8 text)") from None
    return config_from_json(text, str(file))


def load(path, device: str = "cpu") -> DecoderLM:
    """The model saved in folder `path` (or the newest checkpoint of a `zoo train` output folder), in its saved
    dtype, in eval mode on `device`."""
    checks.device("device", device)
    config = load_config(path)
    file = check_checkpoint_folder(path) / WEIGHTS_FILE
    state = read_state_dict(file)
    model = DecoderLM(config)
    floating = {tensor.dtype for tensor in state.values() if tensor.is_floating_point()}
    if len(floating) == 1:  # saved in another dtype (bf16, fp16): load without a round trip through fp32
        model.to(floating.pop())
    model.load_state_dict(fitted_state(model, state, f"weights file {str(file)!r} does not fit its {CONFIG_FILE}"))
    return model.to(device).eval()
