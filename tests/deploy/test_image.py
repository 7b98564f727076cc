"""deploy/docker/Dockerfile, read as text: there is no Docker engine in CI, and resolving the image's
Python set needs the package index, so the pins that keep one CUDA major in the image are checked
here and the resolution itself is done by hand (docs/kubernetes.md, "The image")."""

from __future__ import annotations

import re
import tomllib

import helm_python as helm
import pytest
from helm_objects import CHART_DIR, REPO

pytestmark = pytest.mark.deploy

DOCKER = REPO / "deploy" / "docker"
DOCKERFILE = (DOCKER / "Dockerfile").read_text()


def arg(name: str) -> str:
    found = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.MULTILINE)
    assert found is not None, f"ARG {name}=... missing"
    return found.group(1)


def constraints() -> dict[str, str]:
    """constraints.txt: package name -> pinned version."""
    pins = {}
    for line in (DOCKER / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"not pinned: {line!r}"
            pins[name] = version
    return pins


def test_one_cuda_major() -> None:
    major = arg("CUDA_MAJOR")
    base = re.fullmatch(r"nvidia/cuda:(\d+)\.\d+\.\d+-\S+", arg("CUDA_IMAGE"))
    assert base is not None and base.group(1) == major
    pins = constraints()
    assert pins["torch"] == arg("TORCH_VERSION")
    assert pins[f"nixl-cu{major}"] == arg("NIXL_VERSION")
    assert pins["ray"] == arg("RAY_VERSION")
    # Every CUDA-versioned package (nvidia-*-cuNN, nixl-cuNN, ...) is of the base image's major.
    majors = {m.group(1) for name in pins if (m := re.search(r"-cu(\d+)$", name))}
    assert majors == {major}, majors
    assert pins[f"nvidia-cuda-runtime-cu{major}"].startswith(f"{major}.")
    # The image's pip command installs exactly these pins, the CUDA major's NIXL included.
    assert '"torch==${TORCH_VERSION}"' in DOCKERFILE and '"nixl-cu${CUDA_MAJOR}==${NIXL_VERSION}"' in DOCKERFILE
    assert "--constraint /opt/pdserve/constraints.txt" in DOCKERFILE
    # A build checks torch's CUDA against the same major.
    assert "torch.version.cuda.split('.')[0] == '${CUDA_MAJOR}'" in DOCKERFILE


def test_pyproject_nixl_matches_the_image() -> None:
    """`pip install .` brings pyproject's nixl-cuNN: it must be the image's, or two UCX copies load."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    nixl = [d for d in deps if d.startswith("nixl-cu")]
    assert len(nixl) == 1 and nixl[0].startswith(f"nixl-cu{arg('CUDA_MAJOR')}")


def test_runs_as_a_numeric_non_root_user() -> None:
    users = re.findall(r"^USER (\S+)$", DOCKERFILE, re.MULTILINE)
    assert users == ["${PDSERVE_UID}:${PDSERVE_UID}"]
    uid = int(arg("PDSERVE_UID"))
    assert uid >= 1000  # numeric, so the kubelet can check runAsNonRoot against it
    last_run = max(i for i, ln in enumerate(DOCKERFILE.splitlines()) if ln.startswith("RUN "))
    user_line = next(i for i, ln in enumerate(DOCKERFILE.splitlines()) if ln.startswith("USER "))
    assert user_line > last_run  # nothing runs as root after it, and the image starts as the user


def test_serve_only_install() -> None:
    """The users' install (`pip install .[gpu]`), not the developer set-up CI runs."""
    assert '".[gpu]"' in DOCKERFILE
    assert "-e ." not in DOCKERFILE and "--editable" not in DOCKERFILE
    assert "scripts/setup.sh" not in DOCKERFILE.replace("(as scripts/setup.sh does)", "")
    assert not re.search(r"\.\[[^]]*test", DOCKERFILE)


def test_matches_chart_and_package() -> None:
    values = helm.values_from_yaml((CHART_DIR / "values.yaml").read_text())
    assert values["rayVersion"] == arg("RAY_VERSION")
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}$", DOCKERFILE, re.MULTILINE)
    # Every package pyproject installs is copied into the build.
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setuptools["package-dir"]  # pdserve.router -> router/, ...
    folders = {
        next((d for name, d in mapped.items() if pkg == name or pkg.startswith(name + ".")), pkg).split(".")[0]
        for pkg in setuptools["packages"]
    }
    assert folders >= {"pdserve", "pdserve_proto", "router", "kv_transfer", "prefill_worker", "decode_worker"}
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text()
    for pkg in sorted(folders):
        assert f"COPY {pkg} ./{pkg}" in DOCKERFILE, pkg
        assert f"!{pkg}/" in ignore, pkg
    assert "!deploy/docker/constraints.txt" in ignore


def test_docs_name_the_cuda_major() -> None:
    text = (REPO / "docs" / "kubernetes.md").read_text()
    assert f"CUDA {arg('CUDA_MAJOR')}" in text and arg("TORCH_VERSION") in text
