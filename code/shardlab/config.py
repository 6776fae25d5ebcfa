"""What a training run is asked to do, checked before any process starts.

`TrainConfig` names a run (strategy, world size, model, precision, optimizer, steps,
batch, gradient accumulation, options, checkpoints, rehearsed failures). It is apart from
the loop (`shardlab.train`) because its checks run once, in the launching process, before
any rank exists: a bad value is refused in one line there, not as a traceback from every
rank. `check_resume` reads a checkpoint's marker for the same reason; `resume_folder` is
the one lookup of the checkpoint to resume, there and on the ranks.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardlab import checkpoint, modelio
from shardlab.cards import OURS, card, names
from shardlab.comm.links import SimulatedNetwork, check_simulated_network
from shardlab.faults import check_memory_limit, check_straggler
from shardlab.memory import as_config
from shardlab.models import (HF_MODELS, MODEL_NAMES, check_batch_split, check_loss_mean,
                             corpus_tokens, hf_spec, longest_sequence)
from shardlab.optimizers import optimizer_spec
from shardlab.precision import get_precision
from shardlab.strategy import check_before_launch, checkpoint_refusal, get_strategy


# What draws a step's global batch (`shardlab.models.get_batch`): a resume keeps them, so
# that the data goes on where it stopped; the number of ranks and micro-batches may change.
DATA_FIELDS = ("batch_size", "seq_len", "seed", "variable_lengths")


@dataclass
class TrainConfig:
    """A run, its fields by concern: what is trained and how; the steps and their data;
    what is measured; the checkpoints; the faults rehearsed on purpose. Every field is a
    keyword of its own (`TrainConfig(strategy="zero3", steps=20, save_every=5)`), and the
    command line has one flag per field (`shardlab.cli`)."""

    # -- what is trained, and how
    strategy: str = "single"
    world: int = 1
    # A model name of `shardlab.memory.model_names()` (the course's, or a published size:
    # the Hugging Face model of its family at that shape), or the path of a config.json.
    model: str = "gpt-tiny"
    # Settings of the model's architecture (`shardlab.models.build_model`'s `config`):
    # e.g. {"n_layer": 12, "n_embd": 768} for a GPT-2 of real size.
    model_config: dict[str, Any] | None = None
    # Start from pretrained weights: a Hugging Face folder (config.json, model.safetensors)
    # of `model` with `model_config`, read into the shards through the meta device
    # (`shardlab.modelio`): each rank reads its own pieces, no rank initializes weights.
    init_from: str | None = None
    precision: str = "fp32"
    optimizer: str = "adamw"
    lr: float = 1e-3
    # As real jobs train (chapter 10): clip the gradients to this global norm before each
    # step (None: no clipping).
    clip_norm: float | None = None
    options: dict[str, Any] = field(default_factory=dict)  # the strategy's own
    # Recompute each layer's activations in backward (`shardlab.wrap.recompute_units`).
    recompute: bool = False
    seed: int = 0

    # -- the steps and their data
    steps: int = 10
    batch_size: int = 8  # the global batch of one optimizer step, split among ranks
    seq_len: int = 32
    grad_accum: int = 1  # micro-batches per step (each rank's rows split this many ways)
    # Average the loss over the global count of tokens ("tokens") or naively over
    # micro-batches and ranks ("per-batch"); batches whose rows have different lengths,
    # padded with ignored tokens (label -100).
    loss_mean: str = "tokens"
    variable_lengths: bool = False

    # -- what is measured (`shardlab.report`)
    measure_memory: bool = True
    record_ledger: bool = True
    keep_params: bool = False
    # `memory_limit` (bytes): note where the tracked last step first holds more than
    # that (RunReport.memory_limit_crossing), as an out-of-memory error would.
    memory_limit: int | None = None
    # A folder for a torch.profiler trace of one steady step (the next to last), one
    # Chrome/Perfetto trace file per rank: rank0.json, rank1.json, ...
    profile_dir: str | None = None

    # -- checkpoints (`shardlab.checkpoint`): save after every `save_every` steps into
    # `checkpoint_dir`; `resume`: True for the newest complete checkpoint there, or the
    # path of one (it may come from another world size); then train up to `steps`.
    save_every: int = 0
    checkpoint_dir: str | None = None
    resume: bool | str = False
    # Resume from a checkpoint shardlab did not write (PyTorch's own `dcp.save`): it has
    # no manifest to verify, so it is read only when asked (its metadata still safely).
    trust_checkpoint: bool = False
    # A full, unsharded state dict written by rank 0 after training (torch.save).
    export_path: str | None = None

    # -- production failures rehearsed on purpose (`shardlab.faults`): rank
    # `crash_rank` raises at the start of step `crash_at_step`; rank `slow_rank` sleeps
    # `slow_seconds` before every forward (a straggler); each rank clips by the norm of
    # its own gradient shard instead of the global norm (`clip_local_norm`, a mistake).
    crash_at_step: int | None = None
    crash_rank: int = 0
    slow_rank: int | None = None
    slow_seconds: float = 0.0
    clip_local_norm: bool = False
    # SIMULATION (shardlab.comm.links): the loop's collectives on a network apart from the
    # cores, comm.SimulatedNetwork(alpha, beta), so that overlap shows on a CPU; None: gloo's.
    simulated_network: SimulatedNetwork | None = None

    def validate(self) -> "TrainConfig":
        """Raise on anything that cannot run. Called once, where the run is made: by `run`
        (and so the command line) in the launching process, before any rank exists; on
        the ranks by `train_worker`, for a config launched without `run`."""
        self._check_what_is_trained()
        self._check_steps()
        self._check_faults()
        self._check_measurement()
        self._check_checkpoints()
        if self.init_from is not None:
            self._check_init_from()
        # last: these create the folders, which a config refused above should not
        if self.save_every:
            check_writable_folder(self.checkpoint_dir, "checkpoint_dir")
        if self.export_path:
            check_writable_folder(Path(self.export_path).parent, "the folder of export_path")
        return self

    def _check_what_is_trained(self) -> None:
        get_strategy(self.strategy)
        get_precision(self.precision)
        optimizer_spec(self.optimizer, self.lr, self.clip_norm).check_strategy(
            self.strategy, self.precision)
        check_simulated_network(self.simulated_network)
        if self.model not in MODEL_NAMES:
            hf_spec(self.model)  # a published size or a config.json, else refused by name
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) \
                or not math.isfinite(self.lr) or self.lr <= 0:
            # a NaN or negative rate trains without an error: every weight turns NaN,
            # or the loss climbs
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")
        _check_whole(self, ("world",), least=1)
        _check_whole(self, ("seed",), least=0)
        if self.model_config is not None and not isinstance(self.model_config, dict):
            raise ValueError(f"model_config must be a dict of the architecture's settings, "
                             f"got {type(self.model_config).__name__}")
        if not isinstance(self.options, dict):
            raise ValueError(f"options must be a dict, got {type(self.options).__name__}")
        check_before_launch(self.strategy, self.options, self.world)
        if self.init_from is None:
            self._check_host_memory()

    def _check_host_memory(self) -> None:
        """Each rank builds the whole model in fp32 before it wraps it: refuse, before any
        rank starts, a model whose copies do not fit in this machine's available memory
        (a published size on a laptop would swap for hours, not fail)."""
        try:
            psi = as_config(self.model, self.model_config).num_params()
        except ValueError:
            return  # a toy, or a model the planner does not count: small
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        need, available = 4 * psi * ranks, available_host_memory()
        if available is not None and need > available:
            raise ValueError(f"model {self.model!r} has {psi:,} parameters: {ranks} rank(s) "
                             f"building it in fp32 need {need / 1e9:,.1f} GB, and this "
                             f"machine has {available / 1e9:,.1f} GB available; plan it with "
                             f"python -m shardlab memory --model {self.model}, or train a "
                             f"smaller size (model_config)")

    def _check_steps(self) -> None:
        check_loss_mean(self.loss_mean)
        _check_flag(self, "variable_lengths")
        _check_whole(self, ("steps", "batch_size", "seq_len", "grad_accum"), least=1)
        self._check_seq_len()
        check_batch_split(self.batch_size, self.world, self.grad_accum)

    def _check_faults(self) -> None:
        _check_flag(self, "clip_local_norm")
        if self.clip_local_norm and self.clip_norm is None:
            raise ValueError("clip_local_norm (the mistake of clipping by each rank's own "
                             "norm) needs clip_norm, the norm to clip to")
        if self.clip_local_norm and card(self.strategy).clips_by_own_library:
            raise ValueError(f"clip_local_norm is a mistake rehearsed with the course's "
                             f"strategies; {self.strategy!r} clips with its own library's "
                             f"global norm: use one of {', '.join(names(family=OURS))}")
        _check_whole(self, ("crash_rank",), least=0)
        if self.crash_at_step is not None and (
                isinstance(self.crash_at_step, bool) or not isinstance(self.crash_at_step, int)
                or self.crash_at_step < 0):
            raise ValueError(f"crash_at_step must be a step (a whole number >= 0) or None, "
                             f"got {self.crash_at_step!r}")
        if self.crash_at_step is not None and not 0 <= self.crash_rank < self.world:
            raise ValueError(f"crash_rank must be a rank of the run (0..{self.world - 1}), "
                             f"got {self.crash_rank!r}")
        check_straggler(self.slow_rank, self.slow_seconds, self.world)
        if not math.isfinite(self.slow_seconds):
            raise ValueError(f"slow_seconds must be a finite number of seconds, got "
                             f"{self.slow_seconds!r}")

    def _check_measurement(self) -> None:
        if self.memory_limit is not None:
            check_memory_limit(self.memory_limit)
        if self.profile_dir is not None:
            folder = Path(self.profile_dir)
            if folder.exists() and not folder.is_dir():
                raise ValueError(f"profile_dir {self.profile_dir!r} is a file; give a folder "
                                 f"for the trace files")

    def _check_checkpoints(self) -> None:
        if isinstance(self.save_every, bool) or not isinstance(self.save_every, int) \
                or self.save_every < 0:
            raise ValueError(f"save_every must be a whole number >= 0 (0: never), got "
                             f"{self.save_every!r}")
        if (self.save_every or self.resume is True) and not self.checkpoint_dir:
            raise ValueError("save_every and resume=True need checkpoint_dir, the folder "
                             "that holds the checkpoints")
        asked = [name for name in ("save_every", "resume", "export_path") if getattr(self, name)]
        refusal = (checkpoint_refusal(self.strategy) or optimizer_spec(
            self.optimizer, self.lr).checkpoint_refusal) if asked else None
        if refusal:
            raise ValueError(f"strategy {self.strategy!r} cannot {' / '.join(asked)} with "
                             f"shardlab's checkpoints: {refusal}")

    def _check_init_from(self) -> None:
        """The folder holds a model config and this model's names and shapes (read from
        its header and a model built on meta: nothing is allocated or loaded here)."""
        if self.model not in HF_MODELS:
            raise ValueError(f"init_from loads a Hugging Face folder into an hf-* model, "
                             f"not {self.model!r}; use one of {list(HF_MODELS)}")
        if self.resume:
            raise ValueError("init_from and resume both give the starting weights; ask "
                             "for one of them")
        settings = modelio.read_model_config(self.init_from)
        family = HF_MODELS[self.model].family
        if settings["model_type"] != family:
            raise ValueError(f"init_from {self.init_from!r} holds a {settings['model_type']} "
                             f"model, and model {self.model!r} is {family}; use the hf-* "
                             f"model of its family")
        modelio.check_matches(self.init_from,
                              modelio.build_on_meta(self.model, self.model_config))

    def _check_seq_len(self) -> None:
        longest = longest_sequence(self.model, self.model_config)
        if longest is not None and self.seq_len > longest:
            raise ValueError(f"seq_len {self.seq_len} is longer than model {self.model!r} "
                             f"takes ({longest} positions); use seq_len <= {longest}")
        windows = len(corpus_tokens()) - 1  # each row is seq_len + 1 bytes of the corpus
        if self.seq_len >= windows:
            raise ValueError(f"seq_len {self.seq_len} is longer than the training corpus "
                             f"({windows} tokens); use seq_len < {windows}")

    def check_resume(self) -> int:
        """The step the run resumes at (0 without resume), read from the checkpoint's
        marker before any process starts; refuse a resume with nothing left to train."""
        if not self.resume:
            return 0
        # the one process that speaks: the launching one (under torchrun, rank 0's)
        folder = resume_folder(self, say=print if os.environ.get("RANK", "0") == "0" else None)
        if not checkpoint.is_complete(folder):
            held = checkpoint.complete_steps(folder)
            if held:  # the folder that holds the checkpoints: the natural guess
                names = ", ".join(f.name for f in held[-4:])
                raise ValueError(f"{folder} holds checkpoints ({'..., ' if len(held) > 4 else ''}"
                                 f"{names}) and is not one itself: resume from the newest "
                                 f"that verifies with resume=True and checkpoint_dir="
                                 f"'{folder}', or from one of them, e.g. resume='{held[-1]}'")
            if not self.trust_checkpoint:  # the ranks' load would refuse it, later
                raise ValueError(f"{folder} is not a complete shardlab checkpoint (no "
                                 f"{checkpoint.MARKER} marker): resume from one that "
                                 f"shardlab saved, or, for a checkpoint PyTorch wrote "
                                 f"(dcp.save), ask for trust_checkpoint")
            return 0  # a foreign checkpoint (trust_checkpoint): its step is read on load
        saved = checkpoint.info(folder)
        if saved.get("precision", self.precision) != self.precision:
            # its weights and optimizer state are that precision's (a master copy or not)
            raise ValueError(f"the checkpoint {folder.name} was saved with precision "
                             f"{saved['precision']!r}, not {self.precision!r}: resume it "
                             f"with precision={saved['precision']!r}")
        if saved.get("optimizer", self.optimizer) != self.optimizer:
            # another optimizer would start from no state of its own, silently
            raise ValueError(f"the checkpoint {folder.name} was saved with optimizer "
                             f"{saved['optimizer']!r}, not {self.optimizer!r}: resume it "
                             f"with optimizer={saved['optimizer']!r}")
        self.check_same_data(saved, folder.name)
        step = int(saved.get("step", 0))
        if step >= self.steps:
            raise ValueError(f"nothing to train: the checkpoint {folder.name} is at step "
                             f"{step}; ask for steps > {step}")
        return step

    def check_same_data(self, saved: dict, name: str) -> None:
        """Refuse to resume checkpoint `name` (its marker `saved`) with another batch size,
        sequence length, seed or padding: step s's global batch is drawn from these, so
        the resumed run would read other samples than the uninterrupted one reads next,
        and no count of samples seen could say which were skipped or read twice. Checked
        by `check_resume` in the launching process, and by each rank as it loads."""
        data = saved.get("data", {})  # a checkpoint saved before the marker held it: {}
        changed = [field for field in DATA_FIELDS
                   if field in data and data[field] != getattr(self, field)]
        if changed:
            field, was = changed[0], data[changed[0]]
            raise ValueError(f"the checkpoint {name} read {saved['samples_seen']:,} samples "
                             f"with {field}={was!r}; with {field}={getattr(self, field)!r} "
                             f"the run would go on with other samples than it would have "
                             f"read: resume it with {field}={was!r} (the number of ranks may "
                             f"change: any that divides the batch reads the same rows)")


def resume_folder(config: TrainConfig, say=None) -> Path | None:
    """The checkpoint folder `config.resume` names (None without resume): the newest
    complete one that verifies in `checkpoint_dir` (resume=True; `say` is told which newer
    ones were skipped), or the folder given. What interrupted saves left in the run's
    folders is removed first. Both the launching process (`check_resume`) and the ranks
    (their load) find it here."""
    if not config.resume:
        return None
    for root in checkpoint_roots(config):
        checkpoint.clean_interrupted(root)
    if config.resume is not True:
        folder = Path(config.resume)
        if not folder.is_dir():
            raise ValueError(f"no checkpoint folder {folder}")
        return folder
    folder = checkpoint.latest(config.checkpoint_dir, say=say)
    if folder is None:
        raise ValueError(f"no complete checkpoint that verifies in {config.checkpoint_dir}: "
                         f"train with save_every first, or resume=False")
    return folder


def available_host_memory() -> int | None:
    """Bytes this machine can still hand out without swapping (Linux's MemAvailable), or
    None where /proc/meminfo does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_whole(config: TrainConfig, names: tuple[str, ...], least: int) -> None:
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")


def _check_flag(config: TrainConfig, name: str) -> None:
    if not isinstance(getattr(config, name), bool):
        raise ValueError(f"{name} must be True or False, got {getattr(config, name)!r}")


def checkpoint_roots(config: TrainConfig) -> list[Path]:
    """Where saves of this run go and where it resumes from: the folders whose
    interrupted saves (`step-N.tmp`) are cleaned before a resume."""
    roots = [Path(config.checkpoint_dir)] if config.checkpoint_dir else []
    if config.resume and config.resume is not True:
        roots.append(Path(config.resume).parent)
    return list(dict.fromkeys(roots))


@contextlib.contextmanager
def checkpoint_folders_locked(config: TrainConfig):
    """Hold the writer's lock (`shardlab.checkpoint.writer_lock`) of every folder this run
    saves into or cleans, from before the resume is checked until the ranks are done: a
    second run on the same folder is refused before it trains, naming the first. Under
    torchrun the lock is rank 0's, as the saves are."""
    roots = checkpoint_roots(config) if (config.save_every or config.resume) else []
    if os.environ.get("RANK", "0") != "0":
        roots = []
    with contextlib.ExitStack() as held:
        for root in roots:
            if not root.is_dir():
                continue  # nothing there to clean or resume (refused next, by name)
            try:
                held.enter_context(checkpoint.writer_lock(root))
            except OSError:
                if root == Path(config.checkpoint_dir or "") and config.save_every:
                    raise  # validate() found it writable; say what changed
                # a read-only folder resumed from: nothing there is written or cleaned
        yield


def check_writable_folder(folder, what: str) -> None:
    """Refuse, before training, a folder that cannot be created or written to: create it
    and write a probe file there, which is the only test that holds for every file system
    and user (root passes permission checks that a read-only mount still refuses). The
    probe's name is the file system's own choice (`mkstemp`): ranks that are threads of one
    process check the same folder at once, and a name they shared would be removed by one
    under another."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(prefix=".shardlab-probe-", dir=folder)
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"{what} {str(folder)!r} cannot be written ({exc.strerror}); "
                         f"choose another folder") from None
