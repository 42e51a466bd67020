"""Packaging: atorch installs around the torch an environment already has.

The checks ask pip itself for its plan (``pip install --dry-run --report``) in the environment that
runs the tests (which has torch), and in the same environment with a cluster-style pre-release torch
build (``2.7.0a0+<commit>``, as NGC containers ship) laid over it. Nothing is installed. A plan that
cannot be made because the package index is out of reach is skipped with the reason.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"
GLOBAL_PIP_CONSTRAINTS = Path("/etc/xdg/pip/constraints.txt")  # this machine's own cap, when present
NETWORK_ERRORS = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
                  "Network is unreachable", "ConnectTimeoutError", "ReadTimeoutError", "Max retries exceeded",
                  "ProxyError", "SSLError")
WANTS_TORCH = ("No matching distribution found for torch", "satisfies the requirement torch")


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def all_requirements() -> list[Requirement]:
    project = pyproject()["project"]
    extras = [r for group in project.get("optional-dependencies", {}).values() for r in group]
    return [Requirement(r) for r in project["dependencies"] + extras]


def torch_requirement() -> Requirement:
    found = [Requirement(r) for r in pyproject()["project"]["dependencies"] if Requirement(r).name == "torch"]
    assert len(found) == 1, "pyproject.toml must declare torch exactly once as a runtime dependency"
    return found[0]


def pins(path: Path) -> dict[str, str]:
    """name -> exact version of every ``name==version`` line (comments and blanks skipped)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", f"{path.name}: {line!r} is not an exact pin"
            out[requirement.name.lower().replace("_", "-")] = spec.version
    return out


def build_flags() -> list[str]:
    """Build atorch's metadata with this environment's setuptools when it is new enough (no index
    needed); otherwise let pip fetch the build requirements into an isolated environment."""
    needed = next(Requirement(r) for r in pyproject()["build-system"]["requires"] if r.startswith("setuptools"))
    try:
        have = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return []
    return ["--no-build-isolation"] if needed.specifier.contains(have, prereleases=True) else []


def pip_plan(tmp_path: Path, *args: str, pythonpath: Path | None = None) -> list[tuple[str, str]]:
    """(name, version) of everything pip would install for ``pip install <args>`` here."""
    report = tmp_path / "pip-report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-input",
               "--disable-pip-version-check", "--report", str(report), *build_flags(), *args]
    env = None if pythonpath is None else dict(os.environ, PYTHONPATH=str(pythonpath))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.skip("pip took over 120 s to plan the install (package index slow or out of reach)")
    output = done.stdout + done.stderr
    if done.returncode != 0:
        if any(marker in output for marker in WANTS_TORCH):
            pytest.fail(f"pip wants to install a torch (none it may use is present):\n{output[-3000:]}")
        if any(marker in output for marker in NETWORK_ERRORS):
            pytest.skip(f"pip cannot reach the package index to plan the install: {output.strip().splitlines()[-1]}")
        pytest.fail(f"pip could not plan the install:\n{output[-3000:]}")
    data = json.loads(report.read_text())
    return [(item["metadata"]["name"].lower(), item["metadata"]["version"]) for item in data["install"]]


# --- what pyproject.toml declares -------------------------------------------------------------------
def test_torch_is_a_lower_bound_that_admits_prerelease_builds():
    requirement = torch_requirement()
    operators = {spec.operator for spec in requirement.specifier}
    assert operators == {">="}, f"torch must be declared as a minimum only, got {requirement}"
    (minimum,) = (Version(spec.version) for spec in requirement.specifier)
    assert minimum.is_prerelease, (
        f"{requirement}: without a pre-release marker (e.g. >=2.7.0a0), pip does not count a cluster's "
        "2.7.0a0+<commit> build as 2.7 and replaces it"
    )
    major_minor = f"{minimum.major}.{minimum.minor}"
    install_doc = (ROOT / "docs" / "install.md").read_text()
    assert f"torch {major_minor}" in install_doc, f"docs/install.md must justify the minimum torch {major_minor}"


def test_no_exact_pins_in_pyproject():
    pinned = [str(r) for r in all_requirements() if any(s.operator in ("==", "===") for s in r.specifier)]
    assert not pinned, f"exact pins belong in constraints.txt, not pyproject.toml: {pinned}"
    unbounded = [str(r) for r in all_requirements() if not r.specifier]
    assert not unbounded, f"every requirement needs a version range: {unbounded}"


def test_numpy_is_declared_only_if_atorch_imports_it():
    imports_numpy = any(re.search(r"^\s*(import numpy|from numpy)", path.read_text(), re.M)
                        for path in (ROOT / "atorch").rglob("*.py"))
    declared = any(Requirement(r).name == "numpy" for r in pyproject()["project"]["dependencies"])
    assert declared == imports_numpy


def test_license_file_and_metadata():
    assert pyproject()["project"]["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]


# --- constraints.txt ---------------------------------------------------------------------------------
def test_constraints_pin_torch_inside_the_block_the_makefile_drops():
    text = CONSTRAINTS.read_text()
    block = re.search(r"^# >>> torch\n(.*?)^# <<< torch$", text, re.S | re.M)
    assert block, "constraints.txt must keep torch and its own requirements between '# >>> torch' and '# <<< torch'"
    assert re.search(r"^torch==", block.group(1), re.M)
    outside = text[: block.start()] + text[block.end():]
    assert not re.search(r"^torch==", outside, re.M)
    assert "'/^# >>> torch/,/^# <<< torch/d'" in (ROOT / "Makefile").read_text()


def test_constraints_satisfy_the_declared_ranges_and_this_machines_cap():
    pinned = pins(CONSTRAINTS)
    for requirement in all_requirements():
        name = requirement.name.lower().replace("_", "-")
        if name in pinned:
            assert requirement.specifier.contains(pinned[name], prereleases=True), (
                f"constraints.txt pins {name}=={pinned[name]}, outside pyproject's {requirement}")
    if GLOBAL_PIP_CONSTRAINTS.exists():  # pip applies both files: they must not contradict each other
        for line in GLOBAL_PIP_CONSTRAINTS.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                cap = Requirement(line)
                version = pinned.get(cap.name.lower().replace("_", "-"))
                assert version is None or SpecifierSet(str(cap.specifier)).contains(version), (
                    f"constraints.txt pins {cap.name}=={version}, which {GLOBAL_PIP_CONSTRAINTS} forbids ({cap})")


# --- pip's plan ----------------------------------------------------------------------------------------
def test_pip_keeps_the_torch_this_environment_has(tmp_path):
    pytest.importorskip("torch")
    plan = pip_plan(tmp_path, "-e", str(ROOT))
    names = [name for name, _ in plan]
    assert "atorch" in names
    assert "torch" not in names, f"installing atorch would replace torch: {plan}"


def test_pip_keeps_torch_with_the_makefiles_constraints(tmp_path):
    """What `make` runs in a venv that has a torch: the test extra, constraints minus the torch block,
    torch pinned to the installed version."""
    torch = pytest.importorskip("torch")
    text = re.sub(r"^# >>> torch\n.*?^# <<< torch\n", "", CONSTRAINTS.read_text(), flags=re.S | re.M)
    keep = tmp_path / "constraints-keep-torch.txt"
    keep.write_text(text + f"torch=={torch.__version__}\n")
    plan = pip_plan(tmp_path, "-c", str(keep), "-e", f"{ROOT}[test]")
    assert "torch" not in [name for name, _ in plan], f"make would replace torch: {plan}"


def test_pip_keeps_a_clusters_prerelease_torch_build(tmp_path):
    """A torch 2.7.0a0+<commit> build (what NGC containers ship), found first on sys.path."""
    version = "2.7.0a0+79aa17489c.nv25.4"
    site = tmp_path / "cluster-site"
    info = site / f"torch-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")
    plan = pip_plan(tmp_path, "-e", str(ROOT), pythonpath=site)
    assert "torch" not in [name for name, _ in plan], f"pip would replace the cluster's torch {version}: {plan}"
