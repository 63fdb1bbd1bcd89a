"""The ``capo`` command refuses bad arguments before any work starts, naming the valid ones."""

from __future__ import annotations

from typer.testing import CliRunner


def test_an_unknown_stage_to_force_is_refused_with_the_stage_names(tmp_path):
    import flows.cli as cli

    res = CliRunner().invoke(cli.app, ["round", "--force", "critiqe", "--config", "configs/tiny.yaml",
                                       f"runs_dir={tmp_path}"])
    assert res.exit_code == 2, res.output
    out = " ".join(res.output.replace("│", " ").split())  # the error box wraps the message
    assert "critiqe: not a stage" in out and "rollout, verify, segment, mc, densr, critique, vote, reward, train, eval" in out
    assert not any(tmp_path.iterdir())  # nothing written
