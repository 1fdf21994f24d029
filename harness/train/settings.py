"""`zoo train`'s settings: one dataclass, every value checked (and a resumed checkpoint's settings compared) before
any model is built or any byte of the corpus is read."""
from dataclasses import dataclass, field
from pathlib import Path

import torch

import zoo
from harness.results import check_output_folder, settings_dict
from harness.train.checkpoint import read_train_state
from harness.train.corpus import check_corpus_path
from harness.train.memory import check_training_bytes
from harness.train.moe_losses import BALANCE_WEIGHT, Z_WEIGHT, check_weights, has_moe_layers
from zoo import checks

AUTOCAST = ("auto", "on", "off")
# Settings a resumed run may change: its budgets, how often it evaluates, and where and how fast it runs. Every
# other setting decides the model, the data or the trajectory, so a checkpoint written with another value is refused.
RESUMABLE_CHANGES = ("minutes", "max_steps", "eval_every", "autocast", "device", "out")
BYTE_VOCAB = 256  # token ids are raw bytes
# auto on CPU: bf16 autocast for models at least this wide, where oneDNN's bf16 kernels made a training step 1.6x
# faster on the project's 2-core EPYC (small preset, gqa and mamba); at the tiny preset (d_model 64) it ranged from
# 0.67x to 1.3x by architecture, 0.92x for the CPU default (benchmarks/train_autocast.py; BENCHMARKS.md)
AUTOCAST_MIN_WIDTH = 512
# what a checkpoint written before the MoE auxiliary losses, or before distillation, existed trained with
OLDER_CHECKPOINTS = {"moe_balance_weight": 0.0, "moe_z_weight": 0.0, "init": None, "init_weights": True,
                     "teacher": None}
MOE_WEIGHTS = ("moe_balance_weight", "moe_z_weight")  # settings that change nothing for a model without MoE layers
DISTILL_WEIGHTS = ("distill_temperature", "distill_weight")  # likewise without a teacher


@dataclass
class TrainSettings:
    arch: str = "gqa"
    preset: str = "tiny"
    overrides: dict = field(default_factory=dict)  # registry settings (`zoo describe ARCH`), e.g. {"window": 32}
    corpus: Path | None = None  # a text file or a folder of them; None: this Python's standard library sources
    context: int = 256  # bytes the model reads per window (it predicts each one's next byte)
    batch_size: int = 16  # with lr and context: the best of a measured search on 2 CPU cores (BENCHMARKS.md)
    lr: float = 1e-2  # the peak, after warmup
    warmup_steps: int = 50
    minutes: float | None = 3.0  # training-time budget (optimizer steps; evaluations not counted); None: steps only
    max_steps: int | None = None  # step budget; None: time only
    eval_every: int = 250  # steps between validation figures (one is also taken at the end)
    eval_windows: int = 256  # fixed validation windows, each context + 1 bytes
    autocast: str = "auto"  # bf16 autocast: "on", "off", or "auto" (see autocast_enabled)
    device: str = "cpu"
    seed: int = 0  # weights, batches and a diffusion LM's masking draws
    # MoE auxiliary losses' weights (harness/train/moe_losses.py); 0 turns one off; no MoE layers: not applying
    moe_balance_weight: float = BALANCE_WEIGHT
    moe_z_weight: float = Z_WEIGHT
    # distillation (`zoo distill`): start from a saved model (its config; its weights unless init_weights is False)
    # instead of arch/preset/overrides, and learn from a teacher's next-byte distributions as well as the bytes
    init: Path | None = None
    init_weights: bool = True
    teacher: Path | None = None
    distill_temperature: float = 1.0  # both distributions softened by it; the KL term scaled by its square (Hinton)
    distill_weight: float = 0.5  # the loss: (1 - w) x cross-entropy + w x T^2 x KL(teacher || student)
    out: Path | None = None  # default: results/train/ARCH-PRESET

    def __post_init__(self):
        if self.out is None:
            self.out = Path("results/train") / f"{self.arch}-{self.preset}"
        self.out = Path(self.out)

    def validate(self) -> zoo.ModelConfig:
        """Every bad setting is reported before any work; returns the model config the settings build."""
        if self.init is not None:  # the saved model decides the architecture
            config = zoo.checkpoint.load_config(self.init)
            checks.boolean("init_weights", self.init_weights)
        else:
            zoo.registry.check_architecture(self.arch)
            zoo.presets.preset_settings(self.preset)
            if not isinstance(self.overrides, dict) or not all(isinstance(name, str) for name in self.overrides):
                raise ValueError(f"overrides must map registry setting names to values, got {self.overrides!r}")
            config = zoo.make_config(self.arch, self.preset, **self.overrides)
        checks.integer("context", self.context, minimum=1)
        if self.context > config.max_seq_len:
            raise ValueError(f"context {self.context} is longer than the model's max_seq_len {config.max_seq_len} "
                             f"({self.arch}, preset {self.preset}): use a shorter context or --set "
                             f"max_seq_len={self.context}")
        checks.integer("batch_size", self.batch_size, minimum=1)
        checks.device("device", self.device)
        # priced before even a meta-device build, which takes seconds at thousands of layers
        check_training_bytes(config, self.batch_size, self.context, self.device)
        with torch.device("meta"):  # the mixers' own checks, without allocating any weights
            zoo.DecoderLM(config)
        data_vocab = config.vocab_size - (0 if config.causal else 1)  # a diffusion LM's last id is its mask
        if data_vocab < BYTE_VOCAB:
            raise ValueError(f"vocab_size {data_vocab} is too small for a byte-level model: token ids are bytes "
                             f"0..255, so it must be >= {BYTE_VOCAB} (e.g. --set vocab_size=256)")
        checks.real("lr", self.lr, minimum=0, open_min=True)
        checks.integer("warmup_steps", self.warmup_steps, minimum=0)
        if self.minutes is None and self.max_steps is None:
            raise ValueError("no budget: give minutes, max_steps or both")
        if self.minutes is not None:
            checks.real("minutes", self.minutes, minimum=0, open_min=True)
        checks.optional_integer("max_steps", self.max_steps, minimum=1)
        checks.integer("eval_every", self.eval_every, minimum=1)
        checks.integer("eval_windows", self.eval_windows, minimum=1)
        checks.choice("autocast", self.autocast, AUTOCAST)
        checks.integer("seed", self.seed, minimum=0, maximum=2**63 - 1)  # torch.manual_seed and numpy both take it
        check_weights(self.moe_balance_weight, self.moe_z_weight)
        if self.teacher is not None:
            self.check_teacher(config)
        check_corpus_path(self.corpus)
        check_output_folder(self.out)
        saved = read_train_state(self.out)
        if saved is not None:
            self.check_resume(saved["settings"], config)
        return config

    def check_teacher(self, student: zoo.ModelConfig) -> None:
        """The teacher predicts the same ids over the same context, one byte at a time, as the student."""
        teacher = zoo.checkpoint.load_config(self.teacher)
        if teacher.vocab_size != student.vocab_size:
            raise ValueError(f"the teacher's vocab_size {teacher.vocab_size} differs from the student's "
                             f"{student.vocab_size}: distillation compares their next-token distributions id by id")
        if not (teacher.causal and student.causal):
            raise ValueError("distillation matches next-byte distributions: teacher and student must both be causal "
                             f"(teacher causal={teacher.causal}, student causal={student.causal})")
        if self.context > teacher.max_seq_len:
            raise ValueError(f"context {self.context} is longer than the teacher's max_seq_len {teacher.max_seq_len}")
        checks.real("distill_temperature", self.distill_temperature, minimum=0, open_min=True)
        checks.real("distill_weight", self.distill_weight, minimum=0, maximum=1)

    def autocast_enabled(self, config: zoo.ModelConfig) -> bool:
        """auto: on for CUDA; on CPU for models of d_model >= AUTOCAST_MIN_WIDTH where oneDNN has bf16 kernels for
        the CPU (AVX-512 or AMX; without them bf16 is emulated)."""
        if self.autocast != "auto":
            return self.autocast == "on"
        if torch.device(self.device).type == "cuda":
            return True
        return config.d_model >= AUTOCAST_MIN_WIDTH and torch.ops.mkldnn._is_mkldnn_bf16_supported()

    def fixed(self, config: zoo.ModelConfig) -> dict:
        """The settings a resumed run must share with its checkpoint, as they are recorded (the MoE weights only for
        a model with MoE layers, the distillation weights only with a teacher)."""
        free = (RESUMABLE_CHANGES + (() if has_moe_layers(config) else MOE_WEIGHTS)
                + (() if self.teacher is not None else DISTILL_WEIGHTS))
        return {name: value for name, value in self.record().items() if name not in free}

    def record(self) -> dict:
        """The settings as JSON values, the corpus as an absolute path (how a checkpoint records them)."""
        paths = {name: None if getattr(self, name) is None else str(Path(getattr(self, name)).resolve())
                 for name in ("corpus", "init", "teacher")}
        return {**settings_dict(self), **paths}

    def check_resume(self, saved: dict, config: zoo.ModelConfig) -> None:
        """OUT already holds a checkpoint: these settings may continue it only if they train the same model on the
        same data the same way (budgets, evaluation cadence, device and autocast may change)."""
        saved = {**OLDER_CHECKPOINTS, **saved}
        differ = [f"{name} {saved.get(name)!r} (checkpoint) vs {value!r} (now)"
                  for name, value in self.fixed(config).items() if saved.get(name) != value]
        if differ:
            raise ValueError(f"{self.out} holds a checkpoint trained with other settings: {'; '.join(differ)}. "
                             f"Pass the checkpoint's settings to continue it (only {', '.join(RESUMABLE_CHANGES)} may "
                             f"change), or another --out to start afresh")
