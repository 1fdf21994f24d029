"""What `zoo describe` shows of a registry entry: everything it declares, and which model-wide settings its model
reads, found by building configs with each changed (so this sits above both the registry and the model)."""
from zoo.model import model_bytes
from zoo.registry import ARCHITECTURES, FFNS, SETTINGS, check_architecture, make_config, settings_of


def details(name: str) -> dict:
    """Everything the entry says, for `zoo describe`."""
    arch = ARCHITECTURES[check_architecture(name)]
    return {
        "description": arch.description,
        "mixer": arch.mixer.cls.__name__ if arch.mixer else "composed of other entries' layers",
        "ffn": FFNS[arch.ffn].cls.__name__ if arch.ffn else "the model-wide mlp (swiglu unless set)",
        "causal": arch.causal,
        "settings": {setting: SETTINGS[setting].describe(setting) for setting in settings_of(arch)},
        "model-wide settings it reads (the preset's unless given; probed at the tiny preset)": global_reads(name),
        "recall defaults at d_model 64, 1 head, L 64": arch.recall(64, 1, 64),
        "recall learning rate": arch.recall_lr,
        "recall depths (layers)": ", ".join(map(str, arch.recall_layers)) + (f": {arch.recall_note}" if arch.recall_note else ""),
        "in zoo compare by default": arch.compare_default,
        "in zoo recall by default": arch.recall_default,
        "hybrid layer": arch.in_patterns,
        "HF class": arch.hf_class or "none",
    }


# Model-wide settings an entry may take from the preset or the user without declaring them, each with values valid
# at the tiny preset (4 heads, 2 KV heads for gqa): `zoo describe` shows which of them change an entry's model.
GLOBAL_PROBES = {"n_heads": (2,), "n_kv_heads": (1, 2), "gqa_kv_heads": (1,), "head_dim": (8,), "window": (5,),
                 "mlp": ("gelu",), "mlp_hidden": (40,)}


def global_reads(name: str) -> dict[str, str]:
    """The model-wide settings this entry's layers depend on, found by changing each at the tiny preset: what it
    does with them (its layers or feed-forwards change, or it refuses another value because the entry fixes it).
    A setting the entry does not accept at all (a window where nothing is windowed) is left out."""
    base = make_config(name, preset="tiny")
    reads = {}
    for setting, probes in GLOBAL_PROBES.items():
        for probe in probes:
            try:
                changed = make_config(name, preset="tiny", **{setting: probe})
            except ValueError as error:
                if not str(error).startswith("unknown setting"):
                    reads[setting] = f"fixed by the entry ({error})"
                break
            if (changed.layers, changed.ffns) != (base.layers, base.ffns) or model_bytes(changed) != model_bytes(base):
                reads[setting] = "read: it sizes or shapes this entry's layers"
    return reads
