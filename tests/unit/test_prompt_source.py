"""A ``data.train_prompts`` that is no embedded set, no file and no dataset the hub has is named
with what is valid and the loader's error, and the embedded set it matches ignoring case, instead
of ending in the hub client's traceback. The hub is out of reach here: ``datasets.load_dataset`` is
replaced by one that fails as it does for an unknown name."""

from __future__ import annotations

import pytest

from pipeline.config import load_config


@pytest.fixture
def no_such_dataset(monkeypatch):
    import datasets

    asked = []

    def load_dataset(name, config=None, split=None, **kw):
        asked.append((name, config, split))
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return asked


@pytest.mark.parametrize("value, hint", [
    ("GSM8K", "; did you mean 'gsm8k'?"),
    ("gsm8k_train", "; did you mean 'gsm8k'? (its split goes in data.train_split, now 'train')"),
    ("Math", "; did you mean 'math'?"),
    ("org/no-such-set", None),
])
def test_an_unknown_prompt_source_is_named_with_what_is_valid(tmp_path, no_such_dataset, value, hint):
    from pipeline.stages.base import prompts_path

    cfg = load_config(None, [f"data_dir={tmp_path}", f"data.train_prompts={value}"])
    with pytest.raises(FileNotFoundError) as err:
        prompts_path(cfg)
    msg = str(err.value)
    assert msg.startswith(f"data.train_prompts={value!r} is not gsm8k or math (the embedded sets), not an existing "
                          ".jsonl/.json/.parquet file, and not a dataset the Hugging Face hub or the local cache has"), msg
    assert f"datasets.load_dataset({value!r}, split='train') failed: ConnectionError: Couldn't reach" in msg, msg
    if hint:
        assert msg.endswith(hint), msg
    else:
        assert "did you mean" not in msg, msg
    assert isinstance(err.value.__cause__, FileNotFoundError) and isinstance(err.value.__cause__.__cause__, ConnectionError)
    assert no_such_dataset == [(value, None, "train")]
    assert not list((tmp_path / "prompts").glob("*.parquet"))  # no table written


def test_capo_setup_names_a_mistyped_prompt_source_before_converting_models(tmp_path, no_such_dataset, monkeypatch):
    from typer.testing import CliRunner

    import flows.cli as cli
    import pipeline.stages.base as base

    monkeypatch.setattr(base, "resolve_model", lambda name, cfg: (_ for _ in ()).throw(AssertionError("converted")))
    res = CliRunner().invoke(cli.app, ["setup", "--config", "configs/tiny.yaml", f"data_dir={tmp_path}",
                                       "data.train_prompts=GSM8K"])
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), (res.output, res.exception)
    out = " ".join(res.output.replace("│", " ").split())
    assert "data.train_prompts='GSM8K' is not gsm8k or math" in out and "did you mean 'gsm8k'?" in out, out
