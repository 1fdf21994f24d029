"""A model on disk as a folder: its ModelConfig as JSON (config.json) and its weights as safetensors
(model.safetensors), so `zoo.load(folder)` rebuilds the model without knowing the flags that made it. A quantized
model (zoo.quantize) adds quantization.json: its QuantizeConfig and the layers holding an AWQ input scale
(input_scaled); its weights file then holds each quantized layer's stored tensors (q, scales, zeros, input_scale,
bias) in place of the float weight, which `load` fills into layers built empty from those two records, so the
loaded model equals the saved one bit for bit.

`save` writes the files in place; a caller that must never leave a torn folder (the trainer) saves into a
temporary folder and renames it. `load` reads safetensors only (never pickled code) and reports every way the folder
can be wrong (missing, not a folder, a file absent or damaged, weights that do not fit the config in name, shape or
dtype) as one ValueError.
"""
import dataclasses
import json
import sys
from pathlib import Path

from safetensors.torch import save_model

from zoo import checks
from zoo.config import FFNSpec, MixerSpec, ModelConfig
from zoo.model import DecoderLM
from zoo.quantize import QuantizedLinear, QuantizeConfig, load_skeleton
from zoo.weights import fitted_state, listing, read_state_dict

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
QUANTIZATION_FILE = "quantization.json"
QUANTIZATION_FIELDS = (*(f.name for f in dataclasses.fields(QuantizeConfig)), "input_scaled")
CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))
REQUIRED_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.default is dataclasses.MISSING)


def config_to_json(config: ModelConfig) -> str:
    """The config's fields as JSON; ffns left out when None (every layer the model-wide mlp), so such a model's
    config.json is what it was before per-layer FFNs and loads in an archzoo without them."""
    fields = dataclasses.asdict(config)
    if fields["ffns"] is None:
        del fields["ffns"]
    return json.dumps(fields, indent=2) + "\n"


def specs(entries, cls: type, what: str) -> list:
    """[{"kind": ..., "params": {...}}, ...] (the JSON of a list of MixerSpec or FFNSpec) as `cls` objects."""
    if not isinstance(entries, list) or not all(isinstance(entry, dict) and set(entry) == {"kind", "params"}
                                                 for entry in entries):
        raise ValueError(f"{what} must be a list of {{\"kind\": ..., \"params\": {{...}}}} objects, got {entries!r}")
    return [cls(entry["kind"], entry["params"]) for entry in entries]


def parse_json(text: str, where: str):
    """The JSON value of `text`; `where` names the source in an error."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is damaged (not JSON: {error.msg})") from None
    except RecursionError:  # json nests one Python call per level
        raise ValueError(f"{where} is damaged (JSON nested deeper than {sys.getrecursionlimit()} levels)") from None


def config_from_json(text: str, where: str = "config") -> ModelConfig:
    """The ModelConfig a config_to_json text holds; `where` names the source in an error."""
    fields = parse_json(text, where)
    if not isinstance(fields, dict):
        raise ValueError(f"{where} holds a JSON {type(fields).__name__}, not a ModelConfig object")
    unknown = sorted(set(fields) - set(CONFIG_FIELDS))
    missing = [name for name in REQUIRED_FIELDS if name not in fields]
    if unknown or missing:
        raise ValueError(f"{where} is not a ModelConfig: " + "; ".join(
            f"{label} {names}" for label, names in (("unknown fields", unknown), ("missing fields", missing)) if names)
            + f" (its fields: {', '.join(CONFIG_FIELDS)})")
    try:
        layers = specs(fields["layers"], MixerSpec, "layers")
        ffns = None if fields.get("ffns") is None else specs(fields["ffns"], FFNSpec, "ffns")
        return ModelConfig(**{**fields, "layers": layers, "ffns": ffns})
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def quantization_to_json(model: DecoderLM) -> str | None:
    """quantization.json's text for a quantized model (None for a float one)."""
    config = getattr(model, "quantization", None)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    if config is None and layers:  # e.g. first_layers() of a quantized model: its QuantizeConfig is the parent's
        raise ValueError("zoo.save: the model has quantized layers but no .quantization (the QuantizeConfig that "
                         "zoo.quantize sets): save the model zoo.quantize returned")
    if config is None:
        return None
    scaled = [name for name, layer in layers.items() if layer.input_scale is not None]
    return json.dumps({**dataclasses.asdict(config), "input_scaled": scaled}, indent=2) + "\n"


def quantization_from_json(text: str, where: str) -> tuple[QuantizeConfig, list[str]]:
    """The QuantizeConfig and input-scaled layer names a quantization_to_json text holds."""
    fields = parse_json(text, where)
    if not isinstance(fields, dict) or set(fields) != set(QUANTIZATION_FIELDS):
        got = listing("fields", sorted(fields)) if isinstance(fields, dict) else f"a JSON {type(fields).__name__}"
        raise ValueError(f"{where} is not a quantization record: it needs the fields {', '.join(QUANTIZATION_FIELDS)}, "
                         f"got {got}")
    scaled = fields.pop("input_scaled")
    if not isinstance(scaled, list) or not all(isinstance(name, str) for name in scaled):
        raise ValueError(f"{where}: input_scaled must be a list of layer names, got {repr(scaled)[:200]}")
    try:
        return QuantizeConfig(**fields), scaled
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def check_save_folder(folder: Path) -> None:
    """The folder is one, or can be made: neither it nor a folder above it is a file."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"checkpoint folder {str(folder)!r} exists and is not a folder")
    blocking = next((parent for parent in folder.parents if parent.exists() and not parent.is_dir()), None)
    if blocking is not None:
        raise ValueError(f"checkpoint folder {str(folder)!r} cannot be made: {str(blocking)!r} is a file, not a "
                         f"folder")


def save(model: DecoderLM, path) -> Path:
    """Write model's config and weights (and a quantized model's quantization.json) into the folder `path` (made if
    needed); returns the folder."""
    if not isinstance(model, DecoderLM):
        raise ValueError(f"zoo.save takes a zoo model (zoo.DecoderLM, from zoo.build or zoo.load), got "
                         f"{type(model).__name__}")
    folder = Path(path)
    check_save_folder(folder)
    quantization = quantization_to_json(model)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(config_to_json(model.config))
    save_model(model, str(folder / WEIGHTS_FILE))  # a tied head is stored once; load fills its twin
    if quantization is None:  # a float model saved over a quantized one must not load as quantized
        (folder / QUANTIZATION_FILE).unlink(missing_ok=True)
    else:
        (folder / QUANTIZATION_FILE).write_text(quantization)
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


def read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{file} is damaged (not UTF-8 text)") from None


def load_config(path) -> ModelConfig:
    """The ModelConfig of a saved model, without building it."""
    file = check_checkpoint_folder(path) / CONFIG_FILE
    return config_from_json(read_text(file), str(file))


def load_quantization(folder: Path) -> tuple[QuantizeConfig | None, list[str]]:
    """A saved model's QuantizeConfig and input-scaled layers (None and none for a float model)."""
    file = folder / QUANTIZATION_FILE
    return quantization_from_json(read_text(file), str(file)) if file.is_file() else (None, [])


def quantized_skeleton(model: DecoderLM, quantization: QuantizeConfig, input_scaled: list[str], folder: Path) -> None:
    """The float model built from config.json made the shape zoo.quantize made it, its quantized layers empty."""
    try:
        load_skeleton(model, quantization, input_scaled)
    except ValueError as error:
        raise ValueError(f"{folder / QUANTIZATION_FILE} does not fit its {CONFIG_FILE}: {error}") from None


def load(path, device: str = "cpu") -> DecoderLM:
    """The model saved in folder `path` (or the newest checkpoint of a `zoo train` output folder), in its saved
    dtype, in eval mode on `device`; a quantized one quantized as saved, with its `.quantization`."""
    checks.device("device", device)
    folder = check_checkpoint_folder(path)
    config = load_config(folder)
    quantization, input_scaled = load_quantization(folder)
    file = folder / WEIGHTS_FILE
    state = read_state_dict(file)
    model = DecoderLM(config)
    floating = {tensor.dtype for tensor in state.values() if tensor.is_floating_point()}
    if len(floating) == 1:  # saved in another dtype (bf16, fp16): load without a round trip through fp32
        model.to(floating.pop())
    if quantization is not None:
        quantized_skeleton(model, quantization, input_scaled, folder)
    records = CONFIG_FILE if quantization is None else f"{CONFIG_FILE} and {QUANTIZATION_FILE}"
    model.load_state_dict(fitted_state(model, state, f"weights file {str(file)!r} does not fit its {records}"))
    return model.to(device).eval()
